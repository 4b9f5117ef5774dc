"""GPU memory hygiene: allocator settings, a pre-flight check against the planner, and a clear answer to
a CUDA out-of-memory error (what was being allocated, the peak, a snapshot, and which switches fit).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path

import torch

from tracetrain.config import Config, MemorySection
from tracetrain.errors import TracetrainError

# Alternatives the planner evaluates after an OOM, cheapest in speed first.
_REMEDIES: list[tuple[str, dict[str, object]]] = [
    ("--memory.recompute=selective", {"recompute": "selective"}),
    ("--memory.recompute=full", {"recompute": "full"}),
    ("--memory.activation_offload=streamed", {"activation_offload": "streamed"}),
    ("--memory.optimizer_offload=true", {"optimizer_offload": True}),
]


def configure_allocator(memory: MemorySection, device: torch.device) -> None:
    """Expandable segments (less fragmentation with changing shapes) unless the user configured the
    allocator already. The environment variable only counts before CUDA starts; after, the setting
    is applied through the allocator's own API."""
    if device.type != "cuda" or not memory.expandable_segments:
        return
    if "expandable_segments" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
        return
    # torch 2.11 moved this to an accelerator-generic call (the old one warns); 2.13 has both.
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or torch.cuda.memory._set_allocator_settings
    setter("expandable_segments:True")


def _plan_peak(cfg: Config, gpu: str, **memory_changes: object) -> tuple[float, float]:
    """(predicted peak GiB, capacity GiB) for `cfg` with some memory switches changed."""
    import dataclasses

    from tracetrain.plan import plan, plan_input_from_config

    # Unvalidated on purpose: the alternatives are what-ifs for the planner, never run.
    changed = dataclasses.replace(cfg, memory=dataclasses.replace(cfg.memory, **memory_changes))  # type: ignore[arg-type]  # values from _REMEDIES
    p = plan(plan_input_from_config(changed, 1, gpu))
    return p.memory.required_bytes / 2**30, p.memory.capacity_bytes / 2**30


def preflight(cfg: Config, device: torch.device, note: Callable[[str], None]) -> None:
    """Before the first step: warn when the planner predicts the run will not fit."""
    if device.type != "cuda":
        return
    gpu = torch.cuda.get_device_name(device)
    try:
        need, have = _plan_peak(cfg, gpu)
    except Exception as e:  # the planner must never stop a run; say why it could not help
        note(f"memory pre-flight skipped: the planner could not model this run ({e})")
        return
    if need > have:
        note(
            f"the planner predicts {need:.1f} GiB per GPU but the device has {have:.1f} GiB; "
            f"this run will likely run out of memory. {suggestions(cfg, gpu)}"
        )


def suggestions(cfg: Config, gpu: str) -> str:
    """Switches that the planner predicts would fit, with their predicted peaks."""
    found = []
    for flag, change in _REMEDIES:
        if all(getattr(cfg.memory, k) == v for k, v in change.items()):
            continue
        try:
            need, have = _plan_peak(cfg, gpu, **change)
        except Exception:
            continue
        if need <= have:
            found.append(f"{flag} (planned peak {need:.1f} GiB)")
    if not found:
        return f"Lower train.micro_batch_size (now {cfg.train.micro_batch_size}) or data.seq_len, or use more GPUs."
    return (
        "Would fit: " + "; ".join(found[:3]) + f"; or lower train.micro_batch_size (now {cfg.train.micro_batch_size})."
    )


def explain_oom(
    error: torch.OutOfMemoryError, cfg: Config, device: torch.device, run_dir: Path, step: int
) -> TracetrainError:
    """Snapshot the allocator and turn the OOM into one actionable message."""
    asked = re.search(r"Tried to allocate ([\d.]+ [KMG]iB)", str(error))
    peak = torch.cuda.max_memory_allocated(device) / 2**30
    total = torch.cuda.get_device_properties(device).total_memory / 2**30
    where = ""
    if cfg.memory.oom_snapshot:
        path = run_dir / "oom_snapshot.pickle"
        try:
            torch.cuda.memory._dump_snapshot(str(path))
            where = f" Allocator snapshot: {path} (drag it into pytorch.org/memory_viz)."
        except Exception as e:  # a failed snapshot must not hide the OOM itself
            where = f" (no snapshot: {e})"
    return TracetrainError(
        f"CUDA out of memory at step {step + 1} while allocating {asked.group(1) if asked else 'memory'}; "
        f"peak allocated {peak:.1f} of {total:.1f} GiB.{where} "
        f"{suggestions(cfg, torch.cuda.get_device_name(device))}"
    )
