"""Batched autoregressive generation with a KV cache: greedy, temperature, top-k, top-p; EOS, stop strings
and a token budget per request, each result with its finish reason.

Prompts of different lengths are left-padded; padded positions are masked out of attention and position
ids count only real tokens, so each row generates what it would alone (greedy, fp32: the same tokens as a
batch of one; with sampling the rows share one random generator).

One forward per new token, on a cache from `kv_cache.py`:
- in-GPU (`StaticKVCache`): eager decode steps read the positions written so far; with `cuda_graph=True`
  the step has fixed shapes and reads its write position from a device tensor, so it is captured once
  and replayed for every token (CUDA only);
- offloaded (`kv_offload=True`, `OffloadedKVCache`): K/V in pinned CPU memory, streamed layer by layer
  through two GPU staging buffers; `gpu_window` keeps the most recent positions resident.

Prefill: when no row is left-padded and the cache is on the GPU, the whole prompt goes through one
forward (`prefill_chunk_tokens`): each layer's attention is one causal flash call over the prompt's own
keys and values, no mask tensor and no read back of the cache it has just written; fewer, larger GEMMs
and a sixteenth of the kernel launches of 2048-token chunks at 32k. Chunks of `prefill_chunk` tokens
remain for what needs them: a forward whose activations would not fit in 85% of the free GPU memory
(the chunk is then the largest that does; a forward that runs out of memory all the same goes on in chunks
half as long, with a warning, unless `prefill_chunk` was given), a padded batch (its dense mask grows with chunk x keys) and
the offloaded cache. Only the last position goes through the output head. `prefill_mode="compiled"` runs
that one forward through compiled block functions instead (models/prefill.py); "eager", the default,
runs the model's own eager forward.

Attention kernel (`attention.cached_attention`): a batch without left padding attends with no mask
tensor (flash, GQA included, for prefill chunks and eager decode steps); left padding or a fixed-shape
graphed step needs a dense mask, and then the query heads of each K/V head are grouped so that SDPA's
memory-efficient kernel runs (no K/V copy, no math fallback).

Host synchronisation: the host reads each sampled token to check EOS, stop strings and budgets. It
enqueues the next decode step before it waits for the token, so the device computes step t + 1 while the
host checks token t; the price is one wasted step when the last row finishes.

Text level: `generate_records` batches prompt records by length (data/prompts.py reads a prompts file,
templated as in training, into them; `tracetrain generate --prompts-file` does both), and
`generate_jsonl` writes one result line per prompt.
"""

from __future__ import annotations

import json
import math
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from tracetrain.models.kv_cache import OffloadedKVCache, StaticKVCache
from tracetrain.models.llama import Transformer
from tracetrain.models.prefill import PrefillMode, check_prefill_mode, forward_last, prefill, prefill_chunk_tokens

FinishReason = Literal["eos", "stop", "length"]


@dataclass
class GenerationRequest:
    """One prompt (token ids, BOS included if the model expects it) and its own limits."""

    prompt: list[int]
    max_new_tokens: int = 128
    stop: list[str] = field(default_factory=list)  # stop when the decoded continuation contains one


@dataclass
class GenerationResult:
    """`tokens`: the sampled ids, EOS excluded (with a stop string: up to the token that completed it).
    `text`: the decoded continuation, cut before the stop string (None when no `decode` was given).
    `num_generated`: tokens sampled for this row, EOS included: what the row cost."""

    tokens: list[int]
    finish_reason: FinishReason
    text: str | None
    num_generated: int


class _Row:
    """Host-side state of one request while the batch decodes."""

    def __init__(
        self, request: GenerationRequest, stop_ids: frozenset[int], decode: Callable[[list[int]], str] | None
    ) -> None:
        self.request, self.stop_ids, self.decode = request, stop_ids, decode
        self.tokens: list[int] = []
        self.num_generated = 0
        self.text: str | None = None
        self.finish_reason: FinishReason | None = "length" if request.max_new_tokens <= 0 else None

    def add(self, token: int) -> bool:
        """Take the next sampled token; True once the row is finished."""
        if self.finish_reason is not None:
            return True
        self.num_generated += 1
        if token in self.stop_ids:
            self.finish_reason = "eos"
            return True
        self.tokens.append(token)
        if self.request.stop:
            text = self.decode(self.tokens)  # type: ignore[misc]  # decode is set whenever the request has stop strings
            cuts = [i for i in (text.find(s) for s in self.request.stop) if i >= 0]
            if cuts:
                self.text, self.finish_reason = text[: min(cuts)], "stop"
                return True
        if self.num_generated >= self.request.max_new_tokens:
            self.finish_reason = "length"
        return self.finish_reason is not None

    def result(self) -> GenerationResult:
        text = self.text if self.text is not None else (self.decode(self.tokens) if self.decode else None)
        return GenerationResult(self.tokens, self.finish_reason or "length", text, self.num_generated)


MAX_NEW_TOKENS_LIMIT = 1 << 20

# Allowed values of the sampling options: one table, read by the library checks and the CLI's flag errors.
GENERATION_LIMITS: dict[str, tuple[Callable[[float], bool], str]] = {
    # A million new tokens is past any model's context; a larger count is a typo that would size buffers.
    "max_new_tokens": (lambda v: 0 <= v <= MAX_NEW_TOKENS_LIMIT, f"from 0 to {MAX_NEW_TOKENS_LIMIT:,}"),
    "batch_size": (lambda v: v >= 1, ">= 1"),
    "temperature": (lambda v: 0 <= v < math.inf, ">= 0 and finite (0 = greedy)"),
    "top_k": (lambda v: v >= 0, ">= 0 (0 = off)"),
    "top_p": (lambda v: 0 < v <= 1, "in (0, 1] (1 = off)"),
    "gpu_window": (lambda v: v >= 0, ">= 0"),
}


def bad_generation_option(**options: float) -> tuple[str, float, str] | None:
    """The first option outside `GENERATION_LIMITS` as (name, value, what is allowed), else None.
    NaN fails every test, so it is refused too."""
    for name, value in options.items():
        ok, allowed = GENERATION_LIMITS[name]
        if not ok(value):
            return name, value, allowed
    return None


def check_generation_options(**options: float) -> None:
    """ValueError naming the first option outside `GENERATION_LIMITS`."""
    bad = bad_generation_option(**options)
    if bad is not None:
        raise ValueError(f"{bad[0]} = {bad[1]} is not allowed; must be {bad[2]}")


def sample_next(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, generator: torch.Generator | None
) -> torch.Tensor:
    """(batch, vocab) logits -> (batch,) token ids."""
    if temperature <= 0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(-1, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop = cumulative - sorted_logits.softmax(-1) > top_p  # keep the smallest set reaching top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def left_pad(
    prompts: list[list[int]], pad_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Prompts -> tokens, valid mask and position ids, each (batch, longest); positions count real tokens."""
    batch, longest = len(prompts), max(len(p) for p in prompts)
    tokens = torch.full((batch, longest), pad_id, dtype=torch.long)
    valid = torch.zeros(batch, longest, dtype=torch.bool)
    for i, p in enumerate(prompts):
        tokens[i, longest - len(p) :] = torch.tensor(p, dtype=torch.long)
        valid[i, longest - len(p) :] = True
    positions = (valid.long().cumsum(-1) - 1).clamp(min=0)
    return tokens.to(device), valid.to(device), positions.to(device)


class GraphedDecodeStep:
    """A decode step (batch, 1) -> logits captured as one CUDA graph over static input buffers.

    Captured at the first call; every replay writes K/V at `cache.pos` and advances it on the device.
    The host copy `cache.length` is kept in step here, since replay runs no Python.
    """

    def __init__(self, model: Transformer, cache: StaticKVCache, batch: int, device: torch.device) -> None:
        assert cache.fixed_shape, "a captured decode step needs a fixed-shape cache"
        self.model, self.cache = model, cache
        self.tokens = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.positions = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None

    def _capture(self) -> None:
        length, pos = self.cache.length, self.cache.pos.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside the capture: lazy initialisation, kernel choice
            forward_last(self.model, self.tokens, self.positions, self.cache)
        torch.cuda.current_stream().wait_stream(side)
        # The warm-up wrote K/V at `pos` (rewritten by the first replay) and advanced the cache: undo.
        self.cache.pos.copy_(pos)
        self.cache.length = length
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = forward_last(self.model, self.tokens, self.positions, self.cache)
        self.cache.length = length  # capture ran the host code (length += 1) but no kernel

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, cache: StaticKVCache) -> torch.Tensor:
        self.tokens.copy_(tokens)
        self.positions.copy_(positions)
        if self.graph is None:
            self._capture()
        if self.cache.length + 1 > self.cache.max_len:
            raise ValueError(f"KV cache holds {self.cache.max_len} tokens; {self.cache.length + 1} requested")
        self.graph.replay()  # type: ignore[union-attr]  # captured just above when it was None
        self.cache.length += 1
        return self.logits  # type: ignore[return-value]  # the capture allocates the static logits


def make_cache(
    model: Transformer,
    batch: int,
    max_len: int,
    dtype: torch.dtype,
    kv_offload: bool,
    gpu_window: int,
    fixed_shape: bool = False,
) -> StaticKVCache | OffloadedKVCache:
    """The cache `generate_batch` uses; `fixed_shape` (in-GPU only) for a CUDA-graph decode step."""
    device = model.embed_tokens.weight.device
    if kv_offload:
        return OffloadedKVCache(model.args, batch, max_len, device, dtype, gpu_window)
    return StaticKVCache(model.args, batch, max_len, device, dtype, fixed_shape)


def as_stop_ids(eos_id: int | Iterable[int]) -> frozenset[int]:
    """One EOS id (the older callers' form) or several stop ids (EOS plus end-of-turn ids) -> a set."""
    return frozenset([eos_id] if isinstance(eos_id, int) else eos_id)


def _sync(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


@torch.no_grad()
def generate_batch(
    model: Transformer,
    requests: list[GenerationRequest],
    eos_id: int | Iterable[int],
    pad_id: int,
    *,
    decode: Callable[[list[int]], str] | None = None,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    dtype: torch.dtype | None = None,
    kv_offload: bool = False,
    gpu_window: int = 0,
    cuda_graph: bool = False,
    prefill_chunk: int | None = None,
    prefill_mode: PrefillMode = "eager",
    timings: dict[str, float] | None = None,
) -> list[GenerationResult]:
    """Continue every request in one left-padded batch; one result per request, in order.

    `eos_id`: one id or several (a tokenizer's `stop_ids`: EOS and end-of-turn ids); sampling any of them
    ends the row with finish reason "eos". `decode` (ids -> text) is needed for stop strings and fills
    `GenerationResult.text`. `dtype`: the
    autocast and cache dtype (default: the model's). `cuda_graph` (CUDA, in-GPU cache only) replays the
    decode step as a graph (on CPU the step runs eagerly, with the graph's fixed shapes). `prefill_mode`
    "compiled" runs an unpadded prompt on the in-GPU cache through compiled block functions
    (models/prefill.py; elsewhere it warns and runs eagerly). `timings`, when
    given, receives prefill_s, decode_s (decode steps after the first, which includes graph capture),
    decode_steps and prefill_tokens; it adds two device syncs.
    """
    if any(r.stop for r in requests) and decode is None:
        raise ValueError("stop strings need `decode` (token ids -> text)")
    if not requests or any(not r.prompt for r in requests):
        raise ValueError("every request needs a prompt of at least one token")
    if prefill_chunk is not None and prefill_chunk < 1:
        raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
    check_prefill_mode(prefill_mode)
    check_generation_options(temperature=temperature, top_k=top_k, top_p=top_p, gpu_window=gpu_window)
    if kv_offload and cuda_graph:
        raise ValueError("cuda_graph needs the in-GPU cache: the offloaded cache's copies change size every step")
    device = model.embed_tokens.weight.device
    dtype = dtype or model.embed_tokens.weight.dtype
    stop_ids = as_stop_ids(eos_id)
    rows = [_Row(r, stop_ids, decode) for r in requests]
    num_steps = max(r.max_new_tokens for r in requests)
    if num_steps <= 0:
        return [row.result() for row in rows]
    tokens, valid, positions = left_pad([r.prompt for r in requests], pad_id, device)
    batch, longest = tokens.shape
    cache = make_cache(model, batch, longest + num_steps, dtype, kv_offload, gpu_window, fixed_shape=cuda_graph)
    cache.set_prompt_mask(valid)
    chunk = prefill_chunk_tokens(model, batch, longest, cache, dtype, prefill_chunk)
    graphed = cuda_graph and device.type == "cuda"
    step = GraphedDecodeStep(model, cache, batch, device) if graphed else (lambda t, p, c: forward_last(model, t, p, c))  # type: ignore[arg-type]  # graphed decoding is chosen only for a StaticKVCache
    host_tokens = torch.empty(batch, dtype=torch.long, pin_memory=device.type == "cuda")
    was_training = model.training
    model.eval()
    try:
        # Autocast's cast cache would hold tensors allocated inside the capture: off with graphs.
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32, cache_enabled=not graphed):
            start = time.perf_counter()
            logits = prefill(model, tokens, positions, cache, chunk, prefill_mode, shrink_on_oom=prefill_chunk is None)
            prefill_end = decode_start = _sync(device) if timings is not None else 0.0
            next_pos = positions[:, -1:] + 1  # (batch, 1)
            num_forwards = 0
            for t in range(num_steps):
                nxt = sample_next(logits, temperature, top_k, top_p, generator)
                host_tokens.copy_(nxt, non_blocking=True)
                copied = torch.cuda.Event() if device.type == "cuda" else None
                if copied is not None:
                    copied.record()
                if t + 1 < num_steps:
                    logits = step(nxt[:, None], next_pos, cache)  # type: ignore[arg-type]  # graphed decoding is chosen only for a StaticKVCache; enqueued before the host reads token t
                    next_pos += 1
                    num_forwards += 1
                if copied is not None:
                    copied.synchronize()  # host sync: EOS, stop strings and budgets are checked on the host
                if t == 0 and timings is not None:
                    decode_start = _sync(device)  # the first decode step (lazy init, graph capture) is not timed
                # A list, not a generator: every row must take its token (all() would stop at the first False).
                if all([row.add(tok) for row, tok in zip(rows, host_tokens.tolist())]):  # noqa: C419
                    break
            if timings is not None:
                timed = max(0, num_forwards - 1)
                timings.update(
                    prefill_s=prefill_end - start,
                    prefill_tokens=batch * longest,
                    decode_steps=timed,
                    decode_s=_sync(device) - decode_start if timed else 0.0,
                )
    finally:
        model.train(was_training)
        if isinstance(cache, OffloadedKVCache):
            cache.synchronize()
    return [row.result() for row in rows]


@torch.no_grad()
def generate(
    model: Transformer,
    prompts: list[list[int]],
    max_new_tokens: int,
    eos_id: int | Iterable[int],
    pad_id: int,
    *,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    dtype: torch.dtype | None = None,
    **options: Any,
) -> list[list[int]]:
    """Continue each prompt; returns only the new tokens, cut at (and excluding) EOS (`eos_id`: one id or
    several stop ids).

    `options` are passed to `generate_batch` (kv_offload, gpu_window, cuda_graph, prefill_chunk, prefill_mode)."""
    requests = [GenerationRequest(p, max_new_tokens) for p in prompts]
    results = generate_batch(
        model,
        requests,
        eos_id,
        pad_id,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        generator=generator,
        dtype=dtype,
        **options,
    )
    return [r.tokens for r in results]


def generate_records(
    model: Transformer,
    tokenizer: Any,
    records: list[dict[str, Any]],
    *,
    max_new_tokens: int = 128,
    stop: list[str] | None = None,
    batch_size: int = 16,
    **options: Any,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Generate for prompt records (`prompt_record`); one {"prompt", "completion", "finish_reason", "tokens"}
    per record, in order (`tokens`: tokens generated, the stop id included), and a summary (prompts, tokens,
    seconds, tokens/s, finish reasons).

    Records are batched by prompt length (less padding; a row's result does not depend on its batch).
    `stop` applies to every record, besides its own; `options` go to `generate_batch`.
    """
    check_generation_options(max_new_tokens=max_new_tokens, batch_size=batch_size)
    bos = [tokenizer.bos_id] if tokenizer.add_bos else []  # no BOS for tokenizers without one (Qwen)
    ids = [bos + tokenizer.encode(r["text"]) for r in records]
    requests = [
        GenerationRequest(
            p, max_new_tokens if r["max_new_tokens"] is None else r["max_new_tokens"], list(stop or []) + r["stop"]
        )
        for p, r in zip(ids, records)
    ]
    order = sorted(range(len(requests)), key=lambda i: len(ids[i]))
    results: list[GenerationResult] = [None] * len(requests)  # type: ignore[list-item]  # placeholders: the loop below fills every index (order is a permutation of them)
    start = time.perf_counter()
    for b in range(0, len(order), batch_size):
        chunk = order[b : b + batch_size]
        # Any stop id ends a row: a chat model ends its turn with an end-of-turn id, not always with EOS.
        outs = generate_batch(
            model,
            [requests[i] for i in chunk],
            tokenizer.stop_ids,
            tokenizer.pad_id,
            decode=tokenizer.decode,
            **options,
        )
        for i, out in zip(chunk, outs):
            results[i] = out
    return generation_lines([r["prompt"] for r in records], results, time.perf_counter() - start)


def generation_lines(
    prompts: list[str], results: list[GenerationResult], seconds: float
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """One {"prompt", "completion", "finish_reason", "tokens"} per prompt, and the summary of the run (prompts,
    tokens, seconds, tokens per second, finish reasons), from the results of `seconds` of generation."""
    lines = [
        {"prompt": p, "completion": out.text, "finish_reason": out.finish_reason, "tokens": out.num_generated}
        for p, out in zip(prompts, results)
    ]
    generated = sum(out.num_generated for out in results)
    summary = {
        "prompts": len(prompts),
        "tokens": generated,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(generated / seconds, 1) if seconds > 0 else None,
        "finish_reasons": dict(Counter(out.finish_reason for out in results)),
    }
    return lines, summary


def generate_jsonl(
    model: Transformer,
    tokenizer: Any,
    records: list[dict[str, Any]],
    output_path: str | Path,
    **options: Any,
) -> dict[str, Any]:
    """Generate for prompt `records` (data/prompts.py `read_prompts_jsonl` reads a prompts file into them;
    `generate_records` takes the `options`) and write one JSON line per prompt to `output_path`; returns
    the summary."""
    lines, summary = generate_records(model, tokenizer, records, **options)
    with open(output_path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(line) + "\n" for line in lines)
    return {**summary, "output": str(output_path)}
