"""The planner's predictions for multi-GPU layouts next to benchmarks/scale.py's measurements (no GPU
needed: reads the committed results JSON and plans each case for the GPU it ran on).

  python3 benchmarks/plan_vs_scale.py benchmarks/results/scale_NVIDIA-H200.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tracetrain.config import load_config
from tracetrain.plan import plan, plan_input_from_config


def overrides(case: dict) -> list[str] | None:
    name, lay = case["case"], case["layout"]
    if "llama3.2-1b" in name:
        model = ["--model.preset=llama3.2-1b"]
    elif "llama3-8b" in name:
        model = ["--model.preset=llama3-8b"]
    elif "MoE" in name:
        model = ["--model.preset=llama3.2-1b", "--model.n_layers=8", "--model.num_experts=8", "--model.experts_top_k=2"]
    else:
        return None
    dp = lay["dp_replicate"] * lay["dp_shard"]
    keys = ("dp_replicate", "dp_shard", "tp", "pp", "cp", "ep", "zero_stage", "pp_schedule", "pp_microbatches")
    par = [f"--parallel.{k}={lay[k]}" if not isinstance(lay[k], str) else f'--parallel.{k}="{lay[k]}"'
           for k in keys if k in lay]
    return [*model, *par, f"--data.seq_len={case['seq']}", f"--train.micro_batch_size={case['global_rows'] // dp}",
            f"--memory.recompute={case['recompute']}", "--data.pack=false", "--train.precision=bf16"]


def main(path: str) -> None:
    data = json.loads(Path(path).read_text())
    env = data["environment"]
    gpu = env["device"]
    rows = []
    print(f"{gpu}, torch {env['torch']}, commit {env['commit']}")
    print(f"{'case':<46} {'peak GiB':>8} {'planned':>8} {'err':>7} {'step s':>7} {'planned':>8} {'err':>7}")
    for case in data["cases"]:
        args = overrides(case)
        if args is None:
            continue
        p = plan(plan_input_from_config(load_config(None, args), case["gpus"], gpu))
        peak, step = p.memory.peak_bytes / 2**30, p.step_s
        row = {"case": case["case"], "overrides": args, "peak_gib": case["peak_gib"], "planned_peak_gib": peak,
               "mem_err": peak / case["peak_gib"] - 1, "step_s": case["step_s_median"], "planned_step_s": step,
               "time_err": step / case["step_s_median"] - 1}
        rows.append(row)
        print(f"{case['case'][:46]:<46} {case['peak_gib']:>8.1f} {peak:>8.1f} {100 * row['mem_err']:>+6.1f}% "
              f"{case['step_s_median']:>7.3f} {step:>8.3f} {100 * row['time_err']:>+6.1f}%")
    Path(path).with_name("plan_vs_" + Path(path).name).write_text(json.dumps({**env, "rows": rows}, indent=2))


if __name__ == "__main__":
    main(sys.argv[1])
