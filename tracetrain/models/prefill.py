"""Prefill: a prompt into the KV cache, and the logits of its last position; eager or compiled.

Eager (`prefill(..., mode="eager")`, the default): the prompt goes through the model's own forward with the
cache, in chunks of `prefill_chunk_tokens` (the whole prompt where its activations fit; see
models/generate.py's docstring). Every op runs as PyTorch's eager kernel: RMSNorm, RoPE (with float32
copies of q and k) and SwiGLU each make several passes over memory.

Compiled (`mode="compiled"`): for the case that already takes one forward (an unpadded batch written into
an in-GPU `StaticKVCache` from position 0, the whole prompt in one chunk), each block runs one
`torch.compile`d function of (block, x, cos, sin, mask) that returns (block output, k, v), and the caller
writes k and v into the cache. Inside, the block sees a `PromptKV` as its cache layer: the prompt attends to
its own keys and values, causal, exactly what `StaticKVLayer.update` returns for a prompt from position 0,
so the block's own code (every family's, LoRA and compiled or recomputed blocks included) is traced
unchanged, and Inductor fuses the norms, the rotary embedding, the MLP's activation and the residual adds
around the matmuls and the attention kernel. The cache write stays outside the graph (the cache's length
changes every call). MoE blocks compile their attention half only (`TransformerBlock.attend`): the expert
dispatch reads token counts on the host (as `kernels/apply.py`'s `_CompiledAttentionBlock`).

Shapes: the sequence dimension is marked dynamic (`maybe_mark_dynamic`), so prompts of any length share a
graph; batch 1 has a graph of its own (size-1 dimensions are specialised), and the second batch size makes
the batch dimension dynamic too: about two graphs per model, plus one for a masked (windowed) variant.
Each model compiles a private copy of the functions' code (`own_code`): Dynamo keeps graphs, and counts
them against its recompile limit, per code object.

Where the compiled prefill cannot run, `compiled_prefill_refusal` says why and the prompt goes the eager
way (with a warning naming the reason): padded rows, the offloaded cache, a prompt that needs chunks, a
cache already holding positions, tiled feed-forward blocks (their tile loop would recompile per length),
blocks with forward hooks (FP8 bases re-quantise in one, which must run eagerly).
"""

from __future__ import annotations

import contextlib
import types
import warnings
import weakref
from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import nn
from torch.nn.attention.bias import CausalBias, causal_lower_right

from tracetrain.models.kv_cache import OffloadedKVCache, StaticKVCache
from tracetrain.models.llama import ModelArgs, Transformer, TransformerBlock

PrefillMode = Literal["eager", "compiled"]
PREFILL_MODES: tuple[str, ...] = ("eager", "compiled")
DEFAULT_PREFILL_CHUNK = 2048  # tokens per row and forward for padded batches and the offloaded cache
PREFILL_CHUNK_MULTIPLE = 1024  # a chunk sized from free memory is a multiple of this
# A forward's activations (prefill_bytes_per_token, an upper bound) may take this much of the free device
# memory less a reserve (CUDA context growth, the allocator's rounding, the last position's logits). Half of
# it, before 2026-12-07, chunked prompts Hugging Face prefills in one forward: on one H100, llama2-7b at
# batch 1 and 81,920 tokens the chunk was 75,776, where the count is 180 KB per token and the eager chunk
# used 119 KB per token (peak 60.9 GiB of 79.2: weights 12.6, cache 40.0).
PREFILL_FREE_FRACTION = 0.85
PREFILL_RESERVE_BYTES = 512 * 2**20


def prefill_bytes_per_token(args: ModelArgs, dtype_bytes: int) -> int:
    """Bytes per prompt token alive at once inside one block of a no-grad forward, the larger of its two
    halves: the MLP (residual and normed input, 2 d, with gate, up, SiLU(gate) and their product, 4 f, in
    the compute dtype) and the attention (residual, normed input, q, k, v and output, 4 d + 2 kv, plus
    RoPE's float32 copies of q and k with their rotated halves and products, 16 (d + kv)). The eager
    forward's count; the compiled one keeps less (no float32 copies), so the rule stays on the safe side."""
    kv = args.n_kv_heads * args.head_dim
    mlp = dtype_bytes * (2 * args.dim + 4 * args.ffn_dim)
    attention = dtype_bytes * (4 * args.dim + 2 * kv) + 16 * (args.dim + kv)
    return max(mlp, attention)


def prefill_chunk_tokens(
    model: Transformer, batch: int, prompt_len: int, cache: Any, dtype: torch.dtype, chunk: int | None
) -> int:
    """Tokens per row of each prefill forward (models/generate.py's docstring). `chunk` given: as asked.
    Otherwise the whole prompt, for an unpadded batch on an in-GPU cache whose forward fits in
    PREFILL_FREE_FRACTION of the free device memory less PREFILL_RESERVE_BYTES (on the CPU: always); else the
    largest multiple of 1024 that fits (at least 1024), or DEFAULT_PREFILL_CHUNK for padded rows and the
    offloaded cache. A forward that runs out of memory all the same is retried in smaller chunks
    (`prefill(..., shrink_on_oom=True)`, as `generate_batch` runs a chunk it sized itself)."""
    if chunk is not None:
        return chunk
    if cache.padded or isinstance(cache, OffloadedKVCache):
        return DEFAULT_PREFILL_CHUNK
    device = model.embed_tokens.weight.device
    if device.type != "cuda":
        return prompt_len
    from tracetrain.devices import free_device_bytes

    per_token = batch * prefill_bytes_per_token(model.args, torch.empty((), dtype=dtype).element_size())
    return fitting_chunk(prompt_len, per_token, free_device_bytes(device))


def fitting_chunk(prompt_len: int, per_token_bytes: int, free_bytes: int) -> int:
    """The whole prompt when `prompt_len` tokens of `per_token_bytes` fit in PREFILL_FREE_FRACTION of
    `free_bytes` less PREFILL_RESERVE_BYTES; else the largest multiple of PREFILL_CHUNK_MULTIPLE that does
    (at least one)."""
    usable = int(PREFILL_FREE_FRACTION * max(0, free_bytes - PREFILL_RESERVE_BYTES))
    fit = usable // per_token_bytes
    if fit >= prompt_len:
        return prompt_len
    return max(PREFILL_CHUNK_MULTIPLE, fit // PREFILL_CHUNK_MULTIPLE * PREFILL_CHUNK_MULTIPLE)


def forward_last(model: Transformer, tokens: torch.Tensor, positions: torch.Tensor, cache: Any) -> torch.Tensor:
    """Run (batch, s) tokens through the model with the cache; logits of the last position (batch, vocab).
    With s > 1 the last block computes its keys and values for every position (the cache needs them) and
    the rest of its work for the last position alone (`last_position_block`)."""
    if tokens.shape[1] == 1 or last_position_refusal(model) is not None:
        hidden = model.forward_hidden(tokens, positions, cache=cache)  # (batch, s, dim)
        return model.logits(hidden[:, -1])  # Gemma 2's soft-capped logits too
    h, layer_inputs = model.layer_inputs(tokens, positions, None, cache)
    hidden = model.run_layers(h, layer_inputs, cache, last_block=last_position_block)  # (batch, 1, dim)
    return model.logits(hidden[:, -1])


class _KeysCaptured(Exception):
    """Raised by `_CaptureKV.update`: the rest of the capturing forward is not needed."""


class _CaptureKV:
    """The cache layer of `last_position_block`'s first pass: keeps the keys and values the block's
    attention computed for every position, then stops that pass (its queries, attention and MLP unused)."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.k, self.v = k, v
        raise _KeysCaptured


class _WriteCapturedKV:
    """The cache layer of `last_position_block`'s second pass (the last position alone): writes every
    position's captured keys and values into the real layer, once, and returns what the layer returns.
    The pass's own k and v (the last position's) are the captured ones' last row: same weights, same input."""

    def __init__(self, layer: Any, k: torch.Tensor, v: torch.Tensor) -> None:
        self.layer, self.k, self.v = layer, k, v

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.layer.update(self.k, self.v)


def last_position_refusal(model: Transformer) -> str | None:
    """Why `forward_last` runs the last block over every position; None when it need not."""
    last = model.layers[-1]
    if not isinstance(last, TransformerBlock):
        return f"the last block is a {type(last).__name__}, not a TransformerBlock (attend + ffn)"
    if last._forward_pre_hooks or last._forward_hooks:
        return "the last block has forward hooks (FP8's re-quantisation, activation offload), which its halves skip"
    return None


def last_query_mask(mask: Any, s: int) -> Any:
    """The mask of a prompt's last query alone, from the prompt's (s queries): a dense (batch | 1, 1, s,
    keys) mask's last row; a lower-right `CausalBias` (s, keys) lets the last query see every key, as a
    (1, keys) one does; None (plain causal over the prompt's own s keys, the compiled prefill's) the same
    over s keys."""
    if isinstance(mask, CausalBias):  # first: a CausalBias is a torch.Tensor subclass
        return causal_lower_right(1, mask.seq_len_kv)
    if isinstance(mask, torch.Tensor):
        return mask[:, :, -1:, :]
    if mask is None:
        return causal_lower_right(1, s)
    raise TypeError(f"a KV-cache forward's mask is a tensor, a CausalBias or None, not {type(mask).__name__}")


def last_position_block(
    block: TransformerBlock, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: Any, layer: Any
) -> torch.Tensor:
    """The last block of a prefill forward, output at the last position only (batch, 1, dim): the logits
    need nothing else, while the cache needs every position's keys and values. A first pass of the
    block's attention half over all positions keeps the keys and values its attention computes and stops
    there (`_CaptureKV`); the block then runs on the last position, attending to all of them, which it
    writes into `layer` once (`_WriteCapturedKV`). What this leaves out of the block: its attention, its
    output projection and its MLP for every position but one (a block in 32 at 131,072 tokens: 3% of the
    prefill); the queries' projection still runs for every position. Every family's block code runs as is
    (its `attend` and `ffn`, which is what `TransformerBlock.forward` runs with a cache: the compiled,
    recomputed and tiled block classes run it too)."""
    capture = _CaptureKV()
    with contextlib.suppress(_KeysCaptured):
        block.attend(x, cos, sin, mask, capture)  # type: ignore[arg-type]  # a KV cache layer: has update
    if capture.k is None or capture.v is None:
        raise RuntimeError(f"{type(block).__name__}.attend did not write its keys and values to the cache")
    last_mask = last_query_mask(mask, x.shape[1])
    written = _WriteCapturedKV(layer, capture.k, capture.v)
    h = block.attend(x[:, -1:], cos[:, -1:], sin[:, -1:], last_mask, written)  # type: ignore[arg-type]  # a KV cache layer: has update
    return h + block.ffn(h)


def check_prefill_mode(mode: str) -> None:
    """ValueError naming `mode` and the allowed ones."""
    if mode not in PREFILL_MODES:
        raise ValueError(f"prefill mode {mode!r} is not allowed; must be one of {', '.join(PREFILL_MODES)}")


def compiled_prefill_refusal(model: Transformer, cache: Any, prompt_len: int, chunk: int) -> str | None:
    """Why a prompt of `prompt_len` tokens per row, in chunks of `chunk`, cannot take the compiled prefill
    (it then runs eagerly); None when it can."""
    if not isinstance(cache, StaticKVCache):
        return "the compiled prefill writes an in-GPU StaticKVCache; the offloaded cache streams K/V per layer"
    if cache.padded:
        return "left-padded rows attend through a dense mask over the cache (prompts of one length avoid it)"
    if cache.length:
        return "the cache already holds positions; the compiled prefill writes a prompt from position 0"
    if chunk < prompt_len:
        return f"the prompt runs in chunks of {chunk} tokens (one forward would not fit); later chunks read the cache"
    # memory/tiled_mlp.py's blocks carry their tile size; their tile loop would specialise the length.
    if any(hasattr(block, "_tile_tokens") for block in model.layers):
        return "tiled feed-forward blocks (memory.tiled_mlp) loop over tiles, one graph per prompt length"
    if any(block._forward_pre_hooks or block._forward_hooks for block in model.layers):
        return "the blocks have forward hooks (FP8's re-quantisation), which run eagerly, outside compiled code"
    return None


def prefill(
    model: Transformer,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    cache: Any,
    chunk: int,
    mode: PrefillMode = "eager",
    *,
    shrink_on_oom: bool = False,
) -> torch.Tensor:
    """(batch, prompt) tokens at `positions` into `cache`, `chunk` tokens per forward; logits of the last
    position (batch, vocab). `mode` "compiled" takes the compiled block functions where
    `compiled_prefill_refusal` allows (module docstring), else warns with the reason and runs eagerly.

    `shrink_on_oom` (a chunk sized by `prefill_chunk_tokens`, not asked for): a forward that runs out of
    device memory is run again in chunks half as long (multiples of PREFILL_CHUNK_MULTIPLE, with a warning
    naming both sizes) from the first position not yet written: the cache moves past a forward's positions
    only after its last block, so a failed forward's partial writes are overwritten. At the smallest chunk,
    or without `shrink_on_oom`, the error is raised."""
    check_prefill_mode(mode)
    prompt_len = tokens.shape[1]
    start = cache.length
    if mode == "compiled":
        why = compiled_prefill_refusal(model, cache, prompt_len, chunk)
        if why is None:
            try:
                return _compiled_prefill(model, tokens, positions, cache)
            except torch.OutOfMemoryError:
                if not shrink_on_oom or prompt_len <= PREFILL_CHUNK_MULTIPLE:
                    raise
            chunk = _shrunk(prompt_len, prompt_len, "the compiled prefill")
        else:
            warnings.warn(f"prefill = 'compiled' runs eagerly here: {why}", stacklevel=2)
    done = cache.length - start
    logits = None
    while done < prompt_len:
        try:
            logits = forward_last(model, tokens[:, done : done + chunk], positions[:, done : done + chunk], cache)
        except torch.OutOfMemoryError:
            if not shrink_on_oom or chunk <= PREFILL_CHUNK_MULTIPLE:
                raise
            failed = True
        else:
            failed = False
        if failed:  # outside the handler: the failed forward's tensors (held by the traceback) are gone
            chunk = _shrunk(chunk, prompt_len, f"a prefill forward of {min(chunk, prompt_len - done)} tokens")
        elif cache.length - start != done + min(chunk, prompt_len - done):  # a cache that lags would loop on
            raise RuntimeError(
                f"a prefill forward of {min(chunk, prompt_len - done)} tokens moved the KV cache from "
                f"{start + done} to {cache.length}"
            )
        done = cache.length - start
    assert logits is not None  # the prompt has at least one token
    return logits


def _shrunk(chunk: int, prompt_len: int, what: str) -> int:
    """Half of `chunk` (a multiple of PREFILL_CHUNK_MULTIPLE, at least one), with a warning saying so."""
    half = max(PREFILL_CHUNK_MULTIPLE, min(chunk, prompt_len) // 2 // PREFILL_CHUNK_MULTIPLE * PREFILL_CHUNK_MULTIPLE)
    warnings.warn(f"{what} ran out of GPU memory; the prompt goes on in chunks of {half} tokens", stacklevel=3)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the failed forward's blocks, for the allocator to cut the smaller ones
    return half


class PromptKV:
    """The cache layer a block sees inside the compiled prefill: a prompt from position 0 attends to its own
    keys and values (as `StaticKVLayer.update` returns them then); they are kept for the caller to write."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.k, self.v = k, v
        return k, v


BlockOut = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # block output (batch, s, dim), k and v of the prompt


def _block_prefill(block: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: Any) -> BlockOut:
    kv = PromptKV()
    out = block(x, cos, sin, mask, kv)  # a compiled or recomputed block runs its eager code with a cache
    return out, kv.k, kv.v  # type: ignore[return-value]  # the block's attention called kv.update, which set both


def _attention_prefill(block: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: Any) -> BlockOut:
    kv = PromptKV()
    out = block.attend(x, cos, sin, mask, kv)  # type: ignore[operator]  # nn.Module attributes are typed Tensor | Module in torch's stubs
    return out, kv.k, kv.v  # type: ignore[return-value]  # the block's attention called kv.update, which set both


def own_code(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` with a code object of its own (same bytecode, globals, defaults and closure: zero-argument
    `super()` still finds its class), so that Dynamo's cache for it starts empty."""
    assert isinstance(fn, types.FunctionType)
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


# Per model: the compiled whole-block and attention-half functions (lazy: nothing compiles before a call).
_COMPILED: weakref.WeakKeyDictionary[nn.Module, dict[str, Callable[..., BlockOut]]] = weakref.WeakKeyDictionary()


def _compiled_functions(model: Transformer) -> dict[str, Callable[..., BlockOut]]:
    if model not in _COMPILED:
        # fullgraph: a graph break inside a block is a bug to fix, not something to run slowly.
        _COMPILED[model] = {
            name: torch.compile(own_code(fn), fullgraph=True)
            for name, fn in (("block", _block_prefill), ("attention", _attention_prefill))
        }
    return _COMPILED[model]


def _compiled_prefill(model: Transformer, tokens: torch.Tensor, positions: torch.Tensor, cache: Any) -> torch.Tensor:
    """The whole unpadded prompt from position 0 through the compiled block functions; last logits."""
    s = tokens.shape[1]
    functions = _compiled_functions(model)
    h, layer_inputs = model.layer_inputs(tokens, positions, None, cache)  # (batch, s, dim); the cache's masks
    last_eager = s > 1 and last_position_refusal(model) is None
    for i, block in enumerate(model.layers):
        cos, sin, mask = layer_inputs[i]
        if last_eager and i == len(model.layers) - 1:  # its last position only, eagerly (forward_last's way)
            h = last_position_block(block, h, cos, sin, mask, cache.layers[i])  # type: ignore[arg-type]  # checked by last_position_refusal
            break
        if isinstance(mask, CausalBias):  # square: the prompt's own keys, plain causal (cached_attention's None)
            mask = None
        for t in (h, cos, sin):  # (batch, s, ...): any prompt length, one graph
            torch._dynamo.maybe_mark_dynamic(t, 1)
        if mask is not None:  # a dense (batch | 1, 1, s, s) mask: a sliding window (Mistral, Gemma)
            torch._dynamo.maybe_mark_dynamic(mask, 2)
            torch._dynamo.maybe_mark_dynamic(mask, 3)
        moe = hasattr(block.mlp, "experts")  # the dispatcher reads counts on the host: attention half only
        h, k, v = functions["attention" if moe else "block"](block, h, cos, sin, mask)
        cache.layers[i].update(k, v)  # positions [0, s) of layer i
        if moe:
            h = h + block.ffn(h)  # type: ignore[operator]  # nn.Module attributes are typed Tensor | Module in torch's stubs
    cache.advance(s)
    return model.logits(model.norm(h[:, -1]))
