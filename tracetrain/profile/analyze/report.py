"""The analysis facade: parse each rank's trace, run every analyzer, collect the tables and advice.

Each trace is parsed, analysed and dropped before the next is read, so analysing many ranks costs the
memory of one parsed trace plus the (small) tables.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tracetrain.devices import DeviceSpec, lookup_device
from tracetrain.errors import TracetrainError
from tracetrain.profile.analyze.advice import Advice, advise, merge_advice, rank_advice
from tracetrain.profile.analyze.bound import BoundAnalysis, bound
from tracetrain.profile.analyze.collectives import RankCollectives, peer_waits, rank_collectives, transfer_fraction
from tracetrain.profile.analyze.comm_memory import (
    CommRow,
    MemoryTimeline,
    OffloadRow,
    communication,
    memory_timeline,
    offload,
)
from tracetrain.profile.analyze.counters import CounterReport, counter_report
from tracetrain.profile.analyze.host_gaps import HostGapRow, host_gaps
from tracetrain.profile.analyze.kernels import KernelBreakdown, kernel_breakdown
from tracetrain.profile.analyze.operators import HostTime, host_time
from tracetrain.profile.analyze.overhead import (
    TIMING_SUFFIX,
    Overhead,
    host_only_overhead,
    profiler_overhead,
    read_real_step_us,
    steps_span_us,
)
from tracetrain.profile.analyze.phases import PhaseRow, phases
from tracetrain.profile.analyze.reader import read_traces
from tracetrain.profile.analyze.select import main_device
from tracetrain.profile.analyze.trace import Trace
from tracetrain.profile.analyze.utilisation import Utilisation, idle_by_cause, utilisation

TRACE_SUFFIXES = (".json", ".json.gz", ".sqlite", ".sqlite3")


@dataclass(frozen=True)
class RankReport:
    """Every analysis of one rank's trace."""

    source: str
    rank: int
    world_size: int
    has_gpu: bool
    device_name: str | None
    notes: list[str]
    utilisation: Utilisation
    kernels: KernelBreakdown
    bound: BoundAnalysis
    phases: list[PhaseRow]
    communication: CommRow
    offload: OffloadRow
    memory: MemoryTimeline | None
    advice: list[Advice] = field(default_factory=list)
    # Host operators and ranges by self time, for a trace without GPU activity (empty otherwise).
    host_time: HostTime = field(default_factory=HostTime)
    # CUPTI range-profiler counters (a trace of `cuda_profiler_range` events; empty otherwise).
    counters: CounterReport = field(default_factory=CounterReport)
    # The profiler's own cost to the host-side idle, and the step time without it (overhead.py).
    overhead: Overhead | None = None
    # GPU idle charged to the host, split by what the host was doing (host_gaps.py).
    host_gaps: list[HostGapRow] = field(default_factory=list)
    # Of this rank's NCCL kernel time, the part that was transfer, not waiting for a late peer (set
    # from all ranks' traces by collectives.py; None with one rank or without matched collectives).
    transfer_fraction: float | None = None
    # Of that NCCL time, the transfer that ran exposed while compute the host had already launched
    # waited for it: what communication costs the step (collectives.py; None with one rank).
    delaying_transfer_us: float | None = None
    # From the first step's start until the GPU finished the steps' work (overhead.steps_span_us).
    steps_span_us: float = 0.0
    # This rank's NCCL kernels in sequence, for matching with the other ranks (collectives.py).
    collectives: RankCollectives | None = None

    @property
    def real_steps_us(self) -> float:
        """Time of the profiled steps without the profiler's host-side cost (the denominator of every
        share). When the host runs ahead of the GPU, the step ranges (host time) end before the GPU
        work they launched: the window, to the last GPU activity, is the step time then."""
        removed = self.overhead.removed_total_us if self.overhead else 0.0
        return max(max(self.utilisation.steps_us, self.steps_span_us) - removed, 1e-9)

    def real_idle_us(self, cause: str) -> float:
        """Idle of one cause, less what the profiler's recording cost added."""
        removed = self.overhead.removed_us.get(cause, 0.0) if self.overhead else 0.0
        return max(self.utilisation.idle_us[cause] - removed, 0.0)


@dataclass(frozen=True)
class Report:
    """The analysis of one run: a report per rank (sorted by rank), communication per rank, and the
    advice of all ranks merged (each rule once, at the rank where it gains most)."""

    ranks: list[RankReport]
    communication: list[CommRow]
    advice: list[Advice]
    notes: list[str]


def _device(trace: Trace) -> tuple[DeviceSpec | None, list[str]]:
    if not trace.device_name:
        return None, [
            "device unknown (no deviceProperties in the trace): pass device_name for FLOP/s and bandwidth efficiency"
        ]
    spec = lookup_device(trace.device_name)
    if spec is None:
        return None, [
            f"device {trace.device_name!r} is not in tracetrain.devices: no peak FLOP/s or bandwidth to compare with"
        ]
    return spec, []


def analyze_trace(trace: Trace) -> RankReport:
    """Run every analyzer on one parsed trace."""
    spec, notes = _device(trace)
    has_gpu = len(trace.gpu) > 0
    notes = notes if has_gpu else []
    causes = idle_by_cause(trace, main_device(trace)) if has_gpu else None
    util = utilisation(trace, causes=causes)
    num_devices = len(set(trace.gpu.device.tolist()))
    if num_devices > 1:
        notes.append(f"activity on {num_devices} GPUs in one trace: analysing GPU {util.device}, the busiest")
    if len(trace.gpu) and not util.has_step_ranges:
        notes.append("no ProfilerStep#N ranges (call prof.step() each iteration): the whole window counts as one step")
    capacity = trace.device_memory_bytes or (int(spec.memory_gib * 2**30) if spec else None)
    report = RankReport(
        source=trace.path,
        rank=trace.rank,
        world_size=trace.world_size,
        has_gpu=has_gpu,
        device_name=spec.name if spec else trace.device_name,
        notes=trace.notes + notes,
        utilisation=util,
        kernels=kernel_breakdown(trace),
        bound=bound(trace, spec, util),
        phases=phases(trace, util.steps_us),
        communication=communication(trace, util.steps_us),
        offload=offload(trace),
        memory=memory_timeline(trace, capacity),
        host_time=HostTime() if has_gpu else host_time(trace),
        counters=counter_report(trace),
        collectives=rank_collectives(trace) if has_gpu else None,
    )
    real = read_real_step_us(trace.path)
    if not has_gpu and real is not None:
        overhead = host_only_overhead(trace, util.steps_us, len(util.steps), real)
        report.notes.append(overhead.note)
        report = replace(report, overhead=overhead)
    if has_gpu and causes is not None:
        span = max(steps_span_us(trace), util.steps_us)
        overhead = profiler_overhead(trace, causes, span, len(util.steps), real)
        gaps = host_gaps(trace, causes, overhead.per_event_us)
        report = replace(report, overhead=overhead, host_gaps=gaps, steps_span_us=span)
        if overhead.note:
            report.notes.append(overhead.note)
    # Every rule reads GPU time: a CPU-only trace gets its note and no advice.
    return replace(report, advice=advise(report)) if has_gpu else report


def trace_files(paths: Sequence[str | Path] | str | Path) -> list[Path]:
    """The trace files named: files as given, directories expanded to their `*.json[.gz]` and
    `*.sqlite[3]` (Nsight Systems export) files."""
    items = [paths] if isinstance(paths, (str, Path)) else list(paths)
    files: list[Path] = []
    for item in map(Path, items):
        if item.is_dir():
            # Skip the analyzer's own output (report.json) written beside the traces by `tracetrain profile`.
            found = sorted(
                p
                for p in item.iterdir()
                if p.is_file()
                and p.name.endswith(TRACE_SUFFIXES)
                and not p.name.startswith("report")
                and not p.name.endswith(TIMING_SUFFIX)
            )
            if not found:
                raise TracetrainError(f"{item}: directory has no .json, .json.gz or .sqlite trace files")
            files.extend(found)
        else:
            files.append(item)
    if not files:
        raise TracetrainError("no trace files given")
    seen: set[Path] = set()
    for f in files:  # each file is one rank (or one per process): read twice, it would count twice
        if f.resolve() in seen:
            raise TracetrainError(
                f"{f}: the same trace is named twice (directly or through its folder); each file is one rank, "
                "so name it once"
            )
        seen.add(f.resolve())
    return files


def analyze(paths: Sequence[str | Path] | str | Path, *, device_name: str | None = None) -> Report:
    """Analyse one trace, or one trace per rank of a run (files, or directories of them). A Kineto JSON
    trace is one rank; an Nsight Systems SQLite export is one rank per process that ran GPU work.

    `device_name` (e.g. "H100 SXM") overrides the device the trace names, for peak FLOP/s and
    bandwidth. Raises TracetrainError, naming the file, for a missing or malformed trace.
    """
    ranks: list[Any] = []
    for path in trace_files(paths):
        for trace in read_traces(path, rank=len(ranks), device_name=device_name):
            ranks.append(analyze_trace(trace))
    ranks.sort(key=lambda r: r.rank)
    ranks, shared = _across_ranks(ranks)
    notes = [f"{r.source}: {note}" if len(ranks) > 1 else note for r in ranks for note in r.notes]
    if len({r.rank for r in ranks}) < len(ranks):
        notes.append("several traces claim the same rank; pass one trace per rank")
    return Report(
        ranks=ranks,
        communication=[r.communication for r in ranks],
        advice=merge_advice([r.advice for r in ranks] + [shared]),
        notes=notes,
    )


def _across_ranks(ranks: list[RankReport]) -> tuple[list[RankReport], list[Advice]]:
    """Match the ranks' collectives (collectives.py): each rank's transfer fraction, its advice again
    with it (exposed communication counts transfer only), and the advice that needs all ranks."""
    from tracetrain.profile.analyze.advice_ranks import grad_sync_per_microbatch, waiting_for_peer

    waits = peer_waits(ranks)
    fractions = {w.rank: transfer_fraction(w) for w in waits}
    # A rank with no matched collective keeps its own count (advice.delaying_comm_us).
    delaying = {w.rank: w.delaying_transfer_us for w in waits if fractions[w.rank] is not None}
    ranks = [
        replace(r, transfer_fraction=fractions.get(r.rank), delaying_transfer_us=delaying.get(r.rank)) for r in ranks
    ]
    redone = []
    for r in ranks:
        if not r.has_gpu:  # no GPU timeline (e.g. a counters-only trace): nothing to advise, as in analyze_trace
            redone.append(r)
            continue
        extra = grad_sync_per_microbatch(r)
        found = advise(r) + ([replace(extra, rank=r.rank)] if extra else [])
        redone.append(replace(r, advice=rank_advice(found)))
    late = waiting_for_peer(redone, waits)
    late_rank = next((w.late_rank for w in waits if late is not None and w.rank == late.rank), None)
    if late_rank is not None:
        # The late rank's own host idle is what its peers wait for: the late-peer advice names it, so
        # it is not advised a second time as host- or launch-bound.
        redone = [
            replace(r, advice=[a for a in r.advice if a.rule not in _HOST_RULES]) if r.rank == late_rank else r
            for r in redone
        ]
    return redone, [late] if late else []


_HOST_RULES = ("host_bound", "launch_bound")
