"""What limits the GPU: compute, memory bandwidth, kernel launches, or the host?

- GEMM FLOPs come from the launching op's recorded `Input Dims` (needs `record_shapes=True`): each
  GEMM kernel is linked to the innermost matmul-like op around its launch (see `link.py`); the op's
  FLOPs, `2 * batch * m * k * n`, count once however many kernels it launched. Achieved FLOP/s is
  against the device's dense peak for the op's input type (bf16/fp16, fp8, plain fp32; with TF32
  enabled an fp32 GEMM can exceed the plain-fp32 peak).
- A GEMM is memory-bound when its arithmetic intensity (FLOPs per byte of its three matrices) is below
  the device's ridge point (peak FLOP/s over HBM bytes/s), compute-bound otherwise.
- Elementwise, normalisation, reduction and optimizer kernels stream memory: bytes are estimated from
  the launching op's inputs (plus one output as large as the largest input) and compared with HBM
  bandwidth. Copies use their recorded bytes.
- A category whose mean kernel lasts under 10 µs while the GPU has host-caused idle gaps (>= 10% of
  step time) is launch-bound: the GPU finishes kernels faster than the host issues them.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Final

import numpy as np

from tracetrain.devices import DeviceSpec
from tracetrain.profile.analyze.categories import CATEGORIES, MEMORY_CATEGORIES
from tracetrain.profile.analyze.columns import KERNEL
from tracetrain.profile.analyze.select import gpu_categories, main_device, on_device
from tracetrain.profile.analyze.trace import Trace
from tracetrain.profile.analyze.utilisation import Utilisation

SHORT_KERNEL_US: Final = 10.0
SMALL_GEMM_M: Final = 1024
LOW_GEMM_EFFICIENCY: Final = 0.3
_ITEMSIZE: Final = {
    "float": 4,
    "double": 8,
    "c10::BFloat16": 2,
    "c10::Half": 2,
    "c10::Float8_e4m3fn": 1,
    "c10::Float8_e5m2": 1,
    "c10::Float8_e4m3fnuz": 1,
    "long int": 8,
    "int": 4,
    "short int": 2,
    "signed char": 1,
    "unsigned char": 1,
    "bool": 1,
}
_PRECISION: Final = {
    "float": "fp32",
    "double": "fp32",
    "c10::BFloat16": "bf16",
    "c10::Half": "fp16",
    "c10::Float8_e4m3fn": "fp8",
    "c10::Float8_e5m2": "fp8",
    "c10::Float8_e4m3fnuz": "fp8",
}
_FP32_GEMM_NAME: Final = re.compile(r"sgemm|tf32|gemm_f32f32|_fp32_", re.I)
_LOW_PRECISION_NAME: Final = re.compile(r"bf16|f16|fp16|e4m3|e5m2|fp8|hgemm", re.I)
_GEMM = CATEGORIES.index("gemm")


@dataclass(frozen=True)
class GemmShape:
    flops: float
    bytes: float
    m: int
    precision: str | None


@dataclass(frozen=True)
class GemmStats:
    """GEMM kernels: times in µs; FLOP/s over the kernels whose op shapes are known."""

    time_us: float
    shaped_time_us: float
    num_ops: int
    tflops: float | None
    efficiency: float | None
    intensity: float | None  # FLOPs per byte
    small_time_us: float  # in GEMMs with m < 1024 running below 30% of peak
    fp32_time_us: float


@dataclass(frozen=True)
class BoundRow:
    category: str
    time_us: float
    share: float
    mean_kernel_us: float
    tflops: float | None
    flop_efficiency: float | None
    gb_per_s: float | None
    bandwidth_efficiency: float | None
    verdict: str


@dataclass(frozen=True)
class BoundAnalysis:
    device: str | None
    verdict: str
    reason: str
    mean_kernel_us: float
    rows: list[BoundRow]
    gemm: GemmStats


def _tensors(dims: list, types: list) -> list[tuple[int, int]]:
    """(numel, itemsize) of each plain tensor input (scalars, lists and unknown types skipped)."""
    out = []
    for shape, dtype in zip(dims, types):
        if isinstance(shape, list) and shape and all(isinstance(d, int) for d in shape) and dtype in _ITEMSIZE:
            out.append((math.prod(shape), _ITEMSIZE[dtype]))
    return out


def gemm_shape(op_name: str, dims: list, types: list) -> GemmShape | None:
    """FLOPs, bytes and m of an aten matmul-like op from its recorded input shapes, or None."""
    operands = {"aten::addmm": (1, 2), "aten::addmm_": (1, 2), "aten::baddbmm": (1, 2)}.get(op_name, (0, 1))
    if len(dims) <= operands[1]:
        return None
    a, b = dims[operands[0]], dims[operands[1]]
    if not (isinstance(a, list) and isinstance(b, list) and len(a) >= 1 and len(b) >= 1):
        return None
    if op_name == "aten::linear":  # x (..., k) @ w (n, k)^T
        batch, m, k, n = 1, math.prod(a[:-1]), a[-1], b[0]
    elif len(b) == 2 and len(a) > 2:  # x (..., k) @ w (k, n): torch folds the leading dims into m
        batch, m, k, n = 1, math.prod(a[:-1]), a[-1], b[-1]
    else:  # a (..., m, k) @ b (..., k, n), batch dims broadcast
        a2, b2 = (a if len(a) >= 2 else [1, a[0]]), (b if len(b) >= 2 else [b[0], 1])
        batch = max(math.prod(a2[:-2]), math.prod(b2[:-2]))
        m, k, n = a2[-2], a2[-1], b2[-1]
    dtype = types[operands[0]] if len(types) > operands[0] else None
    precision = "fp8" if op_name == "aten::_scaled_mm" else _PRECISION.get(dtype or "")
    itemsize = _ITEMSIZE.get(dtype or "", 2)
    return GemmShape(
        flops=2.0 * batch * m * k * n,
        bytes=float(itemsize * batch * (m * k + k * n + m * n)),
        m=int(m),
        precision=precision,
    )


def _peak_flops(spec: DeviceSpec | None, precision: str | None) -> float | None:
    if spec is None:
        return None
    tflops = {"bf16": spec.bf16_tflops, "fp16": spec.bf16_tflops, "fp8": spec.fp8_tflops, "fp32": spec.fp32_tflops}.get(
        precision or "bf16"
    )
    return tflops * 1e12 if tflops else None


def _op_shape(trace: Trace, op: int, cache: dict[tuple[int, int], GemmShape | None]) -> GemmShape | None:
    shape_id = int(trace.host.shape[op])
    key = (shape_id, int(trace.host.name[op]))
    if key not in cache:
        dims, types = json.loads(trace.shapes[shape_id]) if shape_id >= 0 else ([], [])
        cache[key] = gemm_shape(trace.names[trace.host.name[op]], dims, types)
    return cache[key]


def gemm_stats(trace: Trace, rows: np.ndarray, spec: DeviceSpec | None) -> GemmStats:
    """FLOP/s, efficiency and small/fp32 GEMM time over the GEMM kernel rows given."""
    ops, inverse = np.unique(trace.gpu.gemm_op[rows], return_inverse=True)
    op_time = np.bincount(inverse, weights=trace.gpu.dur[rows], minlength=len(ops))
    cache: dict[tuple[int, int], GemmShape | None] = {}
    flops = nbytes = shaped = small = fp32 = peak_time = 0.0
    for i, op in enumerate(ops.tolist()):
        shape = _op_shape(trace, op, cache) if op >= 0 else None
        if shape is None:
            continue
        flops, nbytes, shaped = flops + shape.flops, nbytes + shape.bytes, shaped + op_time[i]
        peak = _peak_flops(spec, shape.precision)
        if peak:
            peak_time += shape.flops / peak
            if shape.m < SMALL_GEMM_M and shape.flops / (op_time[i] * 1e-6) < LOW_GEMM_EFFICIENCY * peak:
                small += op_time[i]
        if shape.precision == "fp32":
            fp32 += op_time[i]
    fp32 += _fp32_by_name(trace, rows[trace.gpu.gemm_op[rows] < 0])
    return GemmStats(
        time_us=float(trace.gpu.dur[rows].sum()),
        shaped_time_us=float(shaped),
        num_ops=int((ops >= 0).sum()),
        tflops=float(flops / (shaped * 1e-6) / 1e12) if shaped else None,
        efficiency=float(peak_time / (shaped * 1e-6)) if shaped and peak_time else None,
        intensity=float(flops / nbytes) if nbytes else None,
        small_time_us=float(small),
        fp32_time_us=float(fp32),
    )


def _fp32_by_name(trace: Trace, rows: np.ndarray) -> float:
    """Time of GEMM kernels without a shaped op whose names say fp32 (sgemm, tf32, f32f32)."""
    names, inverse = np.unique(trace.gpu.name[rows], return_inverse=True)
    fp32 = np.array(
        [
            bool(_FP32_GEMM_NAME.search(trace.names[n]) and not _LOW_PRECISION_NAME.search(trace.names[n]))
            for n in names.tolist()
        ],
        dtype=bool,
    )
    return float(trace.gpu.dur[rows][fp32[inverse]].sum()) if len(rows) else 0.0


# Ops whose output is far smaller than their input (a reduction over at least one dimension): their
# traffic is the inputs read; counting an output as large as the largest input would double it.
_REDUCING_OP = re.compile(
    r"\b(?:aten::)?(?:mean|sum|norm|linalg_vector_norm|amax|amin|max|min|argmax|argmin|"
    r"var|std|prod|all|any|nll_loss\w*|_foreach_norm)\b"
)


def op_bytes_estimate(name: str, sizes: list[int]) -> int:
    """Bytes an op moves: its inputs, plus an output as large as the largest input unless it reduces."""
    if not sizes:
        return 0
    return sum(sizes) if _REDUCING_OP.search(name) else sum(sizes) + max(sizes)


def streamed_bytes(trace: Trace, rows: np.ndarray) -> tuple[float, float]:
    """(bytes, µs) over the kernels in `rows` whose launching op's inputs give a byte estimate."""
    ops, inverse = np.unique(trace.gpu.op[rows], return_inverse=True)
    op_time = np.bincount(inverse, weights=trace.gpu.dur[rows], minlength=len(ops))
    op_bytes: dict[tuple[int, int], int] = {}  # by (shape, op): training repeats them every step
    total_bytes = total_us = 0.0
    for i, op in enumerate(ops.tolist()):
        shape_id = int(trace.host.shape[op]) if op >= 0 else -1
        if shape_id < 0:
            continue
        key = (shape_id, int(trace.host.name[op]))
        if key not in op_bytes:
            sizes = [n * size for n, size in _tensors(*json.loads(trace.shapes[shape_id]))]
            op_bytes[key] = op_bytes_estimate(trace.names[trace.host.name[op]], sizes)
        if op_bytes[key]:
            total_bytes += op_bytes[key]
            total_us += op_time[i]
    return total_bytes, total_us


def _ridge(spec: DeviceSpec | None) -> float | None:
    """FLOPs per byte above which a bf16 kernel is compute-bound on this device."""
    return spec.bf16_tflops * 1e12 / (spec.hbm_tb_s * 1e12) if spec else None


def _category_verdict(
    category: str, mean_us: float, launch_gappy: bool, gemm: GemmStats, spec: DeviceSpec | None
) -> str:
    if category == "communication":
        return "communication"
    if category in ("memcpy_h2d", "memcpy_d2h", "memcpy_other"):
        return "transfer-bound"
    if mean_us < SHORT_KERNEL_US and launch_gappy:
        return "launch-bound"
    ridge = _ridge(spec)
    if category == "gemm" and gemm.intensity is not None and ridge is not None:
        return "compute-bound" if gemm.intensity >= ridge else "memory-bound"
    if category in ("gemm", "attention"):
        return "compute-bound"
    if category in MEMORY_CATEGORIES or category == "memcpy_d2d":
        return "memory-bound"
    return "unknown"


def _bandwidth(
    trace: Trace, rows: np.ndarray, category: str, spec: DeviceSpec | None
) -> tuple[float | None, float | None]:
    """Achieved GB/s and its fraction of HBM bandwidth (not for host copies), where bytes are known."""
    if category in MEMORY_CATEGORIES and category != "memset":
        nbytes, us = streamed_bytes(trace, rows)
    elif category.startswith("memcpy_") or category == "memset":  # the trace records their bytes
        known = rows[trace.gpu.bytes[rows] >= 0]
        nbytes, us = float(trace.gpu.bytes[known].sum()), float(trace.gpu.dur[known].sum())
    else:
        return None, None
    if not us:
        return None, None
    gb_per_s = float(nbytes / (us * 1e3))
    on_hbm = spec is not None and category not in ("memcpy_h2d", "memcpy_d2h", "memcpy_other")
    return gb_per_s, gb_per_s / (spec.hbm_tb_s * 1e3) if on_hbm and spec is not None else None


def _category_rows(
    trace: Trace, rows: np.ndarray, spec: DeviceSpec | None, gemm: GemmStats, launch_gappy: bool
) -> list[BoundRow]:
    codes = gpu_categories(trace)[rows]
    total = float(trace.gpu.dur[rows].sum())
    table = []
    for code in np.unique(codes).tolist():
        sel = rows[codes == code]
        category, time_us = CATEGORIES[code], float(trace.gpu.dur[sel].sum())
        mean_us = time_us / len(sel)
        gb_per_s, bandwidth_efficiency = _bandwidth(trace, sel, category, spec)
        table.append(
            BoundRow(
                category=category,
                time_us=time_us,
                share=time_us / total if total else 0.0,
                mean_kernel_us=mean_us,
                tflops=gemm.tflops if code == _GEMM else None,
                flop_efficiency=gemm.efficiency if code == _GEMM else None,
                gb_per_s=gb_per_s,
                bandwidth_efficiency=bandwidth_efficiency,
                verdict=_category_verdict(category, mean_us, launch_gappy, gemm, spec),
            )
        )
    return sorted(table, key=lambda row: -row.time_us)


def _overall(util: Utilisation, rows: list[BoundRow], mean_kernel_us: float) -> tuple[str, str]:
    """One verdict for the rank, with the reason in words."""
    idle = 1.0 - util.busy_fraction
    if idle >= 0.3:
        cause = max(util.idle_us, key=lambda c: util.idle_us[c])
        if cause == "host":
            verdict = "launch-bound" if mean_kernel_us < SHORT_KERNEL_US else "host-bound"
            return verdict, (
                f"GPU idle {idle:.0%} of the window, mostly while the host issues work "
                f"(mean kernel {mean_kernel_us:.1f} µs)"
            )
        return "host-bound", f"GPU idle {idle:.0%} of the window, mostly {cause.replace('_', ' ')}"
    if util.busy_us and util.exposed_comm_us >= 0.3 * util.busy_us:
        share = util.exposed_comm_us / util.busy_us
        return "communication-bound", f"exposed communication is {share:.0%} of busy time"
    compute = sum(r.time_us for r in rows if r.verdict == "compute-bound")
    memory = sum(r.time_us for r in rows if r.verdict in ("memory-bound", "transfer-bound"))
    total = max(sum(r.time_us for r in rows), 1e-9)
    verdict, time_us = ("compute-bound", compute) if compute >= memory else ("memory-bound", memory)
    kind = "compute-bound" if verdict == "compute-bound" else "memory/transfer-bound"
    return verdict, f"GPU busy {util.busy_fraction:.0%}; {time_us / total:.0%} of GPU time in {kind} kernels"


def bound(trace: Trace, spec: DeviceSpec | None, util: Utilisation) -> BoundAnalysis:
    """Per-category and overall verdicts (see the module docstring) for the rank's main GPU."""
    rows = np.flatnonzero(on_device(trace, main_device(trace)))
    codes = gpu_categories(trace)
    gemm = gemm_stats(trace, rows[codes[rows] == _GEMM], spec)
    kernels = rows[trace.gpu.kind[rows] == KERNEL]
    mean_kernel_us = float(trace.gpu.dur[kernels].mean()) if len(kernels) else 0.0
    if not len(rows):
        return BoundAnalysis(
            spec.name if spec else None, "no GPU activity", "the trace has no GPU events", 0.0, [], gemm
        )
    launch_gappy = util.idle_us["host"] >= 0.1 * util.steps_us
    table = _category_rows(trace, rows, spec, gemm, launch_gappy)
    verdict, reason = _overall(util, table, mean_kernel_us)
    return BoundAnalysis(spec.name if spec else None, verdict, reason, mean_kernel_us, table, gemm)
