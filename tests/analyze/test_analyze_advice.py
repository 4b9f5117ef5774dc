"""Every advice rule fires on a trace built to trigger it and stays quiet on one that is not."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import traces_gen as gen

from tracetrain.profile.analyze import analyze
from tracetrain.profile.analyze.advice import OVERLAP_RETURNED, RULES, Advice


def _advice(tmp_path: Path, *docs: dict[str, Any]) -> dict[str, Advice]:
    paths = [gen.write(doc, tmp_path / f"rank{i}.json.gz") for i, doc in enumerate(docs)]
    return {a.rule: a for a in analyze(paths).advice}


def _gemm_bf16() -> dict[str, Any]:
    return gen.gemm_heavy(steps=2)


CASES = {
    # rule: (trace that fires it, trace that does not, expected gain or None)
    "data_loader": (lambda: gen.data_loader_bound(steps=3), _gemm_bf16, 39_990 / 100_000),
    # 3/4 of the copy time, plus the 18 µs the host blocked in the pageable copies' calls while idle.
    "pageable_copies": (
        lambda: gen.host_copies(steps=2, pageable=True),
        lambda: gen.host_copies(steps=2, pageable=False),
        0.75 * 0.6 + 18 / 20_000,
    ),
    # 70% of the 4 000 µs idle as recorded; back-to-back ops 1 µs apart put the recording cost at
    # 2 µs per event, 2 events (op, launch) per kernel: 2 400 µs of idle and step time removed; fusing
    # kernels gives back half the rest.
    "launch_bound": (
        lambda: gen.launch_bound(steps=2, kernels_per_step=200),
        _gemm_bf16,
        0.5 * (0.7 * 4_000 - 2_400) / (4_000 - 2_400),
    ),
    # bf16 gives back 85% of fp32 GEMM time.
    "fp32_gemm": (lambda: gen.gemm_heavy(steps=2, dtype="fp32"), _gemm_bf16, 0.85 * 0.96),
    # Recording cost (4 µs per event) removes 564 µs of the host idle between the launches.
    "small_gemm": (lambda: gen.gemm_heavy(steps=2, m=64), _gemm_bf16, 0.5 * 0.96 * 20_000 / 19_436),
    "sync_stalls": (lambda: gen.sync_heavy(steps=2), _gemm_bf16, 4_908 / 20_000),
    "memory_headroom": (
        lambda: gen.gemm_heavy(steps=2, memory_peak=10 * gen.GIB),
        lambda: gen.gemm_heavy(steps=2, memory_peak=70 * gen.GIB),
        None,
    ),
}


def test_every_rule_has_cases():
    # exposed_comm: below; host_bound: tests/analyze/test_analyze_advice_foreign.py; cpu_optimizer and
    # recompilation: the measured corpus (tests/analyze/test_advice_truth.py, cases cpu_optimizer, recompile)
    assert {rule.__name__ for rule in RULES} == set(CASES) | {
        "exposed_comm",
        "host_bound",
        "cpu_optimizer",
        "recompilation",
    }


@pytest.mark.parametrize("rule", sorted(CASES))
def test_rule_fires_with_evidence_and_gain(tmp_path, rule):
    fires, _, gain = CASES[rule]
    advice = _advice(tmp_path, fires())
    assert rule in advice, sorted(advice)
    found = advice[rule]
    assert found.evidence and found.action and found.title
    assert found.gain == (pytest.approx(gain) if gain is not None else None)
    if gain is not None:  # per step in ms, with a range around it
        step_ms = sum(s.duration_us for s in analyze([tmp_path / "rank0.json.gz"]).ranks[0].utilisation.steps)
        assert found.gain_ms is not None and 0 < found.gain_ms < step_ms / 1e3
        assert found.gain_range is not None and found.gain_range[0] <= found.gain <= found.gain_range[1]


@pytest.mark.parametrize("rule", sorted(CASES))
def test_rule_stays_quiet(tmp_path, rule):
    _, quiet, _ = CASES[rule]
    assert rule not in _advice(tmp_path, quiet())


def test_exposed_comm_fires_on_exposed_nccl_only(tmp_path):
    exposed = _advice(tmp_path, gen.two_rank_nccl(0, exposed=True), gen.two_rank_nccl(1, exposed=True))
    # 15% of the step exposed while the optimizer's kernel waits for it; overlapping gives back half.
    assert exposed["exposed_comm"].gain == pytest.approx(OVERLAP_RETURNED * 0.15)
    hidden = _advice(tmp_path, gen.two_rank_nccl(0, exposed=False), gen.two_rank_nccl(1, exposed=False))
    assert "exposed_comm" not in hidden


def test_exposed_comm_costs_nothing_when_no_launched_compute_waits_for_it(tmp_path):
    """The same exposed all-reduce without the optimizer kernel waiting behind it: the next compute is
    launched only after it ends, so the GPU would have idled for the host anyway."""
    docs = [gen.two_rank_nccl(r, exposed=True) for r in (0, 1)]
    for doc in docs:
        doc["traceEvents"] = [
            e for e in doc["traceEvents"] if "Adam" not in e.get("name", "") and e.get("name") != "aten::_foreach_add_"
        ]
    assert "exposed_comm" not in _advice(tmp_path, *docs)


def test_a_trace_of_nccl_kernels_only_is_analysed(tmp_path):
    b = gen.KinetoTraceBuilder(rank=0, world_size=2)
    b.annotation("ProfilerStep#0", 0, 10_000)
    b.gpu(gen.NCCL_ALLREDUCE, 10, 100, 1_500, stream=20, launch="cudaLaunchKernelExC", launch_dur=1)
    rank = analyze([gen.write(b.document(), tmp_path / "rank0.json.gz")]).ranks[0]
    assert rank.collectives is not None and rank.collectives.delaying_us == 0


def test_well_fed_gemm_trace_gets_no_advice(tmp_path):
    assert _advice(tmp_path, _gemm_bf16()) == {}


def test_advice_is_sorted_by_gain_and_merged_across_ranks(tmp_path):
    report = analyze(
        [
            gen.write(gen.data_loader_bound(steps=2), tmp_path / "a.json.gz"),
            gen.write(gen.launch_bound(steps=2, kernels_per_step=200), tmp_path / "b.json.gz"),
        ]
    )
    gains = [a.gain for a in report.advice]
    assert gains == sorted(gains, reverse=True)
    by_rule = {a.rule: a for a in report.advice}
    assert by_rule["launch_bound"].rank == 1 and by_rule["data_loader"].rank == 0
