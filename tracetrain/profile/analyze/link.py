"""Link each GPU activity to the host code that launched it.

A kernel carries `args.correlation`; the `cudaLaunchKernel` (or `cudaMemcpyAsync`, ...) runtime event
with the same correlation id says when and on which thread it was launched. When that runtime event
is missing, the `ac2g` flow start with the same id gives the same answer. The launch then sits inside
a stack of `cpu_op` ranges on its thread (`aten::linear` > `aten::addmm` > `cudaLaunchKernel`): the
innermost op tells which operator the kernel belongs to (its recorded input shapes give FLOPs and
bytes), and the innermost matmul-like op on the stack gives the GEMM the kernel computes.
"""

from __future__ import annotations

from array import array

import numpy as np

from tracetrain.profile.analyze.categories import GEMM_OPS
from tracetrain.profile.analyze.columns import OP, RUNTIME, Columns


def _lookup(keys: np.ndarray, values: list[np.ndarray], queries: np.ndarray, fills: list[float]) -> list[np.ndarray]:
    """For each query, the values at the matching key (any one occurrence), else the fill values."""
    if len(keys) == 0:
        return [np.full(len(queries), fill) for fill in fills]
    order = np.argsort(keys, kind="stable")
    sorted_keys = keys[order]
    index = np.minimum(np.searchsorted(sorted_keys, queries), len(keys) - 1)
    found = sorted_keys[index] == queries
    return [np.where(found, value[order][index], fill) for value, fill in zip(values, fills)]


def _launch_points(host: Columns, gpu: Columns, flows: Columns) -> tuple[np.ndarray, np.ndarray]:
    """Host time and thread of each GPU event's launch (NaN / -1 when unknown)."""
    runtime = (host.kind == RUNTIME) & (host.corr >= 0)
    ts, thread = _lookup(host.corr[runtime], [host.ts[runtime], host.thread[runtime]], gpu.corr, [np.nan, -1])
    missing = np.isnan(ts) & (gpu.corr >= 0)
    if missing.any() and len(flows):
        flow_ts, flow_thread = _lookup(flows.corr, [flows.ts, flows.thread], gpu.corr[missing], [np.nan, -1])
        ts[missing], thread[missing] = flow_ts, flow_thread
    return ts, thread.astype(np.int64)


def _view(values: np.ndarray) -> memoryview:
    """Zero-copy element access with Python scalars (much smaller than `tolist()` on big traces)."""
    return memoryview(np.ascontiguousarray(values))  # type: ignore[arg-type]  # ndarrays export the buffer protocol


def _innermost(
    op_thread: np.ndarray,
    op_start: np.ndarray,
    op_end: np.ndarray,
    op_is_gemm: np.ndarray,
    q_thread: np.ndarray,
    q_ts: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """Sweep ops and queries in (thread, time) order with a stack of open ops.

    Returns, per query, the position (into the op arrays) of the innermost op containing it and of
    the innermost GEMM-like op containing it, -1 where none."""
    op_order = _view(np.lexsort((-op_end, op_start, op_thread)))
    q_order = _view(np.lexsort((q_ts, q_thread)))
    threads, starts, ends = _view(op_thread), _view(op_start), _view(op_end)
    is_gemm, q_threads, q_times = _view(op_is_gemm), _view(q_thread), _view(q_ts)
    inner, gemm = array("q", [-1]) * len(q_order), array("q", [-1]) * len(q_order)
    stack: list[tuple[int, float, int, int]] = []  # (thread, end, op, innermost gemm op so far)
    i = 0
    for q in q_order:
        q_th, t = q_threads[q], q_times[q]
        while i < len(op_order) and (threads[op_order[i]], starts[op_order[i]]) <= (q_th, t):
            o = op_order[i]
            while stack and (stack[-1][0] != threads[o] or stack[-1][1] <= starts[o]):
                stack.pop()
            parent_gemm = stack[-1][3] if stack else -1
            stack.append((threads[o], ends[o], o, o if is_gemm[o] else parent_gemm))
            i += 1
        while stack and (stack[-1][0] != q_th or stack[-1][1] < t):
            stack.pop()
        if stack:
            inner[q], gemm[q] = stack[-1][2], stack[-1][3]
    return np.frombuffer(inner, dtype=np.int64), np.frombuffer(gemm, dtype=np.int64)


def link_launches(host: Columns, gpu: Columns, flows: Columns, names: list[str]) -> dict[str, np.ndarray]:
    """Columns to add to the GPU table: launch_ts, op and gemm_op (host row indices, -1 if none)."""
    launch_ts, launch_thread = _launch_points(host, gpu, flows)
    op_rows = np.flatnonzero(host.kind == OP)
    gemm_names = np.asarray([name in GEMM_OPS for name in names], dtype=bool)
    op_is_gemm = gemm_names[host.name[op_rows]] if len(names) else np.zeros(len(op_rows), bool)
    known = np.flatnonzero(np.isfinite(launch_ts))
    op = np.full(len(gpu), -1, dtype=np.int64)
    gemm_op = np.full(len(gpu), -1, dtype=np.int64)
    if len(known) and len(op_rows):
        inner, gemm = _innermost(
            host.thread[op_rows],
            host.ts[op_rows],
            host.ts[op_rows] + host.dur[op_rows],
            op_is_gemm,
            launch_thread[known],
            launch_ts[known],
        )
        op[known] = np.where(inner >= 0, op_rows[np.maximum(inner, 0)], -1)
        gemm_op[known] = np.where(gemm >= 0, op_rows[np.maximum(gemm, 0)], -1)
    return {"launch_ts": launch_ts, "op": op, "gemm_op": gemm_op}
