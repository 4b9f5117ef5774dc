"""Advice that needs all ranks' traces: a late peer (a straggler, or unbalanced pipeline stages) and
an all-reduce per micro-batch under gradient accumulation. The table is in collectives.py; the
single-rank rules and the gain conventions are in advice.py."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from tracetrain.profile.analyze.advice import (
    Advice,
    _action,
    _advice,
    _fraction,
    _literal,
    _num_steps,
    delaying_comm_us,
)
from tracetrain.profile.analyze.collectives import PeerWait

if TYPE_CHECKING:
    from tracetrain.profile.analyze.report import RankReport


def _real_wait(wait: PeerWait, by_rank: dict[int, RankReport]) -> float:
    """The wait less what the profiler's recording cost made the late peer late by (its removed
    host-side idle): profiled ranks are slowed unevenly, so a rank with more host work looks late."""
    late = by_rank.get(wait.late_rank) if wait.late_rank is not None else None
    removed = late.overhead.removed_total_us if late is not None and late.overhead is not None else 0.0
    return max(wait.wait_us - removed, 0.0)


def waiting_for_peer(ranks: list[RankReport], waits: list[PeerWait]) -> Advice | None:
    """`straggler`, or `load_imbalance` when the waiting is in point-to-point transfers (pipeline
    stages of unequal cost)."""
    by_rank = {r.rank: r for r in ranks}
    shares = {w.rank: _fraction(by_rank[w.rank], _real_wait(w, by_rank)) for w in waits if w.rank in by_rank}
    if not shares or max(shares.values()) < 0.05:
        return None
    worst = max(waits, key=lambda w: shares[w.rank])
    report = by_rank[worst.rank]
    wait_ms = _real_wait(worst, by_rank) / _num_steps(report) / 1e3
    late = f"rank {worst.late_rank}" if worst.late_rank is not None else "a peer"
    doing = (
        "was still computing (its GPU busy)" if worst.late_computing else "had its GPU idle, waiting for its own host"
    )
    evidence = (
        f"rank {worst.rank} waits {wait_ms:.2f} ms per step ({shares[worst.rank]:.0%} of its step) inside NCCL "
        f"kernels for {late}, which {doing} before joining."
    )
    # Point-to-point waits are a pipeline's stages: whatever makes one late (more layers, more host
    # work per layer), the fix is to rebalance them.
    if worst.wait_p2p_us >= 0.5 * worst.wait_us:
        # Balancing the stages shares the difference out: the step loses the mean wait.
        gain = sum(shares.values()) / len(shares)
        found_p2p = _advice(
            report,
            "load_imbalance",
            "Pipeline stages are unbalanced: one stage waits for the other",
            "Move layers from the slow stage to the waiting one (split by measured time, not layer count: the "
            "first stage also embeds, the last computes the loss), or use more micro-batches and an "
            "interleaved schedule to hide the difference.",
            evidence,
            gain,
            gain,
            shares[worst.rank],
        )
        return replace(found_p2p, rank=worst.rank)
    return _straggler(ranks, worst, report)


def _extra_work(ranks: list[RankReport], late: int) -> tuple[float, bool]:
    """(µs per step, on the GPU) the late rank does beyond the least of its peers: host time outside
    recorded operators, or GPU compute, whichever is larger (collectives.py, module docstring)."""
    work = {r.rank: r.collectives for r in ranks if r.collectives is not None}
    if late not in work or len(work) < 2:
        return 0.0, False
    peers = [c for rank, c in work.items() if rank != late]
    host = work[late].host_unrecorded_us - min(c.host_unrecorded_us for c in peers)
    gpu = work[late].compute_us - min(c.compute_us for c in peers)
    return max(host, gpu, 0.0), gpu > host


def _straggler(ranks: list[RankReport], worst: PeerWait, report: RankReport) -> Advice | None:
    """A late rank that does more work than its peers; the step loses that work, at most the wait."""
    if worst.late_rank is None:
        return None
    extra_us, on_gpu = _extra_work(ranks, worst.late_rank)
    steps = _num_steps(report)
    # A share of the late rank's step: it waits for no one, so its step is the run's without the
    # waiting that the profiler's uneven slowdown adds to its peers'.
    late_report = next(r for r in ranks if r.rank == worst.late_rank)
    share = _fraction(late_report, min(extra_us * steps, worst.wait_us))
    if share < 0.05:
        return None  # ranks doing the same work wait for each other only as the profiler slows them
    late = f"rank {worst.late_rank}"
    doing = (
        f"computes {extra_us / 1e3:.2f} ms per step more on its GPU than its least-loaded peer"
        if on_gpu
        else f"spends {extra_us / 1e3:.2f} ms per step more than its peers on the host outside any recorded "
        "operator (Python, sleeps, I/O)"
    )
    found = _advice(
        late_report,
        "straggler",
        f"A straggler: {late} is late to the collectives",
        f"Find what {late} does that the others do not: "
        + (
            "more work (uneven batches, sequence lengths or shards: balance them)."
            if on_gpu
            else "host work before its collectives (a slow data loader or disk, logging or checkpointing "
            "only on that rank, a busy or throttled CPU); see its Python with "
            + _action(
                late_report, "`profile.with_stack = true`.", "`torch.profiler.profile(with_stack=True)` or py-spy."
            )
        ),
        f"rank {worst.rank} waits {worst.wait_us / steps / 1e3:.2f} ms per step inside NCCL kernels for {late}, "
        f"which {doing}.",
        share,
        0.5 * share,
        _fraction(late_report, worst.wait_us),
    )
    return replace(found, rank=worst.rank)


def grad_sync_per_microbatch(report: RankReport) -> Advice | None:
    """The same all-reduce buckets k >= 2 times a step: gradient accumulation that synchronises
    every micro-batch. With `no_sync` only the last one communicates."""
    rounds = report.collectives.allreduce_rounds if report.collectives else 1
    if rounds < 2:
        return None
    comm = report.communication
    fraction = report.transfer_fraction if report.transfer_fraction is not None else 1.0
    saved = (rounds - 1) / rounds
    # Only the transfer that held up compute costs the step; in a host-paced step the repeated
    # all-reduces run while the GPU waits for the host anyway (advice-truth corpus, H200 NVLink: 4
    # micro-batches without no_sync cost nothing measurable, -7% and -7% in two runs).
    exposed = _fraction(report, delaying_comm_us(report)) * saved
    overlapped = _literal(report, comm.comm_us * fraction) * saved
    return _advice(
        report,
        "grad_sync_per_microbatch",
        "Gradients are all-reduced on every micro-batch",
        _action(
            report,
            "Accumulate without synchronising: tracetrain skips the all-reduce on all but the last "
            "micro-batch; check that `train.grad_accum_steps` counts micro-batches, not steps.",
            "Wrap all but the last micro-batch's forward and backward in `with model.no_sync():` (DDP), or call "
            "`model.set_requires_gradient_sync(False)` before them and `True` before the last (FSDP2).",
        ),
        f"the same all-reduce buckets run {rounds} times per step ({comm.num_kernels / _num_steps(report):.0f} "
        f"NCCL kernels per step); {saved:.0%} of them are not needed.",
        exposed,
        exposed,
        max(exposed, overlapped),
    )
