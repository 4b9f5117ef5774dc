"""GPU check of the memory transforms: peak memory and step time of activation recomputation and
activation offload, and agreement of loss and gradients with the untransformed model.

A llama3.2-1b-shaped model (dim 2048, n_layers reduced, full vocabulary) at batch 4 x seq 2048, fp32
weights under bf16 autocast, packed rows (a document mask, as training with packing uses). Each case
builds the same model (same seed), applies the transforms in build order (recompute, then offload) and
times forward + backward (no optimizer: the transforms change only those) with CUDA events, median of
the timed steps after warm-up. Reported per case: peak allocated memory, activation memory still held
after forward, step time, tokens/s, what the streamed offload moved, and the largest relative
gradient difference to "none" (bf16; attention backward is not bitwise deterministic on the GPU).

  python3 benchmarks/memory_transforms_check.py [--layers 8] [--cases none,full,...]

Prints a table; writes benchmarks/results/memory_transforms_<gpu>.json (and a copy in $OUT when set).
Exits 1 when a case disagrees with "none" or fails, after writing everything it measured.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import environment, median, time_steps, write_result  # noqa: E402

from tracetrain.memory.activation_offload import StreamedOffload, apply_activation_offload  # noqa: E402
from tracetrain.memory.recompute import apply_recompute  # noqa: E402
from tracetrain.models.build import materialize  # noqa: E402
from tracetrain.models.presets import get_preset  # noqa: E402

# case -> (recompute mode, activation offload mode)
CASES: dict[str, tuple[str, str]] = {
    "none": ("none", "none"),
    "full": ("full", "none"),
    "selective": ("selective", "none"),
    "save_on_cpu": ("none", "save_on_cpu"),
    "streamed": ("none", "streamed"),
    "streamed+selective": ("selective", "streamed"),
    "streamed+full": ("full", "streamed"),
}
LOSS_TOL = 1e-3      # absolute, on a loss of ~11.8: the forward is the same computation in every case
GRAD_REL_TOL = 2e-2  # per parameter, ||g - g_ref|| / ||g_ref||, bf16 with non-deterministic attention
GIB = 2**30


def packed_batch(vocab: int, batch: int, seq: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Random tokens, each row packed with 4 documents of random lengths (positions restart per document)."""
    g = torch.Generator().manual_seed(0)
    docs, pos = [], []
    for _ in range(batch):
        cuts = sorted(torch.randint(1, seq, (3,), generator=g).tolist())
        lengths = [b - a for a, b in zip([0, *cuts], [*cuts, seq])]
        docs.append(torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]))
        pos.append(torch.cat([torch.arange(n) for n in lengths]))
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    cpu = {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:], "position_ids": torch.stack(pos),
           "document_ids": torch.stack(docs)}
    return {k: v.contiguous().to(device) for k, v in cpu.items()}


def grad_rel_diff(model: torch.nn.Module, ref: dict[str, torch.Tensor]) -> tuple[float, str]:
    """Largest per-parameter relative L2 difference to the reference gradients (kept on the host)."""
    worst, worst_name = 0.0, ""
    for name, p in model.named_parameters():
        r = ref[name].to(p.grad.device, non_blocking=True)
        rel = float((p.grad - r).norm() / r.norm().clamp_min(1e-30))
        if rel > worst:
            worst, worst_name = rel, name
    return worst, worst_name


def run_case(name: str, a: argparse.Namespace, batch: dict[str, torch.Tensor],
             ref: dict | None) -> tuple[dict, dict | None]:
    """Build, warm up, time and measure one case; compare it with `ref` (None: this is the reference)."""
    recompute, offload_mode = CASES[name]
    args = dataclasses.replace(get_preset("llama3.2-1b"), n_layers=a.layers, max_seq_len=a.seq)
    model = materialize(args, torch.device("cuda"), seed=0)
    apply_recompute(model, recompute, 1)  # type: ignore[arg-type]
    offload = apply_activation_offload(model, offload_mode)  # type: ignore[arg-type]

    def forward() -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16), (
                offload.forward_context() if offload else contextlib.nullcontext()):
            logits = model(batch["input_ids"], batch["position_ids"], batch["document_ids"])
        return F.cross_entropy(logits.float().flatten(0, 1), batch["labels"].flatten())

    def fwd_bwd() -> None:
        model.zero_grad(set_to_none=True)
        forward().backward()

    for _ in range(a.warmup):  # untimed: pinned pools fill, kernels are picked
        fwd_bwd()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = time_steps(fwd_bwd, 0, a.steps)
    row = {"case": name, "recompute": recompute, "offload": offload_mode, "step_s_median": median(times),
           "step_s_all": times, "tokens_per_s": a.batch * a.seq / median(times),
           "peak_gib": torch.cuda.max_memory_allocated() / GIB}
    row["held_after_forward_gib"], row["loss"] = held_after_forward(model, forward)  # leaves the grads
    if isinstance(offload, StreamedOffload):
        row.update(offloaded_gib=offload.stats.offloaded_bytes / GIB, offloaded_tensors=offload.stats.num_tensors,
                   on_demand_loads=offload.stats.num_on_demand, pinned_pool_gib=offload.pool.num_bytes / GIB)
    new_ref = compare(row, model, ref, fwd_bwd)
    if offload is not None:
        offload.remove()
    return row, new_ref


def compare(row: dict, model: torch.nn.Module, ref: dict | None,
            fwd_bwd: Callable[[], None]) -> dict | None:
    """Add the loss and gradient differences to `row`; for the reference case return its loss and grads."""
    if ref is not None:
        row["loss_diff"] = abs(row["loss"] - ref["loss"])
        row["grad_rel_diff"], row["grad_rel_diff_param"] = grad_rel_diff(model, ref["grads"])
        row["ok"] = row["loss_diff"] <= LOSS_TOL and row["grad_rel_diff"] <= GRAD_REL_TOL
        return None
    new_ref = {"loss": row["loss"], "grads": {n: p.grad.float().cpu() for n, p in model.named_parameters()}}
    fwd_bwd()  # a rerun of "none" shows how far the GPU's own non-determinism moves the gradients
    row["grad_rel_diff_rerun"], row["grad_rel_diff_param"] = grad_rel_diff(model, new_ref["grads"])
    return new_ref


def held_after_forward(model: torch.nn.Module, forward: Callable[[], torch.Tensor]) -> tuple[float, float]:
    """GiB allocated by one forward and still held when it returns (saved activations, logits), and its loss.

    Runs the backward too, so the model's gradients are this step's."""
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    loss = forward()
    held = torch.cuda.memory_allocated() - before
    loss.backward()
    return held / GIB, float(loss)


def print_table(rows: list[dict]) -> None:
    print(f"\n{'case':<20} {'peak GiB':>9} {'held GiB':>9} {'step ms':>8} {'tok/s':>9} {'offl GiB':>9} "
          f"{'loss diff':>10} {'grad rel':>9}  ok")
    for r in rows:
        if "error" in r:
            print(f"{r['case']:<20} ERROR {r['error']}")
            continue
        offl = f"{r['offloaded_gib']:.2f}" if "offloaded_gib" in r else "-"
        diff = (f"{r['loss_diff']:>10.2e} {r['grad_rel_diff']:>9.2e}  {'yes' if r['ok'] else 'NO'}"
                if "ok" in r else f"{'reference':>10} {r['grad_rel_diff_rerun']:>9.2e}  (rerun of none)")
        print(f"{r['case']:<20} {r['peak_gib']:>9.2f} {r['held_after_forward_gib']:>9.2f} "
              f"{1e3 * r['step_s_median']:>8.1f} {r['tokens_per_s']:>9,.0f} {offl:>9} {diff}")


def run_all(names: list[str], a: argparse.Namespace) -> list[dict]:
    """Every case in order ("none" first: the reference); a failing case is recorded as an error row."""
    start, rows, ref = time.monotonic(), [], None
    batch = packed_batch(get_preset("llama3.2-1b").vocab_size, a.batch, a.seq, torch.device("cuda"))
    for name in names:
        if time.monotonic() - start > a.budget_s:
            rows.append({"case": name, "error": f"skipped: past the {a.budget_s:.0f} s budget"})
            continue
        try:
            row, new_ref = run_case(name, a, batch, ref)
            ref = ref or new_ref
        except Exception as e:  # recorded, not hidden: the case shows as an error and the exit code is 1
            row = {"case": name, "error": f"{type(e).__name__}: {str(e)[:300]}"}
        rows.append(row)
        summary = row.get("error") or f"{row['peak_gib']:.2f} GiB peak, {1e3 * row['step_s_median']:.1f} ms"
        print(f"{name}: {summary}", flush=True)
        gc.collect()
        torch.cuda.empty_cache()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--layers", type=int, default=8, help="blocks of the llama3.2-1b shape (16 = whole model)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--budget-s", type=float, default=420.0, help="skip the remaining cases past this")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("memory_transforms_check needs a CUDA GPU")
        return 2
    env = environment()
    rows = run_all(["none"] + [n for n in a.cases.split(",") if n != "none"], a)
    print_table(rows)
    config = {"preset": "llama3.2-1b", "n_layers": a.layers, "batch": a.batch, "seq": a.seq,
              "autocast": "bf16", "weights": "fp32", "document_mask": True, "warmup": a.warmup, "steps": a.steps}
    gpu = env["device"].replace(" ", "-").replace("/", "-")
    out = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    write_result(f"memory_transforms_{gpu}.json", {**env, "config": config, "rows": rows}, out)
    failed = [r["case"] for r in rows if "error" in r or r.get("ok") is False]
    print(f"\n{'FAILED: ' + ', '.join(failed) if failed else 'all cases agree with none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
