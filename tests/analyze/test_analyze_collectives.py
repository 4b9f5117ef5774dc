"""Collectives matched across ranks (analyze/collectives.py) on the two-rank traces of the advice-truth
corpus (tests/data/advice_truth, H200s): transfer against waiting for a late peer, who is late and
why, and all-reduces repeated per micro-batch."""

from __future__ import annotations

import pytest
from helpers import DATA

from tracetrain.profile.analyze import analyze
from tracetrain.profile.analyze.collectives import peer_waits

CORPUS = DATA / "advice_truth"
pytestmark = pytest.mark.skipif(not (CORPUS / "straggler").is_dir(), reason="no advice-truth corpus")


def _ranks(case: str):
    return analyze(sorted((CORPUS / case).glob("rank*.json.gz"))).ranks


def test_the_sleeping_rank_is_named_late_with_its_gpu_idle():
    """Rank 1 sleeps 15 ms a step before its step: rank 0's all-reduces wait for it."""
    waits = {w.rank: w for w in peer_waits(_ranks("straggler"))}
    assert waits[0].late_rank == 1 and not waits[0].late_computing
    assert waits[0].wait_us > 10 * waits[1].wait_us  # the late rank hardly waits
    assert waits[0].transfer_us == pytest.approx(waits[1].transfer_us)  # the same matched transfers


def test_the_sleeping_rank_does_its_sleep_more_host_work_than_its_peer():
    """The 15 ms sleep is host time outside every recorded operator, on rank 1 only; its GPU does no
    more work than rank 0's (whose GEMMs run slower beside the NCCL kernels spinning for rank 1)."""
    work = {r.rank: r.collectives for r in _ranks("straggler")}
    assert 13e3 < work[1].host_unrecorded_us - work[0].host_unrecorded_us < 17e3
    assert work[1].compute_us <= work[0].compute_us
    advice = {a.rule: a for a in analyze(sorted((CORPUS / "straggler").glob("rank*.json.gz"))).advice}
    assert "for rank 1, which spends 15." in advice["straggler"].evidence


@pytest.mark.parametrize("case", ["control_ddp", "control_fsdp", "fsdp_prefetch", "ddp_no_sync"])
def test_ranks_doing_the_same_work_have_no_straggler(case):
    """In these the ranks wait for each other in NCCL kernels (up to 58% of a step, as the profiler
    slows one host more than the other), but neither does more work: no straggler."""
    assert max(w.wait_us for w in peer_waits(_ranks(case))) > 0
    report = analyze(sorted((CORPUS / case).glob("rank*.json.gz")))
    assert "straggler" not in {a.rule for a in report.advice}


def test_pipeline_waits_are_point_to_point():
    waits = peer_waits(_ranks("pipeline_unbalanced"))
    assert all(w.wait_p2p_us == pytest.approx(w.wait_us) for w in waits)
    assert max(w.wait_us for w in waits) > 5 * min(w.transfer_us for w in waits)


def test_allreduce_per_micro_batch_is_counted():
    """4 micro-batches without no_sync: DDP's buckets run 4 times a step; with no_sync once."""
    assert {r.collectives.allreduce_rounds for r in _ranks("ddp_no_sync")} == {4}
    assert {r.collectives.allreduce_rounds for r in _ranks("control_ddp")} == {1}
    advice = {a.rule for a in analyze(sorted((CORPUS / "ddp_no_sync").glob("rank*.json.gz"))).advice}
    assert "grad_sync_per_microbatch" in advice


def test_exposed_communication_counts_transfer_only():
    ranks = _ranks("straggler")
    waiting = next(r for r in ranks if r.rank == 0)
    assert waiting.transfer_fraction is not None and waiting.transfer_fraction < 0.5
    found = [a for a in waiting.advice if a.rule == "exposed_comm"]
    literal = waiting.communication.exposed_us / waiting.real_steps_us
    assert not found or found[0].gain < literal
