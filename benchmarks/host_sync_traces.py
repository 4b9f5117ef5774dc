"""Real traces of two plain PyTorch loops the analyzer must read right (issue #20, analyzer 3 and 4), and
the ground truth of what their host stalls cost, measured by removing the cause (run on a GPU):

    python3 benchmarks/host_sync_traces.py OUT_DIR

- `item_loop`: each step runs 100 small blocks (a bf16 GEMM, tanh, a float mean) and reads every
  block's loss back with `.item()` (a blocking device-to-host copy), then does a little Python
  bookkeeping. The same loop without `.item()` (losses summed on the GPU, one read per step) is timed
  too: the difference is what the syncs cost.
- `refill`: each step runs 4 blocks of 8 large GEMMs (~11 ms queued ahead of the GPU), reads the loss
  with `.item()` (the host waits for the queue to drain), then refills the queue slowly: 20 small ops
  with 50 µs of Python between them. Timed without the reads too.
- `host_bound`: each step issues 40 GEMMs of ~50 µs (no short kernels) with ~300 µs of pure-Python
  work between them, as a CPU-bound data or metric loop would. The same GEMMs with no Python work
  between them are timed too: the difference is what the host costs.

Writes a profiler trace of each loop and of its variant without the cause (`item_loop`,
`item_loop_no_sync`, `refill`, `refill_no_sync`, `host_bound`, `host_bound_no_python`, `.json.gz`, 2
steps each, no tracetrain annotations: these are "foreign" programs) and `host_sync_truth.json`
(median step times without the profiler, ms).
"""

import json
import os
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile, schedule

DEVICE = torch.device("cuda")


def python_work(us: float) -> None:
    """Pure-Python CPU work for about `us` microseconds (a CPU-bound loop, no GPU calls)."""
    end = time.perf_counter() + us * 1e-6
    total = 0
    while time.perf_counter() < end:
        total += sum(range(50))


def item_step(x: torch.Tensor, w: torch.Tensor, *, read_each: bool, blocks: int = 100) -> float:
    history: list[float] = []
    on_gpu = torch.zeros((), device=DEVICE)
    for _ in range(blocks):
        h = torch.tanh(x @ w)  # (2048, 2048) bf16
        loss = h.float().mean()
        if read_each:
            history.append(loss.item())  # a host sync per block: the pattern under test
            python_work(20)  # bookkeeping after each read (logging, a running mean)
        else:
            on_gpu += loss
            python_work(20)  # the same bookkeeping, overlapped with the GPU now
    return sum(history) if read_each else float(on_gpu.item())


def refill_step(x: torch.Tensor, w: torch.Tensor, small: torch.Tensor, *, read_each: bool, blocks: int = 4) -> float:
    on_gpu = torch.zeros((), device=DEVICE)
    total = 0.0
    for _ in range(blocks):
        for _ in range(8):
            x = torch.tanh(x @ w)  # (8192, 8192) bf16: ~1.4 ms of GEMM each, queued far ahead of the GPU
        loss = x.float().mean()
        if read_each:
            total += loss.item()  # the host waits for the whole queue to drain
        else:
            on_gpu += loss
        for _ in range(20):  # then refills the queue slowly: small ops between bits of Python work
            small.add_(1.0)
            python_work(50)
    return total if read_each else float(on_gpu.item())


def host_step(x: torch.Tensor, w: torch.Tensor, *, python_us: float, gemms: int = 40) -> None:
    for _ in range(gemms):
        x = torch.tanh(x @ w)  # (4096, 4096) bf16: ~50 µs of GEMM on an H100
        if python_us:
            python_work(python_us)


def median_step_ms(step, n: int = 10) -> float:
    times = []
    for _ in range(n + 2):
        torch.cuda.synchronize()
        t = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times[2:])


def record(path: str, step) -> None:
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True,
                 schedule=schedule(wait=1, warmup=1, active=2, repeat=1),
                 on_trace_ready=lambda prof: prof.export_chrome_trace(path)) as prof:
        for _ in range(4):
            step()
            prof.step()


def main(out_dir: str) -> None:
    torch.manual_seed(0)
    xs, ws = (torch.randn(2048, 2048, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
    xl, wl = torch.randn(4096, 4096, device=DEVICE, dtype=torch.bfloat16), torch.randn(
        4096, 4096, device=DEVICE, dtype=torch.bfloat16) / 64
    xb, wb = torch.randn(8192, 8192, device=DEVICE, dtype=torch.bfloat16), torch.randn(
        8192, 8192, device=DEVICE, dtype=torch.bfloat16) / 90
    small = torch.zeros(1024, device=DEVICE)
    truth = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "item_loop_ms": median_step_ms(lambda: item_step(xs, ws, read_each=True)),
        "item_loop_no_sync_ms": median_step_ms(lambda: item_step(xs, ws, read_each=False)),
        "refill_ms": median_step_ms(lambda: refill_step(xb, wb, small, read_each=True)),
        "refill_no_sync_ms": median_step_ms(lambda: refill_step(xb, wb, small, read_each=False)),
        "host_bound_ms": median_step_ms(lambda: host_step(xl, wl, python_us=300)),
        "host_bound_no_python_ms": median_step_ms(lambda: host_step(xl, wl, python_us=0)),
    }
    print(json.dumps(truth, indent=1))
    with open(os.path.join(out_dir, "host_sync_truth.json"), "w") as out:
        json.dump(truth, out, indent=1)
    record(os.path.join(out_dir, "item_loop.json.gz"), lambda: item_step(xs, ws, read_each=True))
    record(os.path.join(out_dir, "item_loop_no_sync.json.gz"), lambda: item_step(xs, ws, read_each=False))
    record(os.path.join(out_dir, "refill.json.gz"), lambda: refill_step(xb, wb, small, read_each=True))
    record(os.path.join(out_dir, "refill_no_sync.json.gz"), lambda: refill_step(xb, wb, small, read_each=False))
    record(os.path.join(out_dir, "host_bound.json.gz"), lambda: host_step(xl, wl, python_us=300))
    record(os.path.join(out_dir, "host_bound_no_python.json.gz"), lambda: host_step(xl, wl, python_us=0))


if __name__ == "__main__":
    main(sys.argv[1])
