"""Trace parsing: the streaming reader, Kineto event kinds, launch linking, bad input, bounded memory,
and a real (CPU-only) torch.profiler trace."""

from __future__ import annotations

import gzip
import io
import json
import re
import tracemalloc

import numpy as np
import pytest
import torch
import traces_gen as gen
from helpers import DATA

from tracetrain.errors import TracetrainError
from tracetrain.profile.analyze import analyze, jsonstream, parse_trace
from tracetrain.profile.analyze.columns import ANNOTATION, KERNEL, MEMCPY, OP, RUNTIME


def _read(text: str) -> tuple[list, dict]:
    events: list = []
    others = jsonstream.read_trace_document(io.StringIO(text), events.append)
    return events, others


@pytest.mark.parametrize("chunk", [1, 3, 7, 64, 1 << 20])
def test_stream_reader_is_chunk_boundary_safe(monkeypatch, chunk):
    monkeypatch.setattr(jsonstream, "_CHUNK_CHARS", chunk)
    doc = {"schemaVersion": 1, "deviceProperties": [{"name": "NVIDIA H100 80GB HBM3"}],
           "traceEvents": [{"ph": "X", "ts": 1234567890.125, "dur": 12, "name": "a\"]}"},
                           {"ph": "i", "args": {"nested": [1, [2, {"x": None}]]}}, 7, "s"],
           "traceName": "t", "baseTimeNanoseconds": 1790857026000000000}
    events, others = _read(json.dumps(doc, indent=1))
    assert events == doc["traceEvents"]
    assert others["baseTimeNanoseconds"] == 1790857026000000000  # a number split across chunks
    assert others["deviceProperties"] == doc["deviceProperties"] and others["traceEvents"] is True


def test_stream_reader_accepts_bare_array_and_trailing_comma():
    events, others = _read('[{"a": 1}, {"b": 2},\n]')
    assert events == [{"a": 1}, {"b": 2}] and others == {"traceEvents": True}


def test_stream_reader_rejects_malformed_text():
    with pytest.raises(ValueError):
        _read('{"traceEvents": [{"a": 1} {"b": 2}]}')
    with pytest.raises(ValueError):
        _read('{"traceEvents": [{"a": 1},')


def test_parse_keeps_kinds_links_and_metadata(tmp_path):
    path = gen.write(gen.sync_heavy(steps=2), tmp_path / "t.json")
    trace = parse_trace(path)
    kinds = {trace.names[n]: k for n, k in zip(trace.host.name.tolist(), trace.host.kind.tolist())}
    assert kinds["ProfilerStep#0"] == ANNOTATION and kinds["aten::mm"] == OP
    assert kinds["cudaLaunchKernel"] == RUNTIME and kinds["cudaStreamSynchronize"] == RUNTIME
    assert sorted(set(trace.gpu.kind.tolist())) == [KERNEL, MEMCPY]
    assert trace.device_name == "NVIDIA H100 80GB HBM3" and trace.device_memory_bytes == 85_045_821_440
    assert trace.window == (gen.T0, gen.T0 + 40_000)
    # Every GPU event was linked to its launch; kernels to their aten::mm op (shape recorded).
    assert np.isfinite(trace.gpu.launch_ts).all()
    kernels = trace.gpu.kind == KERNEL
    assert {trace.names[trace.host.name[op]] for op in trace.gpu.gemm_op[kernels]} == {"aten::mm"}
    copy = np.flatnonzero(trace.gpu.kind == MEMCPY)[0]
    assert trace.names[trace.host.name[trace.gpu.op[copy]]] == "aten::_local_scalar_dense"
    assert trace.gpu.gemm_op[copy] == -1 and trace.gpu.bytes[copy] == 4


def test_flow_events_link_kernels_without_runtime_correlation(tmp_path):
    doc = gen.gemm_heavy(steps=1)
    for event in doc["traceEvents"]:
        if event.get("cat") == "cuda_runtime":
            event["args"].pop("correlation")
    trace = parse_trace(gen.write(doc, tmp_path / "t.json"))
    assert np.isfinite(trace.gpu.launch_ts).all() and (trace.gpu.gemm_op >= 0).all()


def test_old_category_spellings_and_unknown_fields(tmp_path):
    doc = gen.gemm_heavy(steps=1)
    renames = {"kernel": "Kernel", "cpu_op": "Operator", "cuda_runtime": "Runtime"}
    for event in doc["traceEvents"]:
        event["cat"] = renames.get(event.get("cat"), event.get("cat"))
        event["extra"] = {"unknown": [1, 2]}
    doc["someNewTopLevelKey"] = {"x": 1}
    trace = parse_trace(gen.write(doc, tmp_path / "t.json"))
    assert len(trace.gpu) == 24 and (trace.gpu.gemm_op >= 0).all()


def test_distributed_info_gives_rank(tmp_path):
    trace = parse_trace(gen.write(gen.two_rank_nccl(1, exposed=True), tmp_path / "r1.json.gz"), rank=5)
    assert (trace.rank, trace.world_size) == (1, 2)


@pytest.mark.parametrize("content, message", [
    (None, "not found"),
    (b"this is not json", "not a readable JSON trace"),
    (b'{"traceEvents": [', "not a readable JSON trace"),
    (b'{"schemaVersion": 1}', "no 'traceEvents'"),
    (b'{"traceEvents": [{"ph": "M", "name": "process_name"}]}', "no profiler events"),
    (gzip.compress(b'{"traceEvents": []}', mtime=0)[:-6], "not a readable JSON trace"),
    (gzip.compress(b'{"traceEvents": [' + b'{"ph": "X", "name": "k"},' * 999 + b'{}]}', mtime=0)[:40] + bytes(200),
     "not a readable JSON trace"),
])
def test_bad_input_raises_one_line_error_naming_the_file(tmp_path, content, message):
    path = tmp_path / "bad.json"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(TracetrainError, match=message) as error:
        analyze([path])
    assert str(path) in str(error.value) and "\n" not in str(error.value)


def test_directory_of_traces_is_expanded(tmp_path):
    for rank in (0, 1):
        gen.write(gen.two_rank_nccl(rank, exposed=True), tmp_path / f"rank{rank}.json.gz")
    (tmp_path / "notes.txt").write_text("not a trace")
    report = analyze(tmp_path)
    assert [r.rank for r in report.ranks] == [0, 1]
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(TracetrainError, match=re.escape("no .json")):
        analyze(empty)


def test_streaming_parse_of_large_gz_trace_uses_bounded_memory(tmp_path):
    doc = gen.launch_bound(steps=4, kernels_per_step=10_000)  # 40k kernels: ~200k events
    path = gen.write(doc, tmp_path / "big.json.gz")
    num_events = len(doc["traceEvents"])
    del doc
    with gzip.open(path, "rb") as text:
        text_bytes = sum(len(chunk) for chunk in iter(lambda: text.read(1 << 20), b""))
    assert num_events > 200_000
    tracemalloc.start()
    trace = parse_trace(path)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert len(trace.gpu) == 40_000 and len(trace.host) == 80_004
    # Compact columns, not dicts: the peak stays far below the decompressed JSON.
    assert peak < text_bytes / 3, (peak, text_bytes)


def test_real_cpu_only_profiler_trace_gives_report_with_note(tmp_path):
    path = tmp_path / "cpu_trace.json"

    def export(prof: torch.profiler.profile) -> None:
        prof.export_chrome_trace(str(path))

    x = torch.randn(64, 64)
    schedule = torch.profiler.schedule(wait=0, warmup=1, active=2, repeat=1)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True,
                                profile_memory=True, schedule=schedule, on_trace_ready=export) as prof:
        for _ in range(4):
            with torch.profiler.record_function("tracetrain/forward"):
                torch.addmm(x, x, x) @ x
            prof.step()
    report = analyze([path])
    rank = report.ranks[0]
    assert not rank.has_gpu and rank.advice == [] and rank.bound.verdict == "no GPU activity"
    assert any("no GPU events" in note for note in report.notes)
    assert [p.phase for p in rank.phases] == ["forward"] and rank.phases[0].cpu_us > 0
    assert len(rank.utilisation.steps) >= 1
    assert rank.utilisation.steps[0].name.startswith("ProfilerStep#")


def test_committed_fixtures_parse():
    folder = DATA / "traces"
    report = analyze(sorted(folder.glob("nccl_exposed_rank*.json.gz")))
    assert [r.rank for r in report.ranks] == [0, 1]
    assert report.communication[0].exposed_us == pytest.approx(4_500)
    single = analyze(folder / "data_loader_bound.json.gz").ranks[0]
    assert single.utilisation.busy_fraction == pytest.approx(0.6)
