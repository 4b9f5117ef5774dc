"""`tracetrain tune` on one GPU against the best hand-tuned tokens/s we know, and on 2 GPUs against every
layout measured (issue #31, point 5).

Each case starts from tracetrain's default switches (compile, attention, fused loss, no recomputation, no
offload: what `tracetrain train` resolves), with the model, the batch and 2048-token packed rows of the
built-in synthetic task set on the command line, and runs `tracetrain.tune` with a small budget. The
tuned config's measured tokens/s is compared with the best hand-tuned figure of docs/performance.md:

| case        | start                                      | best known (docs/performance.md)                     |
|-------------|--------------------------------------------|------------------------------------------------------|
| 7b-lora     | llama2-7b LoRA r=16 q/k/v/o, 4 x 2048      | 20,305 tok/s, defaults, packed (H100, same day)      |
| 1b-full     | llama3.2-1b full, 4 x 2048                 | 59,642 tok/s, defaults, packed (H100)                |
| 8b-full     | llama3-8b full, 2 x 2048 (does not fit)    | 8,133 tok/s, full recompute, 2 x 2048 (H200)         |
| 7b-full-80  | llama2-7b full, 4 x 2048, --max-memory 80  | a config that fits in 80 GiB (6,744 tok/s with       |
|             |                                            | optimizer offload and 8 x accumulation, H200)        |

Each case's budget (1.2 to 2.1 minutes, 6.5 in all; `--budget-scale` multiplies them) keeps the whole
script under 8 minutes on one H200. Writes `tune_check_<gpu>.json` (benchmarks/results, and $OUT when set) with every case's trials
(change, reason, predicted and measured gain, status), and copies each case's tuned.toml and report.html
to $OUT/tune_check/<case>/.

    PYTHONPATH=. python3 benchmarks/tune_check.py [--cases 7b-lora,1b-full] [--budget-scale 1.0]

With `--gpus 2` (tune_check_layouts.py): does tune pick a layout within 5% of the best measured one? The
case `2gpu-1b-full` (llama3.2-1b full, 2 x 2048 per rank, default switches) runs `tracetrain tune --gpus 2`
for 3.0 minutes (the planner's top three layouts are its first candidates), then measures every
distinct layout the planner lists for 2 GPUs (DDP, FSDP, ZeRO-1, ZeRO-2, tp2, cp2), each in its own
torchrun process with tune's trial window and a fresh ledger, for at most 4.7 minutes, and reports tune's
pick against the best of them (ratio, trials, minutes) in `tune_check_2gpu_<gpu>.json`. About 8 minutes
in all; on a 2 x H200 machine:

    CUDA_VISIBLE_DEVICES=0,1 TRACETRAIN_COMMIT=<sha> PYTHONPATH=. python3 benchmarks/tune_check.py --gpus 2

(`--cases 2rank-cpu` runs the same check on the CPU with gloo and the built-in tiny run: the script's
smoke test.)
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, write_result

COMMON = ["--data.seq_len=2048", "--data.kind=synthetic", "--data.tokenizer=byte", "--data.pack=true"]
# case -> (overrides, --max-memory, best hand-tuned tok/s, where that figure comes from, budget minutes)
CASES: dict[str, tuple[list[str], float | None, float | None, str, float]] = {
    "7b-lora": (
        ["--model.preset=llama2-7b", "--train.mode=lora", "--train.micro_batch_size=4"],
        None,
        20_305.0,
        "docs/performance.md: 7B LoRA defaults, packed (speed_fp8_fused_mlp_NVIDIA-H100-80GB-HBM3.json)",
        1.4,
    ),
    "1b-full": (
        ["--model.preset=llama3.2-1b", "--train.micro_batch_size=4"],
        None,
        59_642.0,
        "docs/performance.md: llama3.2-1b full defaults, packed (speed_inductor_knobs_1b_NVIDIA-H100-80GB-HBM3.json)",
        1.2,
    ),
    "8b-full": (
        ["--model.preset=llama3-8b", "--train.micro_batch_size=2"],
        None,
        8_133.0,
        "docs/performance.md: llama3-8b full, full recompute, 2 x 2048 on one H200 (peers_NVIDIA-H200.json)",
        1.8,
    ),
    "7b-full-80": (
        ["--model.preset=llama2-7b", "--train.micro_batch_size=4"],
        80.0,
        None,
        "a config that fits in 80 GiB (docs/performance.md: 6,744 tok/s with optimizer offload, H200)",
        2.1,
    ),
}


# The 2-GPU cases (tune_check_layouts.py): case -> (overrides, tune budget, reference budget, minutes).
# llama3.2-1b full, 2 x 2048 per rank: its six layouts (DDP, FSDP, ZeRO-1, ZeRO-2, tp2, cp2; tied
# embeddings rule out a pipeline) fit, and each trial is short enough that all six fit the reference budget.
# "2rank-cpu" is the same check on the CPU with the built-in tiny run (gloo): a smoke test of the script.
LAYOUT_CASES: dict[str, tuple[list[str], float, float]] = {
    "2gpu-1b-full": (COMMON + ["--model.preset=llama3.2-1b", "--train.micro_batch_size=2"], 3.0, 4.7),
    "2rank-cpu": (["--data.synthetic_examples=300", "--train.micro_batch_size=4"], 1.5, 2.5),
}


def run_case(name: str, scale: float, work: Path) -> dict:
    import tracetrain

    overrides, cap, best_known, source, budget = CASES[name]
    budget_min = budget * scale
    out = work / name
    shutil.rmtree(out, ignore_errors=True)  # a fresh tune: trials of an earlier call are not reused
    start = time.monotonic()
    try:
        result = tracetrain.tune(
            None,
            overrides=COMMON + overrides,
            budget_min=budget_min,
            max_memory_gib=cap,
            out_dir=out,
            say=lambda line: print(f"  {name}: {line}", flush=True),
        )
    except Exception as e:  # one failed case must not lose the others' results
        return {"case": name, "error": f"{type(e).__name__}: {e}", "minutes": (time.monotonic() - start) / 60}
    base, best = result.baseline, result.best
    tuned = best or base
    tuned_tps = tuned.tokens_per_s if tuned else None
    m = tuned.outcome.measurement if tuned else None
    peak = (m.peak_reserved_gib or m.peak_gib) if m else None
    row = {
        "case": name,
        "overrides": COMMON + overrides,
        "max_memory_gib": cap,
        "baseline_tokens_per_s": base.tokens_per_s if base else None,
        "tuned_tokens_per_s": tuned_tps,
        "tuned_peak_gib": peak,
        "changes": result.changes,
        "best_known_tokens_per_s": best_known,
        "best_known_source": source,
        "ratio_to_best_known": tuned_tps / best_known if tuned_tps and best_known else None,
        "fits_cap": (peak is not None and peak <= cap) if cap else None,
        "budget_min": budget_min,
        "num_trials": sum(1 for t in result.trials if t.outcome.status != "pruned"),
        "minutes": result.seconds / 60,
        "trials": [_trial(t) for t in result.trials],
        "notes": result.notes,
    }
    return row


def _trial(t) -> dict:
    m = t.outcome.measurement
    return {
        "label": t.candidate.label,
        "role": t.role,
        "changes": dict(t.candidate.changes),
        "reason": t.candidate.reason,
        "status": t.outcome.status,
        "message": t.outcome.message,
        "predicted_gain": t.candidate.predicted_gain,
        "measured_gain": t.gain,
        "predicted_tokens_per_s": t.candidate.predicted_tokens_per_s,
        "tokens_per_s": m.tokens_per_s if m else None,
        "predicted_peak_gib": t.candidate.predicted_peak_gib,
        "peak_gib": m.peak_gib if m else None,
        "peak_reserved_gib": m.peak_reserved_gib if m else None,
        "guard": t.guard,
        "winner": t.winner,
        "seconds": t.outcome.seconds,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", help=f"default: {','.join(CASES)}; with --gpus 2: 2gpu-1b-full")
    ap.add_argument("--budget-scale", type=float, default=1.0, help="multiplies each case's budget (minutes)")
    ap.add_argument("--work", default="/tmp/tune_check", help="tune folders (trials, runs)")
    ap.add_argument("--gpus", type=int, default=1, help="2: the layout cases (default cases: 2gpu-1b-full)")
    a = ap.parse_args()
    out_env = os.environ.get("OUT")
    work = Path(a.work)
    if a.gpus > 1:
        return main_layouts(a, work, out_env)
    rows = []
    for name in (a.cases or ",".join(CASES)).split(","):
        print(f"--- {name}", flush=True)
        rows.append(run_case(name, a.budget_scale, work))
        if out_env:
            for f in ("tuned.toml", "tune/report.html"):
                src = work / name / f
                if src.is_file():
                    dst = Path(out_env) / "tune_check" / name / Path(f).name
                    dst.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy(src, dst)
    env = environment()  # after the cases: it opens a CUDA context, and the GPU's memory is the trials'
    payload = {**env, "budget_scale": a.budget_scale, "cases": rows}
    gpu = env["device"].replace(" ", "-")
    path = write_result(f"tune_check_{gpu}.json", payload, Path(out_env) if out_env else None)
    print("\n| case | baseline tok/s | tuned tok/s | best known | ratio | peak GiB | trials | min | changes |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['case']} | error: {r['error'][:80]} | | | | | | | |")
            continue
        f = lambda v, p="{:,.0f}": p.format(v) if isinstance(v, (int, float)) else "-"  # noqa: E731
        print(
            f"| {r['case']} | {f(r['baseline_tokens_per_s'])} | {f(r['tuned_tokens_per_s'])} | "
            f"{f(r['best_known_tokens_per_s'])} | {f(r['ratio_to_best_known'], '{:.3f}')} | "
            f"{f(r['tuned_peak_gib'], '{:.1f}')} | {r['num_trials']} | {r['minutes']:.1f} | {r['changes']} |"
        )
    print(f"wrote {path}")


def main_layouts(a: argparse.Namespace, work: Path, out_env: str | None) -> None:
    """The 2-GPU cases: tune's layout pick against every layout measured (tune_check_layouts.py)."""
    from tune_check_layouts import run_layout_case, table

    rows = []
    for name in (a.cases or "2gpu-1b-full").split(","):
        overrides, budget, ref_budget = LAYOUT_CASES[name]
        print(f"--- {name}", flush=True)
        try:
            row = run_layout_case(name, overrides, budget * a.budget_scale, ref_budget * a.budget_scale, a.gpus, work)
        except Exception as e:  # one failed case must not lose the others' results
            row = {"case": name, "error": f"{type(e).__name__}: {e}"}
        rows.append(row)
        if out_env:
            for f in ("tuned.toml", "tune/report.html"):
                if (work / name / f).is_file():
                    dst = Path(out_env) / "tune_check" / name / Path(f).name
                    dst.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy(work / name / f, dst)
    env = environment()  # after the cases: it opens a CUDA context, and the GPU's memory is the trials'
    payload = {**env, "gpus": a.gpus, "budget_scale": a.budget_scale, "cases": rows}
    gpu = env["device"].replace(" ", "-")
    path = write_result(f"tune_check_{a.gpus}gpu_{gpu}.json", payload, Path(out_env) if out_env else None)
    print("\n" + table(rows))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
