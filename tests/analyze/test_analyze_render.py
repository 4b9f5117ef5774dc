"""Rendering: terminal tables, JSON data, the self-contained HTML page, and comparisons."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pytest
import traces_gen as gen
from rich.console import Console

from tracetrain.profile.analyze import (
    CompareReport,
    Report,
    analyze,
    compare,
    render_html,
    render_json,
    render_terminal,
)

EVIL = 'evil<script>alert("x")</script>_gemm&"quote"'


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> tuple[Report, Report]:
    folder = tmp_path_factory.mktemp("traces")
    doc = gen.data_loader_bound(steps=3)
    for event in doc["traceEvents"]:
        if event.get("cat") == "kernel" and event["ts"] > gen.T0 + 150_000:
            event["name"] = EVIL  # a hostile kernel name from an untrusted trace
    slow = analyze([gen.write(doc, folder / "slow.json.gz")])
    fast = analyze([gen.write(gen.gemm_heavy(steps=3, memory_peak=8 * gen.GIB), folder / "fast.json.gz")])
    return slow, fast


def _terminal(report: Report | CompareReport) -> str:
    out = io.StringIO()
    render_terminal(report, Console(file=out, width=160, color_system=None))
    return out.getvalue()


def test_terminal_report_shows_tables_and_advice(reports):
    text = _terminal(reports[0])
    for expected in ("GPU utilisation", "60.0%", "idle: data loader", "Top kernels", "nvjet_tst_128x256",
                     "Phases", "Advice", "The GPU waits for the data loader", "<script>"):
        assert expected in text, expected


def test_terminal_multi_rank_and_comparison(tmp_path, reports):
    paths = [gen.write(gen.two_rank_nccl(r, exposed=True), tmp_path / f"r{r}.json.gz") for r in (0, 1)]
    text = _terminal(analyze(paths))
    assert "Ranks" in text and "Communication (NCCL) per rank" in text and "AllReduce" in text
    diff = _terminal(compare(*reports))
    assert "step time" in diff and "-90.0%" in diff and "Advice for a" in diff


def test_json_is_plain_and_complete(reports):
    data = render_json(reports[0])
    text = json.dumps(data, allow_nan=False)
    assert data["kind"] == "tracetrain.analysis" and data["version"] == 1
    rank = data["ranks"][0]
    assert rank["utilisation"]["busy_fraction"] == pytest.approx(0.6)
    assert rank["advice"][0]["rule"] == "data_loader"
    assert {"kernels", "bound", "phases", "communication", "offload", "memory"} <= set(rank)
    assert json.loads(text) == data
    diff = render_json(compare(*reports))
    assert diff["kind"] == "tracetrain.compare" and diff["summary"][0]["metric"] == "step time"
    json.dumps(diff, allow_nan=False)


def test_html_is_self_contained_and_escapes_trace_strings(reports):
    page = render_html(reports[0])
    assert page.startswith("<!doctype html>") and page.endswith("</html>")
    assert "<script" not in page  # neither ours nor the trace's
    assert "evil&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;_gemm&amp;&quot;quote&quot;" in page
    assert not re.search(r"(src|href)\s*=|https?://|@import", page)
    for section in ("GPU timeline", "GPU time by category", "Top kernels", "Phases", "Advice"):
        assert section in page
    assert page.count("<svg") >= 4
    assert len(page) < 200_000


def test_html_has_memory_chart_when_memory_events_exist(reports):
    assert "GPU memory" in render_html(reports[1]) and "GPU memory" not in render_html(reports[0])


def test_html_comparison(reports):
    page = render_html(compare(*reports))
    assert "tracetrain comparison" in page and "<svg" in page and "<script" not in page
    assert "Advice for a" in page


def test_compare_deltas_per_step(reports):
    diff = compare(*reports)
    rows = {r.metric: r for r in diff.summary}
    assert rows["step time"].a == pytest.approx(100_000) and rows["step time"].b == pytest.approx(10_000)
    assert rows["step time"].delta == pytest.approx(-90_000)
    assert rows["GPU busy"].delta == pytest.approx(0.96 - 0.6)
    idle = {r.metric: r for r in diff.idle}
    assert idle["data_loader"].a == pytest.approx(39_990) and idle["data_loader"].b == 0
    categories = {r.metric: r for r in diff.categories}
    assert categories["gemm"].a == pytest.approx(60_000) and categories["gemm"].b == pytest.approx(9_600)
    assert diff.verdict_a == "host-bound" and diff.verdict_b == "compute-bound"
    assert [a.rule for a in diff.advice_a][0] == "data_loader"


def test_cpu_only_report_renders_everywhere(tmp_path):
    b = gen.KinetoTraceBuilder(device=None)
    b.annotation("ProfilerStep#0", 0, 100)
    b.op("aten::mm", 10, 50, [[4, 4], [4, 4]], ["float", "float"])
    report = analyze([gen.write(b.document(), tmp_path / "cpu.json")])
    assert "no GPU events" in _terminal(report)
    assert "no GPU events" in render_html(report)
    json.dumps(render_json(report), allow_nan=False)


def test_html_can_be_written_and_read_back(tmp_path, reports):
    out = Path(tmp_path / "report.html")
    out.write_text(render_html(reports[0]), encoding="utf-8")
    assert "tracetrain trace analysis" in out.read_text(encoding="utf-8")
