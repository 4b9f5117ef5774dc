"""Trace analysis: where does training time go?

A facade over stateless analyzers. `analyze` parses one PyTorch-profiler (Kineto) trace per rank, or
an Nsight Systems SQLite export (nsys.py; one rank per process in it), and runs each analyzer, every
one answering one question with a table. `parse_trace` / `read_traces` (reader.py) pick the reader,
trace.py (Kineto JSON) or nsys.py (Nsight Systems SQLite), by the file's header.

| module          | question                                                                 |
|-----------------|--------------------------------------------------------------------------|
| utilisation.py  | how busy is the GPU, per step; when idle, was it data, syncs, comm, host? |
| kernels.py      | which kernels and categories take the GPU time; how fast are the copies? |
| bound.py        | compute-, memory-, launch- or host-bound; achieved FLOP/s and GB/s       |
| phases.py       | host and GPU time of forward / backward / optimizer / data / checkpoint  |
| comm_memory.py  | NCCL time and its overlap with compute; offload copies; memory over time |
| operators.py    | without GPU activity: which host operators and ranges take the time      |
| advice.py       | what to change, with evidence and an estimated gain                      |
| compare.py      | what changed between two runs                                            |

Rendering is separate: `render_terminal` (rich), `render_json` (plain data), `render_html` (one
self-contained page with inline SVG charts).

    report = analyze(["rank0.json.gz", "rank1.json.gz"], device_name=None)
    render_terminal(report)
    diff = compare(analyze("before.json.gz"), analyze("after.json.gz"))
"""

from tracetrain.profile.analyze.advice import Advice
from tracetrain.profile.analyze.compare import CompareReport, compare
from tracetrain.profile.analyze.reader import parse_trace, read_traces
from tracetrain.profile.analyze.render import render_json, render_terminal
from tracetrain.profile.analyze.report import RankReport, Report, analyze
from tracetrain.profile.analyze.report_html import render_html
from tracetrain.profile.analyze.trace import Trace

__all__ = [
    "Advice",
    "CompareReport",
    "RankReport",
    "Report",
    "Trace",
    "analyze",
    "compare",
    "parse_trace",
    "read_traces",
    "render_html",
    "render_json",
    "render_terminal",
]
