"""CUPTI range-profiler traces (`cuda_profiler_range` events, issue #20): the analyzer says what such a
trace holds (hardware counters per kernel) and what it cannot give (kernel times), and reports the
counters. The expected numbers are read off the trace's JSON here, without the analyzer's code.

HTA's `cupti_profiler` trace (tests/data/hta, A100, AlexNet forward under PARAM): 77 ranges named after
kernels (one `__missing__`), nine SASS instruction counters each, every range 121,431 µs long (Kineto
splits the profiled span evenly), and no kernel events.
"""

from __future__ import annotations

import gzip
import io
import json
from decimal import Decimal
from typing import Any

import pytest
import traces_gen as gen
from helpers import DATA
from rich.console import Console

from tracetrain.profile.analyze import analyze, render_html, render_json, render_terminal
from tracetrain.profile.analyze.counters import SASS_FLOP_COUNTERS

CUPTI = DATA / "hta" / "cupti_profiler" / "benchmark_result_924719_1679055439_trace.json.gz"


def _ranges() -> list[dict[str, Any]]:
    with gzip.open(CUPTI, "rt") as text:
        doc = json.load(text, parse_float=Decimal, parse_int=Decimal)
    return [e for e in doc["traceEvents"] if e.get("ph") == "X" and e.get("cat") == "cuda_profiler_range"]


@pytest.fixture(scope="module")
def rank():
    return analyze(CUPTI).ranks[0]


def test_the_note_says_what_the_trace_holds_and_what_it_cannot_give(rank):
    note = " ".join(rank.notes)
    assert "77 CUPTI range-profiler ranges" in note and "9 hardware counters" in note
    assert "121,431 µs" in note and "cannot be computed" in note and "replays" in note
    assert "was the profiler run with ProfilerActivity.CUDA" not in note  # it was: the old, wrong hint
    assert not rank.has_gpu and rank.advice == []


def test_counter_totals_and_largest_kernel_as_read_from_the_json(rank):
    ranges = _ranges()
    assert rank.counters.num_ranges == len(ranges) == 77
    assert rank.counters.num_names == len({e["name"] for e in ranges})
    rows = {r.counter: r for r in rank.counters.counters}
    assert set(rows) == set(SASS_FLOP_COUNTERS)
    for counter, row in rows.items():
        by_name: dict[str, Decimal] = {}
        for e in ranges:
            by_name[e["name"]] = by_name.get(e["name"], Decimal(0)) + e["args"][counter]
        total = sum(by_name.values())
        assert row.total == pytest.approx(float(total), rel=1e-12)
        assert row.nonzero_ranges == sum(e["args"][counter] != 0 for e in ranges)
        if total:
            top = max(by_name, key=by_name.__getitem__)
            assert row.top_full_name == top and row.top_share == pytest.approx(float(by_name[top] / total))
        else:
            assert row.top_full_name == ""


def test_cuda_core_flops_count_fma_twice(rank):
    ranges = _ranges()
    flops = [sum(e["args"][c] * ops for c, ops in SASS_FLOP_COUNTERS.items()) for e in ranges]
    assert rank.counters.total_flops == pytest.approx(float(sum(flops)), rel=1e-12)
    by_name: dict[str, Decimal] = {}
    for e, f in zip(ranges, flops):
        by_name[e["name"]] = by_name.get(e["name"], Decimal(0)) + f
    best = max(by_name, key=by_name.__getitem__)
    first = rank.counters.flops[0]
    assert first.full_name == best == "ampere_sgemm_32x32_sliced1x4_tn"
    assert first.flops == pytest.approx(float(by_name[best]))
    assert [r.flops for r in rank.counters.flops] == sorted((r.flops for r in rank.counters.flops), reverse=True)


def test_renderers_show_the_counters(rank):
    report = analyze(CUPTI)
    out = io.StringIO()
    render_terminal(report, Console(file=out, width=200, color_system=None))
    text = out.getvalue()
    assert "CUPTI counters over 77 ranges" in text and "CUDA-core FLOPs by kernel" in text
    assert "ampere_sgemm_32x32_sliced1x4_tn" in text
    assert "CUPTI counters" in render_html(report)
    data = json.loads(json.dumps(render_json(report)))
    assert data["ranks"][0]["counters"]["num_ranges"] == 77


def _with_ranges(doc: dict[str, Any], counters: dict[str, Any]) -> dict[str, Any]:
    """`doc` plus two range-profiler events on GPU 0, as Kineto writes them."""
    extra = [
        {
            "ph": "X",
            "cat": "cuda_profiler_range",
            "name": name,
            "pid": 0,
            "tid": 0,
            "ts": gen.T0 + 10 * i,
            "dur": 10,
            "args": counters,
        }
        for i, name in enumerate([gen.NVJET, gen.ADD])
    ]
    return {**doc, "traceEvents": doc["traceEvents"] + extra}


def test_ranges_beside_kernels_are_not_gpu_time(tmp_path):
    doc = gen.gemm_heavy(steps=2)
    plain = analyze(gen.write(doc, tmp_path / "plain.json")).ranks[0]
    both = analyze(gen.write(_with_ranges(doc, {"sm__inst_executed_pipe_tensor.sum": 7}), tmp_path / "b.json")).ranks[0]
    assert both.has_gpu and both.utilisation.busy_us == plain.utilisation.busy_us
    assert any("not counted as GPU time" in n for n in both.notes)
    assert both.counters.num_ranges == 2 and both.counters.counters[0].total == 14
    assert both.counters.flops == [] and both.counters.total_flops is None  # no SASS counters in it


def test_non_numeric_args_are_not_counters(tmp_path):
    doc = gen.KinetoTraceBuilder().document()
    doc = _with_ranges(doc, {"sm__cycles_elapsed.avg": 3.5, "label": "not a number"})
    rank = analyze(gen.write(doc, tmp_path / "ranges_only.json")).ranks[0]
    assert [r.counter for r in rank.counters.counters] == ["sm__cycles_elapsed.avg"]
    assert rank.counters.counters[0].total == 7.0 and not rank.has_gpu
