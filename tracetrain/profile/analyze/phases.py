"""How long does each training phase take, on the host and on the GPU?

Phases come from annotations (record_function / NVTX ranges): tracetrain's own `tracetrain/forward`,
`tracetrain/backward`, `tracetrain/optimizer`, `tracetrain/data_wait`, `tracetrain/checkpoint` (any
other `tracetrain/<name>` becomes phase `<name>`), and generic ones: `## forward ##`,
`Optimizer.step#...`, `Optimizer.zero_grad#...`, `enumerate(DataLoader)#...` (rules in
`categories.py`).

Host time is the union of the phase's ranges. GPU time is the time of the GPU activities launched
while the host was inside one of those ranges, found through the launch's correlation id. A launch
from any thread of the rank counts, because autograd runs backward kernels on its own thread while
the main thread sits inside `tracetrain/backward`. GPU time launched outside every phase is reported as
`(no phase)`.

The `tracetrain/` names also tell a trace of tracetrain's own trainer from one of any other program,
so that advice can name tracetrain's config keys for the one and the plain PyTorch fix for the other.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tracetrain.profile.analyze.categories import PHASES, phase_of
from tracetrain.profile.analyze.columns import ANNOTATION
from tracetrain.profile.analyze.intervals import Spans, contains, union
from tracetrain.profile.analyze.select import host_rows, main_device, on_device
from tracetrain.profile.analyze.trace import Trace

NO_PHASE = "(no phase)"
TRACETRAIN_PREFIX = "tracetrain/"  # profile/capture.py names every phase range `tracetrain/<phase>`


@dataclass(frozen=True)
class PhaseRow:
    """One phase: host ranges found, host time and GPU time (µs), and their shares (of the time inside
    steps, and of all GPU activity time). `from_tracetrain`: some of its ranges carry tracetrain's own
    names (`tracetrain/<phase>`, written by `profile/capture.py`), so tracetrain ran the step."""

    phase: str
    num_ranges: int
    cpu_us: float
    gpu_us: float
    cpu_share: float
    gpu_share: float
    from_tracetrain: bool = False


def _phase_spans(trace: Trace) -> dict[str, tuple[int, Spans, bool]]:
    """Phase name -> (number of ranges, union of ranges, whether tracetrain named any of them), in a
    stable order (known phases first)."""
    rows = host_rows(trace, (ANNOTATION,), lambda name: phase_of(name) is not None)
    by_phase: dict[str, list[int]] = {}
    for row in rows.tolist():
        by_phase.setdefault(phase_of(trace.names[trace.host.name[row]]) or "", []).append(row)
    order = [p for p in PHASES if p in by_phase] + sorted(p for p in by_phase if p not in PHASES)
    out = {}
    for phase in order:
        sel = np.asarray(by_phase[phase])
        ours = any(trace.names[n].startswith(TRACETRAIN_PREFIX) for n in np.unique(trace.host.name[sel]).tolist())
        out[phase] = (len(sel), union(trace.host.ts[sel], trace.host.ts[sel] + trace.host.dur[sel]), ours)
    return out


def phases(trace: Trace, steps_us: float) -> list[PhaseRow]:
    """Host and GPU time per phase; `steps_us` (time inside steps) normalises the host shares."""
    found = _phase_spans(trace)
    if not found:
        return []
    gpu = np.flatnonzero(on_device(trace, main_device(trace)))
    launch_ts, dur = trace.gpu.launch_ts[gpu], trace.gpu.dur[gpu]
    total_gpu = float(dur.sum())
    attributed = np.zeros(len(gpu), dtype=bool)
    table = []
    for phase, (num_ranges, spans, ours) in found.items():
        inside = contains(spans, launch_ts)
        attributed |= inside
        gpu_us = float(dur[inside].sum())
        table.append(
            PhaseRow(
                phase=phase,
                num_ranges=num_ranges,
                cpu_us=spans.total(),
                gpu_us=gpu_us,
                cpu_share=spans.total() / steps_us if steps_us else 0.0,
                gpu_share=gpu_us / total_gpu if total_gpu else 0.0,
                from_tracetrain=ours,
            )
        )
    rest = float(dur[~attributed].sum())
    if rest > 0:
        table.append(PhaseRow(NO_PHASE, 0, 0.0, rest, 0.0, rest / total_gpu))
    return table
