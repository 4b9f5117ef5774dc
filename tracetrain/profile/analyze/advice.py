"""What to change: rules over a rank's analysis tables, each with its evidence and estimated gain.

A rule is a small function `RankReport -> Advice | None`. `gain` predicts the fraction of the step
that fixing the cause gives back (what the step would lose), `gain_ms` the same per step in ms, and
`gain_range` the (low, high) fractions where the prediction is uncertain; None when the benefit is not
a time saving on this trace. Shares are of the step time without the profiler's own host-side cost
(`RankReport.real_steps_us`, overhead.py): host-paced idle is read less what recording added, and the
range runs up to the share read literally from the trace. Host idle that `host_gaps.py` puts on a
named host activity (a CPU optimizer step, a recompilation, a blocking pageable copy) goes to that
activity's rule, not to host_bound/launch_bound.

| rule            | fires when                                                          | gain            |
|-----------------|---------------------------------------------------------------------|-----------------|
| data_loader     | GPU idle while the host loads data >= 5% of step time               | that idle time  |
| pageable_copies | copies from/to pageable host memory >= 1% of step time              | 3/4 their time  |
|                 |                                                                     | (all of the     |
|                 |                                                                     | bytes that go   |
|                 |                                                                     | out and come    |
|                 |                                                                     | back) + host    |
|                 |                                                                     | blocked         |
| cpu_optimizer   | GPU idle while the optimizer step runs CPU operators >= 5%          | that idle time  |
|                 |                                                                     | + the copies    |
| recompilation   | GPU idle while the host compiles (Dynamo/Inductor) >= 5%            | that idle time  |
| launch_bound    | mean kernel < 10 µs and host-caused GPU idle >= 10% of step time    | half that idle  |
| host_bound      | mean kernel >= 10 µs and host-caused GPU idle >= 10% of step time   | that idle time  |
|                 | (Python overhead or CPU work between launches, not kernel size)     |                 |
| fp32_gemm       | fp32/TF32 GEMMs >= 10% of GEMM time and >= 2% of step time          | 85% their time  |
| small_gemm      | GEMMs with m < 1024 below 30% of peak: >= half of GEMM time and     | half their time |
|                 | >= 10% of step time                                                 |                 |
| sync_stalls     | GPU idle charged to host syncs (`.item()`, ...) >= 5% of step time  | that idle time  |
|                 | (its round trip is never corrected away, overhead.py; listed before | (round trip     |
|                 | host/launch_bound when it holds most of its refill, syncs.py)       | kept)           |
| memory_headroom | peak reserved memory leaves >= 40% of the GPU's memory unused       | None            |
| exposed_comm    | NCCL transfer time not overlapped by compute, while compute the     | half that time  |
|                 | host had already launched waited for it, >= 5% of step time         | (overlapping    |
|                 | (waiting for a late peer is not transfer: see collectives.py; in a  | slows compute,  |
|                 | host-paced step the GPU would have idled for the host anyway)       | the last bucket |
|                 |                                                                     | stays exposed)  |

The cross-rank rules (a straggler, unbalanced pipeline stages, an all-reduce per micro-batch) read
all ranks at once and live in collectives.py.

Actions are said in the trace's own terms: a trace of tracetrain's trainer (its phase ranges are named
`tracetrain/<phase>`, see `phases.py`) gets tracetrain's config keys (`data.num_workers`); any other
program's trace gets the plain PyTorch change (`DataLoader(num_workers=...)`, `torch.autocast`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Final

from tracetrain.profile.analyze.bound import SHORT_KERNEL_US
from tracetrain.profile.analyze.host_gaps import activity
from tracetrain.profile.analyze.kernels import MemcpyRow
from tracetrain.profile.analyze.syncs import refill_share, sync_remedy

if TYPE_CHECKING:
    from tracetrain.profile.analyze.report import RankReport


@dataclass(frozen=True)
class Advice:
    """One recommendation: which rule, what to do, the numbers behind it, and the predicted gain."""

    rule: str
    title: str
    action: str
    evidence: str
    gain: float | None
    rank: int | None = None
    gain_ms: float | None = None  # per step
    gain_range: tuple[float, float] | None = None  # (low, high) fractions of the step
    # Rules this one is listed before when both fire, whatever their gains (`rank_advice`).
    ahead_of: tuple[str, ...] = ()


def gain_text(advice: Advice) -> str:
    """`predicted gain 23% of the step (4.10 ms per step; 18-30%)`, or "" without a gain."""
    if not advice.gain:
        return ""
    ms = f"{advice.gain_ms:.2f} ms per step" if advice.gain_ms is not None else ""
    low, high = advice.gain_range or (advice.gain, advice.gain)
    span = f"{low:.0%}-{high:.0%}" if round(low, 2) != round(high, 2) else ""
    detail = "; ".join(part for part in (ms, span) if part)
    return f"predicted gain {advice.gain:.0%} of the step" + (f" ({detail})" if detail else "")


def _by_tracetrain(report: RankReport) -> bool:
    """Whether tracetrain's trainer wrote the trace (its `tracetrain/<phase>` ranges are in it)."""
    return any(row.from_tracetrain for row in report.phases)


def _action(report: RankReport, tracetrain: str, pytorch: str) -> str:
    """The action in the trace's terms: tracetrain config keys for its own traces, else plain PyTorch."""
    return tracetrain if _by_tracetrain(report) else pytorch


def _num_steps(report: RankReport) -> int:
    return max(len(report.utilisation.steps), 1)


def _per_step(report: RankReport, us: float) -> str:
    return f"{us / _num_steps(report) / 1e3:.2f} ms per step"


def _fraction(report: RankReport, us: float) -> float:
    """A share of the step without the profiler's host-side cost."""
    return us / report.real_steps_us if report.real_steps_us > 0 else 0.0


def _literal(report: RankReport, us: float) -> float:
    """A share of the step as the trace shows it (profiler cost included)."""
    return us / report.utilisation.steps_us if report.utilisation.steps_us > 0 else 0.0


def _advice(
    report: RankReport,
    rule: str,
    title: str,
    action: str,
    evidence: str,
    gain: float,
    low: float | None = None,
    high: float | None = None,
) -> Advice:
    """An advice with its gain in ms per step (of the step without the profiler) and its range."""
    step_ms = report.real_steps_us / _num_steps(report) / 1e3
    # A cause cannot give back more than the whole step (shares corrected apart can overshoot).
    gain = min(gain, 1.0)
    low, high = (None if x is None else min(x, 1.0) for x in (low, high))
    span = None if low is None or high is None else (min(low, gain), max(high, gain))
    return Advice(rule, title, action, evidence, gain, gain_ms=gain * step_ms, gain_range=span)


def _host_paced(report: RankReport, cause: str) -> tuple[float, float, float]:
    """(predicted share, low, high) of one host-paced idle cause: corrected, and as read literally."""
    share = _fraction(report, report.real_idle_us(cause))
    return share, share, max(share, _literal(report, report.utilisation.idle_us[cause]))


def data_loader(report: RankReport) -> Advice | None:
    share, low, high = _host_paced(report, "data_loader")
    if share < 0.05:
        return None
    return _advice(
        report,
        "data_loader",
        "The GPU waits for the data loader",
        _action(
            report,
            "Raise `data.num_workers` (and `data.prefetch_factor`), keep `data.pin_memory = true`, "
            "and tokenize/pack the dataset ahead of time.",
            "Load in worker processes: `DataLoader(..., num_workers=N, pin_memory=True, "
            "persistent_workers=True)`, and tokenize, decode or augment ahead of time, not in the loop.",
        ),
        f"GPU idle {_per_step(report, report.real_idle_us('data_loader'))} ({share:.0%} of step time) while the "
        f"host was in data-loading ranges{_top_ops(report, 'data_loader')}.",
        share,
        low,
        high,
    )


def _top_ops(report: RankReport, activity_name: str) -> str:
    row = activity(report.host_gaps, activity_name)
    if not row.top:
        return ""
    return " (" + ", ".join(f"{name} {us / _num_steps(report) / 1e3:.2f} ms" for name, us in row.top) + " per step)"


def pageable_copies(report: RankReport) -> Advice | None:
    rows = report.kernels.memcpy
    pageable_us = sum(row.pageable_us for row in rows)
    share = _fraction(report, pageable_us)
    if share < 0.01:
        return None
    count = sum(row.pageable_count for row in rows)
    mib = sum(row.pageable_bytes for row in rows) / 2**20
    # Pinned copies run 2-4x faster and asynchronously (on the advice-truth corpus, H200: pinning a
    # 128 MiB batch gave back 43% of a step whose pageable copies were 32% of it, with the host freed).
    blocked = _fraction(report, activity(report.host_gaps, "pageable_copy").corrected_us)
    # Bytes that go out and come back (saved activations, offloaded states) need not move at all: kept
    # on the GPU, recomputed, or copied on a side stream under compute, their whole time comes back
    # (activations saved to pageable memory, H200: 84% of the step in copies, 99% given back).
    round_trip = _round_trip_fraction(rows)
    kept = 0.75 + 0.25 * round_trip
    return _advice(
        report,
        "pageable_copies",
        "Host copies use pageable memory",
        _action(
            report,
            "Set `data.pin_memory = true` and copy with `.to(device, non_blocking=True)`; activations "
            "offloaded and brought back are best kept on the GPU if they fit (`memory.activation_offload = "
            '"none"`), else recomputed (`memory.recompute`) or streamed under compute '
            '(`memory.activation_offload = "streamed"`).',
            "Pin host batches (`DataLoader(..., pin_memory=True)` or `tensor.pin_memory()`) and copy "
            "with `.to(device, non_blocking=True)`; tensors offloaded and brought back (activations under "
            "`save_on_cpu`) are best kept on the GPU if they fit, else recomputed (`torch.utils.checkpoint`) "
            "or offloaded into pinned buffers (`save_on_cpu(pin_memory=True)`).",
        ),
        f"{count} copies of pageable memory ({mib:.0f} MiB, {_per_step(report, pageable_us)}, "
        f"{share:.0%} of step time); pinned copies are faster and do not block the host"
        + (
            f"; {round_trip:.0%} of the bytes go to the host and come back (offloaded tensors)."
            if round_trip >= 0.1
            else "."
        ),
        kept * share + blocked,
        0.5 * share + blocked,
        share + blocked,
    )


def _round_trip_fraction(rows: list[MemcpyRow]) -> float:
    """The share of pageable bytes that go to the host and back: twice the smaller direction."""
    by_direction = {row.direction: row.pageable_bytes for row in rows}
    total = sum(by_direction.values())
    out, back = by_direction.get("d2h", 0), by_direction.get("h2d", 0)
    return 2 * min(out, back) / total if total else 0.0


_NAMED_HOST: Final = ("cpu_optimizer", "compile", "pageable_copy")
LAUNCH_FUSED: Final = 0.5  # the share of launch-bound idle that fusing kernels gives back
# The share of exposed communication that overlapping it gives back: the last bucket (or first
# all-gather) stays exposed and NCCL kernels beside the compute slow it. On the advice-truth corpus
# (H200, NVLink) default DDP buckets against one bucket after the backward gave back 48% of its
# exposed all-reduce time, and nothing at 3x the size.
OVERLAP_RETURNED: Final = 0.5


def _host_residual(report: RankReport) -> tuple[float, float, float]:
    """Host idle (share, low, high) not put on a named activity (CPU optimizer, compile, copies)."""
    named = sum(activity(report.host_gaps, a).corrected_us for a in _NAMED_HOST)
    share = _fraction(report, max(report.real_idle_us("host") - named, 0.0))
    literal = _literal(report, max(report.utilisation.idle_us["host"] - named, 0.0))
    return share, share, max(share, literal)


def _host_evidence(report: RankReport, share: float) -> str:
    util = report.utilisation
    every = f", one every {util.mean_step_us / util.launches_per_step:.0f} µs" if util.launches_per_step else ""
    doing = [row for row in report.host_gaps if row.activity in ("python", "dispatch", "cpu_ops")]
    during = (
        "; meanwhile the host was "
        + ", ".join(
            f"{_DOING[row.activity]} {row.idle_us / max(util.steps_us, 1e-9):.0%}"
            + (f" ({', '.join(name for name, _ in row.top[:2])})" if row.top else "")
            for row in doing
        )
        if doing
        else ""
    )
    return (
        f"GPU idle {share:.0%} of step time while the host was issuing work{during}; "
        f"mean kernel {report.bound.mean_kernel_us:.1f} µs, {util.launches_per_step:.0f} GPU launches per "
        f"step{every}."
    )


_DOING: Final = {"python": "in Python between ops", "dispatch": "dispatching GPU ops", "cpu_ops": "in CPU-only ops"}


def launch_bound(report: RankReport) -> Advice | None:
    idle, _, literal = _host_residual(report)
    if report.bound.mean_kernel_us >= SHORT_KERNEL_US or idle < 0.10:
        return None
    # Fusing (torch.compile) removes about half the launches, the GEMMs and the rest stay: half the
    # idle comes back (45% of a 93%-idle step on the advice-truth corpus); CUDA graphs can give all.
    share = LAUNCH_FUSED * idle
    return _advice(
        report,
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
        _host_evidence(report, idle),
        share,
        0.3 * idle,
        literal,
    )


def host_bound(report: RankReport) -> Advice | None:
    """Host-caused idle with kernels long enough that launching them is not the cost: the host spends
    its time elsewhere between launches (Python, CPU work in the loop)."""
    share, low, high = _host_residual(report)
    if report.bound.mean_kernel_us < SHORT_KERNEL_US or share < 0.10:
        return None
    return _advice(
        report,
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
        _host_evidence(report, share),
        share,
        low,
        high,
    )


def cpu_optimizer(report: RankReport) -> Advice | None:
    row = activity(report.host_gaps, "cpu_optimizer")
    share = _fraction(report, row.corrected_us)
    if share < 0.05:
        return None
    # States on the host bring their copies: gradients down, weights up, through pageable memory when
    # not pinned. Stepping on the GPU removes them too.
    copies = _fraction(report, sum(r.pageable_us for r in report.kernels.memcpy))
    copies += _fraction(report, activity(report.host_gaps, "pageable_copy").corrected_us)
    return _advice(
        report,
        "cpu_optimizer",
        "The optimizer step runs on the CPU while the GPU waits",
        _action(
            report,
            "Step the optimizer on the GPU (turn `memory.optimizer_offload` off if the states fit); if "
            "they must live on the host, overlap their transfer and CPU step with the next step's compute.",
            "Keep parameters and optimizer states on the GPU and use a fused optimizer "
            "(`torch.optim.AdamW(model.parameters(), fused=True)`); if the states must live on the host, "
            "use an offload that overlaps the CPU step and the copies with compute (DeepSpeed "
            "ZeRO-Offload, torchao's `CPUOffloadOptimizer`) and pinned buffers.",
        ),
        f"GPU idle {_per_step(report, row.corrected_us)} ({share:.0%} of step time) while the host ran the "
        f"optimizer step's CPU operators{_top_ops(report, 'cpu_optimizer')}; pageable copies to and from the "
        f"host take {copies:.0%} more.",
        share + copies,
        share,
        max(share + copies, _literal(report, row.idle_us) + copies),
    )


def recompilation(report: RankReport) -> Advice | None:
    row = activity(report.host_gaps, "compile")
    share = _fraction(report, row.corrected_us)
    if share < 0.05:
        return None
    return _advice(
        report,
        "recompilation",
        "torch.compile recompiles inside the training step",
        _action(
            report,
            "Keep shapes fixed from step to step (`data.pack = true` or a fixed `data.seq_len`); run with "
            "`TORCH_LOGS=recompiles` to see which guard fails.",
            "Find the failing guard with `TORCH_LOGS=recompiles`; for changing sequence lengths let shapes be "
            "dynamic (`torch.compile(model)` without `dynamic=False`, or `torch._dynamo.mark_dynamic`) or pad "
            "to a few bucket lengths; do not pass changing Python numbers into the compiled function.",
        ),
        f"GPU idle {_per_step(report, row.corrected_us)} ({share:.0%} of step time) while the host was "
        f"compiling{_top_ops(report, 'compile')}.",
        share,
        share,
        max(share, _literal(report, row.idle_us)),
    )


def fp32_gemm(report: RankReport) -> Advice | None:
    gemm = report.bound.gemm
    share = _fraction(report, gemm.fp32_time_us)
    if gemm.time_us <= 0 or gemm.fp32_time_us < 0.1 * gemm.time_us or share < 0.02:
        return None
    # bf16 tensor cores run a GEMM 2x (against TF32) to 16x (against plain fp32) faster; on the
    # advice-truth corpus (H200, fp32 without TF32) autocast gave back 85% of the step.
    return _advice(
        report,
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
        0.85 * share,
        0.5 * share,
        0.94 * share,
    )


def small_gemm(report: RankReport) -> Advice | None:
    gemm = report.bound.gemm
    share = _fraction(report, gemm.small_time_us)
    if gemm.time_us <= 0 or gemm.small_time_us < 0.5 * gemm.time_us or share < 0.10:
        return None
    achieved = f" (achieved {gemm.tflops:.0f} TFLOP/s)" if gemm.tflops else ""
    return _advice(
        report,
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
        0.25 * share,
        0.75 * share,
    )


def sync_stalls(report: RankReport) -> Advice | None:
    util = report.utilisation
    share, low, high = _host_paced(report, "sync")
    if share < 0.05:
        return None
    # The syncs and the host's pace charge parts of the same refill; where the syncs' part is the
    # larger, removing them is the first thing to do, and the host's pace is read again after.
    ahead = ("host_bound", "launch_bound") if refill_share(report) > 0.5 else ()
    many = util.syncs_per_step >= 16
    per_item = (
        " That many syncs a step is one per tensor (a `.item()` per parameter or per logged value): "
        "stack the values on the GPU and read them once."
        if many
        else ""
    )
    advice = _advice(
        report,
        "sync_stalls",
        "Host synchronisations drain the GPU queue",
        _action(
            report,
            "Raise `logging.log_interval` (metrics are read back, one host sync, once per interval); "
            "look for `.item()`, `.cpu()` or `print(tensor)` in model code run inside the step.",
            sync_remedy(report),
        )
        + per_item,
        f"GPU idle {_per_step(report, report.real_idle_us('sync'))} ({share:.0%} of step time) while the host "
        f"waited in {util.syncs_per_step:.0f} syncs per step{_top_ops(report, 'sync')} and refilled the queue "
        "after them.",
        share,
        low,
        high,
    )
    return replace(advice, ahead_of=ahead)


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
    """Exposed NCCL time; with the peers' traces (collectives.py), the transfer part only: a kernel
    that waits for a late peer is not slow communication."""
    comm = report.communication
    exposed_us = delaying_comm_us(report)
    share = _fraction(report, exposed_us)
    if share < 0.05:
        return None
    waited = (
        f"; {1 - report.transfer_fraction:.0%} of NCCL time was waiting for a peer and is not counted"
        if report.transfer_fraction is not None and report.transfer_fraction < 0.95
        else ""
    )
    return _advice(
        report,
        "exposed_comm",
        "Communication is not hidden behind compute",
        _action(
            report,
            "Communicate less often (raise `train.grad_accum_steps`) and check for a straggler rank.",
            "Overlap it: keep DDP's default buckets (`bucket_cap_mb=25`; one huge bucket starts the "
            "all-reduce only after the whole backward), enable FSDP prefetching (`backward_prefetch="
            "BackwardPrefetch.BACKWARD_PRE`, `forward_prefetch=True`; FSDP2 prefetches by default), and "
            "accumulate gradients under `model.no_sync()` to communicate less often.",
        ),
        f"{exposed_us / _num_steps(report) / 1e3:.2f} ms of NCCL transfer per step ({share:.0%} of step "
        f"time) ran with no compute alongside while compute already launched waited for it "
        f"({comm.overlap_fraction:.0%} of NCCL time overlapped){waited}.",
        OVERLAP_RETURNED * share,
        0.0,
        max(share, _literal(report, comm.exposed_us)),
    )


def delaying_comm_us(report: RankReport) -> float:
    """NCCL time that cost this rank's step: exposed (no compute alongside) while compute the host had
    already launched waited for it, and transfer, not waiting for a late peer (collectives.py)."""
    if report.delaying_transfer_us is not None:
        return report.delaying_transfer_us
    return report.collectives.delaying_us if report.collectives is not None else report.communication.exposed_us


RULES: tuple[Callable[[RankReport], Advice | None], ...] = (
    data_loader,
    pageable_copies,
    cpu_optimizer,
    recompilation,
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


def rank_advice(found: list[Advice]) -> list[Advice]:
    """Largest predicted gain first, except that an advice goes before the rules in its `ahead_of`."""
    ordered = sorted(found, key=_by_gain)
    for advice in [a for a in ordered if a.ahead_of]:
        behind = [i for i, a in enumerate(ordered) if a.rule in advice.ahead_of]
        if behind and min(behind) < ordered.index(advice):
            ordered.remove(advice)
            ordered.insert(min(behind), advice)
    return ordered


def advise(report: RankReport) -> list[Advice]:
    """Every rule that fires for this rank, largest predicted gain first but for `ahead_of`."""
    return rank_advice([replace(a, rank=report.rank) for rule in RULES if (a := rule(report)) is not None])


def merge_advice(per_rank: list[list[Advice]]) -> list[Advice]:
    """One advice per rule across ranks: the rank where it gains most."""
    best: dict[str, Advice] = {}
    for advice in (a for rank_advice in per_rank for a in rank_advice):
        current = best.get(advice.rule)
        if current is None or _by_gain(advice) < _by_gain(current):
            best[advice.rule] = advice
    return rank_advice(list(best.values()))
