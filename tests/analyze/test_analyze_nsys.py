"""The Nsight Systems SQLite reader, on synthetic exports (tests/nsys_gen.py; no real export was
available): numbers computed by hand from each construction, and the same report as the Kineto reader
gives for the same scenario (tests/traces_gen.py)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import nsys_gen
import numpy as np
import pytest
import traces_gen as gen
from helpers import DATA

from tracetrain.cli import main
from tracetrain.errors import TracetrainError
from tracetrain.profile.analyze import analyze, parse_trace, render_json
from tracetrain.profile.analyze import nsys as nsys_reader
from tracetrain.profile.analyze.columns import ANNOTATION
from tracetrain.profile.analyze.reader import read_traces
from tracetrain.profile.analyze.report import RankReport

REAL = DATA / "traces"
# What an export cannot carry: operator shapes (FLOP/s), allocator events, the rank's distributedInfo;
# and what is read from recorded operators (the profiler's cost per operator, the host's activity
# during GPU idle) or from NCCL kernels' args (collectives matched across ranks).
_KINETO_ONLY = ("source", "bound", "memory", "notes", "world_size", "advice", "overhead", "host_gaps", "collectives")


def _rank(tmp_path: Path, builder: nsys_gen.NsysExportBuilder, **kwargs: Any) -> RankReport:
    (rank,) = analyze([builder.write(tmp_path / "run.sqlite")], **kwargs).ranks
    return rank


def _same_report(tmp_path: Path, doc: dict[str, Any]) -> tuple[dict, dict]:
    kineto = render_json(analyze([gen.write(doc, tmp_path / "kineto.json.gz")]))["ranks"][0]
    export = render_json(analyze([nsys_gen.from_kineto(doc).write(tmp_path / "nsys.sqlite")]))["ranks"][0]
    for row in kineto["kernels"]["top"] + export["kernels"]["top"]:  # the launching cpu_op: Kineto only
        del row["launched_by"], row["launched_by_share"]
    return ({k: v for k, v in kineto.items() if k not in _KINETO_ONLY},
            {k: v for k, v in export.items() if k not in _KINETO_ONLY})


@pytest.mark.parametrize("make", [
    lambda: gen.data_loader_bound(steps=3), lambda: gen.gemm_heavy(steps=2),
    lambda: gen.host_copies(steps=2, pageable=True), lambda: gen.host_copies(steps=2, pageable=False),
    lambda: gen.launch_bound(steps=2, kernels_per_step=100), lambda: gen.sync_heavy(steps=2),
    lambda: gen.two_rank_nccl(0, exposed=True)],
    ids=["data_loader", "gemm", "pageable", "pinned", "launch", "sync", "nccl"])
def test_same_report_as_the_kineto_trace_of_the_scenario(tmp_path, make):
    kineto, export = _same_report(tmp_path, make())
    _approx_equal(export, kineto)


def test_same_report_as_a_real_kineto_trace(tmp_path):
    """A real H200 trace (tests/data/traces/real_h200.json.gz) re-expressed as an export: utilisation,
    idle causes, kernels, copies and phases come out the same through either reader. Its `cpu_op`s are
    dropped first, as an export has none: `.item()` ops that the Kineto reader counts as host syncs
    otherwise move about 6 µs of idle time from `sync` to `host`."""
    with gzip.open(REAL / "real_h200.json.gz", "rt") as text:
        doc = json.load(text)
    doc["traceEvents"] = [e for e in doc["traceEvents"] if e.get("cat") != "cpu_op"]
    kineto, export = _same_report(tmp_path, _rebase(doc))
    _approx_equal(export, kineto)
    assert kineto["utilisation"]["busy_us"] > 0 and kineto["utilisation"]["idle_us"]["sync"] > 0
    assert len(kineto["phases"]) >= 3 and kineto["kernels"]["memcpy"]


def _rebase(doc: dict) -> dict:
    """Shift a real trace's clock onto the generator's origin (the converter counts from gen.T0)."""
    first = min(e["ts"] for e in doc["traceEvents"] if e.get("ph") == "X")
    for event in doc["traceEvents"]:
        if "ts" in event:
            event["ts"] = event["ts"] - first + gen.T0
    return doc


def _approx_equal(a: Any, b: Any) -> None:
    """Equal; numbers to 1e-9 relative or 0.01 µs (Kineto's µs clock origin rounds at ~1e-3 µs)."""
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            _approx_equal(a[key], b[key])
    elif isinstance(a, list):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _approx_equal(x, y)
    elif isinstance(a, float) or isinstance(b, float):
        assert a == pytest.approx(b, rel=1e-9, abs=1e-2)
    else:
        assert a == b


def _data_loader_bound(steps: int) -> nsys_gen.NsysExportBuilder:
    """tracetrain's own NVTX ranges: steps `step N` of 100 ms; `tracetrain/data_wait` [0, 39 990) with the
    GPU idle; `tracetrain/forward` [39 992, 40 392) launches 30 GEMMs of 1 ms back to back from 40 000,
    `tracetrain/backward` [40 500, 40 900) 30 more from 70 000. Per step: busy 60 000 µs, data-loader
    idle 39 990, host idle 10."""
    b = nsys_gen.NsysExportBuilder()
    for i in range(steps):
        s = i * 100_000.0
        b.nvtx(f"step {i + 6}", s, 100_000)
        b.nvtx("tracetrain/data_wait", s, 39_990)
        b.nvtx("tracetrain/forward", s + 39_992, 400)
        for j in range(30):
            b.gpu(gen.NVJET, s + 39_995 + 10 * j, s + 40_000 + 1000 * j, 1000)
        b.nvtx("tracetrain/backward", s + 40_500, 400)
        for j in range(30):
            b.gpu(gen.NVJET, s + 40_505 + 10 * j, s + 70_000 + 1000 * j, 1000)
    return b


def test_data_loader_bound_with_tracetrain_nvtx_ranges(tmp_path):
    rank = _rank(tmp_path, _data_loader_bound(steps=4))
    util = rank.utilisation
    assert util.window_us == pytest.approx(400_000) and util.busy_fraction == pytest.approx(0.6)
    assert util.idle_us == pytest.approx({"data_loader": 4 * 39_990, "sync": 0, "communication": 0,
                                          "host": 4 * 10, "outside_steps": 0})
    assert [s.name for s in util.steps] == [f"ProfilerStep#{i}" for i in range(6, 10)]
    assert util.steps[1].num_kernels == 60 and util.steps[1].busy_us == pytest.approx(60_000)
    phases = {p.phase: p for p in rank.phases}
    assert set(phases) == {"data_wait", "forward", "backward"}
    assert phases["data_wait"].cpu_us == pytest.approx(4 * 39_990) and phases["data_wait"].gpu_us == 0
    assert phases["forward"].gpu_us == pytest.approx(4 * 30_000) and phases["forward"].num_ranges == 4
    assert phases["backward"].gpu_share == pytest.approx(0.5)
    assert rank.bound.verdict == "host-bound" and "data loader" in rank.bound.reason
    assert "data_loader" in {a.rule for a in rank.advice}


def test_gemm_kernels_categories_and_device_from_target_info(tmp_path):
    """Steps of 10 ms with 24 bf16 GEMMs of 400 µs back to back over [400, 10 000): busy 96%."""
    b = nsys_gen.NsysExportBuilder()
    for i in range(3):
        b.nvtx(f"step {i + 1}", i * 10_000, 10_000)
        for j in range(24):
            b.gpu(gen.NVJET, i * 10_000 + 50 + 10 * j, i * 10_000 + 400 + 400 * j, 400)
    rank = _rank(tmp_path, b)
    assert rank.device_name == "H100 SXM" and rank.utilisation.busy_fraction == pytest.approx(0.96)
    (top,) = rank.kernels.top
    assert (top.full_name, top.category, top.count, top.mean_us) == (gen.NVJET, "gemm", 72, 400)
    assert [(c.category, c.share) for c in rank.kernels.categories] == [("gemm", 1.0)]
    # No operator shapes in an export: the GEMMs' FLOP/s are unknown, their time is not.
    assert rank.bound.gemm.tflops is None and rank.bound.gemm.time_us == pytest.approx(72 * 400)
    assert parse_trace(tmp_path / "run.sqlite").device_memory_bytes == nsys_gen.H100_GPU["totalMemory"]


@pytest.mark.parametrize("enums", [True, False], ids=["enum-tables", "documented-values"])
def test_pageable_and_pinned_copies_bandwidth(tmp_path, enums):
    """Per 10 ms step a 64 MiB H2D copy [10, 6 010) (11.18 GB/s), pageable in even steps and pinned in
    odd ones, 3 GEMMs [6 020, 9 020) and a 4-byte D2H copy [9 502, 9 504); labels come from the
    export's enum tables or, without them, from the documented values."""
    b = nsys_gen.NsysExportBuilder(enums=enums)
    for i in range(4):
        s = i * 10_000.0
        b.nvtx(f"step {i}", s, 10_000)
        b.runtime("cudaMemcpyAsync", s + 2, 6_009, corr=10 + i)
        b.memcpy(s + 10, 6_000, 64 * gen.MIB, 10 + i, src="Pageable" if i % 2 == 0 else "Pinned")
        for j in range(3):
            b.gpu(gen.NVJET, s + 6_013 + j, s + 6_020 + 1000 * j, 1000)
        b.runtime("cudaMemcpyAsync", s + 9_500, 5, corr=20 + i)
        b.memcpy(s + 9_502, 2, 4, 20 + i, copy="DtoH", src="Device", dst="Pinned")
    rank = _rank(tmp_path, b)
    h2d, d2h = sorted(rank.kernels.memcpy, key=lambda row: row.direction != "h2d")
    assert (h2d.direction, h2d.count, h2d.total_bytes) == ("h2d", 4, 4 * 64 * gen.MIB)
    assert h2d.gb_per_s == pytest.approx(64 * gen.MIB / 6_000e-6 / 1e9)
    assert (h2d.pageable_count, h2d.pageable_bytes) == (2, 2 * 64 * gen.MIB)
    assert (d2h.direction, d2h.count, d2h.total_bytes, d2h.pageable_count) == ("d2h", 4, 16, 0)
    assert {row.full_name for row in rank.kernels.top if row.category.startswith("memcpy")} == {
        "Memcpy HtoD (Pageable -> Device)", "Memcpy HtoD (Pinned -> Device)", "Memcpy DtoH (Device -> Pinned)"}
    assert rank.offload.h2d_bytes == 4 * 64 * gen.MIB and rank.offload.copy_fraction == pytest.approx(0.6002)
    assert "pageable_copies" in {a.rule for a in rank.advice}


def test_launch_bound_and_runtime_names_without_version_suffix(tmp_path):
    """Every 10 µs a `cudaLaunchKernel_v7000` launches a 3 µs elementwise kernel: busy 30%, host 70%."""
    b = nsys_gen.NsysExportBuilder()
    for i in range(2):
        b.nvtx(f"step {i}", i * 1_000, 1_000)
        for j in range(100):
            t = i * 1_000 + 10 * j
            b.gpu(gen.ADD, t + 1, t + 5, 3)
    trace = parse_trace(b.write(tmp_path / "run.sqlite"))
    assert {trace.names[n] for n in trace.host.name[trace.host.kind != ANNOTATION]} == {"cudaLaunchKernel"}
    assert np.allclose(trace.gpu.launch_ts - trace.gpu.ts, -4.0)  # every kernel linked to its launch
    rank = _rank(tmp_path, b)
    assert rank.utilisation.busy_fraction == pytest.approx(0.3)
    assert rank.utilisation.idle_us["host"] == pytest.approx(0.7 * 2_000)
    assert rank.bound.verdict == "launch-bound" and rank.bound.mean_kernel_us == pytest.approx(3.0)


def test_stream_synchronize_explains_the_gap_after_it(tmp_path):
    """10 GEMMs [100, 10 100); cudaStreamSynchronize [110, 10 105); 4 GEMMs [15 010, 19 010) in a 20 ms
    step: the gap [10 100, 15 010) touches the sync, so it is sync idle; the rest is host."""
    b = nsys_gen.NsysExportBuilder()
    b.nvtx("step 1", 0, 20_000)
    for j in range(10):
        b.gpu(gen.NVJET, 10 * j, 100 + 1000 * j, 1000)
    b.runtime("cudaStreamSynchronize", 110, 9_995)
    for j in range(4):
        b.gpu(gen.NVJET, 15_000 + j, 15_010 + 1000 * j, 1000)
    util = _rank(tmp_path, b).utilisation
    assert util.busy_us == pytest.approx(14_000)
    assert util.idle_us["sync"] == pytest.approx(4_910) and util.idle_us["host"] == pytest.approx(1_090)


def test_nvtx_registered_strings_start_end_ranges_marks_and_open_ranges(tmp_path):
    b = nsys_gen.NsysExportBuilder()
    b.nvtx("step 3", 0, 1_000, event_type=nsys_gen.START_END)
    b.nvtx("tracetrain/forward", 10, 300, registered=True)
    b.nvtx("tracetrain/optimizer", 500, None)  # never closed: runs to the end of the capture
    b.nvtx("tracetrain/checkpoint", 900, 0, event_type=nsys_gen.MARK)  # a mark is not a range
    b.gpu(gen.NVJET, 20, 100, 200)
    b.gpu(gen.NVJET, 600, 700, 500)  # ends at 1 200: the last timestamp of the capture
    rank = _rank(tmp_path, b)
    assert [s.name for s in rank.utilisation.steps] == ["ProfilerStep#3"]
    phases = {p.phase: (p.num_ranges, p.cpu_us, p.gpu_us) for p in rank.phases}
    assert phases == {"forward": (1, 300, 200), "optimizer": (1, 700, 500)}


def test_each_process_of_an_export_is_a_rank(tmp_path):
    """Two processes (as under `nsys profile torchrun`) reusing the same correlation ids: pid 7000 on
    GPU 1 launches a 300 µs kernel inside its forward range, pid 9000 on GPU 0 a 500 µs one."""
    b = nsys_gen.NsysExportBuilder(gpu=None)
    b.gpus = [nsys_gen.H100_GPU, nsys_gen.H100_GPU]
    for pid, device, dur in ((7000, 1, 300), (9000, 0, 500)):
        b.pid, b.tid, b.device, b.next_corr = pid, pid, device, 100
        b.nvtx("step 1", 0, 1_000)
        b.nvtx("tracetrain/forward", 10, 100)
        b.gpu(gen.NVJET, 20, 200, dur)
    path = b.write(tmp_path / "two.sqlite")
    report = analyze([path])
    assert [(r.rank, r.world_size, r.kernels.total_gpu_us) for r in report.ranks] == [(0, 2, 500), (1, 2, 300)]
    assert [r.source for r in report.ranks] == [f"{path} (pid 9000)", f"{path} (pid 7000)"]
    assert [r.phases[0].gpu_us for r in report.ranks] == [500, 300]  # each launch linked in its process
    assert [r.device_name for r in report.ranks] == ["H100 SXM", "H100 SXM"]
    with pytest.raises(TracetrainError, match="2 GPU processes"):
        parse_trace(path)
    traces = list(read_traces(path, rank=4))
    assert [(t.rank, t.threads) for t in traces] == [(4, ["9000/9000"]), (5, ["7000/7000"])]
    assert [len(t.host) for t in traces] == [3, 3]  # its own step, forward and launch; none of the other's


def test_device_through_the_process_cuda_ordinal(tmp_path):
    """TARGET_INFO_CUDA_DEVICE maps the process's CUDA device 0 (CUDA_VISIBLE_DEVICES=1) to GPU 1."""
    b = nsys_gen.NsysExportBuilder(gpu=None)
    b.gpus = [nsys_gen.H100_GPU, {"name": "NVIDIA H200", "totalMemory": 150_000_000_000, "smCount": 132}]
    b.rows["TARGET_INFO_CUDA_DEVICE"].append((1, 0, b.pid, "GPU-1"))
    b.gpu(gen.NVJET, 0, 10, 100)
    path = b.write(tmp_path / "run.sqlite")
    trace = parse_trace(path)
    assert (trace.device_name, trace.device_memory_bytes) == ("NVIDIA H200", 150_000_000_000)
    assert parse_trace(path, device_name="H100 SXM").device_name == "H100 SXM"  # the argument wins


def test_kernel_table_alone_reads_with_notes(tmp_path):
    """No runtime, NVTX, copy or GPU-info tables (nsys creates tables lazily): kernels still count."""
    b = nsys_gen.NsysExportBuilder(gpu=None, enums=False)
    b.kernel(gen.NVJET, 0, 100, corr=None)
    b.kernel(gen.NVJET, 200, 100, corr=None)
    rank = _rank(tmp_path, b)
    assert rank.utilisation.busy_fraction == pytest.approx(2 / 3) and rank.device_name is None
    assert any("no NVTX ranges" in note for note in rank.notes)
    assert rank.phases == [] and not rank.utilisation.has_step_ranges


def test_unified_memory_copies_are_not_device_copies(tmp_path):
    b = nsys_gen.NsysExportBuilder()
    b.gpu(gen.NVJET, 0, 10, 100)
    b.memcpy(200, 50, 65_536, None, copy="UVM_HtoD", src="Managed", dst="Managed")
    rank = _rank(tmp_path, b)
    assert rank.kernels.memcpy == []
    assert (rank.offload.num_unified_events, rank.offload.unified_us, rank.offload.unified_bytes) == (1, 50, 65_536)


def test_reading_in_small_chunks_gives_the_same_trace(tmp_path, monkeypatch):
    path = _data_loader_bound(steps=2).write(tmp_path / "run.sqlite")
    whole = parse_trace(path)
    monkeypatch.setattr(nsys_reader, "_CHUNK_ROWS", 7)
    chunked = parse_trace(path)
    assert whole.names == chunked.names and whole.window == chunked.window
    for key in whole.gpu.data:
        np.testing.assert_array_equal(whole.gpu.data[key], chunked.gpu.data[key])
    for key in whole.host.data:
        np.testing.assert_array_equal(whole.host.data[key], chunked.host.data[key])


def test_detected_by_header_not_name_and_found_in_directories(tmp_path):
    b = _data_loader_bound(steps=1)
    odd_name = b.write(tmp_path / "capture.bin")
    assert analyze([odd_name]).ranks[0].utilisation.busy_fraction == pytest.approx(0.6)
    folder = tmp_path / "profile"
    folder.mkdir()
    b.write(folder / "rank0.sqlite")
    gen.write(gen.data_loader_bound(steps=1), folder / "rank1.json.gz")
    assert len(analyze([folder]).ranks) == 2


@pytest.mark.parametrize("content, message", [
    (b"not a database at all", "not an SQLite database"),
    (b"SQLite format 3\x00" + b"\x00" * 200, "not a readable Nsight Systems export"),
])
def test_bad_files_name_the_file(tmp_path, content, message):
    path = tmp_path / "broken.sqlite"
    path.write_bytes(content)
    with pytest.raises(TracetrainError, match=message) as error:
        analyze([path])
    assert str(path) in str(error.value)


def test_sqlite_without_a_kernel_table_names_the_file(tmp_path):
    b = nsys_gen.NsysExportBuilder()
    b.nvtx("step 1", 0, 100)
    path = b.write(tmp_path / "cpu_only.sqlite")
    with pytest.raises(TracetrainError, match="no CUPTI_ACTIVITY_KIND_KERNEL table") as error:
        analyze([path])
    assert str(path) in str(error.value)


def test_cli_analyzes_an_export(tmp_path, capsys):
    path = _data_loader_bound(steps=2).write(tmp_path / "run.sqlite")
    assert main(["analyze", str(path), "--json", str(tmp_path / "report.json")]) == 0
    (rank,) = json.loads((tmp_path / "report.json").read_text())["ranks"]
    assert rank["utilisation"]["busy_fraction"] == pytest.approx(0.6) and rank["source"] == str(path)
    assert "ProfilerStep#6" in capsys.readouterr().out
