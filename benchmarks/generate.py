"""Generation speed (issue #9): prefill and decode tokens/s of tracetrain's KV caches next to Hugging Face
transformers' `generate` with its default (dynamic) cache, on the same random weights; the attention
kernels of the cached path; and the longest context that fits at batch 1, with and without offload.

Cases: llama2-7b and llama3-8b shapes, bf16, batch 1 and 16, context 4k and 32k (prompt + decoded tokens),
four methods: `gpu` (in-GPU `StaticKVCache`, eager decode), `gpu+graph` (the decode step replayed as a
CUDA graph, fixed shapes), `offload` (`OffloadedKVCache`, K/V in pinned host memory) and `hf`.

- Prefill: the whole prompt (random ids of one length: no padding, so the peer does the same work),
  as `generate_batch` does it by default (`prefill_chunk_tokens`: one forward over the whole prompt when
  its activations fit in 85% of the free memory, else chunks, halved on running out of memory; 2048-token chunks for the offloaded
  cache), timed once: batch x prompt / seconds. transformers: one `generate(max_new_tokens=1)` call (its
  prefill plus one step).
- Prefill variants (`--prefill-variants`, default `fused`; #32): each in-GPU row (`gpu`, `gpu+graph`) is run
  once per variant, next to transformers at the same case. `eager`: the model's own eager forward without
  the fused kernels (`--train.fused_kernels=off`); `compiled`: the same prompt through compiled block functions
  (models/prefill.py; `generate_batch(prefill_mode="compiled")`); `fused`: a twin of the model on the same
  weights with the Triton RMSNorm / RoPE / SwiGLU kernels (the generation spec's kernel row), eager
  prefill, and those kernels in its decode steps too (what `tracetrain generate` runs by default on CUDA). Each variant is warmed up at every batch size before
  the timed rows (compilation, Triton's JIT and autotuning are not timed); a row says which path its
  prefill took (`prefill_path`: a compiled prefill that had to run in chunks says so). Each in-GPU row
  carries the planner's prefill tokens/s for its variant (`plan_prefill_tok_s`, `tracetrain.plan.plan_prefill`:
  the measured figure's prediction). A table of ours / HF per variant (prefill and decode) ends the output.
- Prefill at the longest prompt transformers holds (#32), per model and batch: doubling from the
  longest case it ran, then bisection to 1/8 (at most 128k tokens and 6 probes), then tracetrain's
  prefill of the same length in each variant; `--no-hf-longest` skips it.
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
  # the prefill comparison alone (#32): every variant next to transformers, HF's longest prompt included
  python3 benchmarks/generate.py --methods gpu+graph,hf --prefill-variants eager,compiled,fused --no-search
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, write_result
from generate_cases import attention_kernels, cached_logits_difference, logits_difference, run_case, run_hf, run_ours
from generate_measure import PREFILL_VARIANTS, build_models, failure, free_memory, fused_twin
from generate_search import hf_longest, longest_context

from tracetrain.models.presets import get_preset

METHODS = ("gpu", "gpu+graph", "offload", "hf")


def setup(smoke: bool) -> dict:
    """Shapes, sizes and step counts. decode: (warm-up steps, timed steps per repeat, repeats)."""
    if smoke:
        torch.set_num_threads(1)  # tiny matmuls: a second thread only adds spin-waits on a busy machine
        return dict(
            device=torch.device("cpu"),
            dtype=torch.float32,
            models={"tiny": get_preset("tiny")},
            batches=(1, 4),
            contexts=(64, 256),
            chunk=32,
            gpu="h100-sxm",
            refetch_limit=1e6,
            decode={"gpu": (1, 4, 3), "offload": (1, 2, 3), "hf": (0, 4, 3)},
            search=(64, 2048, 6),
            hf_cap=1024,
            warmup_context=48,
            attention=dict(heads=4, kv_heads=2, head_dim=32, keys=512, batches=(1, 4), chunk=32),
        )
    return dict(
        device=torch.device("cuda"),
        dtype=torch.bfloat16,
        models={n: get_preset(n) for n in ("llama2-7b", "llama3-8b")},
        batches=(1, 16),
        contexts=(4096, 32768),
        chunk=2048,
        gpu=torch.cuda.get_device_name(0),
        refetch_limit=200e9,
        decode={"gpu": (2, 16, 3), "offload": (1, 2, 3), "hf": (0, 16, 3)},
        search=(4096, 1 << 21, 6),
        hf_cap=1 << 17,
        warmup_context=1024,  # each prefill variant's warm-up at every batch size (compile, Triton JIT)
        attention=dict(heads=32, kv_heads=8, head_dim=128, keys=32768, batches=(1, 16), chunk=2048),
    )


def warm_up_variants(ours: dict, variants: list[str], s: dict) -> None:
    """Each variant's prefill at every batch size, and its decode steps, before any timed row: the compiled
    prefill's graphs (batch 1 and the dynamic batch), Triton's JIT for the fused kernels."""
    for variant in variants:
        which, mode = PREFILL_VARIANTS[variant]
        for batch in s["batches"]:
            run_ours(ours[which], "gpu+graph", batch, s["warmup_context"], s, mode)
            free_memory()


def render(kernels: list[dict], rows: list[dict], search: list[dict]) -> str:
    lines = [
        "attention kernels (cached attention, GQA shapes):",
        f"  {'phase':<14} {'batch':>5} {'keys':>6} {'path':<34} {'ms':>9}  without math backend",
    ]
    for r in kernels:
        lines.append(
            f"  {r['phase']:<14} {r['batch']:>5} {r['keys']:>6} {r['path']:<34} "
            f"{r.get('ms', r.get('status', '')):>9}  {r.get('without_math', '')}"
        )
    lines += [
        "",
        f"{'model':<10} {'batch':>5} {'context':>7} {'method':<9} {'variant':<9} {'prefill tok/s':>13} "
        f"{'plan prefill':>12} {'decode tok/s':>12} {'plan decode':>11} {'peak GiB':>8}  status",
    ]
    for r in rows:
        path = r.get("prefill_path", "")
        lines.append(
            f"{r['model']:<10} {r['batch']:>5} {r['context']:>7} {r['method']:<9} {r.get('variant', ''):<9} "
            f"{r.get('prefill_tok_s') or '':>13} {r.get('plan_prefill_tok_s', ''):>12} {r.get('decode_tok_s') or '':>12} "
            f"{r.get('plan_decode_tok_s', ''):>11} {r.get('peak_gib', ''):>8}  {r['status']}"
            + (" (decode only: prompt positions claimed, not prefilled)" if "prefill not" in r.get("note", "") else "")
            + (f" (prefill {path})" if path.startswith("eager:") else "")
        )
    lines += [
        "",
        "longest context at batch 1 (the planner's limit probed, bisection below it on failure; "
        "a cache and a decode step at its last position):",
    ]
    for r in search:
        known = f", {r['known_to_fit']} known from in-GPU" if r["known_to_fit"] else ""
        lines.append(
            f"  {r['model']:<10} {'offload' if r['offload'] else 'in-GPU':<8} {r['longest_context']}"
            f"  (planner's limit {r['planner_limit']}; {r['probes']} probes{known}; "
            f"stopped: {r['stopped']})"
        )
    return "\n".join(lines)


def render_hf_longest(rows: list[dict]) -> str:
    lines = [
        "",
        "prefill at the longest prompt transformers holds (doubling, then bisection; capped):",
        f"  {'model':<10} {'batch':>5} {'context':>8} {'HF tok/s':>10} {'variant':<9} {'ours tok/s':>10} "
        f"{'ratio':>6}  HF first failing",
    ]
    for r in rows:
        hf = r.get("hf") or {}
        failing = (
            r["hf_first_failing"] or f"none up to the cap {r['hf_probes'][-1]['context'] if r['hf_probes'] else ''}"
        )
        for variant, ours in (r.get("ours") or {"-": {}}).items():
            lines.append(
                f"  {r['model']:<10} {r['batch']:>5} {r['context']:>8} {hf.get('prefill_tok_s', '-'):>10} "
                f"{variant:<9} {ours.get('prefill_tok_s', ours.get('status', '-')):>10} "
                f"{r.get('prefill_ratio', {}).get(variant, '-'):>6}  {failing}"
            )
    return "\n".join(lines)


def render_ratios(rows: list[dict], variants: list[str]) -> str:
    """ours / HF per case and prefill variant: prefill and decode tokens/s (the issue's goals: prefill >= 1.2,
    decode >= 3 with the graphed step)."""
    lines = [
        "",
        "ours / HF (prefill, decode tokens/s; same weights, same call):",
        f"  {'model':<10} {'batch':>5} {'context':>7} {'method':<9} "
        + " ".join(f"{v + ' prefill':>17} {v + ' decode':>16}" for v in variants),
    ]
    hf = {(r["model"], r["batch"], r["context"]): r for r in rows if r["method"] == "hf" and r["status"] == "ok"}
    ours = {
        (r["model"], r["batch"], r["context"], r["method"], r.get("variant")): r for r in rows if r["status"] == "ok"
    }
    methods = sorted({r["method"] for r in rows if "variant" in r})
    for (model, batch, context), peer in hf.items():
        for method in methods:
            cells = []
            for v in variants:
                r = ours.get((model, batch, context, method, v), {})
                for key, width in (("prefill_tok_s", 17), ("decode_tok_s", 16)):
                    ok = r.get(key) and peer.get(key)
                    cells.append(f"{r[key] / peer[key]:>{width}.2f}" if ok else f"{'-':>{width}}")
            lines.append(f"  {model:<10} {batch:>5} {context:>7} {method:<9} " + " ".join(cells))
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
    ap.add_argument("--models", default="", help="comma-separated subset of the models (default: all of them)")
    ap.add_argument("--no-hf-longest", action="store_true", help="skip the prefill at the longest prompt HF holds")
    ap.add_argument(
        "--prefill-variants",
        default="fused",
        help=f"comma-separated subset of {','.join(PREFILL_VARIANTS)}: a row per variant for each in-GPU method",
    )
    a = ap.parse_args()
    s = setup(a.smoke)
    methods = [m for m in a.methods.split(",") if m]
    if unknown := set(methods) - set(METHODS):
        ap.error(f"unknown methods {sorted(unknown)}; choose from {', '.join(METHODS)}")
    if a.models:
        if unknown := set(a.models.split(",")) - set(s["models"]):
            ap.error(f"unknown models {sorted(unknown)}; choose from {', '.join(s['models'])}")
        s["models"] = {n: args for n, args in s["models"].items() if n in a.models.split(",")}
    variants = [v for v in a.prefill_variants.split(",") if v]
    if not variants or (unknown := set(variants) - set(PREFILL_VARIANTS)):
        ap.error(f"--prefill-variants {a.prefill_variants!r}: choose from {', '.join(PREFILL_VARIANTS)}")
    deadline = time.perf_counter() + a.budget_s
    results = {
        "budget_s": a.budget_s,
        "prefill_variants": variants,
        "dtype": str(s["dtype"]),
        "prefill_chunk": s["chunk"],
        "decode_steps": s["decode"],
        "attention_kernels": attention_kernels(s),
        "cases": [],
        "longest_context": [],
        "ours_vs_hf_logits": [],
        "hf_longest": [],
    }
    rows, search = results["cases"], results["longest_context"]
    print(json.dumps(results["attention_kernels"]), flush=True)
    save(results, a.smoke)
    for name, args in s["models"].items():
        try:
            plain, hf = build_models(args, s["device"], s["dtype"])
            ours = {"plain": plain, "fused": fused_twin(plain, s["device"]) if "fused" in variants else None}
            run_ours(plain, "gpu", 1, 2 * s["chunk"], s)  # warm-up: cuBLAS handles, kernel selection
            warm_up_variants(ours, variants, s)
            if hf is not None and "hf" in methods:
                run_hf(hf, 1, 2 * s["chunk"], s)
                results["ours_vs_hf_logits"].append({"model": name, **logits_difference(plain, hf, s)})
                for variant, model in (("eager", plain), ("fused", ours["fused"])):
                    if model is not None:  # the cached prefill + one decode step, per model
                        row = {"model": name, "variant": variant, "path": "cached prefill + decode step"}
                        results["ours_vs_hf_logits"].append({**row, **cached_logits_difference(model, hf, s)})
                print(json.dumps(results["ours_vs_hf_logits"][-3:]), flush=True)
            free_memory()
        except Exception as e:
            rows.append({"model": name, "batch": 0, "context": 0, "method": "build", "status": failure(e)})
            continue
        for context in s["contexts"]:
            for batch in s["batches"]:
                for method, variant in [
                    (m, v) for m in methods for v in (variants if m in ("gpu", "gpu+graph") else [None])
                ]:
                    if time.perf_counter() > deadline:
                        rows.append(
                            {
                                "model": name,
                                "batch": batch,
                                "context": context,
                                "method": method,
                                **({"variant": variant} if variant else {}),
                                "status": "skipped: time budget",
                            }
                        )
                        continue
                    rows.append(run_case(ours, hf, name, args, method, batch, context, s, variant or "eager"))
                    print(json.dumps(rows[-1]), flush=True)
                    save(results, a.smoke)
        if hf is not None and "hf" in methods and not a.no_hf_longest:
            for batch in s["batches"]:
                known = max(
                    [
                        r["context"]
                        for r in rows
                        if r["model"] == name
                        and r["batch"] == batch
                        and r["method"] == "hf"
                        and r.get("status") == "ok"
                    ],
                    default=0,
                )
                results["hf_longest"].append(hf_longest(ours, hf, name, batch, known, s, deadline, variants))
                save(results, a.smoke)
        if not a.no_search:
            del hf
            free_memory()
            gpu = longest_context(plain, args, False, s, deadline)
            # What fits in the GPU fits offloaded (less GPU memory): the offload search starts above it,
            # which saves pinning every smaller size.
            off = longest_context(plain, args, True, s, deadline, known=gpu["longest_context"])
            search += [{"model": name, **gpu}, {"model": name, **off}]
            print(json.dumps(search[-2:]), flush=True)
            save(results, a.smoke)
        del ours, plain
        free_memory()
    table = (
        render(results["attention_kernels"], rows, search)
        + render_hf_longest(results["hf_longest"])
        + render_ratios(rows, variants)
    )
    print(table)
    path = save(results, a.smoke, table)
    if path is not None:
        print(f"written: {path}")


if __name__ == "__main__":
    main()
