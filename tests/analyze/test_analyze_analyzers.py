"""Each analyzer against numbers computed by hand from the generated traces (see traces_gen.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import traces_gen as gen

from tracetrain.profile.analyze import analyze
from tracetrain.profile.analyze.report import RankReport


def _rank(tmp_path: Path, doc: dict[str, Any], **kwargs: Any) -> RankReport:
    return analyze([gen.write(doc, tmp_path / "trace.json.gz")], **kwargs).ranks[0]


def test_data_loader_bound_utilisation_and_idle_causes(tmp_path):
    rank = _rank(tmp_path, gen.data_loader_bound(steps=5))
    util = rank.utilisation
    assert util.window_us == pytest.approx(500_000)
    assert util.busy_us == pytest.approx(300_000) and util.busy_fraction == pytest.approx(0.6)
    assert util.idle_us == pytest.approx({"data_loader": 5 * 39_990, "sync": 0, "communication": 0,
                                          "host": 5 * 10, "outside_steps": 0})
    assert [s.name for s in util.steps] == [f"ProfilerStep#{i}" for i in range(10, 15)]
    step = util.steps[2]
    assert step.duration_us == pytest.approx(100_000) and step.busy_fraction == pytest.approx(0.6)
    assert step.idle_us["data_loader"] == pytest.approx(39_990) and step.num_kernels == 60
    assert util.mean_step_us == pytest.approx(100_000)
    assert sum(b.busy_fraction * b.width_us for b in util.timeline) == pytest.approx(300_000)
    assert rank.bound.verdict == "host-bound" and "data loader" in rank.bound.reason


def test_overlapping_streams_count_once_and_time_between_steps_counts(tmp_path):
    b = gen.KinetoTraceBuilder()
    b.annotation("ProfilerStep#0", 0, 1_000)
    b.gpu(gen.NVJET, 1, 100, 600)  # [100, 700) on stream 7
    b.gpu(gen.NCCL_ALLREDUCE, 2, 400, 500, stream=20)  # [400, 900) on stream 20
    b.annotation("ProfilerStep#1", 1_500, 1_000)  # 500 µs between the steps
    b.gpu(gen.NVJET, 1_501, 1_600, 400)
    util = _rank(tmp_path, b.document()).utilisation
    assert util.window_us == pytest.approx(2_500)
    assert util.busy_us == pytest.approx(800 + 400)
    assert util.exposed_comm_us == pytest.approx(200)  # the all-reduce's [700, 900)
    assert util.idle_us["outside_steps"] == pytest.approx(500)
    assert util.idle_us["host"] == pytest.approx(2_500 - 1_200 - 500)


def test_no_step_ranges_use_the_whole_window(tmp_path):
    b = gen.KinetoTraceBuilder()
    b.gpu(gen.NVJET, 0, 10, 90)
    rank = _rank(tmp_path, b.document())
    assert not rank.utilisation.has_step_ranges and rank.utilisation.idle_us["outside_steps"] == 0
    assert rank.utilisation.steps_us == pytest.approx(100)
    assert any("ProfilerStep" in note for note in rank.notes)


def test_sync_heavy_attributes_the_gap_after_a_sync(tmp_path):
    util = _rank(tmp_path, gen.sync_heavy(steps=4)).utilisation
    assert util.busy_us == pytest.approx(4 * 14_002)
    assert util.idle_us["sync"] == pytest.approx(4 * 4_908)
    assert util.idle_us["host"] == pytest.approx(4 * 1_090)


def test_launch_bound_is_host_idle_with_short_kernels(tmp_path):
    rank = _rank(tmp_path, gen.launch_bound(steps=3, kernels_per_step=200))
    assert rank.utilisation.busy_fraction == pytest.approx(0.3)
    assert rank.utilisation.idle_us["host"] == pytest.approx(0.7 * 3 * 2_000)
    assert rank.bound.mean_kernel_us == pytest.approx(3.0)
    assert rank.bound.verdict == "launch-bound"
    (row,) = rank.bound.rows
    assert (row.category, row.verdict) == ("elementwise", "launch-bound")
    # aten::add of two float[1024] inputs: 3 x 4 KiB moved per 3 µs kernel.
    assert row.gb_per_s == pytest.approx(3 * 4096 / 3e-6 / 1e9)


def test_gemm_heavy_kernels_and_achieved_flops(tmp_path):
    rank = _rank(tmp_path, gen.gemm_heavy(steps=4))
    kernels = rank.kernels
    assert kernels.total_gpu_us == pytest.approx(4 * 24 * 400)
    (top,) = kernels.top
    assert (top.name, top.category, top.count) == (gen.NVJET, "gemm", 96)
    assert top.mean_us == pytest.approx(400) and top.share == pytest.approx(1.0)
    assert [(c.category, c.share) for c in kernels.categories] == [("gemm", 1.0)]
    gemm = rank.bound.gemm
    flops = 2 * 8192 * 4096 * 4096
    assert gemm.num_ops == 96 and gemm.shaped_time_us == pytest.approx(96 * 400)
    assert gemm.tflops == pytest.approx(flops / 400e-6 / 1e12)
    assert gemm.efficiency == pytest.approx(flops / 400e-6 / 989.4e12)
    assert gemm.fp32_time_us == 0 and gemm.small_time_us == 0
    assert rank.bound.device == "H100 SXM" and rank.bound.verdict == "compute-bound"
    assert rank.bound.rows[0].verdict == "compute-bound"


def test_device_name_argument_overrides_the_trace(tmp_path):
    rank = _rank(tmp_path, gen.gemm_heavy(steps=1), device_name="NVIDIA H200")
    assert rank.bound.device == "H200 SXM"
    unknown = _rank(tmp_path, gen.gemm_heavy(steps=1), device_name="Mystery GPU")
    assert unknown.bound.gemm.efficiency is None and unknown.bound.gemm.tflops is not None
    assert any("Mystery GPU" in note for note in unknown.notes)


def test_pageable_copies_bandwidth_and_offload(tmp_path):
    rank = _rank(tmp_path, gen.host_copies(steps=4, pageable=True))
    (copy,) = rank.kernels.memcpy
    assert (copy.direction, copy.count, copy.total_bytes) == ("h2d", 4, 4 * 64 * gen.MIB)
    assert copy.gb_per_s == pytest.approx(64 * gen.MIB / 6_000e-6 / 1e9)
    assert copy.pageable_count == 4 and copy.pageable_us == pytest.approx(24_000)
    assert rank.offload.h2d_bytes == 4 * 64 * gen.MIB and rank.offload.copy_fraction == pytest.approx(0.6)
    pinned = _rank(tmp_path, gen.host_copies(steps=4, pageable=False))
    assert pinned.kernels.memcpy[0].pageable_count == 0


def test_phases_cpu_and_gpu_time(tmp_path):
    phases = {p.phase: p for p in _rank(tmp_path, gen.data_loader_bound(steps=5)).phases}
    assert set(phases) == {"data_wait", "forward", "backward"}
    assert phases["forward"].gpu_us == pytest.approx(5 * 30_000)
    assert phases["backward"].gpu_us == pytest.approx(5 * 30_000)
    assert phases["forward"].cpu_us == pytest.approx(5 * 400) and phases["forward"].num_ranges == 5
    assert phases["data_wait"].cpu_us == pytest.approx(5 * 39_990) and phases["data_wait"].gpu_us == 0
    assert phases["forward"].gpu_share == pytest.approx(0.5)


def test_backward_kernels_launched_from_another_thread_count_for_the_phase(tmp_path):
    b = gen.KinetoTraceBuilder()
    b.annotation("ProfilerStep#0", 0, 1_000)
    b.annotation("tracetrain/backward", 10, 900)
    main_tid = b.tid
    b.tid = main_tid + 1  # autograd's thread
    b.op("aten::mm", 50, 10, [[64, 64], [64, 64]], ["float", "float"])
    b.gpu(gen.NVJET, 52, 100, 300)
    b.tid = main_tid
    (phase,) = _rank(tmp_path, b.document()).phases
    assert (phase.phase, phase.gpu_us) == ("backward", pytest.approx(300))


def test_two_ranks_exposed_and_overlapped_communication(tmp_path):
    exposed = [gen.write(gen.two_rank_nccl(r, exposed=True), tmp_path / f"e{r}.json.gz") for r in (1, 0)]
    report = analyze(exposed)
    assert [c.rank for c in report.communication] == [0, 1]
    for comm in report.communication:
        assert comm.num_kernels == 3 and comm.comm_us == pytest.approx(4_500)
        assert comm.exposed_us == pytest.approx(4_500) and comm.overlap_fraction == 0
        assert comm.exposed_fraction == pytest.approx(0.15)
        assert comm.collectives == {"AllReduce": pytest.approx(4_500)}
    hidden = analyze([gen.write(gen.two_rank_nccl(0, exposed=False), tmp_path / "h0.json.gz")])
    comm = hidden.communication[0]
    assert comm.overlapped_us == pytest.approx(4_500) and comm.exposed_us == pytest.approx(0)
    assert comm.comm_share == pytest.approx(4_500 / 24_000)


def test_memory_timeline_peak_and_headroom(tmp_path):
    rank = _rank(tmp_path, gen.gemm_heavy(steps=2, memory_peak=10 * gen.GIB))
    memory = rank.memory
    assert memory is not None and memory.num_events == 4
    assert memory.peak_allocated_bytes == 10 * gen.GIB and memory.peak_reserved_bytes == 11 * gen.GIB
    assert memory.capacity_bytes == gen.H100["totalGlobalMem"]
    assert memory.headroom_fraction == pytest.approx(1 - 11 * gen.GIB / gen.H100["totalGlobalMem"])
    assert memory.points[0] == (100.0, 5 * gen.GIB)
    assert _rank(tmp_path, gen.gemm_heavy(steps=1)).memory is None


def test_unified_memory_events_are_counted(tmp_path):
    b = gen.KinetoTraceBuilder()
    b.annotation("ProfilerStep#0", 0, 1_000)
    b.gpu(gen.NVJET, 0, 10, 100)
    b.events.append({"ph": "X", "cat": "gpu_memcpy", "name": "Unified Memory Memcpy HtoD", "pid": 0,
                     "tid": 7, "ts": gen.T0 + 200, "dur": 50, "args": {"bytes": 65536}})
    offload = _rank(tmp_path, b.document()).offload
    assert (offload.num_unified_events, offload.unified_us, offload.unified_bytes) == (1, 50, 65536)
