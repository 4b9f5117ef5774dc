"""The analyzer on traces nobody here wrote: HolisticTraceAnalysis's test data (tests/data/hta; its
README says what each file is and where it came from).

Every trace analyzes and renders to the terminal, JSON and HTML; on every trace with GPU kernels fewer
than 10% of GPU time land in "other". Then what a person checking a trace reads off it: its steps, the
GPU's busy time, the NCCL and GEMM kernel time, where a CPU-only trace's host time went, how two runs
compare. Those numbers are computed here from the JSON, without the analyzer's code.
"""

from __future__ import annotations

import functools
import gzip
import heapq
import html
import io
import itertools
import json
import re
from collections import defaultdict
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import traces_gen as gen
from helpers import DATA, console_errors, render_in_browser
from rich.console import Console

from tracetrain.errors import TracetrainError
from tracetrain.profile.analyze import Report, analyze, compare, render_html, render_json, render_terminal

HTA = DATA / "hta"
NOT_KINETO = "execution_trace/benchmark_simple_add_et.json.gz"
TRACES = sorted(str(p.relative_to(HTA)) for p in HTA.rglob("*.json.gz") if str(p.relative_to(HTA)) != NOT_KINETO)
GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset", "Kernel", "Memcpy", "Memset"}
STEP = re.compile(r"^ProfilerStep#\d+$")
# Traces whose "other" share is the honest answer: torch.cuda._sleep's spin kernel is neither compute
# nor memory traffic, and here it is most of the GPU's 51 µs.
OTHER_EXEMPT = {"critical_path/cuda_event_sync/event_sync_trace.json.gz": "spin_kernel"}


@functools.cache
def report(name: str) -> Report:
    return analyze([HTA / name])


def complete_events(name: str, exact: bool = False) -> list[dict[str, Any]]:
    """The trace's `X` events; with `exact`, every number is a `Decimal` (no float rounding)."""
    with gzip.open(HTA / name, "rt") as text:
        doc = json.load(text, parse_float=Decimal, parse_int=Decimal) if exact else json.load(text)
    return [e for e in doc["traceEvents"] if e.get("ph") == "X"]


@functools.cache
def gpu_events(name: str) -> list[dict[str, Any]]:
    """Kernels, copies and memsets with a usable duration, on the device with the most GPU time."""
    found = [e for e in complete_events(name) if e.get("cat") in GPU_CATS and float(e.get("dur", -1)) >= 0]
    by_device: dict[Any, float] = defaultdict(float)
    for e in found:
        by_device[(e.get("args") or {}).get("device", e.get("pid"))] += e["dur"]
    if not by_device:
        return []
    main = max(by_device, key=by_device.__getitem__)
    return [e for e in found if (e.get("args") or {}).get("device", e.get("pid")) == main]


@functools.cache
def step_events(name: str) -> list[dict[str, Any]]:
    """`ProfilerStep#N` ranges, whatever their category (an annotation, or an op in older schemas)."""
    return [e for e in complete_events(name) if STEP.match(e.get("name", ""))]


def terminal(result: Any) -> str:
    out = io.StringIO()
    render_terminal(result, Console(file=out, width=160, color_system=None))
    return out.getvalue()


@pytest.mark.parametrize("name", TRACES)
def test_every_trace_analyzes_and_renders(name):
    result = report(name)
    text = terminal(result)
    json.dumps(render_json(result), allow_nan=False)
    page = render_html(result)
    assert page.startswith("<!doctype html>") and page.endswith("</html>") and "<script" not in page
    rank = result.ranks[0]
    if not rank.has_gpu:  # host time instead of a step that is "idle" end to end
        assert "idle: sync" not in text and "idle: host" not in text
        assert ("Top host operators by self time" in text) == bool(rank.host_time.operators)
    else:
        assert "GPU utilisation" in text and "GPU timeline" in page


# No CUDA kernel activity: host-only traces, MTIA, and CUPTI's range profiler (counters, no timing).
WITHOUT_GPU = {"cpu_only", "cupti_profiler", "distributed_info_unavailable", "mtia_inference_trace", "rank_non_gpu",
               "rank_unavailable"}


def test_the_traces_without_gpu_kernels_are_the_ones_the_readme_names():
    without_gpu = {name.split("/")[0] for name in TRACES if not report(name).ranks[0].has_gpu}
    assert len(TRACES) == 23 and without_gpu == WITHOUT_GPU


@pytest.mark.parametrize("name", [name for name in TRACES if name.split("/")[0] not in WITHOUT_GPU])
def test_other_is_under_ten_percent_of_gpu_time(name):
    rank = report(name).ranks[0]
    assert rank.has_gpu
    share = {row.category: row.share for row in rank.kernels.categories}.get("other", 0.0)
    if name in OTHER_EXEMPT:
        others = {k.full_name for k in rank.kernels.top if k.category == "other"}
        assert others and all(OTHER_EXEMPT[name] in k for k in others), others
    else:
        assert share < 0.10, [(k.name, k.share) for k in rank.kernels.top if k.category == "other"]


@pytest.mark.parametrize("name", TRACES)
def test_steps_as_read_from_the_trace(name):
    """One step per `ProfilerStep#N` range, whether the trace writes it as an annotation or an op."""
    steps = {e["name"] for e in step_events(name)}
    util = report(name).ranks[0].utilisation
    assert [s.name for s in util.steps] == sorted(steps, key=lambda n: int(n.split("#")[1]))
    assert util.has_step_ranges == bool(steps)


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


@pytest.mark.parametrize("name", TRACES)
def test_gpu_busy_time_as_read_from_the_trace(name):
    events = gpu_events(name)
    busy_us = _union_us([(e["ts"], e["ts"] + e["dur"]) for e in events])
    assert report(name).ranks[0].utilisation.busy_us == pytest.approx(busy_us, rel=1e-9, abs=1e-6)
    assert report(name).ranks[0].has_gpu == bool(events)


@pytest.mark.parametrize("name", ["nccl_parser_config/nccl_data.json.gz", "timeline_analysis/sampled_rank-0.json.gz",
                                  "trace_diff/control/control.json.gz", "trace_filter/sampled_rank-1.json.gz"])
def test_nccl_kernel_time_as_read_from_the_trace(name):
    events = gpu_events(name)
    nccl_us = sum(e["dur"] for e in events if "nccl" in e["name"].lower())
    rows = {row.category: row for row in report(name).ranks[0].kernels.categories}
    assert nccl_us > 0 and rows["communication"].total_us == pytest.approx(nccl_us)
    assert rows["communication"].share == pytest.approx(nccl_us / sum(e["dur"] for e in events))


def test_amd_gemms_are_the_tensile_kernels():
    """On the MI250 trace every GEMM is a rocBLAS Tensile kernel, `Cijk_...`; nothing else is one."""
    name = "amd_trace/mi250_minitoy_train_ROCm6_2_kineto.json.gz"
    tensile_us = sum(e["dur"] for e in gpu_events(name) if e["name"].startswith("Cijk_"))
    rows = {row.category: row for row in report(name).ranks[0].kernels.categories}
    assert tensile_us > 0 and rows["gemm"].total_us == pytest.approx(tensile_us)


def test_cudnn_convolutions_take_most_of_a_convnet_step():
    """The V100 convnet's cuDNN convolution kernels (`..._scudnn_...`, `wgrad_alg0_engine`) make GEMM the
    top category, and all of their time is in it."""
    name = "ns_resolution_trace/rank-0.Apr_03_18_51_38.1102.pt.trace.json.gz"
    conv_us = sum(e["dur"] for e in gpu_events(name) if re.search(r"scudnn|wgrad_alg", e["name"]))
    rows = report(name).ranks[0].kernels.categories
    top = max(rows, key=lambda row: row.total_us)
    assert top.category == "gemm" and top.total_us >= conv_us > 0.2 * sum(row.total_us for row in rows)


def test_host_waits_on_an_allocation_before_the_first_kernel():
    """event_sync_trace: one step of 3.15 ms in which the host spends 2.2 ms in `aten::empty` (inside
    `aten::ones`) before it launches anything. The GPU, with nothing queued, idles for that time, and
    the cause is the host."""
    name = "critical_path/cuda_event_sync/event_sync_trace.json.gz"
    (empty,) = [e for e in complete_events(name) if e["name"] == "aten::empty"]
    first_kernel = min(e["ts"] for e in gpu_events(name))
    assert first_kernel > empty["ts"] + empty["dur"] and empty["dur"] > 2000
    idle = report(name).ranks[0].utilisation.idle_us
    assert idle["host"] >= empty["dur"] and idle["host"] == max(idle.values())


def _self_times_by_sweep(events: list[dict[str, Any]]) -> dict[str, Decimal]:
    """Self time per operator name, by walking each thread's timeline: every stretch belongs to the
    innermost operator open then, the one that started last (of two with the same start and duration,
    the one written later: Kineto writes a caller, `aten::item`, before its callee)."""
    self_us: dict[str, Decimal] = defaultdict(Decimal)
    by_thread: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        by_thread[(e.get("pid"), e.get("tid"))].append(e)
    for ops in by_thread.values():
        # Boundaries: (time, 0 = end before 1 = start at the same instant, -duration, index).
        marks = sorted([(e["ts"] + e["dur"], 0, Decimal(0), i) for i, e in enumerate(ops)]
                       + [(e["ts"], 1, -e["dur"], i) for i, e in enumerate(ops)])
        open_ops: list[tuple[Decimal, Decimal, int]] = []  # heap of (-start, duration, -index): innermost first
        closed: set[int] = set()
        last = marks[0][0]
        for time, is_start, _, i in marks:
            while open_ops and -open_ops[0][2] in closed:
                heapq.heappop(open_ops)
            if open_ops:
                self_us[ops[-open_ops[0][2]]["name"]] += time - last
            last = time
            if is_start:
                heapq.heappush(open_ops, (-ops[i]["ts"], ops[i]["dur"], -i))
            else:
                closed.add(i)
    return self_us


@pytest.mark.parametrize("name", ["rank_non_gpu/rank_non_gpu.json.gz",
                                  "mtia_inference_trace/mtia_inference_rank_0.json.gz"])
def test_cpu_only_top_operators_as_read_from_the_trace(name):
    # Times as exact decimals: at 1.7e15 µs a float's step is 0.25 µs, too coarse for a sum of differences.
    ops = [e for e in complete_events(name, exact=True) if e.get("cat") == "cpu_op" and not STEP.match(e["name"])]
    expected = _self_times_by_sweep(ops)
    rows = report(name).ranks[0].host_time.operators
    assert rows and rows[0].name == max(expected, key=expected.__getitem__)
    for row in rows:
        assert row.self_us == pytest.approx(float(expected[row.name]), rel=1e-9, abs=1e-3)
        assert row.count == sum(e["name"] == row.name for e in ops)
    assert sum(row.self_share for row in rows) <= 1 + 1e-9


def test_a_cpu_only_distributed_step_is_its_collective():
    """cpu_only: the step's 210 ms are spent in `gloo:all_reduce` ranges (two threads); the four
    operators take 4 µs. The range table leads with the collective."""
    name = "cpu_only/rank-34.Jul_15_10_52_41.1074.pt.trace.json.gz"
    gloo_us = sum(e["dur"] for e in complete_events(name) if e["name"] == "gloo:all_reduce")
    top = report(name).ranks[0].host_time.ranges[0]
    assert top.name == "gloo:all_reduce" and top.total_us == pytest.approx(gloo_us)
    assert "gloo:all_reduce" in terminal(report(name))


def test_an_execution_trace_is_refused_in_one_line():
    with pytest.raises(TracetrainError, match="no 'traceEvents' list") as error:
        analyze([HTA / NOT_KINETO])
    assert "\n" not in str(error.value)


def _mean_step_us(name: str) -> float:
    steps = [e["dur"] for e in step_events(name)]
    return sum(steps) / len(steps)


def test_compare_headline_of_htas_own_pair():
    """HTA's trace_compare pair runs the same two steps: the same speed, said first."""
    a, b = "trace_compare/base/base.json.gz", "trace_compare/test/test.json.gz"
    assert abs(_mean_step_us(b) / _mean_step_us(a) - 1) < 0.01
    text = terminal(compare(report(a), report(b)))
    assert text.startswith("b runs at the speed of a: 111.22 ms and 111.22 ms per step")


def test_compare_headline_names_the_faster_run_and_why():
    a, b = "nccl_parser_config/nccl_data.json.gz", "trace_diff/control/control.json.gz"
    change = _mean_step_us(b) / _mean_step_us(a) - 1
    diff = compare(report(a), report(b))
    assert diff.headline.change == pytest.approx(change, rel=1e-6) and change < -0.01
    assert diff.headline.reason_delta_us is not None and diff.headline.reason_delta_us < 0
    first = terminal(diff).splitlines()[0]
    assert first.startswith(f"b is {100 * -change:.1f}% faster than a per step") and ", mostly less " in first
    assert render_json(diff)["headline"]["change"] == pytest.approx(change)


def test_compare_headline_of_two_runs_built_by_hand(tmp_path):
    """traces_gen's data-loader-bound run: 100 ms steps, 60 ms of GEMMs; its GEMM-heavy run: 10 ms
    steps, 9.6 ms of GEMMs. Of the step's parts, GEMM time moved most (-50.4 ms; data-loader idle -40 ms)."""
    slow = analyze([gen.write(gen.data_loader_bound(steps=3), tmp_path / "slow.json.gz")])
    fast = analyze([gen.write(gen.gemm_heavy(steps=3), tmp_path / "fast.json.gz")])
    assert terminal(compare(slow, fast)).startswith(
        "b is 90.0% faster than a per step (100.00 ms → 10.00 ms), mostly less GPU time in gemm kernels "
        "(-50.40 ms per step).")
    assert terminal(compare(fast, slow)).startswith("b is 10.00x slower than a per step (10.00 ms → 100.00 ms)")


# Added to a copy of a page (the pages themselves have no scripts): what the browser drew, as JSON.
PROBE = """<script>
const box = e => { const b = e.getBBox(); return [b.x, b.width, b.height]; };
const probe = {
  charts: [...document.querySelectorAll('svg.chart')].map(s => [s.getAttribute('aria-label'), ...box(s)]),
  ticks: [...document.querySelectorAll('text.tick')].map(t => [t.textContent, ...box(t)]),
  lanes: [...document.querySelectorAll('text.lane')].map(t => [t.textContent, ...box(t)]),
  first: document.querySelector('h1').nextElementSibling.textContent,
};
const pre = document.createElement('pre'); pre.id = 'probe'; pre.textContent = JSON.stringify(probe);
document.body.appendChild(pre);
</script>"""


def drawn(page: str, tmp_path: Path) -> dict[str, Any]:
    """Open the page in headless Chromium; fail on console errors; return what the probe measured."""
    path = tmp_path / "page.html"
    path.write_text(page.replace("</body>", PROBE + "</body>"), encoding="utf-8")
    dom, log = render_in_browser(path, tmp_path)
    assert not console_errors(log), console_errors(log)
    found = re.search(r'<pre id="probe">(.*?)</pre>', dom, re.S)
    assert found, dom[-2000:]
    return json.loads(html.unescape(found.group(1)))


def test_timeline_has_a_time_axis_and_lane_labels_in_a_browser(tmp_path):
    name = "nccl_parser_config/nccl_data.json.gz"
    probe = drawn(render_html(report(name)), tmp_path)
    assert all(width > 0 and height > 0 for _, _, width, height in probe["charts"]), probe["charts"]
    assert [lane for lane, *_ in probe["lanes"]] == ["steps", "GPU"]
    ticks = probe["ticks"]
    assert len(ticks) >= 3 and ticks[0][0] in ("0 ms", "0 s") and all(w > 0 for _, _, w, _ in ticks)
    assert all(x0 + w0 <= x1 for (_, x0, w0, _), (_, x1, _, _) in itertools.pairwise(ticks)), "tick labels overlap"
    window_ms = report(name).ranks[0].utilisation.window_us / 1e3
    last = float(ticks[-1][0].split()[0]) * (1e3 if ticks[-1][0].endswith(" s") else 1)
    assert 0.5 * window_ms < last <= window_ms


def test_cpu_only_page_draws_the_host_operators_in_a_browser(tmp_path):
    probe = drawn(render_html(report("rank_non_gpu/rank_non_gpu.json.gz")), tmp_path)
    labels = [label for label, *_ in probe["charts"]]
    assert "host operators by self time" in labels and not probe["ticks"]
    assert all(width > 0 for _, _, width, _ in probe["charts"])


def test_compare_page_puts_its_headline_first_in_a_browser(tmp_path):
    diff = compare(report("nccl_parser_config/nccl_data.json.gz"), report("trace_diff/control/control.json.gz"))
    probe = drawn(render_html(diff), tmp_path)
    assert re.match(r"b is [\d.]+% faster than a per step \(", probe["first"]), probe["first"]
    assert probe["charts"] and all(width > 0 for _, _, width, _ in probe["charts"])
