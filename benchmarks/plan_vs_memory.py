"""The planner's predictions next to the memory benchmark's measurements (no GPU needed: it reads the
committed benchmarks/results/memory_<gpu>.json and plans the same configurations for that GPU).

  python3 benchmarks/plan_vs_memory.py benchmarks/results/memory_NVIDIA-H100-80GB-HBM3.json
  python3 benchmarks/plan_vs_memory.py --compiled benchmarks/results/memory_7b-lora_offload_capped_NVIDIA-H100-80GB-HBM3.json

`--compiled`: the results were measured with the trainer's CUDA defaults (compile, FlexAttention, fused
CE), as every run since the offload re-measurement is; without it, the eager path of the first table.
Rows run under an allocator cap ("@cap") plan as their uncapped twin.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from memory import EXTRA, MODELS, SWITCHES  # noqa: E402

from tracetrain.config import load_config  # noqa: E402
from tracetrain.plan import plan, plan_input_from_config  # noqa: E402


EAGER = ["--train.compile=off", "--train.fused_kernels=off", "--train.fused_ce=false"]


def main(path: str, compiled: bool) -> None:
    data = json.loads(Path(path).read_text())
    out = []
    print(f"{data['device']}, torch {data['torch']}, commit {data['commit']}")
    print(f"{'model':<8} {'switch':<24} {'peak GiB':>9} {'planned':>8} {'err':>7} {'step s':>7} {'planned':>8} {'err':>7}")
    for r in data["rows"]:
        if "peak_gib" not in r:
            continue
        sargs = {**SWITCHES, **EXTRA.get(r["model"], {})}[r["switch"].removesuffix(" @cap")]
        cfg = load_config(None, [*MODELS[r["model"]], *sargs, "--data.seq_len=2048", "--data.pack=false",
                                 *(["--train.device=cuda"] if compiled else EAGER), "--train.micro_batch_size=4",
                                 "--train.precision=" + ("fp16" if r["switch"] == "fp16" else "bf16")])
        p = plan(plan_input_from_config(cfg, 1, data["device"]))
        peak, step = p.memory.peak_bytes / 2**30, p.step_s
        row = {"model": r["model"], "switch": r["switch"], "peak_gib": r["peak_gib"], "planned_peak_gib": peak,
               "mem_err": peak / r["peak_gib"] - 1, "step_s": r["step_s_median"], "planned_step_s": step,
               "time_err": step / r["step_s_median"] - 1}
        out.append(row)
        print(f"{row['model']:<8} {row['switch']:<24} {row['peak_gib']:>9.1f} {peak:>8.1f} {100 * row['mem_err']:>+6.1f}% "
              f"{row['step_s']:>7.3f} {step:>8.3f} {100 * row['time_err']:>+6.1f}%")
    target = Path(path).with_name("plan_vs_" + Path(path).name)
    target.write_text(json.dumps({k: data[k] for k in ("device", "torch", "commit", "date")} | {"rows": out}, indent=2))


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--compiled"]
    if len(args) != 1:
        sys.exit("usage: plan_vs_memory.py [--compiled] RESULTS_JSON")
    main(args[0], "--compiled" in sys.argv[1:])
