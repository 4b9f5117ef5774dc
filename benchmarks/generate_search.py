"""The longest-context searches of benchmarks/generate.py: the longest cache that fits at batch 1 (the
planner's limit probed, bisection below it), and the prefill at the longest prompt transformers holds."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import torch
from generate_measure import GIB, PREFILL_VARIANTS, autocast, does_not_fit, failure, free_memory, prefill, sync

from tracetrain.models.generate import make_cache
from tracetrain.models.llama import ModelArgs, Transformer
from tracetrain.models.prefill import PrefillMode, forward_last, last_position_refusal, prefill_chunk_tokens


def fits(model: Transformer, context: int, offload: bool, s: dict) -> None:
    """A cache of `context` positions (batch 1) and a decode step at its last position."""
    dev = s["device"]
    cache = make_cache(model, 1, context, s["dtype"], offload, 0)
    cache.set_prompt_mask(torch.ones(1, 1, dtype=torch.bool, device=dev))
    cache.length = context - 1  # claims the positions before the last (not written: memory and a step only)
    if offload:
        cache.fetch(0)
    else:
        cache.pos.fill_(context - 1)
    with torch.no_grad(), autocast(s):
        forward_last(
            model, torch.zeros(1, 1, dtype=torch.long, device=dev), torch.full((1, 1), context - 1, device=dev), cache
        )
    sync(dev)
    if offload:
        cache.synchronize()


def planner_limit(args: ModelArgs, offload: bool, s: dict) -> int:
    """The longest context (a multiple of 1024, at most the cap) that `does_not_fit` accepts at batch 1."""
    lo, hi = 0, s["search"][1] // 1024
    while lo < hi:  # the planner is a pure function: a binary search on it costs nothing
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if does_not_fit(args, offload, 1, mid * 1024, s) is None else (lo, mid - 1)
    return lo * 1024


def longest_context(
    model: Transformer, args: ModelArgs, offload: bool, s: dict, deadline: float, known: int | None = None
) -> dict:
    """Probe the planner's limit (92% of GPU memory; offload: 70% of available host memory for the pinned
    cache); if it fails, bisect between the longest known to fit (`known`, else the search's start) and
    it, to 1/16 of that length. Bounded by a number of probes and the deadline (an offloaded probe pins
    up to tens of GiB, seconds each). The longest that worked, and why the search stopped."""
    low, _, max_probes = s["search"]
    best, probes, tried = known, 0, []

    def probe(n: int) -> bool:
        nonlocal probes
        probes += 1
        try:
            fits(model, n, offload, s)
            tried.append((n, "ok"))
            return True
        except Exception as e:
            tried.append((n, failure(e)))
            return False
        finally:
            free_memory()

    def budget_left() -> bool:
        return probes < max_probes and time.perf_counter() < deadline

    limit = planner_limit(args, offload, s)
    if best is None and limit >= low and budget_left():
        best = low if probe(low) else None  # nothing known yet: the search's start first
    if best is not None and limit > best and budget_left():
        if probe(limit):
            best = limit
        else:
            failed = limit
            while failed - best > max(1024, best // 16) and budget_left():
                mid = (best + failed) // 2 // 1024 * 1024
                if probe(mid):
                    best = mid
                else:
                    failed = mid
    stop = "; ".join(f"{n}: {r}" for n, r in tried if r != "ok") or (
        "reached the planner's limit" if best == limit else "probes or time budget"
    )
    return {
        "offload": offload,
        "longest_context": best,
        "planner_limit": limit,
        "known_to_fit": known,
        "probes": probes,
        "tried": tried,
        "stopped": stop,
    }


def hf_prefill(hf, batch: int, context: int, s: dict) -> dict:
    """transformers' prefill of a (batch, context - 1) prompt: one `generate(max_new_tokens=1)`."""
    dev = s["device"]

    def measure() -> dict:
        ids = torch.randint(0, hf.config.vocab_size, (batch, context - 1), device=dev)
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        start = sync(dev)
        with torch.no_grad():
            hf.generate(
                ids,
                max_new_tokens=1,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        return {"status": "ok", "prefill_tok_s": round(batch * (context - 1) / (sync(dev) - start), 1)}

    return prefill_row(measure, dev)


def ours_prefill(model: Transformer, batch: int, context: int, s: dict, mode: PrefillMode = "eager") -> dict:
    """tracetrain's prefill of the same prompt into an in-GPU cache (generate_batch's chunk rule, `mode`).
    The compiled mode first runs one untimed prefill of the same shape: a new shape can recompile (16 x
    13,312 tokens of llama3-8b was the first whose MLP tensors pass 2^31 elements, and that row's single timed
    prefill measured 0.44x HF where the eager one measured 1.17x)."""

    def measure() -> dict:
        cache = make_cache(model, batch, context, s["dtype"], False, 0)
        cache.set_prompt_mask(torch.ones(batch, context - 1, dtype=torch.bool, device=s["device"]))
        if s["device"].type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        _, seconds, path = prefill(model, cache, batch, context - 1, s, mode)
        return {
            "status": "ok",
            "prefill_tok_s": round(batch * (context - 1) / seconds, 1),
            "prefill_chunk": prefill_chunk_tokens(model, batch, context - 1, cache, s["dtype"], None),
            "prefill_path": path,
            "prefill_last_block": "every position" if last_position_refusal(model) else "last position",
        }

    if mode == "compiled":
        warm = prefill_row(measure, s["device"])
        if warm.get("status") != "ok":
            return warm
    return prefill_row(measure, s["device"])


def prefill_row(measure: Callable[[], dict], device: torch.device) -> dict:
    """The row `measure()` returns, with the peak GPU memory on CUDA, or {"status": "OOM" | "error: ..."} when
    it fails; memory is freed after either way (the tensors `measure` made are gone with its frame)."""
    try:
        row = measure()
        if device.type == "cuda":
            row["peak_gib"] = round(torch.cuda.max_memory_allocated() / GIB, 2)
        return row
    except Exception as e:
        return {"status": failure(e)}
    finally:
        free_memory()


def hf_longest(
    ours: dict[str, Transformer], hf, name: str, batch: int, known: int, s: dict, deadline: float, variants: list[str]
) -> dict:
    """The longest prompt transformers prefills at `batch`: doubling from the longest case it ran (`known`),
    then bisection to 1/8 of the length (multiples of 1024), at most `hf_cap` tokens and 6 probes; then
    tracetrain's prefill of that length in each prefill variant, same call. A length the planner says cannot
    hold the cache is a failure without a probe."""
    lo, hi, probes, best = known, None, [], None
    n = 2 * known if known else 2048
    while n <= s["hf_cap"] and len(probes) < 6 and time.perf_counter() < deadline:
        reason = does_not_fit(ours["plain"].args, False, batch, n, s)
        r = {"status": f"does not fit (predicted): {reason}"} if reason else hf_prefill(hf, batch, n, s)
        probes.append({"context": n, **r})
        print(json.dumps({"hf_longest": name, "batch": batch, **probes[-1]}), flush=True)
        if r["status"] == "ok":
            lo, best = n, r
        else:
            hi = n
        if hi is None:
            n *= 2
        elif hi - lo <= max(1024, lo // 8):
            break
        else:
            n = (lo + hi) // 2 // 1024 * 1024
    row = {
        "model": name,
        "batch": batch,
        "context": lo,
        "hf_first_failing": hi,
        "hf_capped": hi is None,
        "hf": best,
        "hf_probes": probes,
    }
    row["ours"], row["prefill_ratio"] = {}, {}
    for variant in variants:
        if not lo or time.perf_counter() > deadline:
            break
        which, mode = PREFILL_VARIANTS[variant]
        ours_row = row["ours"][variant] = ours_prefill(ours[which], batch, lo, s, mode)
        if best and ours_row.get("status") == "ok":
            row["prefill_ratio"][variant] = round(ours_row["prefill_tok_s"] / best["prefill_tok_s"], 3)
    return row
