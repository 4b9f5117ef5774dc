"""`plan(PlanInput) -> Plan`: the memory and time models together, a fit verdict and advice."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from tracetrain.plan.inputs import PlanInput
from tracetrain.plan.memory import GIB, MemoryPlan, plan_memory
from tracetrain.plan.step import StepTime, plan_time


@dataclass
class Plan:
    """Per-GPU memory (bytes) at the peak phase, step time (seconds) by kind, throughput and MFU."""

    input: PlanInput
    memory: MemoryPlan
    time: StepTime
    advice: list[str] = field(default_factory=list)
    reason: str = ""  # one line, set by `search` for ranked rows
    reason_batch_changed: bool = False  # search: the layout could not keep the asked global batch

    @property
    def fits(self) -> bool:
        return self.memory.fits

    @property
    def tokens_per_s(self) -> float:
        return self.time.tokens_per_s

    @property
    def mfu(self) -> float:
        return self.time.mfu

    @property
    def step_s(self) -> float:
        return self.time.step_s

    @property
    def peak_gib(self) -> float:
        return self.memory.peak_bytes / GIB

    def layout(self) -> str:
        """Short layout label, e.g. 'fsdp8' or 'dp2 fsdp2 tp2 pp2(1f1b)'."""
        i = self.input
        parts = []
        if i.dp_replicate > 1:
            parts.append(f"dp{i.dp_replicate}")
        if i.dp_shard > 1:
            parts.append(f"fsdp{i.dp_shard}" if i.zero_stage == 3 else f"zero{i.zero_stage}x{i.dp_shard}")
        if i.tp > 1:
            parts.append(f"tp{i.tp}" + ("+sp" if i.sequence_parallel else ""))
        if i.pp > 1:
            v = f" x{i.pp_virtual_stages}" if i.pp_schedule == "interleaved_1f1b" else ""
            parts.append(f"pp{i.pp}({i.pp_schedule}{v})")
        if i.cp > 1:
            parts.append(f"cp{i.cp}")
        if i.ep > 1:
            parts.append(f"ep{i.ep}")
        return " ".join(parts) or "single GPU"

    def to_dict(self) -> dict[str, Any]:
        i = asdict(self.input)
        i["model"] = asdict(self.input.model)
        m = self.memory
        return {
            "input": i,
            "layout": self.layout(),
            "fits": self.fits,
            "reason": self.reason,
            "advice": self.advice,
            "memory": {
                "stage": m.stage,
                "peak_phase": m.peak_phase,
                "peak_bytes": m.peak_bytes,
                "breakdown_bytes": m.breakdown,
                "phases_bytes": m.phases,
                "fragmentation_bytes": m.fragmentation_bytes,
                "context_bytes": m.context_bytes,
                "required_bytes": m.required_bytes,
                "build_peak_bytes": m.build_peak_bytes,
                "build_required_bytes": m.build_required_bytes,
                "step_peak_bytes": m.step_peak_bytes,
                "capacity_bytes": m.capacity_bytes,
                "spare_bytes": m.spare_bytes,
                "cpu_bytes": m.cpu_bytes,
                "managed_bytes": m.managed_bytes,
            },
            "time": {
                "step_s": self.step_s,
                "breakdown_s": self.time.breakdown,
                "comm_total_s": self.time.comm_total,
                "tokens_per_s": self.tokens_per_s,
                "mfu": self.mfu,
                "hfu": self.time.hfu,
                "model_flops_per_step": self.time.model_flops,
            },
        }


def plan(inp: PlanInput) -> Plan:
    """Plan one run: validates `inp` (ValueError naming the field), then memory, time and advice."""
    inp.validate()
    p = Plan(inp, plan_memory(inp), plan_time(inp))
    p.advice = advice(p)
    return p


def max_micro_batch(inp: PlanInput) -> int:
    """Largest micro-batch (sequences) that still fits, from the affine memory model (0 if none)."""
    cap = inp.hardware().memory_bytes
    lo, hi = 0, 1
    while hi <= 4096 and _fits_at(inp, hi, cap):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if _fits_at(inp, mid, cap) else (lo, mid)
    return lo


def _fits_at(inp: PlanInput, micro_batch: int, cap: float) -> bool:
    return plan_memory(inp.replace(micro_batch=micro_batch)).required_bytes <= cap


def advice(p: Plan) -> list[str]:
    """Short, actionable notes: what dominates memory and time, and what would change it."""
    out: list[str] = []
    i, m, t = p.input, p.memory, p.time
    peak = m.peak_bytes
    share = {k: v / peak for k, v in m.breakdown.items()}
    gib = lambda b: f"{b / GIB:.1f} GiB"  # noqa: E731
    if m.host_bytes_per_node > m.host_capacity_bytes:
        out.append(
            f"host memory: offloaded state needs {gib(m.host_bytes_per_node)} per node of {gib(m.host_capacity_bytes)}"
        )
    if m.required_bytes > m.capacity_bytes:
        out.append(
            f"does not fit: needs {gib(m.required_bytes)} of {gib(m.capacity_bytes)} "
            f"(peak at {m.peak_phase}); largest item: {max(share, key=lambda k: share[k])}"
        )
        out.append(_build_advice(m))
        if share.get("activations", 0) > 0.3 and i.recompute != "full":
            out.append(
                "activations dominate: try memory.recompute="
                + ("selective" if i.recompute == "none" else "full")
                + " or a smaller micro-batch"
            )
        if share.get("AdamW states", 0) > 0.25 and not i.optimizer_offload:
            out.append(
                "optimizer states are large: shard them (FSDP/ZeRO over more GPUs) or memory.optimizer_offload=true"
            )
    elif m.host_bytes_per_node <= m.host_capacity_bytes:  # (a host that is too small was said above)
        mb = max_micro_batch(i)
        if mb > i.micro_batch:
            out.append(f"fits with {gib(m.spare_bytes)} spare; micro-batch could grow to {mb}")
        else:
            out.append(f"fits with {gib(m.spare_bytes)} spare")
    loss = m.breakdown.get("logits / loss", 0)
    if loss > 0.15 * peak and not i.model.final_logit_softcap:  # the fused loss does not soft-cap (spec.py)
        out.append(
            f"loss buffers (12 x tokens x vocab bytes at backward start) are {gib(loss)}: a chunked or fused "
            "cross-entropy would remove most of them"
        )
    casts = m.breakdown.get("autocast bf16 weight copies", 0)
    if casts > 0.05 * peak:
        out.append(
            f"autocast keeps {gib(casts)} of bf16 weight copies until backward; bf16 weights "
            "(FSDP mixed precision) would drop them"
        )
    mem_bound = t.breakdown.get("memory-bound", 0) / t.step_s
    if mem_bound > 0.25:
        out.append(
            f"memory-bound ops (fp32 RMSNorm and RoPE math, casts, SwiGLU, loss) take {mem_bound:.0%} of the "
            "step; fusing them (torch.compile, fused kernels) is the biggest time lever"
        )
    comm_exposed = sum(v for k, v in t.breakdown.items() if "comm" in k)
    if comm_exposed > 0.1 * t.step_s:
        out.append(f"exposed communication is {comm_exposed / t.step_s:.0%} of the step")
    if t.breakdown.get("pipeline bubble", 0) > 0.1 * t.step_s:
        out.append("pipeline bubble above 10%: raise the number of micro-batches or use the interleaved schedule")
    return out


def _build_advice(m: MemoryPlan) -> str:
    """What the build (each rank materialising its shard of the weights) needs next to the step."""
    gib = f"{m.build_required_bytes / GIB:.1f} GiB"
    if m.build_required_bytes > m.capacity_bytes:
        return (
            f"the build alone does not fit: materialising this rank's shard of the weights needs {gib} "
            "(the shard in its final dtype + one fp32 chunk of initial values); shard the weights over "
            "more GPUs (parallel.dp_shard, tp or pp)"
        )
    return f"the build (materialising this rank's shard of the weights) fits with {gib}; the step does not"
