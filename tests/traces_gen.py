"""Generate small PyTorch-profiler (Kineto) traces with known answers, for the analyzer tests.

The events have the structure `torch.profiler.profile(...).export_chrome_trace()` writes on a CUDA
machine: `ProfilerStep#N` user annotations, `cpu_op` ranges with `Input Dims`/`Input type`,
`cuda_runtime` launches carrying a correlation id, `kernel`/`gpu_memcpy` events on stream 7 (pid =
device, tid = stream) with the same correlation and Kineto's kernel args, `ac2g` flow pairs, `[memory]`
instant events, `deviceProperties` and `distributedInfo`. Times are microseconds from an arbitrary
large clock origin, as in real traces. Each scenario documents the numbers it was built to produce.

Run `python tests/traces_gen.py [OUT_DIR]` to rewrite the committed fixtures (`COMMITTED`).
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path
from typing import Any

T0 = 4_382_106_682_000.0  # clock origin (µs), like a real trace's `ts`
H100 = {"id": 0, "name": "NVIDIA H100 80GB HBM3", "totalGlobalMem": 85_045_821_440, "computeMajor": 9,
        "computeMinor": 0, "maxThreadsPerBlock": 1024, "numSms": 132, "warpSize": 32}
NVJET = "nvjet_tst_128x256_64x4_1x2_h_bz_coopB_TNT"
SGEMM = "cutlass_80_simt_sgemm_128x128_8x4_tn_align1"
ADD = ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>, "
       "std::array<char*, 3ul> >(int, at::native::CUDAFunctor_add<float>, std::array<char*, 3ul>)")
NCCL_ALLREDUCE = "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
MIB = 1 << 20
GIB = 1 << 30


class KinetoTraceBuilder:
    """Emit Kineto-format events; all times are µs relative to `T0`."""

    def __init__(self, *, rank: int | None = None, world_size: int = 1, device: dict | None = H100,
                 pid: int = 4242) -> None:
        self.pid, self.tid = pid, pid
        self.events: list[dict[str, Any]] = [
            {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "ts": T0, "args": {"name": "python"}},
            {"ph": "M", "name": "process_labels", "pid": 0, "tid": 0, "ts": T0, "args": {"labels": "GPU 0"}},
            {"ph": "M", "name": "thread_name", "pid": 0, "tid": 7, "ts": T0, "args": {"name": "stream 7 "}},
        ]
        self.top: dict[str, Any] = {"schemaVersion": 1, "deviceProperties": [device] if device else []}
        if rank is not None:
            self.top["distributedInfo"] = {"backend": "nccl", "rank": rank, "world_size": world_size}
        self.next_corr, self.next_ext = 100, 1

    def _x(self, cat: str, name: str, ts: float, dur: float, pid: Any, tid: Any, args: dict) -> None:
        self.events.append({"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid,
                            "ts": T0 + ts, "dur": dur, "args": args})

    def annotation(self, name: str, ts: float, dur: float) -> None:
        self._x("user_annotation", name, ts, dur, self.pid, self.tid,
                {"External id": self._ext(), "Record function id": 0})

    def op(self, name: str, ts: float, dur: float, dims: list | None = None,
           types: list | None = None) -> None:
        args: dict[str, Any] = {"External id": self._ext(), "Record function id": 0}
        if dims is not None:
            args.update({"Input Dims": dims, "Input type": types or [], "Concrete Inputs": [""] * len(dims)})
        self._x("cpu_op", name, ts, dur, self.pid, self.tid, args)

    def runtime(self, name: str, ts: float, dur: float, corr: int | None = None) -> None:
        args = {"External id": self.next_ext - 1, "cbid": 211}
        if corr is not None:
            args["correlation"] = corr
        self._x("cuda_runtime", name, ts, dur, self.pid, self.tid, args)

    def gpu(self, name: str, launch_ts: float, start: float, dur: float, *, cat: str = "kernel",
            stream: int = 7, nbytes: int | None = None, launch: str = "cudaLaunchKernel",
            launch_dur: float = 4.0) -> None:
        """A runtime launch at `launch_ts` and its GPU activity at `start`, linked by correlation
        and by an ac2g flow pair."""
        corr = self.next_corr
        self.next_corr += 1
        self.runtime(launch, launch_ts, launch_dur, corr)
        args: dict[str, Any] = {"External id": self.next_ext - 1, "device": 0, "context": 1,
                                "stream": stream, "correlation": corr}
        if cat == "kernel":
            args.update({"queued": 0, "registers per thread": 168, "shared memory": 98304,
                         "blocks per SM": 1.0, "warps per SM": 8.0, "grid": [132, 1, 1],
                         "block": [384, 1, 1], "est. achieved occupancy %": 13})
        else:
            args.update({"bytes": nbytes, "memory bandwidth (GB/s)": nbytes / (dur * 1e3)})
        self._x(cat, name, start, dur, 0, stream, args)
        self.events.append({"ph": "s", "id": corr, "pid": self.pid, "tid": self.tid, "ts": T0 + launch_ts,
                            "cat": "ac2g", "name": "ac2g"})
        self.events.append({"ph": "f", "id": corr, "pid": 0, "tid": stream, "ts": T0 + start,
                            "cat": "ac2g", "name": "ac2g", "bp": "e"})

    def memory(self, ts: float, allocated: int, reserved: int, device: int = 0) -> None:
        self.events.append({"ph": "i", "cat": "cpu_instant_event", "s": "t", "name": "[memory]",
                            "pid": self.pid, "tid": self.tid, "ts": T0 + ts,
                            "args": {"Total Reserved": reserved, "Total Allocated": allocated,
                                     "Bytes": 512, "Device Id": device, "Device Type": 1, "Addr": 1}})

    def _ext(self) -> int:
        self.next_ext += 1
        return self.next_ext - 1

    def document(self) -> dict[str, Any]:
        events = self.events + [
            {"ph": "X", "cat": "Trace", "name": "PyTorch Profiler (0)", "pid": "Spans",
             "tid": "PyTorch Profiler", "ts": T0 - 500, "dur": 50, "args": {"Op count": 0}},
            {"ph": "i", "s": "g", "name": "Record Window End", "pid": "", "tid": "", "ts": T0 - 400}]
        return {**self.top, "traceEvents": events, "traceName": "generated", "baseTimeNanoseconds": 1}


def write(doc: dict[str, Any], path: Path) -> Path:
    text = json.dumps(doc)
    if path.suffix == ".gz":
        with gzip.open(path, "wt", encoding="utf-8", compresslevel=1) as out:
            out.write(text)
    else:
        path.write_text(text)
    return path


def gemm_ops(b: KinetoTraceBuilder, launch0: float, gpu0: float, count: int, dur: float, *,
             name: str = NVJET, dims: list | None = None, dtype: str = "c10::BFloat16") -> float:
    """`count` aten::mm ops launched 10 µs apart from `launch0`, their kernels back to back on the GPU
    from `gpu0`, each `dur` long. Returns the GPU end time."""
    dims = dims or [[8192, 4096], [4096, 4096]]
    for j in range(count):
        t = launch0 + 10 * j
        b.op("aten::mm", t, 8, dims, [dtype, dtype])
        b.gpu(name, t + 2, gpu0 + j * dur, dur)
    return gpu0 + count * dur


def data_loader_bound(steps: int = 5) -> dict[str, Any]:
    """Steps of 100 ms: the data loader runs [0, 39 990) µs with the GPU idle, then 60 GEMM kernels of
    1 ms run back to back [40 000, 100 000). Per step: busy 60 000, data-loader idle 39 990, host
    idle 10. Forward annotation covers the first 30 launches, backward the other 30."""
    b = KinetoTraceBuilder()
    for i in range(steps):
        s = i * 100_000.0
        b.annotation(f"ProfilerStep#{i + 10}", s, 100_000)
        b.annotation("enumerate(DataLoader)#_MultiProcessingDataLoaderIter.__next__", s, 39_990)
        b.annotation("tracetrain/forward", s + 39_992, 400)
        gemm_ops(b, s + 39_995, s + 40_000, 30, 1000)
        b.annotation("tracetrain/backward", s + 40_500, 400)
        gemm_ops(b, s + 40_505, s + 70_000, 30, 1000)
    return b.document()


def gemm_heavy(steps: int = 4, *, m: int = 8192, dtype: str = "bf16",
               memory_peak: int | None = None) -> dict[str, Any]:
    """Steps of 10 ms, each with GEMMs (m x 4096) @ (4096 x 4096) back to back on the GPU over
    [400, 10 000): busy 96%. bf16, m=8192: 24 kernels, 2.749e11 FLOP in 400 µs = 687 TFLOP/s (69% of an
    H100's 989). fp32 (SIMT sgemm): 2 kernels of 4 800 µs = 57 TFLOP/s. m < 1024: 384 kernels of 25 µs,
    2.147e9 FLOP each = 86 TFLOP/s at m=64 (9% of peak)."""
    b = KinetoTraceBuilder()
    dur = 25.0 if m < 1024 else 400.0 if dtype == "bf16" else 4_800.0
    name, torch_type = (NVJET, "c10::BFloat16") if dtype == "bf16" else (SGEMM, "float")
    for i in range(steps):
        s = i * 10_000.0
        b.annotation(f"ProfilerStep#{i}", s, 10_000)
        gemm_ops(b, s + 50, s + 400, int(9_600 // dur), dur, name=name, dims=[[m, 4096], [4096, 4096]],
                 dtype=torch_type)
        if memory_peak is not None:
            b.memory(s + 100, memory_peak // 2, memory_peak + GIB)
            b.memory(s + 5_000, memory_peak, memory_peak + GIB)
    return b.document()


def launch_bound(steps: int = 3, kernels_per_step: int = 1000) -> dict[str, Any]:
    """Steps of 10 µs x kernels_per_step: every 10 µs an aten::add launches a 3 µs elementwise kernel
    (GPU start = launch + 5). Busy 30%; the other 70% is host (launch) overhead."""
    b = KinetoTraceBuilder()
    step = 10.0 * kernels_per_step
    for i in range(steps):
        s = i * step
        b.annotation(f"ProfilerStep#{i}", s, step)
        for j in range(kernels_per_step):
            t = s + 10 * j
            b.op("aten::add", t, 9, [[1024], [1024], []], ["float", "float", "Scalar"])
            b.gpu(ADD, t + 1, t + 5, 3)
    return b.document()


def sync_heavy(steps: int = 4) -> dict[str, Any]:
    """Steps of 20 ms: 10 GEMMs [100, 10 100), then `.item()` (a 2 µs D2H copy and a
    cudaStreamSynchronize [110, 10 105)), then the host works until 15 000 and launches 4 more GEMMs
    [15 010, 19 010). Per step: busy 14 002, sync idle 4 908 (gap 10 102 - 15 010), host idle 1 090."""
    b = KinetoTraceBuilder()
    for i in range(steps):
        s = i * 20_000.0
        b.annotation(f"ProfilerStep#{i}", s, 20_000)
        gemm_ops(b, s, s + 100, 10, 1000)
        b.op("aten::item", s + 100, 10_010)
        b.op("aten::_local_scalar_dense", s + 101, 10_008)
        b.gpu("Memcpy DtoH (Device -> Pinned)", s + 105, s + 10_100, 2, cat="gpu_memcpy", nbytes=4,
              launch="cudaMemcpyAsync")
        b.runtime("cudaStreamSynchronize", s + 110, 9_995)
        gemm_ops(b, s + 15_000, s + 15_010, 4, 1000)
    return b.document()


def host_copies(steps: int = 4, *, pageable: bool = True) -> dict[str, Any]:
    """Steps of 10 ms: a 64 MiB H2D copy [10, 6 010) (11.18 GB/s) from pageable or pinned memory, then
    3 GEMMs [6 020, 9 020). Copy share of the window: 60%."""
    b = KinetoTraceBuilder()
    source = "Pageable" if pageable else "Pinned"
    for i in range(steps):
        s = i * 10_000.0
        b.annotation(f"ProfilerStep#{i}", s, 10_000)
        b.op("aten::copy_", s, 6_012, [[16, 1024, 1024], [16, 1024, 1024], []],
             ["float", "float", "Scalar"])
        b.gpu(f"Memcpy HtoD ({source} -> Device)", s + 2, s + 10, 6_000, cat="gpu_memcpy",
              nbytes=64 * MIB, launch="cudaMemcpyAsync", launch_dur=6_009)
        gemm_ops(b, s + 6_013, s + 6_020, 3, 1000)
    return b.document()


def two_rank_nccl(rank: int, *, exposed: bool) -> dict[str, Any]:
    """Steps of 10 ms on each of 2 ranks: 8 compute GEMMs [100, 8 100) on stream 7 and a 1 500 µs NCCL
    all-reduce on stream 20, either inside the compute [4 000, 5 500) (fully overlapped) or after
    it [8 100, 9 600) (fully exposed: 15% of the step), with the optimizer's 50 µs kernel, launched with
    the GEMMs, waiting for it [9 600, 9 650)."""
    b = KinetoTraceBuilder(rank=rank, world_size=2, pid=5000 + rank)
    for i in range(3):
        s = i * 10_000.0
        b.annotation(f"ProfilerStep#{i}", s, 10_000)
        gemm_ops(b, s, s + 100, 8, 1000)
        start = s + (8_100 if exposed else 4_000)
        b.op("c10d::allreduce_", s + 90, 5)
        b.op("record_param_comms", s + 91, 3)
        b.gpu(NCCL_ALLREDUCE, s + 92, start, 1_500, stream=20, launch="cudaLaunchKernelExC", launch_dur=1)
        if exposed:
            b.op("aten::_foreach_add_", s + 180, 5)
            b.gpu("void at::native::multi_tensor_apply_kernel<Adam>", s + 182, s + 9_600, 50)
    return b.document()


# Small enough to commit as golden fixtures in tests/data/traces (the others are generated per test).
COMMITTED = {
    "data_loader_bound": data_loader_bound,
    "nccl_exposed_rank0": lambda: two_rank_nccl(0, exposed=True),
    "nccl_exposed_rank1": lambda: two_rank_nccl(1, exposed=True),
}


if __name__ == "__main__":
    out_dir = Path(sys.argv[1] if len(sys.argv) > 1 else "tests/data/traces")
    out_dir.mkdir(parents=True, exist_ok=True)
    for scenario, make in COMMITTED.items():
        print(write(make(), out_dir / f"{scenario}.json.gz"))
