"""Traces written by other programs: the 2021 Kineto schema (ranges as `Operator` events), cuDNN, MIOpen
and rocBLAS kernel names, invalid durations, and terminal escape codes in names.

The traces are synthetic, built here in the shape of PyTorch 1.8-1.9 era Kineto output: categories
`Operator`, `Runtime`, `Kernel`; `ProfilerStep#N` and `enumerate(DataLoader)#...` as `Operator`
events; lower-case `external id`; kernels on `pid` = device with a `stream N` thread name and no
`ac2g` flows (the launch is found by its correlation id).
"""

from __future__ import annotations

import io
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers import REPO
from rich.console import Console

from tracetrain.profile.analyze import analyze, parse_trace, render_terminal
from tracetrain.profile.analyze.categories import MEMORY_CATEGORIES, kernel_category
from tracetrain.profile.analyze.columns import ANNOTATION, OP

T0 = 1_621_500_000_000_000.0  # µs, a 2021 wall clock like the old profiler's
SGEMM = "volta_sgemm_128x64_nn"
DATA_RANGE = "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__"


class OldKinetoTrace:
    """Events in the 2021 schema; times are µs relative to `T0`."""

    def __init__(self, range_cat: str = "Operator") -> None:
        self.range_cat = range_cat
        self.events: list[dict[str, Any]] = [
            {"ph": "M", "name": "process_name", "pid": 17, "tid": 0, "args": {"name": "python3"}},
            {"ph": "M", "name": "thread_name", "pid": 0, "tid": "stream 7", "args": {"name": "stream 7"}},
        ]
        self.next_id = 1

    def _x(self, cat: str, name: str, ts: float, dur: float, pid: Any, tid: Any, args: dict[str, Any]) -> None:
        self.events.append({"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid,
                            "ts": T0 + ts, "dur": dur, "args": args})

    def op(self, name: str, ts: float, dur: float, cat: str = "Operator") -> None:
        self.next_id += 1
        self._x(cat, name, ts, dur, 17, "17", {"Input dims": [], "External id": self.next_id,
                                              "Trace name": "PyTorch Profiler", "Trace iteration": 0})

    def range(self, name: str, ts: float, dur: float) -> None:
        """A record_function range, written as an operator by the old schema."""
        self.op(name, ts, dur, cat=self.range_cat)

    def kernel(self, name: str, launch_ts: float, start: float, dur: Any) -> None:
        self.next_id += 1
        args = {"correlation": self.next_id, "external id": self.next_id}
        self._x("Runtime", "cudaLaunchKernel", launch_ts, 5, 17, "17", {**args, "cbid": 211})
        self._x("Kernel", name, start, dur, 0, "stream 7",
                {**args, "queued": 0, "device": 0, "context": 1, "stream": 7, "registers per thread": 64,
                 "shared memory": 0, "grid": [80, 1, 1], "block": [256, 1, 1]})

    def write(self, path: Path) -> Path:
        doc = {"schemaVersion": 1, "traceEvents": self.events,
               "deviceProperties": [{"id": 0, "name": "Tesla V100-SXM2-16GB", "totalGlobalMem": 16_945_512_448}]}
        path.write_text(json.dumps(doc))  # json writes NaN as the bare `NaN` some old exporters wrote
        return path


def data_bound_trace(range_cat: str, steps: int = 3) -> OldKinetoTrace:
    """Steps of 100 ms: the data loader runs [0, 40 000) µs with the GPU idle, then 60 SGEMMs of 1 ms run
    back to back [40 000, 100 000), launched from inside `aten::mm` ops."""
    trace = OldKinetoTrace(range_cat)
    for i in range(steps):
        s = i * 100_000.0
        trace.range(f"ProfilerStep#{i + 2}", s, 100_000)
        trace.range(DATA_RANGE, s, 40_000)
        for j in range(60):
            launch = s + 39_500 + 10 * j
            trace.op("aten::mm", launch, 8)
            trace.kernel(SGEMM, launch + 2, s + 40_000 + 1000 * j, 1000)
    return trace


@pytest.mark.parametrize("range_cat", ["Operator", "cpu_op"])
def test_old_schema_ranges_are_steps_and_data_loader(tmp_path, range_cat):
    path = data_bound_trace(range_cat).write(tmp_path / "old.json")
    report = analyze([path])
    util = report.ranks[0].utilisation
    assert util.has_step_ranges
    assert [step.name for step in util.steps] == ["ProfilerStep#2", "ProfilerStep#3", "ProfilerStep#4"]
    assert util.idle_us["data_loader"] == pytest.approx(3 * 40_000)
    assert util.idle_us["host"] == pytest.approx(0)
    assert {row.phase: row.num_ranges for row in report.ranks[0].phases}["data_wait"] == 3
    data = {a.rule: a for a in report.advice}["data_loader"]
    assert data.gain == pytest.approx(0.4)


def test_old_schema_operators_stay_operators(tmp_path):
    trace = parse_trace(data_bound_trace("Operator", steps=1).write(tmp_path / "old.json"))
    kinds = {trace.names[name]: int(kind) for name, kind in zip(trace.host.name, trace.host.kind)}
    assert kinds["aten::mm"] == OP
    assert kinds["ProfilerStep#2"] == ANNOTATION and kinds[DATA_RANGE] == ANNOTATION


CONVOLUTION_KERNELS = [
    "void cudnn::detail::implicit_convolve_sgemm<float, float, 128, 6, 7, 3, 3, 5, 0, false, false, true>"
    "(int, int, int, float const*, int, float*, float const*, kernel_conv_params, unsigned long long, int, "
    "float, float, int, float const*, float const*, bool, int, int)",
    "sm80_xmma_fprop_implicit_gemm_tf32f32_tf32f32_f32_nhwckrsc_nchw_tilesize128x128x16_stage4_warpsize2x2x1"
    "_g1_tensor16x8x8_kernel",
    "sm86_xmma_dgrad_implicit_gemm_indexed_f16f16_f16f32_f32_nhwckrsc_nhwc_tilesize64x64x64_stage4_warpsize2x2x1"
    "_g1_tensor16x8x16_kernel",
    "sm70_xmma_wgrad_implicit_gemm_f16f16_f16f32_f32_nchwkcrs_nchw_tilesize64x64x32_stage1_kernel",
    "void cudnn::winograd_nonfused::winogradForwardFilter4x4<float, float>(cudnn::winograd_nonfused::"
    "WinogradFilterParams<float, float>)",
    "void fft2d_r2c_32x32<float, false, 0u, false>(float2*, float const*, int, int, int, int, int, int, int, "
    "int, int, cudnn::reduced_divisor, bool, int2, int, int)",
    "void conv2d_c1_k1_nchw_hw_packed_kernel<float, float, 64, 1>(cudnnTensorStruct, float const*, float*)",
    "void cudnn::cnn::wgrad_alg0_engine<float, 128, 6, 7, 3, 3, 5, false, 512>(int, int, int, float const*, "
    "int, float*, float const*, kernel_grad_params, unsigned long long, int, float, int, int, int, int)",
    # AMD: Tensile GEMMs from rocBLAS and hipBLASLt, rocBLAS by name, MIOpen convolutions.
    "Cijk_Ailk_Bljk_HHS_BH_MT128x128x32_MI32x32x8x1_SN_1LDSB1_APM1_ABV0_ACED0_AF0EM8_AF1EM1_AMAS3",
    "Cijk_Alik_Bljk_BBS_BH_Bias_HA_S_SAV_UserArgs_MT256x128x64_MI16x16x1_SN_LDSB1",
    "void rocblas_gemvt_kernel<256, float, float const*, float*>(int, int, float, long, float const*, long)",
    "hipblasltExtSplitKReduce_f32_128x1",
    "naive_conv_fwd_nchw_half_double_half",
    "igemm_bwd_gtcx_nhwc_fp16_bx0_ex1_bt256x128x32_wt32x32x8_ws2x1_wr2x2_gkgs",
    "miopenSp3AsmConv_v30_3_1_gfx9_fp32_f2x3_stride1",
    "MIOpenConvUni",
]
NORM_KERNELS = [
    "void cudnn::bn_fw_tr_1C11_kernel_NCHW<float, float, 512, true, 1>(cudnnTensorStruct, float const*, "
    "cudnnTensorStruct, float*, float const*, float const*, float, float, float*, float*, float*, float*, "
    "float, float)",
    "void cudnn::bn_bw_1C11_kernel_new<float, float, float2, 512, true, 1>(float, float, float, float, "
    "cudnnTensorStruct, float const*, cudnnTensorStruct, float const*, cudnnTensorStruct, float*, float const*, "
    "float*, float*, float const*, float const*, float)",
    "void cudnn::bn_fw_inf_1C11_kernel_NCHW<float, float, true, 1>(float, float, cudnnTensorStruct, "
    "float const*, cudnnTensorStruct, float*, float const*, float const*, float const*, float const*, float)",
    "void at::native::batch_norm_collect_statistics_kernel<at::native::InvStd, float, float, float, int>"
    "(at::GenericPackedTensorAccessor<float const, 3ul, at::RestrictPtrTraits, int>, float, float, "
    "at::GenericPackedTensorAccessor<float, 1ul, at::RestrictPtrTraits, int>)",
    "void at::native::batch_norm_backward_reduce_kernel<float, float, float, int>(...)",
    "MIOpenBatchNormFwdTrainSpatial",
    "MIOpenBatchNormBwdSpatial",
]
ELEMENTWISE_KERNELS = [
    "void cudnn::ops::nchwToNhwcKernel<float, float, float, true, false, (cudnnKernelDataType_t)0>"
    "(cudnn::ops::nchw2nhwc_params_t<float>, float const*, float*)",
    "void cudnn::ops::nhwcToNchwKernel<__half, __half, float, true, false, (cudnnKernelDataType_t)0>"
    "(cudnn::ops::nhwc2nchw_params_t<float>, __half const*, __half*)",
]


@pytest.mark.parametrize("name", CONVOLUTION_KERNELS)
def test_convolution_and_amd_gemm_kernels_are_matmul_like(name):
    assert kernel_category(name, "kernel") == "gemm"
    assert "gemm" not in MEMORY_CATEGORIES


@pytest.mark.parametrize("name", NORM_KERNELS)
def test_batch_norm_kernels_are_memory_bound_normalisation(name):
    assert kernel_category(name, "kernel") == "normalisation" and "normalisation" in MEMORY_CATEGORIES


@pytest.mark.parametrize("name", ELEMENTWISE_KERNELS)
def test_cudnn_layout_transposes_are_elementwise(name):
    assert kernel_category(name, "kernel") == "elementwise"


def test_library_prefixes_do_not_hide_softmax_or_attention():
    assert kernel_category("MIOpenSoftmaxFwd", "kernel") == "reduction"
    assert kernel_category("void cudnn::fusion::compute_dot_do_o_specialized<true, 64>(...)", "kernel") == "attention"


@pytest.mark.parametrize("bad", [-250.0, math.nan, "NaN", None])
def test_invalid_durations_are_dropped_and_counted(tmp_path, bad):
    trace = OldKinetoTrace()
    trace.range("ProfilerStep#1", 0, 1000)
    for j in range(4):
        trace.kernel(SGEMM, 10 * j, 100 + 100 * j, 100)
    trace.kernel(SGEMM, 50, 600, bad)
    trace.kernel(SGEMM, 60, 700, -1.0)
    if bad is None:
        del trace.events[-3]["dur"]
    report = analyze([trace.write(tmp_path / "bad.json")])
    (row,) = report.ranks[0].kernels.top
    assert (row.count, row.mean_us, row.total_us) == (4, pytest.approx(100), pytest.approx(400))
    assert math.isfinite(report.ranks[0].utilisation.busy_us)
    assert any("dropped 2 events with invalid durations" in note for note in report.notes), report.notes


ESCAPES = {
    "csi": "\x1b[31mgemm_red\x1b[0m",
    "osc": "\x1b]0;pwned\x07gemm_title",
    "c1": "\x9b2Jgemm_clear",
}


@pytest.mark.parametrize("name", ESCAPES.values(), ids=ESCAPES.keys())
def test_escape_sequences_in_names_never_reach_the_terminal(tmp_path, name):
    trace = data_bound_trace("Operator", steps=1)
    trace.kernel(name, 99_000, 99_990, 5)
    trace.range("\x1b[2J" + DATA_RANGE, 99_900, 10)
    out = io.StringIO()
    render_terminal(analyze([trace.write(tmp_path / "ansi.json")]), Console(file=out, width=240, color_system=None))
    text = out.getvalue()
    assert "gemm_" in text  # the name is printed, its control codes are not
    assert "\x1b" not in text and "\x9b" not in text and "\x07" not in text


def test_cli_reads_an_old_schema_trace(tmp_path):
    trace = data_bound_trace("Operator")
    trace.kernel("\x1b[1;31mvolta_scudnn_128x64_relu_interior_nn_v1\x1b[0m", 299_000, 299_990, 5)
    path = trace.write(tmp_path / "old.json")
    run = subprocess.run([sys.executable, "-m", "tracetrain.cli", "analyze", str(path)], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "ProfilerStep#4" in run.stdout and "data loader" in run.stdout.lower()
    assert "volta_scudnn_128x64_relu_interior_nn_v1" in run.stdout and "\x1b" not in run.stdout
