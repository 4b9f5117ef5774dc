"""Golden traces: real CUDA profiler output from an H200 (torch 2.11, CUDA 13), made by
tests/data/traces/make_real_trace.py: one GPU, and two DDP ranks over NCCL. Numbers are checked
against a naive recomputation from the raw JSON, and the findings against how the traces were made
(a slow, unpinned data loader, bf16 GEMMs, cuDNN attention, `.item()` each step)."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest
from helpers import DATA

from tracetrain.profile.analyze import analyze, parse_trace

TRACES = DATA / "traces"
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def _raw(name: str) -> list[dict]:
    with gzip.open(TRACES / name, "rt") as text:
        return json.load(text)["traceEvents"]


def _naive_union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def test_real_single_gpu_trace_matches_naive_numbers():
    events = _raw("real_h200.json.gz")
    gpu = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in GPU_CATS]
    timed = [e for e in events if e.get("ph") == "X" and e.get("cat") not in ("Trace", "python_function",
                                                                              "gpu_user_annotation")]
    window = max(e["ts"] + e["dur"] for e in timed) - min(e["ts"] for e in timed)
    rank = analyze(TRACES / "real_h200.json.gz").ranks[0]
    util = rank.utilisation
    assert util.window_us == pytest.approx(window)
    assert util.busy_us == pytest.approx(_length(_naive_union(gpu)))
    assert sum(util.idle_us.values()) + util.busy_us == pytest.approx(window)
    assert rank.kernels.total_gpu_us == pytest.approx(sum(b - a for a, b in gpu))
    assert [s.name for s in util.steps] == ["ProfilerStep#2", "ProfilerStep#3"]
    assert sum(s.num_kernels for s in util.steps) == sum(e.get("cat") == "kernel" for e in events)


def test_real_single_gpu_trace_findings():
    trace = parse_trace(TRACES / "real_h200.json.gz")
    assert np.isfinite(trace.gpu.launch_ts).all() and (trace.gpu.op >= 0).all()  # every activity linked
    rank = analyze(TRACES / "real_h200.json.gz").ranks[0]
    assert rank.device_name == "H200 SXM" and rank.memory is not None
    assert rank.memory.capacity_bytes == 150_109_880_320
    categories = {row.category for row in rank.kernels.categories}
    assert {"gemm", "attention", "normalisation", "elementwise", "reduction", "optimizer"} <= categories
    assert "other" not in categories
    gemm = rank.bound.gemm
    assert gemm.num_ops > 0 and gemm.shaped_time_us == pytest.approx(gemm.time_us)
    assert 0.3 < gemm.efficiency < 1.0  # bf16 GEMMs of 4096 x 1024 x 3072 and the like
    assert rank.bound.verdict == "host-bound" and "data loader" in rank.bound.reason
    phases = {p.phase: p for p in rank.phases}
    assert {"data_wait", "forward", "backward", "optimizer"} <= set(phases)
    assert phases["backward"].gpu_us > phases["forward"].gpu_us > 0
    # data_wait's GPU work is the batch's host-to-device copy and its cast to bf16.
    assert rank.offload.h2d_us < phases["data_wait"].gpu_us < 1.1 * rank.offload.h2d_us
    advice = [a.rule for a in rank.advice]
    assert advice[0] == "data_loader" and "pageable_copies" in advice
    assert rank.utilisation.idle_us["sync"] > 0  # loss.item() each step


def test_real_two_rank_trace_communication():
    paths = [TRACES / "real_rank1.json.gz", TRACES / "real_rank0.json.gz"]
    report = analyze(paths)
    assert [(r.rank, r.world_size) for r in report.ranks] == [(0, 2), (1, 2)]
    for comm, name in zip(report.communication, ("real_rank0.json.gz", "real_rank1.json.gz")):
        events = _raw(name)
        nccl = [(e["ts"], e["ts"] + e["dur"]) for e in events
                if e.get("cat") == "kernel" and "nccl" in e["name"]]
        other = _naive_union([(e["ts"], e["ts"] + e["dur"]) for e in events
                              if e.get("cat") in GPU_CATS and "nccl" not in e["name"]])
        overlap = sum(max(0.0, min(b, d) - max(a, c)) for a, b in _naive_union(nccl) for c, d in other)
        assert comm.num_kernels == len(nccl) > 0 and set(comm.collectives) == {"AllReduce"}
        assert comm.comm_us == pytest.approx(_length(_naive_union(nccl)))
        assert comm.overlapped_us == pytest.approx(overlap)
        assert 0 < comm.overlap_fraction < 1
