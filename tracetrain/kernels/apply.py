"""Speed transforms over the plain model: fused kernels in, and regional compilation.

Order (rows of the transform table, `train/assemble.py` TRANSFORMS, which says why each sits where it
does): LoRA -> attention backend -> fused kernels -> fused cross-entropy -> FP8 -> the layout rows ->
recomputation -> compile. Kernels and the attention core are swapped before recomputation and compile so
that both see the final modules (a recomputed block reruns the fused ops).

Under `apply_compile`, Inductor already fuses RMSNorm, RoPE, SwiGLU, the residual adds and the LoRA
scale-and-add of each block into a few generated kernels, so the hand-written block kernels matter
for the eager path only: inside a compiled region (`torch.compiler.is_compiling()`) the fused RMSNorm,
RoPE and SwiGLU run their plain PyTorch formulas, which Inductor fuses with their neighbours (an opaque
custom op would stop it). A model with both therefore runs the kernels exactly where its blocks run
eagerly: generation's KV-cache forwards (decode steps, chunked prefill), which `apply_compile` leaves
eager (with train.fused_kernels = "on"; spec.py). The fused cross-entropy (fused_ce.py) lives outside
the blocks and helps either way.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Iterable

import torch
from torch import nn

from tracetrain.kernels.lora import FusedLoRALinear
from tracetrain.kernels.rmsnorm import FusedRMSNorm
from tracetrain.kernels.rope import fused_rope_qk
from tracetrain.kernels.swiglu import FusedFeedForward
from tracetrain.models.llama import Attention, FeedForward, KVCacheLayer, RMSNorm, Transformer
from tracetrain.models.lora import LoRALinear
from tracetrain.models.prefill import own_code

FUSED_KERNELS: tuple[str, ...] = ("rmsnorm", "rope", "swiglu", "lora")


def apply_fused_kernels(model: Transformer, kernels: Iterable[str] = FUSED_KERNELS) -> int:
    """Swap the named block ops for their fused custom ops, in place; returns how many were swapped.

    Modules change class (RMSNorm -> FusedRMSNorm, FeedForward -> FusedFeedForward, LoRALinear ->
    FusedLoRALinear), and each attention's `rope_fn` becomes the fused rotary op: parameters, names
    and state dicts are unchanged. Apply after LoRA (the "lora" kernel swaps existing adapters).
    Raises ValueError for an unknown kernel name.
    """
    kernels = set(kernels)
    unknown = kernels - set(FUSED_KERNELS)
    if unknown:
        raise ValueError(f"unknown fused kernel(s) {', '.join(sorted(unknown))}; allowed: {', '.join(FUSED_KERNELS)}")
    num_swapped = 0
    for module in model.modules():
        if "rmsnorm" in kernels and type(module) is RMSNorm:
            module.__class__ = FusedRMSNorm
        elif "swiglu" in kernels and type(module) is FeedForward:
            module.__class__ = FusedFeedForward
        elif "lora" in kernels and type(module) is LoRALinear:
            module.__class__ = FusedLoRALinear
        elif "rope" in kernels and isinstance(module, Attention):
            module.rope_fn = fused_rope_qk
        else:
            continue
        num_swapped += 1
    return num_swapped


class _CompiledBlock(nn.Module):
    """Mixin placed in front of a block's own class: forwards without a KV cache run the compiled graph.

    Generation (a KV cache) runs eagerly: the cache grows every token, so each length would be a new
    static shape, and with `fullgraph=True` Dynamo's recompile limit would turn that into an error. (The
    compiled prefill, models/prefill.py, traces the block's eager code with a cache of its own.)
    """

    _compiled_forward: Callable[..., torch.Tensor]

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: object, cache: KVCacheLayer | None = None
    ) -> torch.Tensor:
        if cache is not None:
            return super().forward(x, cos, sin, mask, cache)
        return self._compiled_forward(x, cos, sin, mask)

    def _block_forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: object) -> torch.Tensor:
        return super().forward(x, cos, sin, mask)


class _CompiledAttentionBlock(_CompiledBlock):
    """For MoE blocks: only the attention half (norm, projections, RoPE, attention, residual) is
    compiled. The MoE dispatcher reads the per-expert token counts on the host to split the tokens
    (models/moe.py), which a full graph cannot contain, and whose changing sizes would recompile
    every step; the expert half stays eager."""

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: object, cache: KVCacheLayer | None = None
    ) -> torch.Tensor:
        if cache is not None:
            return super().forward(x, cos, sin, mask, cache)  # eager, as _CompiledBlock does
        x = self._compiled_forward(x, cos, sin, mask)
        return x + self.ffn(x)  # type: ignore[operator]  # nn.Module attributes are typed Tensor | Module in torch's stubs

    def _block_forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: object) -> torch.Tensor:
        return self.attend(x, cos, sin, mask, None)  # type: ignore[operator]  # nn.Module attributes are typed Tensor | Module in torch's stubs; the block class behind this mixin defines attend


@functools.cache
def _compiled_class(cls: type[nn.Module], attention_only: bool = False) -> type[nn.Module]:
    mixin = _CompiledAttentionBlock if attention_only else _CompiledBlock
    return type(f"Compiled{cls.__name__}", (mixin, cls), {})


def apply_compile(model: Transformer, recompute_pointwise: bool = False) -> int:
    """Compile each TransformerBlock on its own (regional compilation), in place; returns the count.

    `fullgraph=True`: a graph break inside a block is a bug to fix, not something to run slowly.
    `dynamic=False`: packed batches have one static shape, so each block graph is compiled once. All
    blocks share one compiled graph (the block's code is the same; parameters are graph inputs), so
    compile time is that of one block, not of the whole model; the first block of a LoRA model gets a
    second graph (its input needs no gradient), eval (no grad) one more. The block's class is swapped
    (as `apply_recompute` does, which must come first): names and state-dict keys are unchanged, there
    is no `_orig_mod.` prefix. Embedding, final norm and the loss stay eager. MoE blocks compile their
    attention half only (see `_CompiledAttentionBlock`).

    `recompute_pointwise`: the partitioner may recompute in backward a pointwise result that the backward
    reads as a matmul input (AOTAutograd's `ban_recompute_materialized_backward` off). By default it saves
    those: a LoRA block then keeps SwiGLU's output (the down adapter's input) beside gate and up, and the
    norm outputs beside the residual stream they are computed from. Recomputed, they cost one extra write
    each in backward (fused with the pointwise backward that reads gate/up anyway) and a LoRA block keeps
    (f + 1.5 d) x 2 bytes per token less: for llama3-8b at 4 x 2048, ~10 GiB of the step's peak. Opt-in
    (config `memory.recompute_pointwise`, decided in spec.py).

    Each call compiles a private copy of the block's forward code (`own_code`, models/prefill.py): Dynamo keeps graphs, and
    counts them against `torch._dynamo.config.recompile_limit` (8), per code object, and with
    `fullgraph=True` reaching the limit is an error. Shared by every model of a process, the train, eval
    and batch-shape variants of a few models (runs one after another from Python, a sweep, a notebook)
    would reach it; per model they stay a handful, and a model's graphs go with it.
    """
    own: dict[Callable[..., torch.Tensor], Callable[..., torch.Tensor]] = {}
    for block in model.layers:
        if is_compiled(block):
            raise ValueError("model blocks are already compiled")
        block.__class__ = _compiled_class(type(block), attention_only=hasattr(block.mlp, "experts"))  # type: ignore[arg-type]  # nn.Module attributes are typed Tensor | Module in torch's stubs
        fn = type(block)._block_forward  # type: ignore[attr-defined]  # set just above: the class is now a _CompiledBlock
        if fn not in own:  # one copy for all blocks of a model
            own[fn] = own_code(fn)
        forward = types.MethodType(own[fn], block)
        compiled = torch.compile(forward, fullgraph=True, dynamic=False)
        if recompute_pointwise:  # read when the first call partitions the graph (forward and backward at once)
            compiled = torch._functorch.config.patch(ban_recompute_materialized_backward=False)(compiled)
        block._compiled_forward = compiled  # type: ignore[assignment]  # nn.Module attributes are typed Tensor | Module in torch's stubs
    return len(model.layers)


def is_compiled(block: nn.Module) -> bool:
    return isinstance(block, _CompiledBlock)


def compiled_frame_count() -> int:
    """Frames Dynamo has compiled so far in this process (one per distinct graph and guard set)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
