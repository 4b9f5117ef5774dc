"""The planner's predictions for multi-GPU layouts next to benchmarks/scale.py's measurements (no GPU
needed: reads the committed results JSON and plans each case for the GPU it ran on).

  python3 benchmarks/plan_vs_scale.py benchmarks/results/scale_NVIDIA-H200.json
  python3 benchmarks/plan_vs_scale.py benchmarks/results/scale_trainer_NVIDIA-H200.json

A `scale_trainer` result (benchmarks/scale_trainer.py: `tracetrain train` itself under torchrun) is
planned with the trainer's CUDA defaults instead (packed rows, compile, FlexAttention, fused loss where
the layout allows it), from that script's CASES table.

Each case is planned from the very overrides scale.py ran it with (its GROUPS table: model, layout,
micro-batch per data-parallel rank, sequence length), plus what scale.py's `run_case` fixes: no
packing, bf16, and the eager path it assembles (config keys: SDPA, no torch.compile, no fused kernels,
the loss through `ParallelModel.cross_entropy_sum`, i.e. no fused lm_head + cross-entropy). Measured values are copied from the results JSON unchanged; the output
(plan_vs_scale_<gpu>.json next to it) adds the plan and the error of every row.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scale import GROUPS  # noqa: E402
from scale_trainer import CASES as TRAINER_CASES  # noqa: E402

from tracetrain.config import load_config  # noqa: E402
from tracetrain.plan import plan, plan_input_from_config  # noqa: E402

# What scale.run_case adds to every case, and the eager path it runs (see the module docstring).
FIXED = ["--data.pack=false", "--train.precision=bf16", "--train.compile=off", "--train.fused_kernels=off",
         "--train.attention=sdpa", "--train.fused_ce=false"]


def overrides(case: dict) -> list[str] | None:
    """The config overrides scale.py ran `case` with, or None when GROUPS no longer has it."""
    for _, cases in GROUPS.values():
        for name, args, micro_batch, seq in cases:
            if name == case["case"]:
                return [*args, f"--data.seq_len={seq}", f"--train.micro_batch_size={micro_batch}", *FIXED]
    return None


def trainer_cases(data: dict) -> dict:
    """A scale_trainer result in plan_vs_scale's shape: the overrides the trainer ran with (its defaults
    otherwise: packed rows, compile, FlexAttention, fused loss), measured step time and peak."""
    env = {k: data[k] for k in ("device", "torch", "cuda", "commit", "date") if k in data}
    cases = []
    for r in data["rows"]:
        if r["status"] != "ok":
            continue
        gpus, args, micro_batch, _ = TRAINER_CASES[r["case"]]
        cases.append({"case": r["case"], "gpus": gpus, "peak_gib": r["peak_gib"], "step_s_median": r["step_s_median"],
                      "args": [*args, "--data.seq_len=2048", f"--train.micro_batch_size={micro_batch}",
                               "--data.pack=true", "--train.precision=bf16"]})
    return {"environment": env, "cases": cases}


def main(path: str) -> None:
    data = json.loads(Path(path).read_text())
    if "rows" in data and "cases" not in data:  # benchmarks/scale_trainer.py
        data = trainer_cases(data)
    env = data["environment"]
    gpu = env["device"]
    rows = []
    print(f"{gpu}, torch {env['torch']}, commit {env['commit']} (measured); planned offline")
    print(f"{'case':<46} {'peak GiB':>8} {'planned':>8} {'err':>7} {'step s':>7} {'planned':>8} {'err':>7}  goal")
    for case in data["cases"]:
        args = case.get("args") or overrides(case)
        if args is None:
            print(f"{case['case'][:46]:<46} not in scale.GROUPS any more: skipped")
            continue
        p = plan(plan_input_from_config(load_config(None, args), case["gpus"], gpu))
        peak, step = p.memory.peak_bytes / 2**30, p.step_s
        row = {"case": case["case"], "overrides": args, "layout": p.layout(), "peak_gib": case["peak_gib"],
               "planned_peak_gib": peak, "mem_err": peak / case["peak_gib"] - 1, "step_s": case["step_s_median"],
               "planned_step_s": step, "time_err": step / case["step_s_median"] - 1,
               "planned_peak_phase": p.memory.peak_phase, "planned_time_s": p.time.breakdown}
        row["meets_goal"] = abs(row["mem_err"]) <= 0.10 and abs(row["time_err"]) <= 0.25
        rows.append(row)
        print(f"{case['case'][:46]:<46} {case['peak_gib']:>8.1f} {peak:>8.1f} {100 * row['mem_err']:>+6.1f}% "
              f"{case['step_s_median']:>7.3f} {step:>8.3f} {100 * row['time_err']:>+6.1f}%  "
              f"{'yes' if row['meets_goal'] else 'MISS'}")
    print(f"{sum(r['meets_goal'] for r in rows)} of {len(rows)} rows within memory ±10% and time ±25%")
    Path(path).with_name("plan_vs_" + Path(path).name).write_text(json.dumps({**env, "rows": rows}, indent=2))


if __name__ == "__main__":
    main(sys.argv[1])
