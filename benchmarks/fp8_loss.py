"""FP8 vs bf16 loss curves through the real trainer, plus the FP8 amax/scale behaviour per layer.

Runs `tracetrain train` twice as subprocesses (same seed, same data order; only `train.fp8` differs) on
GSM8K packed rows, reads each run's metrics.jsonl, and compares the per-step losses over the last
`--window` steps: max and mean |loss_fp8 - loss_bf16|. Then builds the FP8 model once more in this process
and probes one step eagerly (`kernels.fp8.probe_amax`): input and gradient amax, scales and the share
of values that underflow to zero in FP8, summarised per projection.

Default case: llama2-7b shape (random init: there are no weights on the device machine) with the GPT-2
tokenizer (vocabulary padded to 50,304 rows), LoRA on the default targets, 4 x 2048 packed, 200 steps,
no checkpoint. A random base learns little, so the curves test FP8 numerics, not fine-tuning quality.
Tolerance (stated up front, printed as pass/fail): mean |diff| over the window <= 1% of the bf16 mean
loss and max |diff| <= 5% of it, and no step skipped as non-finite in either run.

Estimated (not yet measured): two runs of 200 steps take about 6 minutes on an H100 (data, build and
compile ~1.5 min plus ~0.3-0.4 s per step, each); --steps 120 --window 40 stays well inside 8 minutes.

  python3 benchmarks/fp8_loss.py --recipe tensorwise
  python3 benchmarks/fp8_loss.py --recipe rowwise --steps 120 --window 40
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, write_result  # noqa: E402

DATA = Path(".carry/data")
MEAN_TOL, MAX_TOL = 0.01, 0.05  # of the bf16 mean loss over the window


EAGER = ["--train.compile=off", "--train.attention=sdpa", "--train.fused_ce=false", "--train.fused_kernels=off"]


def run_args(a: argparse.Namespace, fp8: str, run_dir: Path) -> list[str]:
    return ["--logging.progress=false", f"--train.output_dir={run_dir.parent}", f"--train.run_name={run_dir.name}",
            f"--model.preset={a.preset}", f"--model.vocab_size={a.vocab_size}", f"--train.mode={a.mode}",
            "--data.kind=instruction", f"--data.path={a.data / 'gsm8k/train.jsonl'}",
            f"--data.eval_path={a.data / 'gsm8k/test.jsonl'}", f"--data.tokenizer={a.data / 'gpt2_tokenizer.json'}",
            "--data.instruction_field=question", "--data.context_field=", "--data.response_field=answer",
            f"--data.seq_len={a.seq}", "--data.pack=true", f"--train.micro_batch_size={a.batch}",
            f"--train.steps={a.steps}", "--train.seed=0", "--train.eval_interval=0", "--train.eval_batches=2",
            "--train.eval_generate=0", "--checkpoint.save_final=false", f"--logging.log_interval={a.log_interval}",
            f"--train.fp8={fp8}"]


def train_run(a: argparse.Namespace, fp8: str, root: Path, extra: tuple[str, ...] = (), name: str = "") -> dict:
    run_dir = root / f"fp8_loss_{name or fp8}"
    t = time.time()
    proc = subprocess.run([sys.executable, "-m", "tracetrain.cli", "train", *run_args(a, fp8, run_dir), *extra],
                          capture_output=True, text=True)
    wall_s = time.time() - t
    if proc.returncode != 0:
        return {"fp8": fp8, "error": (proc.stderr or proc.stdout)[-800:], "wall_s": wall_s}
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r and "eval_loss" not in r]
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"fp8": fp8, "wall_s": wall_s, "losses": [r["loss"] for r in steps],
            "skipped": sum(bool(r["skipped"]) for r in steps), "tokens_per_s": summary.get("tokens_per_s"),
            "mfu": summary.get("mfu"), "mem_peak_alloc_gib": summary.get("mem_peak_alloc_gib")}


def compare(ref: list[float], fp8: list[float], window: int) -> dict:
    n = min(len(ref), len(fp8))
    diffs = [abs(x - y) for x, y in zip(ref[n - window:n], fp8[n - window:n])]
    mean_ref = statistics.fmean(ref[n - window:n])
    out = {"window": len(diffs), "max_abs_diff": max(diffs), "mean_abs_diff": statistics.fmean(diffs),
           "mean_loss_bf16": mean_ref, "mean_loss_fp8": statistics.fmean(fp8[n - window:n]),
           "max_abs_diff_all_steps": max(abs(x - y) for x, y in zip(ref[:n], fp8[:n]))}
    out["within_tolerance"] = out["mean_abs_diff"] <= MEAN_TOL * mean_ref and out["max_abs_diff"] <= MAX_TOL * mean_ref
    return out


def probe(a: argparse.Namespace, fp8: str, root: Path) -> dict:
    """Build the FP8 model as the trainer does and probe one forward/backward on a real GSM8K batch."""
    import torch

    from tracetrain.config import load_config
    from tracetrain.data.loader import build_datasets, build_loader
    from tracetrain.data.tokenizer import load_tokenizer
    from tracetrain.kernels.fp8 import probe_amax
    from tracetrain.train.assemble import assemble, step_context
    from tracetrain.spec import resolve
    from tracetrain.train.step import IGNORE_INDEX, loss_sum, to_device

    # Eager sdpa for the probe: eager FlexAttention would materialise every score matrix.
    overrides = [*run_args(a, fp8, root / "probe"), "--train.compile=off", "--train.attention=sdpa"]
    cfg = load_config(None, overrides)
    device = torch.device("cuda")
    ds, _, _ = build_datasets(cfg.data, load_tokenizer(cfg.data.tokenizer))
    batch = to_device(next(build_loader(ds, a.batch, cfg.data, seed=cfg.data.seed)), device)
    spec = resolve(cfg, device)
    model = assemble(spec, until="materialise").module
    ctx = step_context(spec)
    targets = int((batch["labels"] != IGNORE_INDEX).sum())
    rows = probe_amax(model, lambda: (loss_sum(model, batch, ctx) / targets).backward())
    by_kind: dict[str, list[dict]] = {}
    for r in rows:
        by_kind.setdefault(r["layer"].split(".", 3)[-1], []).append(r)
    summary = {}
    for kind, rs in by_kind.items():
        entry = {}
        for key in ("x_amax", "x_underflow", "grad_amax", "grad_underflow", "w_amax"):
            vals = [r[key] for r in rs if key in r]
            if vals:
                entry[key] = {"min": min(vals), "median": statistics.median(vals), "max": max(vals)}
        summary[kind] = entry
    del model
    torch.cuda.empty_cache()
    return {"layers": rows, "by_projection": summary}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipe", default="tensorwise", choices=("tensorwise", "rowwise"))
    ap.add_argument("--preset", default="llama2-7b")
    ap.add_argument("--mode", default="lora", choices=("lora", "full"))
    ap.add_argument("--vocab-size", type=int, default=50304, help="GPT-2's 50,257 ids padded to a multiple of 64")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--window", type=int, default=50, help="compare the last N steps")
    ap.add_argument("--log-interval", type=int, default=50)
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument("--no-probe", action="store_true")
    ap.add_argument("--eager-reference", action="store_true",
                    help="also run the eager bf16 path (no compile, SDPA, unfused loss and kernels) and compare the "
                         "default compiled bf16 run and the FP8 run against it, with the same tolerance")
    a = ap.parse_args()
    env = environment()
    root = Path(os.environ.get("TMPDIR", "/tmp")) / f"fp8_loss_{os.getpid()}"
    runs = {fp8: train_run(a, fp8, root) for fp8 in ("none", a.recipe)}
    if a.eager_reference:
        runs["eager"] = train_run(a, "none", root, tuple(EAGER), "eager")
    for r in runs.values():
        print(f"train.fp8={r['fp8']}: {r.get('tokens_per_s') or 0:,.0f} tok/s  skipped {r.get('skipped')}  "
              f"wall {r['wall_s']:.0f} s  {r.get('error', '')}", flush=True)
    result = {**env, "case": vars(a) | {"data": str(a.data)}, "runs": runs,
              "tolerance": {"mean_abs_diff_max_share": MEAN_TOL, "max_abs_diff_max_share": MAX_TOL}}
    ref, low = runs["none"], runs[a.recipe]
    if "losses" in ref and "losses" in low:
        cmp = compare(ref["losses"], low["losses"], a.window)
        cmp["within_tolerance"] = cmp["within_tolerance"] and ref["skipped"] == 0 and low["skipped"] == 0
        result["comparison"] = cmp
        print(f"last {cmp['window']} steps: max |dloss| {cmp['max_abs_diff']:.4f}  mean |dloss| "
              f"{cmp['mean_abs_diff']:.4f}  (bf16 mean loss {cmp['mean_loss_bf16']:.4f}, fp8 "
              f"{cmp['mean_loss_fp8']:.4f})  within tolerance: {cmp['within_tolerance']}", flush=True)
        if ref.get("tokens_per_s") and low.get("tokens_per_s"):
            print(f"speed-up of the trainer run: {low['tokens_per_s'] / ref['tokens_per_s']:.2f}x", flush=True)
    eager = runs.get("eager", {})
    if "losses" in eager:
        for name in ("none", a.recipe):
            if "losses" in runs[name]:
                c = compare(eager["losses"], runs[name]["losses"], a.window)
                c["within_tolerance"] = c["within_tolerance"] and eager["skipped"] == 0 and runs[name]["skipped"] == 0
                result[f"{'compile_bf16' if name == 'none' else 'fp8'}_vs_eager"] = c
                print(f"vs eager bf16, {name if name != 'none' else 'compiled bf16'}: last {c['window']} steps max "
                      f"|dloss| {c['max_abs_diff']:.4f} mean {c['mean_abs_diff']:.4f} (eager mean loss "
                      f"{c['mean_loss_bf16']:.4f})  within tolerance: {c['within_tolerance']}", flush=True)
    if not a.no_probe and a.mode == "lora":
        result["amax_probe"] = probe(a, a.recipe, root)
        for kind, entry in result["amax_probe"]["by_projection"].items():
            parts = [f"{k} {v['min']:.3g}/{v['median']:.3g}/{v['max']:.3g}" for k, v in entry.items()]
            print(f"amax {kind:<22} (min/median/max) " + "  ".join(parts), flush=True)
    gpu = env["device"].replace(" ", "-").replace("/", "-")
    out = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    write_result(f"fp8_loss_{a.recipe}_{a.mode}_{gpu}.json", result, out)


if __name__ == "__main__":
    main()
