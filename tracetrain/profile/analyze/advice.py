"""What to change: rules over a rank's analysis tables, each with its evidence and estimated gain.

A rule is a small function `RankReport -> Advice | None`. `gain` estimates the fraction of step time
(time inside `ProfilerStep` ranges) that the change could recover; it is an upper-bound style
estimate from the trace alone, or None when the benefit is not a time saving on this trace.

| rule            | fires when                                                          | gain            |
|-----------------|---------------------------------------------------------------------|-----------------|
| data_loader     | GPU idle while the host loads data >= 5% of step time               | that idle time  |
| pageable_copies | copies from/to pageable host memory >= 1% of step time              | half their time |
| launch_bound    | mean kernel < 10 µs and host-caused GPU idle >= 10% of step time    | that idle time  |
| host_bound      | mean kernel >= 10 µs and host-caused GPU idle >= 10% of step time   | that idle time  |
|                 | (Python overhead or CPU work between launches, not kernel size)     |                 |
| fp32_gemm       | fp32/TF32 GEMMs >= 10% of GEMM time and >= 2% of step time          | half their time |
| small_gemm      | GEMMs with m < 1024 below 30% of peak: >= half of GEMM time and     | half their time |
|                 | >= 10% of step time                                                 |                 |
| sync_stalls     | GPU idle charged to host syncs (`.item()`, ...) >= 5% of step time  | that idle time  |
| memory_headroom | peak reserved memory leaves >= 40% of the GPU's memory unused       | None            |
| exposed_comm    | NCCL time not overlapped by compute >= 5% of step time              | that time       |

Actions are said in the trace's own terms: a trace of tracetrain's trainer (its phase ranges are named
`tracetrain/<phase>`, see `phases.py`) gets tracetrain's config keys (`data.num_workers`); any other
program's trace gets the plain PyTorch change (`DataLoader(num_workers=...)`, `torch.autocast`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from tracetrain.profile.analyze.bound import SHORT_KERNEL_US

if TYPE_CHECKING:
    from tracetrain.profile.analyze.report import RankReport


@dataclass(frozen=True)
class Advice:
    """One recommendation: which rule, what to do, the numbers behind it, and the estimated gain."""

    rule: str
    title: str
    action: str
    evidence: str
    gain: float | None
    rank: int | None = None


def _by_tracetrain(report: RankReport) -> bool:
    """Whether tracetrain's trainer wrote the trace (its `tracetrain/<phase>` ranges are in it)."""
    return any(row.from_tracetrain for row in report.phases)


def _action(report: RankReport, tracetrain: str, pytorch: str) -> str:
    """The action in the trace's terms: tracetrain config keys for its own traces, else plain PyTorch."""
    return tracetrain if _by_tracetrain(report) else pytorch


def _per_step(report: RankReport, us: float) -> str:
    steps = max(len(report.utilisation.steps), 1)
    return f"{us / steps / 1e3:.2f} ms per step"


def _fraction(report: RankReport, us: float) -> float:
    return us / report.utilisation.steps_us if report.utilisation.steps_us > 0 else 0.0


def data_loader(report: RankReport) -> Advice | None:
    idle = report.utilisation.idle_us["data_loader"]
    share = _fraction(report, idle)
    if share < 0.05:
        return None
    return Advice(
        "data_loader",
        "The GPU waits for the data loader",
        _action(
            report,
            "Raise `data.num_workers` (and `data.prefetch_factor`), keep `data.pin_memory = true`, "
            "and tokenize/pack the dataset ahead of time.",
            "Load in worker processes: `DataLoader(..., num_workers=N, pin_memory=True, "
            "persistent_workers=True)`, and tokenize, decode or augment ahead of time, not in the loop.",
        ),
        f"GPU idle {_per_step(report, idle)} ({share:.0%} of step time) while the host was in data-loading ranges.",
        share,
    )


def pageable_copies(report: RankReport) -> Advice | None:
    rows = report.kernels.memcpy
    pageable_us = sum(row.pageable_us for row in rows)
    share = _fraction(report, pageable_us)
    if share < 0.01:
        return None
    count = sum(row.pageable_count for row in rows)
    mib = sum(row.pageable_bytes for row in rows) / 2**20
    return Advice(
        "pageable_copies",
        "Host copies use pageable memory",
        _action(
            report,
            "Set `data.pin_memory = true` and copy with `.to(device, non_blocking=True)`; pin "
            "any host buffers used for offload.",
            "Pin host batches (`DataLoader(..., pin_memory=True)` or `tensor.pin_memory()`) and copy "
            "with `.to(device, non_blocking=True)`; pin any host buffers used for offload.",
        ),
        f"{count} copies of pageable memory ({mib:.0f} MiB, {_per_step(report, pageable_us)}, "
        f"{share:.0%} of step time); pinned copies are faster and do not block the host.",
        0.5 * share,
    )


def _host_evidence(report: RankReport, idle: float, share: float) -> str:
    util = report.utilisation
    every = f", one every {util.mean_step_us / util.launches_per_step:.0f} µs" if util.launches_per_step else ""
    return (
        f"GPU idle {_per_step(report, idle)} ({share:.0%} of step time) while the host was issuing work; "
        f"mean kernel {report.bound.mean_kernel_us:.1f} µs, {util.launches_per_step:.0f} GPU launches per "
        f"step{every}."
    )


def launch_bound(report: RankReport) -> Advice | None:
    idle = report.utilisation.idle_us["host"]
    share = _fraction(report, idle)
    if report.bound.mean_kernel_us >= SHORT_KERNEL_US or share < 0.10:
        return None
    return Advice(
        "launch_bound",
        "Many short kernels: the GPU outruns the host",
        _action(
            report,
            'Set `train.compile = "on"` (fuses small kernels into fewer launches) or capture the step '
            "in CUDA graphs; a larger `train.micro_batch_size` gives each kernel more work.",
            "Compile the model, `model = torch.compile(model)` (fuses small kernels into fewer launches; "
            '`mode="reduce-overhead"` also replays them as a CUDA graph); a larger batch gives each '
            "kernel more work.",
        ),
        _host_evidence(report, idle, share),
        share,
    )


def host_bound(report: RankReport) -> Advice | None:
    """Host-caused idle with kernels long enough that launching them is not the cost: the host spends
    its time elsewhere between launches (Python, CPU work in the loop)."""
    idle = report.utilisation.idle_us["host"]
    share = _fraction(report, idle)
    if report.bound.mean_kernel_us < SHORT_KERNEL_US or share < 0.10:
        return None
    return Advice(
        "host_bound",
        "The host issues work too slowly: Python or CPU work between launches",
        _action(
            report,
            "Find what the host does between launches (`profile.with_stack = true`, or py-spy) and move "
            "CPU work out of the step (data work into `data.num_workers`); "
            '`train.compile = "on"` cuts Python and dispatcher overhead, and a larger '
            "`train.micro_batch_size` gives each launch more work.",
            "Find what the host does between launches (`torch.profiler.profile(with_stack=True)`, or "
            "py-spy) and move CPU work out of the training loop (metrics every N steps, data work into "
            "`DataLoader(num_workers=...)`); `torch.compile(model)` cuts Python and dispatcher overhead, "
            "and a larger batch gives each launch more work.",
        ),
        _host_evidence(report, idle, share),
        share,
    )


def fp32_gemm(report: RankReport) -> Advice | None:
    gemm = report.bound.gemm
    share = _fraction(report, gemm.fp32_time_us)
    if gemm.time_us <= 0 or gemm.fp32_time_us < 0.1 * gemm.time_us or share < 0.02:
        return None
    return Advice(
        "fp32_gemm",
        "Matrix multiplies run in fp32",
        _action(
            report,
            'Train in bf16 (`train.precision = "bf16"`), FP8 for large linear layers (`train.fp8`).',
            'Run forward and loss under `torch.autocast("cuda", dtype=torch.bfloat16)`; at the least '
            'allow TF32: `torch.set_float32_matmul_precision("high")`.',
        ),
        f"{gemm.fp32_time_us / gemm.time_us:.0%} of GEMM time ({share:.0%} of step time) is "
        "in fp32/TF32 GEMMs (fp32 inputs or sgemm/tf32 kernels).",
        0.5 * share,
    )


def small_gemm(report: RankReport) -> Advice | None:
    gemm = report.bound.gemm
    share = _fraction(report, gemm.small_time_us)
    if gemm.time_us <= 0 or gemm.small_time_us < 0.5 * gemm.time_us or share < 0.10:
        return None
    achieved = f" (achieved {gemm.tflops:.0f} TFLOP/s)" if gemm.tflops else ""
    return Advice(
        "small_gemm",
        "GEMMs are too small to fill the GPU",
        _action(
            report,
            "Raise `train.micro_batch_size` (lower `train.grad_accum_steps` to keep the global "
            "batch) or `data.seq_len`, so each GEMM has more rows.",
            "Raise the batch size (fewer gradient-accumulation steps keep the global batch) or the "
            "sequence length, so each GEMM has more rows.",
        ),
        f"{gemm.small_time_us / gemm.time_us:.0%} of GEMM time is in GEMMs with fewer than "
        f"1024 rows running below 30% of peak{achieved}.",
        0.5 * share,
    )


def sync_stalls(report: RankReport) -> Advice | None:
    util = report.utilisation
    idle = util.idle_us["sync"]
    share = _fraction(report, idle)
    if share < 0.05:
        return None
    return Advice(
        "sync_stalls",
        "Host synchronisations drain the GPU queue",
        _action(
            report,
            "Raise `logging.log_interval` (metrics are read back, one host sync, once per interval); "
            "look for `.item()`, `.cpu()` or `print(tensor)` in model code run inside the step.",
            "Remove `.item()`, `.cpu()`, `.tolist()`, `print(tensor)` and `torch.cuda.synchronize()` "
            "from the step: accumulate metrics on the GPU and read them back every N steps; avoid "
            "data-dependent shapes (`nonzero`, boolean-mask indexing) in the step.",
        ),
        f"GPU idle {_per_step(report, idle)} ({share:.0%} of step time) while the host waited in "
        f"{util.syncs_per_step:.0f} syncs per step (cudaStreamSynchronize, .item(), ...) and refilled "
        "the queue after them.",
        share,
    )


def memory_headroom(report: RankReport) -> Advice | None:
    memory = report.memory
    if memory is None or memory.headroom_fraction is None or memory.headroom_fraction < 0.4:
        return None
    peak_gib, capacity_gib = memory.peak_reserved_bytes / 2**30, (memory.capacity_bytes or 0) / 2**30
    return Advice(
        "memory_headroom",
        "GPU memory is left unused",
        _action(
            report,
            "Use it: raise `train.micro_batch_size`, or recompute fewer activations (`memory.recompute`).",
            "Use it: raise the batch size, or checkpoint fewer activations (`torch.utils.checkpoint`).",
        ),
        f"peak reserved {peak_gib:.1f} GiB of {capacity_gib:.1f} GiB ({memory.headroom_fraction:.0%} unused).",
        None,
    )


def exposed_comm(report: RankReport) -> Advice | None:
    comm = report.communication
    if comm.exposed_fraction < 0.05:
        return None
    return Advice(
        "exposed_comm",
        "Communication is not hidden behind compute",
        _action(
            report,
            "Communicate less often (raise `train.grad_accum_steps`) and check for a straggler rank.",
            "Overlap it: tune `DistributedDataParallel(bucket_cap_mb=...)` or FSDP prefetching, "
            "accumulate gradients under `model.no_sync()` to communicate less often, and check for a "
            "straggler rank.",
        ),
        f"{comm.exposed_us / 1e3:.2f} ms of NCCL time ({comm.exposed_fraction:.0%} of step "
        f"time) ran with no compute alongside ({comm.overlap_fraction:.0%} overlapped).",
        comm.exposed_fraction,
    )


RULES: tuple[Callable[[RankReport], Advice | None], ...] = (
    data_loader,
    pageable_copies,
    launch_bound,
    host_bound,
    fp32_gemm,
    small_gemm,
    sync_stalls,
    memory_headroom,
    exposed_comm,
)


def _by_gain(advice: Advice) -> float:
    return -(advice.gain if advice.gain is not None else -1.0)


def advise(report: RankReport) -> list[Advice]:
    """Every rule that fires for this rank, largest estimated gain first."""
    found = [replace(a, rank=report.rank) for rule in RULES if (a := rule(report)) is not None]
    return sorted(found, key=_by_gain)


def merge_advice(per_rank: list[list[Advice]]) -> list[Advice]:
    """One advice per rule across ranks: the rank where it gains most."""
    best: dict[str, Advice] = {}
    for advice in (a for rank_advice in per_rank for a in rank_advice):
        current = best.get(advice.rule)
        if current is None or _by_gain(advice) < _by_gain(current):
            best[advice.rule] = advice
    return sorted(best.values(), key=_by_gain)
