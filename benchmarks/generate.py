"""Generation speed (issue #9): prefill and decode tokens/s of tracetrain's KV caches next to Hugging Face
transformers' `generate` with its default (dynamic) cache, on the same random weights; the attention
kernels of the cached path; and the longest context that fits at batch 1, with and without offload.

Cases: llama2-7b and llama3-8b shapes, bf16, batch 1 and 16, context 4k and 32k (prompt + decoded tokens),
four methods: `gpu` (in-GPU `StaticKVCache`, eager decode), `gpu+graph` (the decode step replayed as a
CUDA graph, fixed shapes), `offload` (`OffloadedKVCache`, K/V in pinned host memory) and `hf`.

- Prefill: the whole prompt (random ids of one length: no padding, so the peer does the same work),
  as `generate_batch` does it by default (`prefill_chunk_tokens`: one forward over the whole prompt when
  its activations fit in half of the free memory, else chunks; 2048-token chunks for the offloaded
  cache), timed once: batch x prompt / seconds. transformers: one `generate(max_new_tokens=1)` call (its
  prefill plus one step).
- Prefill at the longest prompt transformers holds (#32), per model and batch: doubling from the
  longest case it ran, then bisection to 1/8 (at most 128k tokens and 6 probes), then tracetrain's
  prefill of the same length; `--no-hf-longest` skips it.
- Decode: a fixed number of steps after warm-up steps (the first includes graph capture), timed in
  several repeats; decode tokens/s = batch x steps / seconds, median of the repeats (all repeats are in
  the JSON). tracetrain's steps are driven directly (model + cache, greedy), without `generate_batch`'s
  host checks. transformers: (time of `generate(1 + n)` - time of `generate(1)`) / n, a pair repeated
  while a pair is cheap.
- A case the planner (`tracetrain.plan.plan_generation`) says cannot fit in GPU memory (or in pinned
  host memory for offload) is recorded "does not fit (predicted)" with the bytes, not attempted (e.g.
  the transformers peer at batch 16 and 32k on llama2-7b: 256 GiB of cache). An out-of-memory error is
  recorded as "OOM" for its row only; memory is freed and the run goes on. An offloaded prefill that
  would copy more than 200 GB host-to-device (each chunk fetches all earlier positions) is not run: its
  decode is timed on a cache that claims the prompt's positions (synthetic; the note says so).
- Attention kernels: the cached attention at llama3-8b shapes (GQA 4) for the paths the cache picks
  (flash without a mask tensor; grouped query heads with a dense mask) next to what ran before
  (`enable_gqa` with a dense mask: SDPA's math backend), median ms, and whether each call runs with the
  math backend disabled.
- Longest context at batch 1: the planner's limit (92% of GPU memory; offload: a pinned cache of at most
  70% of the available host memory) is probed; if it fails, bisection below it. Bounded: at most 6
  probes per search, none after the time budget. The offload search starts from the in-GPU result.
  "Fits" = a cache of that length is allocated and a decode step at its last position runs (a prefill
  needs more: its activations scale with the chunk).

Time: a budget (`--budget-s`, default 390 s) after which no case starts (reported as skipped); the
longest single case is about half a minute, so the run ends within 8 minutes on one H100 80GB.

  python3 benchmarks/generate.py           # GPU; table on stdout, JSON to results/generate_<device>.json (+ $OUT)
  python3 benchmarks/generate.py --smoke   # CPU, the "tiny" preset, small contexts, fp32 (< 1 minute)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, write_result  # noqa: E402

from tracetrain.models.accounting import kv_cache_bytes  # noqa: E402
from tracetrain.models.attention import cached_attention, sdpa_attention  # noqa: E402
from tracetrain.models.generate import (GraphedDecodeStep, forward_last, make_cache,  # noqa: E402
                                        prefill_chunk_tokens)
from tracetrain.models.kv_cache import OffloadedKVCache, causal_valid_mask  # noqa: E402
from tracetrain.models.llama import ModelArgs, Transformer, rope_inv_freq  # noqa: E402
from tracetrain.models.presets import get_preset  # noqa: E402
from tracetrain.plan import plan_generation  # noqa: E402

METHODS = ("gpu", "gpu+graph", "offload", "hf")
GIB = 2**30


def setup(smoke: bool) -> dict:
    """Shapes, sizes and step counts. decode: (warm-up steps, timed steps per repeat, repeats)."""
    if smoke:
        torch.set_num_threads(1)  # tiny matmuls: a second thread only adds spin-waits on a busy machine
        return dict(device=torch.device("cpu"), dtype=torch.float32, models={"tiny": get_preset("tiny")},
                    batches=(1, 4), contexts=(64, 256), chunk=32, gpu="h100-sxm", refetch_limit=1e6,
                    decode={"gpu": (1, 4, 3), "offload": (1, 2, 3), "hf": (0, 4, 3)}, search=(64, 2048, 6),
                    hf_cap=1024,
                    attention=dict(heads=4, kv_heads=2, head_dim=32, keys=512, batches=(1, 4), chunk=32))
    return dict(device=torch.device("cuda"), dtype=torch.bfloat16,
                models={n: get_preset(n) for n in ("llama2-7b", "llama3-8b")}, batches=(1, 16),
                contexts=(4096, 32768), chunk=2048, gpu=torch.cuda.get_device_name(0), refetch_limit=200e9,
                decode={"gpu": (2, 16, 3), "offload": (1, 2, 3), "hf": (0, 16, 3)}, search=(4096, 1 << 21, 6),
                hf_cap=1 << 17,
                attention=dict(heads=32, kv_heads=8, head_dim=128, keys=32768, batches=(1, 16), chunk=2048))


def host_available_bytes() -> int:
    for line in open("/proc/meminfo"):
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        if hasattr(torch._C, "_host_emptyCache"):
            torch._C._host_emptyCache()  # cached pinned blocks go back to the OS (the next case pins other sizes)
        torch.cuda.reset_peak_memory_stats()


def is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


def failure(e: BaseException) -> str:
    if is_oom(e):
        return "OOM"
    traceback.print_exc()
    return f"error: {type(e).__name__}: {str(e)[:300]}"


def sync(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def median_s(fn, device: torch.device, warmup: int = 2, reps: int = 7) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start = sync(device)
        fn()
        times.append(sync(device) - start)
    return statistics.median(times)


def attention_kernels(s: dict) -> list[dict]:
    """The cached attention's kernel paths at GQA shapes vs the `enable_gqa` + dense-mask call of before."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right
    a, dev, rows = s["attention"], s["device"], []
    fused = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
    shapes = [("decode", b, 1) for b in a["batches"]] + [("prefill chunk", 1, a["chunk"])]
    for phase, batch, q_len in shapes:
        keys = a["keys"]
        q = torch.randn(batch, q_len, a["heads"], a["head_dim"], device=dev, dtype=s["dtype"]).transpose(1, 2)
        k, v = torch.randn(2, batch, a["kv_heads"], keys, a["head_dim"], device=dev, dtype=s["dtype"]).unbind(0)
        valid = torch.ones(batch, keys, dtype=torch.bool, device=dev)
        dense = causal_valid_mask(valid, torch.arange(keys - q_len, keys, device=dev), keys)
        paths = {"new: no mask tensor (flash)": lambda: cached_attention(q, k, v, causal_lower_right(q_len, keys)),
                 "new: dense mask, grouped heads": lambda: cached_attention(q, k, v, dense),
                 "before: enable_gqa + dense mask": lambda: sdpa_attention(q, k, v, dense)}
        for name, fn in paths.items():
            row = {"phase": phase, "batch": batch, "q_len": q_len, "keys": keys, "path": name}
            try:
                row["ms"] = round(median_s(fn, dev) * 1e3, 3)
                if dev.type == "cuda":
                    try:
                        with sdpa_kernel(fused):
                            fn()
                        row["without_math"] = True
                    except RuntimeError:
                        row["without_math"] = False
            except Exception as e:  # noqa: BLE001 - one path's failure is a result
                row["status"] = failure(e)
            rows.append(row)
            free_memory()
        del q, k, v, dense
        free_memory()
    return rows


def build_models(args: ModelArgs, device: torch.device, dtype: torch.dtype) -> tuple[Transformer, object | None]:
    """Random weights shared by tracetrain's model and the HF one (no second copy); HF None if absent."""
    try:
        import transformers
    except ImportError:
        transformers = None
    if transformers is None:
        from tracetrain.models.build import materialize
        return materialize(args, device, 0, dtype).eval(), None
    extra = {"rope_scaling": {"rope_type": "llama3", **args.rope_scaling}} if args.rope_scaling else {}
    cfg = transformers.LlamaConfig(hidden_size=args.dim, intermediate_size=args.ffn_dim,
                                   num_hidden_layers=args.n_layers,
                                   num_attention_heads=args.n_heads, num_key_value_heads=args.n_kv_heads,
                                   vocab_size=args.vocab_size, rope_theta=args.rope_theta, rms_norm_eps=args.norm_eps,
                                   max_position_embeddings=1 << 22, tie_word_embeddings=args.tie_embeddings,
                                   attention_bias=args.qkv_bias, bos_token_id=None, eos_token_id=None, pad_token_id=0,
                                   **extra)
    cfg._attn_implementation = "sdpa"
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        torch.manual_seed(0)
        with torch.device(device):
            hf = transformers.LlamaForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(default)
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    with torch.device("meta"):
        ours = Transformer(args)
    ours.load_state_dict({k.removeprefix("model."): v for k, v in hf.state_dict().items()}, assign=True)
    ours.rope_inv_freq = rope_inv_freq(args).to(device)  # a non-persistent buffer: not in the state dict
    ours.tie_weights()
    return ours.eval(), hf


def refetch_bytes(args: ModelArgs, batch: int, prompt: int, s: dict) -> int:
    """Bytes an offloaded chunked prefill copies host-to-device: every chunk fetches all earlier positions."""
    dtype_bytes = torch.empty((), dtype=s["dtype"]).element_size()
    num_chunks = -(-prompt // s["chunk"])
    return num_chunks * (num_chunks - 1) // 2 * s["chunk"] * kv_cache_bytes(args, batch, 1, dtype_bytes)


def autocast(s: dict, graph: bool = False):
    # As generate_batch: autocast's cast cache would hold tensors allocated inside a graph capture.
    return torch.autocast(s["device"].type, dtype=s["dtype"], enabled=s["dtype"] != torch.float32,
                          cache_enabled=not graph)


def prefill(model: Transformer, cache, batch: int, prompt: int, s: dict) -> tuple[torch.Tensor, float | None]:
    """Random prompt ids through the cache in chunks; (last logits, seconds), or a cache that only claims
    the prompt's positions (seconds None) when an offloaded prefill would copy too much."""
    dev = s["device"]
    if isinstance(cache, OffloadedKVCache) and refetch_bytes(model.args, batch, prompt, s) > s["refetch_limit"]:
        cache.length = prompt
        cache.fetch(0)
        return torch.zeros(batch, model.args.vocab_size, device=dev), None
    tokens = torch.randint(0, model.args.vocab_size, (batch, prompt), device=dev)
    positions = torch.arange(prompt, device=dev).expand(batch, prompt)
    # The library's rule (generate_batch's default): the whole prompt when it fits, else chunks.
    chunk = prefill_chunk_tokens(model, batch, prompt, cache, s["dtype"], None)
    start = sync(dev)
    with torch.no_grad(), autocast(s):
        for a in range(0, prompt, chunk):
            logits = forward_last(model, tokens[:, a:a + chunk], positions[:, a:a + chunk], cache)
    return logits, sync(dev) - start


def run_ours(model: Transformer, method: str, batch: int, context: int, s: dict) -> dict:
    warmup, steps, repeats = s["decode"]["offload" if method == "offload" else "gpu"]
    prompt, dev, graph = context - warmup - steps * repeats, s["device"], method == "gpu+graph"
    cache = make_cache(model, batch, context, s["dtype"], method == "offload", 0,
                       fixed_shape=method == "gpu+graph")
    cache.set_prompt_mask(torch.ones(batch, prompt, dtype=torch.bool, device=dev))
    logits, prefill_s = prefill(model, cache, batch, prompt, s)
    use_graph = graph and dev.type == "cuda"
    step = GraphedDecodeStep(model, cache, batch, dev) if use_graph else \
        (lambda t, p, c: forward_last(model, t, p, c))
    token, pos = logits.argmax(-1, keepdim=True), torch.full((batch, 1), prompt, device=dev)
    tok_s = []
    with torch.no_grad(), autocast(s, graph):
        for _ in range(warmup):
            token, pos = step(token, pos, cache).argmax(-1, keepdim=True), pos + 1
        for _ in range(repeats):
            start = sync(dev)
            for _ in range(steps):
                token, pos = step(token, pos, cache).argmax(-1, keepdim=True), pos + 1
            tok_s.append(batch * steps / (sync(dev) - start))
    if isinstance(cache, OffloadedKVCache):
        cache.synchronize()
    row = {"prefill_tok_s": batch * prompt / prefill_s if prefill_s else None,
           "decode_tok_s": statistics.median(tok_s), "decode_tok_s_repeats": [round(x, 1) for x in tok_s],
           "decode_steps": f"{warmup} warm-up + {repeats} x {steps}"}
    if prefill_s is None:
        row["note"] = (f"prefill not run: it would copy {refetch_bytes(model.args, batch, prompt, s) / 1e9:.3g} GB "
                       "host-to-device; decode timed on a cache that claims the prompt's positions")
    return row


def run_hf(hf, batch: int, context: int, s: dict) -> dict:
    _, steps, repeats = s["decode"]["hf"]
    dev = s["device"]
    ids = torch.randint(0, hf.config.vocab_size, (batch, context - 1 - steps), device=dev)
    kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=False, eos_token_id=None, pad_token_id=0)

    def timed(n: int) -> float:
        start = sync(dev)
        out = hf.generate(ids, max_new_tokens=n, **kwargs)
        end = sync(dev)
        assert out.shape[1] == ids.shape[1] + n, f"HF generated {out.shape[1] - ids.shape[1]} of {n} tokens"
        return end - start

    pairs = []
    with torch.no_grad():
        while len(pairs) < repeats:
            one = timed(1)
            pairs.append((one, timed(1 + steps)))
            if one > 1.0:  # a pair is not cheap: one is enough
                break
    decode = [batch * steps / (full - one) for one, full in pairs if full > one]
    return {"prefill_tok_s": batch * ids.shape[1] / statistics.median(p[0] for p in pairs),
            "decode_tok_s": statistics.median(decode) if decode else None,  # None: timing noise
            "decode_tok_s_repeats": [round(x, 1) for x in decode], "decode_steps": f"{len(pairs)} x {steps}"}


def logits_difference(ours: Transformer, hf, s: dict) -> dict:
    """Both models on one random prompt: the weights are shared, so the logits must agree (to bf16 noise)."""
    tokens = torch.randint(0, ours.args.vocab_size, (1, 64), device=s["device"])
    with torch.no_grad(), autocast(s):
        a, b = ours(tokens).float(), hf(tokens).logits.float()
    return {"max_abs_diff": round((a - b).abs().max().item(), 4), "logit_std": round(b.std().item(), 4),
            "same_argmax": round((a.argmax(-1) == b.argmax(-1)).float().mean().item(), 3)}


def does_not_fit(args: ModelArgs, offload: bool, batch: int, context: int, s: dict) -> str | None:
    """The planner's verdict: a reason when the cache cannot fit (GPU, or pinned host memory), else None."""
    dtype_bytes = torch.empty((), dtype=s["dtype"]).element_size()
    p = plan_generation(args, batch, context, dtype_bytes, s["gpu"], offload=offload)
    if s["device"].type == "cuda":
        total = torch.cuda.get_device_properties(0).total_memory
        if p.gpu_bytes > 0.92 * total:
            return f"weights + cache {p.gpu_bytes / GIB:.1f} GiB > 92% of {total / GIB:.0f} GiB GPU memory"
    if p.cpu_cache_bytes > 0.7 * host_available_bytes():  # pinned pages cannot be swapped: leave headroom
        return f"pinned cache {p.cpu_cache_bytes / GIB:.1f} GiB > 70% of {host_available_bytes() / GIB:.0f} " \
               "GiB available host memory"
    return None


def run_case(ours, hf, name: str, args: ModelArgs, method: str, batch: int, context: int, s: dict) -> dict:
    row = {"model": name, "batch": batch, "context": context, "method": method}
    dtype_bytes = torch.empty((), dtype=s["dtype"]).element_size()
    plan = plan_generation(args, batch, context, dtype_bytes, s["gpu"], offload=method == "offload")
    row["plan_decode_tok_s"] = round(plan.decode_tokens_per_s, 1)
    if method == "gpu+graph" and s["device"].type != "cuda":
        row["note"] = "no CUDA: the fixed-shape step runs eagerly"
    if method == "hf" and hf is None:
        return {**row, "status": "skipped: transformers is not installed"}
    reason = does_not_fit(args, method == "offload", batch, context, s)
    if reason:
        return {**row, "status": f"does not fit (predicted): {reason}"}
    try:
        result = run_hf(hf, batch, context, s) if method == "hf" else run_ours(ours, method, batch, context, s)
        row.update(status="ok", **{k: round(v, 1) if isinstance(v, float) else v for k, v in result.items()})
    except Exception as e:  # noqa: BLE001 - one case's failure must not end the run; it is reported
        row["status"] = failure(e)
    if s["device"].type == "cuda":
        row["peak_gib"] = round(torch.cuda.max_memory_allocated() / GIB, 2)
    free_memory()
    return row


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
        forward_last(model, torch.zeros(1, 1, dtype=torch.long, device=dev),
                     torch.full((1, 1), context - 1, device=dev), cache)
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


def longest_context(model: Transformer, args: ModelArgs, offload: bool, s: dict, deadline: float,
                    known: int | None = None) -> dict:
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
        except Exception as e:  # noqa: BLE001
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
    stop = "; ".join(f"{n}: {r}" for n, r in tried if r != "ok") or \
        ("reached the planner's limit" if best == limit else "probes or time budget")
    return {"offload": offload, "longest_context": best, "planner_limit": limit, "known_to_fit": known,
            "probes": probes, "tried": tried, "stopped": stop}


def hf_prefill(hf, batch: int, context: int, s: dict) -> dict:
    """transformers' prefill of a (batch, context - 1) prompt: one `generate(max_new_tokens=1)`."""
    dev = s["device"]
    try:
        ids = torch.randint(0, hf.config.vocab_size, (batch, context - 1), device=dev)
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        start = sync(dev)
        with torch.no_grad():
            hf.generate(ids, max_new_tokens=1, attention_mask=torch.ones_like(ids), do_sample=False,
                        eos_token_id=None, pad_token_id=0)
        row = {"status": "ok", "prefill_tok_s": round(batch * (context - 1) / (sync(dev) - start), 1)}
        if dev.type == "cuda":
            row["peak_gib"] = round(torch.cuda.max_memory_allocated() / GIB, 2)
        return row
    except Exception as e:  # noqa: BLE001 - running out is the answer the search looks for
        return {"status": failure(e)}
    finally:
        ids = None
        free_memory()


def ours_prefill(model: Transformer, batch: int, context: int, s: dict) -> dict:
    """tracetrain's prefill of the same prompt into an in-GPU cache (generate_batch's chunk rule)."""
    try:
        cache = make_cache(model, batch, context, s["dtype"], False, 0)
        cache.set_prompt_mask(torch.ones(batch, context - 1, dtype=torch.bool, device=s["device"]))
        if s["device"].type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        _, seconds = prefill(model, cache, batch, context - 1, s)
        row = {"status": "ok", "prefill_tok_s": round(batch * (context - 1) / seconds, 1),
               "prefill_chunk": prefill_chunk_tokens(model, batch, context - 1, cache, s["dtype"], None)}
        if s["device"].type == "cuda":
            row["peak_gib"] = round(torch.cuda.max_memory_allocated() / GIB, 2)
        return row
    except Exception as e:  # noqa: BLE001
        return {"status": failure(e)}
    finally:
        cache = None
        free_memory()


def hf_longest(ours: Transformer, hf, name: str, batch: int, known: int, s: dict, deadline: float) -> dict:
    """The longest prompt transformers prefills at `batch`: doubling from the longest case it ran (`known`),
    then bisection to 1/8 of the length (multiples of 1024), at most `hf_cap` tokens and 6 probes; then
    tracetrain's prefill of that length, same call. A length the planner says cannot hold the cache is
    a failure without a probe."""
    lo, hi, probes, best = known, None, [], None
    n = 2 * known if known else 2048
    while n <= s["hf_cap"] and len(probes) < 6 and time.perf_counter() < deadline:
        reason = does_not_fit(ours.args, False, batch, n, s)
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
    row = {"model": name, "batch": batch, "context": lo, "hf_first_failing": hi, "hf_capped": hi is None,
           "hf": best, "hf_probes": probes}
    if lo and time.perf_counter() < deadline:
        row["ours"] = ours_prefill(ours, batch, lo, s)
        if best and row["ours"].get("status") == "ok":
            row["prefill_ratio"] = round(row["ours"]["prefill_tok_s"] / best["prefill_tok_s"], 3)
    return row


def render(kernels: list[dict], rows: list[dict], search: list[dict]) -> str:
    lines = ["attention kernels (cached attention, GQA shapes):",
             f"  {'phase':<14} {'batch':>5} {'keys':>6} {'path':<34} {'ms':>9}  without math backend"]
    for r in kernels:
        lines.append(f"  {r['phase']:<14} {r['batch']:>5} {r['keys']:>6} {r['path']:<34} "
                     f"{r.get('ms', r.get('status', '')):>9}  {r.get('without_math', '')}")
    lines += ["", f"{'model':<10} {'batch':>5} {'context':>7} {'method':<9} {'prefill tok/s':>13} "
                  f"{'decode tok/s':>12} {'plan decode':>11} {'peak GiB':>8}  status"]
    for r in rows:
        lines.append(f"{r['model']:<10} {r['batch']:>5} {r['context']:>7} {r['method']:<9} "
                     f"{r.get('prefill_tok_s') or '':>13} {r.get('decode_tok_s') or '':>12} "
                     f"{r.get('plan_decode_tok_s', ''):>11} {r.get('peak_gib', ''):>8}  {r['status']}"
                     + (" (decode only: prompt positions claimed, not prefilled)" if "prefill not" in
                        r.get("note", "") else ""))
    lines += ["", "longest context at batch 1 (the planner's limit probed, bisection below it on failure; "
                  "a cache and a decode step at its last position):"]
    for r in search:
        known = f", {r['known_to_fit']} known from in-GPU" if r["known_to_fit"] else ""
        lines.append(f"  {r['model']:<10} {'offload' if r['offload'] else 'in-GPU':<8} {r['longest_context']}"
                     f"  (planner's limit {r['planner_limit']}; {r['probes']} probes{known}; "
                     f"stopped: {r['stopped']})")
    return "\n".join(lines)


def render_hf_longest(rows: list[dict]) -> str:
    lines = ["", "prefill at the longest prompt transformers holds (doubling, then bisection; capped):",
             f"  {'model':<10} {'batch':>5} {'context':>8} {'HF tok/s':>10} {'ours tok/s':>10} {'ratio':>6}  "
             "HF first failing"]
    for r in rows:
        hf, ours = r.get("hf") or {}, r.get("ours") or {}
        failing = r["hf_first_failing"] or f"none up to the cap {r['hf_probes'][-1]['context'] if r['hf_probes'] else ''}"
        lines.append(f"  {r['model']:<10} {r['batch']:>5} {r['context']:>8} {hf.get('prefill_tok_s', '-'):>10} "
                     f"{ours.get('prefill_tok_s', ours.get('status', '-')):>10} {r.get('prefill_ratio', '-'):>6}  {failing}")
    return "\n".join(lines)


def save(results: dict, smoke: bool, table: str | None = None) -> Path | None:
    """The JSON (rewritten after every case, so a killed run keeps what it measured) and the table.
    Smoke runs (CPU numbers mean nothing) write only under $OUT."""
    payload = {"env": environment(), "smoke": smoke, **results}
    out = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        if table is not None:
            (out / "generate_table.txt").write_text(table + "\n")
    if smoke:
        if out is not None:
            (out / "generate_smoke.json").write_text(json.dumps(payload, indent=2))
        return None
    return write_result(f"generate_{payload['env']['device'].replace(' ', '-')}.json", payload, out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", "--tiny", action="store_true", help="CPU smoke test: the tiny preset, small contexts")
    ap.add_argument("--budget-s", type=float, default=390.0, help="start no case or probe after this many seconds")
    ap.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated subset of {','.join(METHODS)}")
    ap.add_argument("--no-search", action="store_true", help="skip the longest-context search")
    ap.add_argument("--no-hf-longest", action="store_true", help="skip the prefill at the longest prompt HF holds")
    a = ap.parse_args()
    s = setup(a.smoke)
    methods = [m for m in a.methods.split(",") if m]
    if unknown := set(methods) - set(METHODS):
        ap.error(f"unknown methods {sorted(unknown)}; choose from {', '.join(METHODS)}")
    deadline = time.perf_counter() + a.budget_s
    results = {"budget_s": a.budget_s, "dtype": str(s["dtype"]), "prefill_chunk": s["chunk"],
               "decode_steps": s["decode"], "attention_kernels": attention_kernels(s), "cases": [],
               "longest_context": [], "ours_vs_hf_logits": [], "hf_longest": []}
    rows, search = results["cases"], results["longest_context"]
    print(json.dumps(results["attention_kernels"]), flush=True)
    save(results, a.smoke)
    for name, args in s["models"].items():
        try:
            ours, hf = build_models(args, s["device"], s["dtype"])
            run_ours(ours, "gpu", 1, 2 * s["chunk"], s)  # warm-up: cuBLAS handles, kernel selection
            if hf is not None and "hf" in methods:
                run_hf(hf, 1, 2 * s["chunk"], s)
                results["ours_vs_hf_logits"].append({"model": name, **logits_difference(ours, hf, s)})
            free_memory()
        except Exception as e:  # noqa: BLE001
            rows.append({"model": name, "batch": 0, "context": 0, "method": "build", "status": failure(e)})
            continue
        for context in s["contexts"]:
            for batch in s["batches"]:
                for method in methods:
                    if time.perf_counter() > deadline:
                        rows.append({"model": name, "batch": batch, "context": context, "method": method,
                                     "status": "skipped: time budget"})
                        continue
                    rows.append(run_case(ours, hf, name, args, method, batch, context, s))
                    print(json.dumps(rows[-1]), flush=True)
                    save(results, a.smoke)
        if hf is not None and "hf" in methods and not a.no_hf_longest:
            for batch in s["batches"]:
                known = max([r["context"] for r in rows if r["model"] == name and r["batch"] == batch
                             and r["method"] == "hf" and r.get("status") == "ok"], default=0)
                results["hf_longest"].append(hf_longest(ours, hf, name, batch, known, s, deadline))
                save(results, a.smoke)
        if not a.no_search:
            del hf
            free_memory()
            gpu = longest_context(ours, args, False, s, deadline)
            # What fits in the GPU fits offloaded (less GPU memory): the offload search starts above it,
            # which saves pinning every smaller size.
            off = longest_context(ours, args, True, s, deadline, known=gpu["longest_context"])
            search += [{"model": name, **gpu}, {"model": name, **off}]
            print(json.dumps(search[-2:]), flush=True)
            save(results, a.smoke)
        del ours
        free_memory()
    table = render(results["attention_kernels"], rows, search) + render_hf_longest(results["hf_longest"])
    print(table)
    path = save(results, a.smoke, table)
    if path is not None:
        print(f"written: {path}")


if __name__ == "__main__":
    main()
