"""Top kernels name the CPU operator that launched them (issue #20 item 6).

The analyzer finds the launcher by time: the kernel's correlation id gives its runtime launch, and the
innermost `cpu_op` open at that moment is the operator. The kernels of a real CUDA trace also carry the
`External id` of that operator, so the expected answer here is recomputed from the raw JSON by that
other route and compared with the report in JSON, terminal and HTML form."""

from __future__ import annotations

import gzip
import json
from collections import defaultdict

import pytest
import traces_gen as gen
from helpers import DATA

from tracetrain.cli import main
from tracetrain.profile.analyze import analyze

TRACES = DATA / "traces"
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def _launchers_by_external_id(name: str) -> dict[str, tuple[str, float]]:
    """Per GPU activity name: the operator (by `External id`) with most of its time, and that share."""
    with gzip.open(TRACES / name, "rt") as text:
        events = json.load(text)["traceEvents"]
    ops = {e["args"]["External id"]: e["name"] for e in events if e.get("cat") == "cpu_op" and "args" in e}
    time: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for e in events:
        op = ops.get((e.get("args") or {}).get("External id"))
        if e.get("cat") in GPU_CATS and op is not None:
            time[e["name"]][op] += e["dur"]
    return {
        kernel: (max(by_op, key=by_op.__getitem__), max(by_op.values()) / sum(by_op.values()))
        for kernel, by_op in time.items()
    }


@pytest.mark.parametrize("name", ["real_h200.json.gz", "real_rank0.json.gz"])
def test_top_kernels_name_the_operator_that_the_external_id_names(name, tmp_path):
    expected = _launchers_by_external_id(name)
    assert main(["analyze", str(TRACES / name), "--json", str(tmp_path / "report.json")]) == 0
    top = json.loads((tmp_path / "report.json").read_text())["ranks"][0]["kernels"]["top"]
    assert len(top) == 15
    for row in top:
        op, share = expected[row["full_name"]]
        assert row["launched_by"] == op, row["full_name"]
        assert row["launched_by_share"] == pytest.approx(share)
    # Real launchers, not a constant: GEMMs from matmul ops, the optimizer kernel from the fused AdamW.
    launchers = {row["launched_by"] for row in top}
    assert {"aten::mm", "aten::addmm", "aten::_fused_adamw_"} <= launchers


def test_launcher_shows_in_terminal_and_html(tmp_path, capsys):
    path = TRACES / "real_h200.json.gz"
    assert main(["analyze", str(path), "--html", str(tmp_path / "report.html")]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if "launched by" in line)
    assert header.index("kernel") < header.index("launched by") < header.index("category")
    assert "aten::_fused_adamw_" in out
    html = (tmp_path / "report.html").read_text()
    assert "<th>launched by</th>" in html.replace(' class="num"', "") and "aten::_fused_adamw_" in html


def test_kernel_launched_by_two_operators_names_the_larger_with_its_share(tmp_path):
    b = gen.KinetoTraceBuilder()
    b.annotation("ProfilerStep#0", 0, 1_000)
    # The same kernel, launched for 30 µs of GPU time from aten::add and for 10 µs from aten::mul.
    for op, start, dur in (("aten::add", 0, 30), ("aten::mul", 100, 10)):
        b.op(op, start, 20)
        b.gpu("add_kernel", start + 5, start + 50, dur)
    # A kernel whose launch is not in the trace (launched before the profiler recorded the host).
    b.events.append({"ph": "X", "cat": "kernel", "name": "early_kernel", "pid": 0, "tid": 7, "ts": gen.T0 + 500,
                     "dur": 5, "args": {"device": 0, "stream": 7, "correlation": 99_999}})
    top = analyze(gen.write(b.document(), tmp_path / "t.json")).ranks[0].kernels.top
    rows = {row.full_name: row for row in top}
    assert rows["add_kernel"].launched_by == "aten::add"
    assert rows["add_kernel"].launched_by_share == pytest.approx(0.75)
    assert rows["early_kernel"].launched_by is None and rows["early_kernel"].launched_by_share == 0.0
