"""Across ranks: how much of each collective was transfer, and how much waiting for a late peer?

An NCCL kernel starts on each rank when that rank reaches it and ends on all ranks together, once the
last one has joined and the data has moved. So matched across ranks, the shortest instance is the
transfer (the last rank to arrive waits least), and every other rank's extra time is waiting for that
peer. Collectives are matched by sequence: the n-th NCCL kernel of a process group on one rank is the
n-th on every other (PyTorch writes the group and collective into the kernel's args; without them all
of a rank's NCCL kernels form one sequence). A group whose kernel count differs between ranks is not
matched. This needs no common clock between the ranks.

Per rank this gives the transfer fraction of its NCCL time (exposed communication counts only that
part, advice.exposed_comm) and its wait per step. The late rank of each collective is described by
what it did before joining: its GPU was computing (it had more work: unbalanced stages or shards), or
its GPU sat idle waiting for its own host (a slow host: a straggler).

A wait is not yet a straggler: the profiler slows each rank's host by its own amount (its recording
cost lands on a busier or slower CPU unevenly), so ranks running the same program wait for each other
in a profiled window and not without it (the healthy DDP and FSDP controls of the advice-truth corpus
wait 17% and 58% of a step in NCCL kernels). What a late rank does that its peers do not is extra
*work*: host time outside every recorded operator (Python, a sleep, I/O, a data loader without
ranges; a uniformly slower CPU or recording cost mostly lengthens the recorded operators, which every
rank runs alike), or more GPU compute. Each rank's per-step amount of both is kept
(`host_unrecorded_us`, `compute_us`) and the straggler's gain is its excess over the least of its
peers, at most the wait it causes. Three rules read this (advice_ranks.py):

| rule                     | fires when                                            | gain                       |
|--------------------------|-------------------------------------------------------|----------------------------|
| straggler                | a rank waits for a late peer, which does >= 5% of a   | that extra work, at most   |
|                          | step more host work or compute than the least peer    | the wait                   |
| load_imbalance           | the same, in point-to-point (pipeline) transfers, the | the mean wait over ranks   |
|                          | late rank computing                                   | (what balancing gives)     |
| grad_sync_per_microbatch | the same all-reduce buckets run k >= 2 times a step   | (k-1)/k of their transfer  |
|                          | (gradient accumulation without `no_sync`)             | that held up compute       |

Communication costs a step only where it held up compute: per kernel, `delaying` is its time with no
compute alongside after the host had launched the compute that runs next (before that launch the GPU
would have idled for the host anyway), and matched across ranks only its transfer part counts.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from tracetrain.profile.analyze.categories import CATEGORIES, collective_of
from tracetrain.profile.analyze.columns import OP, RUNTIME
from tracetrain.profile.analyze.intervals import complement, measure_between, union
from tracetrain.profile.analyze.select import gpu_categories, gpu_spans, main_device, step_rows

if TYPE_CHECKING:
    from tracetrain.profile.analyze.report import RankReport
    from tracetrain.profile.analyze.trace import Trace

_COMM = CATEGORIES.index("communication")
_P2P = ("send", "recv", "sendrecv")


# One NCCL kernel: (collective, duration, host_late: the GPU idled waiting for this launch, message
# elements, delaying: its time with no compute alongside while compute the host had already launched
# waited for it, all µs).
Call = tuple[str, float, bool, int, float]


@dataclass(frozen=True)
class RankCollectives:
    """One rank's NCCL kernels in sequence per process group (µs), for matching with its peers."""

    groups: dict[str, list[Call]] = field(default_factory=dict)
    allreduce_rounds: int = 1  # how many times a step the same all-reduce buckets run
    host_unrecorded_us: float = 0.0  # per step: host time inside the steps outside every recorded event
    compute_us: float = 0.0  # per step: busy time of the GPU's non-NCCL work
    delaying_us: float = 0.0  # summed `delaying` of the kernels (transfer and waiting for peers alike)


def rank_collectives(trace: Trace) -> RankCollectives:
    """The NCCL kernels of the rank's main GPU, per process group, in time order."""
    device = main_device(trace)
    rows = np.flatnonzero((gpu_categories(trace) == _COMM) & (trace.gpu.device == device))
    if not len(rows):
        return RankCollectives()
    unrecorded, compute = _work_per_step(trace, device)
    rows = rows[np.argsort(trace.gpu.ts[rows], kind="stable")]
    meta = {int(r): (trace.names[g], trace.names[c], int(n)) for r, g, c, n in zip(*trace.comm.data.values())}
    other = np.flatnonzero((gpu_categories(trace) != _COMM) & (trace.gpu.device == device))
    ends = np.sort(trace.gpu.ts[other] + trace.gpu.dur[other])
    delaying = _delaying(trace, rows, other)
    groups: dict[str, list[Call]] = {}
    for row, delay in zip(rows.tolist(), delaying.tolist()):
        group, coll, nelems = meta.get(row, ("", collective_of(trace.names[trace.gpu.name[row]]), -1))
        start, launch = trace.gpu.ts[row], trace.gpu.launch_ts[row]
        before = np.searchsorted(ends, start, side="right") - 1
        last_compute = ends[before] if before >= 0 else -np.inf
        host_late = bool(np.isfinite(launch) and launch > last_compute)
        groups.setdefault(group, []).append((coll.lower(), float(trace.gpu.dur[row]), host_late, nelems, delay))
    rounds = _allreduce_rounds(trace, groups)
    return RankCollectives(groups, rounds, unrecorded, compute, float(delaying.sum()))


def _delaying(trace: Trace, rows: np.ndarray, other: np.ndarray) -> np.ndarray:
    """Per NCCL kernel, the time it ran with no compute alongside after the host had launched the
    compute that runs next (which so waited for it). Before that launch the GPU would have idled for
    the host anyway: a host-paced step (or a profiled host) does not lose its communication time."""
    if not len(other):
        return np.zeros(len(rows))  # no compute to hold up
    mask = np.zeros(len(trace.gpu), dtype=bool)
    mask[other] = True
    compute = gpu_spans(trace, mask)
    order = np.argsort(trace.gpu.ts[other], kind="stable")
    starts, launches = trace.gpu.ts[other][order], trace.gpu.launch_ts[other][order]
    start, end = trace.gpu.ts[rows], trace.gpu.ts[rows] + trace.gpu.dur[rows]
    nxt = np.searchsorted(starts, end - 1.0)  # the first compute to start once the kernel is done
    launch = np.where(nxt < len(starts), launches[np.minimum(nxt, len(starts) - 1)], np.inf)
    since = np.maximum(start, np.where(np.isnan(launch), start, launch))
    waited = np.maximum(end - since, 0.0)
    return np.maximum(waited - measure_between(compute, np.minimum(since, end), end), 0.0)


def _work_per_step(trace: Trace, device: int) -> tuple[float, float]:
    """(host time outside every recorded operator or runtime call, on any thread, inside the steps;
    busy time of the GPU's non-NCCL work), per step: what a straggler does more than its peers."""
    steps = step_rows(trace)
    num_steps = max(len(steps), 1)
    if len(steps):
        lo, hi = float(trace.host.ts[steps].min()), float((trace.host.ts[steps] + trace.host.dur[steps]).max())
    else:
        lo, hi = trace.window
    recorded = (trace.host.kind == OP) | (trace.host.kind == RUNTIME)
    host = union(trace.host.ts[recorded], trace.host.ts[recorded] + trace.host.dur[recorded])
    # GPU work launched inside the steps (a host running ahead has the next step's on the GPU too).
    when = np.where(np.isfinite(trace.gpu.launch_ts), trace.gpu.launch_ts, trace.gpu.ts)
    compute = (gpu_categories(trace) != _COMM) & (trace.gpu.device == device) & (when >= lo) & (when <= hi)
    return complement(host, lo, hi).total() / num_steps, gpu_spans(trace, compute).total() / num_steps


def _allreduce_rounds(trace: Trace, groups: dict[str, list[Call]]) -> int:
    """How many times per step the same all-reduce message sizes repeat (DDP's buckets per backward)."""
    sizes = Counter(n for calls in groups.values() for coll, _, _, n, _ in calls if coll == "allreduce" and n > 0)
    num_steps = max(len(step_rows(trace)), 1)
    if not sizes:
        return 1
    per_step = sorted(count / num_steps for count in sizes.values())
    return max(round(per_step[len(per_step) // 2]), 1)


@dataclass(frozen=True)
class PeerWait:
    """A rank's NCCL time split into transfer and waiting for a late peer (µs over the window)."""

    rank: int
    transfer_us: float
    wait_us: float
    wait_p2p_us: float  # of which in point-to-point transfers (pipeline stages)
    late_rank: int | None  # the peer it waited for most
    late_computing: bool  # whether that peer's GPU was computing (not idle for its host) before joining
    delaying_transfer_us: float = 0.0  # transfer time that delayed compute already launched (`_delaying`)


@dataclass
class _Tally:
    transfer_us: float = 0.0
    wait_us: float = 0.0
    wait_p2p_us: float = 0.0
    delaying_transfer_us: float = 0.0
    late: dict[int, float] = field(default_factory=lambda: defaultdict(float))  # peer rank -> µs waited for it
    late_how: dict[tuple[int, bool], float] = field(default_factory=lambda: defaultdict(float))  # (peer, computing)

    def row(self, rank: int) -> PeerWait:
        late = max(self.late, key=lambda peer: self.late[peer]) if self.late else None
        how = self.late_how
        computing = late is not None and how.get((late, True), 0.0) >= how.get((late, False), 0.0)
        return PeerWait(
            rank, self.transfer_us, self.wait_us, self.wait_p2p_us, late, computing, self.delaying_transfer_us
        )


def peer_waits(ranks: list[RankReport]) -> list[PeerWait]:
    """Match every rank's collectives by sequence (module docstring); one row per rank."""
    if len(ranks) < 2:
        return []
    by_rank = {r.rank: r.collectives for r in ranks if r.collectives is not None}
    tallies = {rank: _Tally() for rank in by_rank}
    for group in set().union(*(c.groups for c in by_rank.values())):
        seqs = {rank: c.groups.get(group, []) for rank, c in by_rank.items()}
        if len({len(s) for s in seqs.values()}) != 1:
            continue  # not the same collectives on every rank: cannot match
        for i in range(len(next(iter(seqs.values())))):
            _match({rank: seq[i] for rank, seq in seqs.items()}, tallies)
    return [tally.row(rank) for rank, tally in sorted(tallies.items())]


def _match(calls: dict[int, Call], tallies: dict[int, _Tally]) -> None:
    """One collective on every rank: the shortest is the transfer; the rest of each is waiting."""
    late = min(calls, key=lambda r: calls[r][1])
    transfer = calls[late][1]
    for rank, (coll, dur, _, _, delaying) in calls.items():
        tally, wait = tallies[rank], dur - transfer
        tally.transfer_us += transfer
        # What delayed this rank's compute was the transfer, not the wait for the late peer.
        tally.delaying_transfer_us += min(delaying, transfer)
        tally.wait_us += wait
        tally.wait_p2p_us += wait if coll in _P2P else 0.0
        if rank != late and wait > 0:
            tally.late[late] += wait
            tally.late_how[(late, not calls[late][2])] += wait


def transfer_fraction(wait: PeerWait) -> float | None:
    total = wait.transfer_us + wait.wait_us
    return wait.transfer_us / total if total > 0 else None
