"""Memory hygiene: allocator settings, a pre-flight check against the planner, and a one-line answer to
running out of memory (issue #27): the phase (build, load, forward, backward, optimizer, save), what was
being allocated, the planned and the actual peak, a snapshot, and the planner's suggestion.

Out of memory is a CUDA `torch.OutOfMemoryError`, or on the host the CPU allocator's RuntimeError
("can't allocate memory") or a MemoryError. `MemoryPhases` remembers the phase a run is in (the step's
phases come through its `StepContext.phase`); `explain_oom` turns the error into `OutOfMemory`, a
`TracetrainError` whose one line rank 0 prints (cli.py) and the other ranks keep to their logs: with
several ranks each one reports its line through the store first, so that rank 0 prints it even when
only another rank ran out (parallel/dist.py `Watchdog`). Checkpoints are staged and renamed into place
(train/checkpoint.py), so an OOM while saving leaves no half-written one.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tracetrain.config import Config, MemorySection
from tracetrain.errors import OutOfMemory

if TYPE_CHECKING:
    from tracetrain.spec import RunSpec

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


def _plan_peak(cfg: Config, gpu: str, world_size: int = 1, **memory_changes: object) -> tuple[float, float]:
    """(predicted peak GiB, capacity GiB) for `cfg` with some memory switches changed: a what-if, so the
    changed config is resolved anew (its spec is not the run's)."""
    import dataclasses

    from tracetrain.plan import plan, plan_input_from_config

    # Unvalidated on purpose: the alternatives are what-ifs for the planner, never run.
    changed = dataclasses.replace(cfg, memory=dataclasses.replace(cfg.memory, **memory_changes))  # type: ignore[arg-type]  # values from _REMEDIES (typed object), each of its memory field's type
    p = plan(plan_input_from_config(changed, world_size, gpu))
    return p.memory.required_bytes / 2**30, p.memory.capacity_bytes / 2**30


def preflight(spec: RunSpec, note: Callable[[str], None]) -> None:
    """Before the model is built: one line when the planner predicts the run (its spec, as resolved) will
    not fit (`preflight_line`)."""
    if spec.device.type != "cuda":
        return
    from tracetrain.plan import plan, plan_input_from_spec

    cfg, gpu = spec.cfg, torch.cuda.get_device_name(spec.device)
    try:
        p = plan(plan_input_from_spec(spec, gpu))
        need, have = p.memory.required_bytes / 2**30, p.memory.capacity_bytes / 2**30
        if need > have:
            note(preflight_line(cfg, gpu, need, have, spec.world_size))
    except Exception as e:  # the planner must never stop a run; say why it could not help
        note(f"memory pre-flight skipped: the planner could not model this run ({e})")


def preflight_line(cfg: Config, gpu: str, need_gib: float, have_gib: float, world_size: int = 1) -> str:
    """The pre-flight warning: the planned and available memory, the longest data.seq_len these settings
    fit, and the long-context switches under which this length fits that the planner predicts fastest
    (plan/longest.py `fitting_remedy`), else the general remedies (`suggestions`)."""
    from tracetrain.plan.longest import fitting_remedy, longest_context, remedy_text

    seq, mbs, host = cfg.data.seq_len, cfg.train.micro_batch_size, _host_available_gib()
    line = (
        f"data.seq_len = {seq:,} x micro-batch {mbs} will likely not fit: the planner predicts {need_gib:.1f} GiB "
        f"per GPU, {gpu} has {have_gib:.1f} GiB"
    )
    longest = longest_context(cfg, gpu, world_size, host_memory_gib=host).seq_len
    line += f"; the longest data.seq_len these settings fit is {longest:,}." if longest else "."
    remedy = fitting_remedy(cfg, seq, gpu, world_size, host_memory_gib=host)
    if remedy is None:
        return f"{line} {suggestions(cfg, gpu, world_size)}"
    return f"{line} {remedy_text(*remedy)}"


_FALLBACK = "Lower train.micro_batch_size (now {mbs}) or data.seq_len, or use more GPUs."


def suggestions(cfg: Config, gpu: str, world_size: int = 1) -> str:
    """Switches that the planner predicts would fit, with their predicted peaks."""
    found = []
    for flag, change in _REMEDIES:
        if all(getattr(cfg.memory, k) == v for k, v in change.items()):
            continue
        try:
            need, have = _plan_peak(cfg, gpu, world_size, **change)
        except Exception:
            continue
        if need <= have:
            found.append(f"{flag} (planned peak {need:.1f} GiB)")
    if not found:
        return _FALLBACK.format(mbs=cfg.train.micro_batch_size)
    return (
        "Would fit: " + "; ".join(found[:3]) + f"; or lower train.micro_batch_size (now {cfg.train.micro_batch_size})."
    )


def _host_available_gib() -> float | None:
    """This machine's available host memory (what offloaded activations may take), None if unknown."""
    try:
        found = re.search(r"MemAvailable:\s+(\d+) kB", Path("/proc/meminfo").read_text())
    except OSError:
        return None
    return int(found.group(1)) / 2**20 if found else None


def is_out_of_memory(error: BaseException) -> bool:
    """A CUDA OOM, or the host's allocator failing (torch raises a RuntimeError for that)."""
    if isinstance(error, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(error, RuntimeError) and "can't allocate memory" in str(error)


class MemoryPhases:
    """The phase a run is in, for the OOM line. Entering a phase names it; leaving it normally restores
    the outer one, leaving it by an exception keeps it (that is where the memory ran out)."""

    def __init__(self, name: str = "build") -> None:
        self.name = name

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        outer, self.name = self.name, name
        yield
        self.name = outer

    def around(
        self, other: Callable[[str], contextlib.AbstractContextManager]
    ) -> Callable[[str], contextlib.AbstractContextManager]:
        """A `StepContext.phase` that enters `other(name)` (the profiler's) and this phase."""

        @contextlib.contextmanager
        def both(name: str) -> Iterator[None]:
            with other(name), self(name):
                yield

        return both


def _asked(error: BaseException) -> str:
    text = str(error)
    cuda = re.search(r"Tried to allocate ([\d.]+ [KMG]iB)", text)
    if cuda:
        return cuda.group(1)
    host = re.search(r"tried to allocate (\d+) bytes", text)
    return f"{int(host.group(1)) / 2**30:.1f} GiB" if host else "memory"


def _host_peak_gib() -> float:
    # The process's peak resident memory (VmHWM): what the host allocator had handed out at most.
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return float("nan")
    found = re.search(r"VmHWM:\s+(\d+) kB", status)
    return int(found.group(1)) / 2**20 if found else float("nan")


def _snapshot(cfg: Config, run_dir: Path | None) -> str:
    if not cfg.memory.oom_snapshot or run_dir is None:
        return ""
    path = run_dir / "oom_snapshot.pickle"
    try:
        torch.cuda.memory._dump_snapshot(str(path))
    except Exception as e:  # a failed snapshot must not hide the OOM itself
        return f" (no snapshot: {e})"
    return f" Allocator snapshot: {path} (drag it into pytorch.org/memory_viz)."


def explain_oom(
    error: BaseException,
    cfg: Config,
    device: torch.device,
    phase: str,
    *,
    rank: int = 0,
    world_size: int = 1,
    run_dir: Path | None = None,
) -> OutOfMemory:
    """The OOM as one actionable line: phase, what was asked, planned vs actual peak, the suggestion."""
    where = f"rank {rank} {OutOfMemory.MARK}" if world_size > 1 else f"{device.type.upper()} {OutOfMemory.MARK}"
    if device.type == "cuda":
        gpu = torch.cuda.get_device_name(device)
        peak = torch.cuda.max_memory_allocated(device) / 2**30
        total = torch.cuda.get_device_properties(device).total_memory / 2**30
        try:
            planned = f"{_plan_peak(cfg, gpu, world_size=world_size)[0]:.1f} GiB"
        except Exception:  # the planner must never hide the OOM
            planned = "not modelled"
        actual = f"actual {peak:.1f} of {total:.1f} GiB"
        advice = _snapshot(cfg, run_dir) + " " + suggestions(cfg, gpu, world_size=world_size)
    else:
        planned = "not modelled on the host (the planner plans GPUs)"
        actual = f"actual {_host_peak_gib():.1f} GiB resident"
        advice = " " + _FALLBACK.format(mbs=cfg.train.micro_batch_size)
    if phase in ("build", "load"):  # the weights alone do not fit: activations switches cannot help
        advice = " Hold less of the model per rank: more ranks in parallel.dp_shard, tp or pp, or train.mode=lora."
    return OutOfMemory(
        f"{where} during {phase} (allocating {_asked(error)}); planned peak {planned}, {actual}.{advice}",
        quiet=rank != 0,
    )
