"""`tracetrain tune` on one GPU against the best hand-tuned tokens/s we know (issue #31, point 5).

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
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, write_result  # noqa: E402

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
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--budget-scale", type=float, default=1.0, help="multiplies each case's budget (minutes)")
    ap.add_argument("--work", default="/tmp/tune_check", help="tune folders (trials, runs)")
    a = ap.parse_args()
    out_env = os.environ.get("OUT")
    work = Path(a.work)
    rows = []
    for name in a.cases.split(","):
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


if __name__ == "__main__":
    main()
