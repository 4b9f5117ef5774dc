"""A whole optimizer step: micro-batches (time.py) x their number, exposed communication (collective_time.py),
once-per-step work (gradient accumulation, AdamW, DP sync, offload transfers) and the pipeline bubble.
Formulas and overlap rules are in time.py's docstring."""

from __future__ import annotations

from dataclasses import dataclass

from tracetrain.plan import collective_time as comm
from tracetrain.plan import traffic as tr
from tracetrain.plan.activations import Numerics, numerics
from tracetrain.plan.inputs import Hardware, PlanInput
from tracetrain.plan.memory import in_flight, memory_model, tokens_per_microbatch
from tracetrain.plan.params import stage_params
from tracetrain.plan.time import (
    CPU_ACCUMULATE_BYTES_PER_PARAM,
    CPU_ADAM_BYTES_PER_PARAM,
    DP_OVERLAP,
    HBM_EFFICIENCY,
    MicroBatchTime,
    microbatch_time,
    step_flops,
)


@dataclass
class StepTime:
    """Seconds per optimizer step on one GPU by kind, and the throughput that follows."""

    breakdown: dict[str, float]  # exposed seconds per kind; they sum to step_s
    comm_total: dict[str, float]  # communication seconds before overlap, per kind
    step_s: float
    tokens_per_s: float  # all GPUs
    model_flops: float  # per step, all GPUs (MFU)
    hardware_flops: float  # with recomputation (HFU)
    mfu: float
    hfu: float


def _add(d: dict[str, float], k: str, v: float) -> None:
    d[k] = d.get(k, 0.0) + v


def _comm_per_microbatch(
    inp: PlanInput, hw: Hardware, nm: Numerics, mb: MicroBatchTime, stage: int
) -> tuple[dict[str, float], dict[str, float]]:
    """(exposed, total) communication seconds of one micro-batch: TP, CP, EP, FSDP, PP."""
    a = inp.model
    tokens = inp.micro_batch * inp.seq_len / inp.cp
    sp = stage_params(inp, stage)
    n = sp.num_blocks
    act_bytes = tokens * a.dim * nm.c
    total: dict[str, float] = {}
    exposed: dict[str, float] = {}
    if inp.tp > 1:
        passes = 2 + (1 if inp.recompute == "full" else 0)  # forward, backward (+ recomputed forward)
        t = passes * n * 2 * comm.all_reduce_s(act_bytes, inp.tp, comm.bandwidth(inp, hw, ("tp",)))
        total["TP"] = exposed["TP"] = t
    if inp.cp > 1:
        kv = 2 * tokens * a.n_kv_heads * a.head_dim / inp.tp * nm.c
        bw = comm.bandwidth(inp, hw, ("cp",))
        fwd, bwd = n * (inp.cp - 1) * kv / bw, n * (inp.cp - 1) * 2 * kv / bw
        total["CP"] = fwd + bwd
        exposed["CP"] = max(0.0, fwd - mb.forward.get("attention", 0.0)) + max(
            0.0, bwd - mb.backward.get("attention", 0.0)
        )
    if inp.ep > 1:
        t = (
            2
            * 2
            * n
            * comm.all_to_all_s(tokens * inp.top_k * a.dim * nm.c, inp.ep, comm.bandwidth(inp, hw, ("dp_shard", "cp")))
        )
        total["EP"] = exposed["EP"] = t
    fsdp = inp.dp_shard * inp.cp
    if inp.zero_stage == 3 and (fsdp > 1 or inp.fsdp_cpu_offload):
        bw = comm.bandwidth(inp, hw, ("dp_shard", "cp"))
        train = sp.total if inp.mode == "full" else sp.adapters
        ag = comm.all_gather_s(sp.total * 2, fsdp, bw)
        rs = comm.all_gather_s(train * 4, fsdp, bw)
        ag_bwd = ag if inp.reshard_after_forward else 0.0
        if inp.fsdp_cpu_offload:  # shards come from, and grads go to, host memory in each pass
            host = hw.host_bytes_s
            ag += sp.total * 4 / fsdp / host
            ag_bwd += sp.total * 4 / fsdp / host if inp.reshard_after_forward else 0.0
            rs += train * 4 / fsdp / host
        total["FSDP"] = ag + ag_bwd + rs
        exposed["FSDP"] = max(0.0, ag - mb.forward_s) + max(0.0, ag_bwd + rs - mb.backward_s)
    if inp.pp > 1:
        t = 2 * comm.all_to_all_s(
            2 * act_bytes / (inp.tp if inp.sequence_parallel else 1), 2, comm.bandwidth(inp, hw, ("pp",))
        )
        total["PP send/recv"] = exposed["PP send/recv"] = t
    return exposed, total


def plan_time(inp: PlanInput) -> StepTime:
    """Step time, throughput and MFU of `inp` (see time.py's docstring)."""
    hw, nm = inp.hardware(), numerics(inp)
    stages = sorted({0, inp.pp - 1})
    mbs = {s: microbatch_time(inp, hw, nm, s) for s in stages}
    stage = max(stages, key=lambda s: mbs[s].forward_s + mbs[s].backward_s)
    mb, m = mbs[stage], inp.num_microbatches
    breakdown: dict[str, float] = {}
    for part in (mb.forward, mb.backward):
        for k, v in part.items():
            _add(breakdown, k, v * m)
    exposed, comm_total = _comm_per_microbatch(inp, hw, nm, mb, stage)
    comm_total = {k: v * m for k, v in comm_total.items()}
    for k, v in exposed.items():
        _add(breakdown, f"{k} comm (exposed)", v * m)
    _per_step(inp, hw, mb, stage, breakdown, comm_total)
    if inp.pp > 1:
        v = inp.pp_virtual_stages if inp.pp_schedule == "interleaved_1f1b" else 1
        bubble = (inp.pp - 1) / (v * m + inp.pp - 1)
        breakdown["pipeline bubble"] = sum(breakdown.values()) * bubble / (1 - bubble)
    step_s = sum(breakdown.values())
    model, hardware = step_flops(inp)
    peak_all = hw.peak_flops * inp.num_gpus
    tokens = inp.global_batch * inp.seq_len
    return StepTime(
        {k: v for k, v in breakdown.items() if v > 0},
        comm_total,
        step_s,
        tokens / step_s,
        model,
        hardware,
        model / step_s / peak_all,
        hardware / step_s / peak_all,
    )


def _per_step(
    inp: PlanInput,
    hw: Hardware,
    mb: MicroBatchTime,
    stage: int,
    breakdown: dict[str, float],
    comm_total: dict[str, float],
) -> None:
    """Once-per-step work: grad accumulation, optimizer, DP sync, offload transfers."""
    a, m = inp.model, inp.num_microbatches
    bw = hw.hbm_bytes_s * HBM_EFFICIENCY
    sp = stage_params(inp, stage)
    fsdp = inp.dp_shard * inp.cp
    z = inp.zero_stage if fsdp > 1 else 0
    train = sp.total if inp.mode == "full" else sp.adapters
    grads_local = train / (fsdp if z >= 2 else 1)
    opt_local = train / (fsdp if z >= 1 else 1)
    accum = (m - 1) * 12 * grads_local  # .grad += new, from the second micro-batch
    if inp.mode == "full" and stage == 0:  # dense embedding grad (+ adding it to lm_head's)
        accum += m * (8 + (12 if a.tie_embeddings and inp.pp == 1 else 0)) * a.vocab_size * a.dim / inp.tp
    if inp.optimizer_offload:
        # tracetrain.memory.optimizer_offload: each bf16 grad goes to the host during backward (side
        # stream) and a worker accumulates it in fp32; the step is a fused CPU AdamW chunk by chunk,
        # each chunk's bf16 weights uploading while the next one updates.
        host = hw.host_bytes_s
        d2h = grads_local * 2 / host
        accumulate = grads_local * CPU_ACCUMULATE_BYTES_PER_PARAM / hw.cpu_bytes_s
        comm_total["offload D2H grads"] = d2h * m
        breakdown["offload: grads to host (exposed)"] = m * max(0.0, max(d2h, accumulate) - mb.backward_s)
        cpu_adam = opt_local * CPU_ADAM_BYTES_PER_PARAM / hw.cpu_bytes_s
        h2d = opt_local * 2 / host
        breakdown["offload: CPU AdamW"] = cpu_adam
        breakdown["offload: weights to GPU (exposed)"] = max(0.0, h2d - cpu_adam) + h2d / 32
    elif inp.fsdp_cpu_offload:
        breakdown["grad accumulation"] = accum / bw
        breakdown["CPU AdamW (FSDP offload)"] = opt_local * CPU_ADAM_BYTES_PER_PARAM / hw.cpu_bytes_s
    else:
        breakdown["grad accumulation"] = accum / bw
        breakdown["optimizer"] = opt_local * tr.adamw_bytes_per_param(inp.fused_adamw) / bw
    if inp.dp_replicate > 1:
        t = comm.all_reduce_s(grads_local * 4, inp.dp_replicate, comm.bandwidth(inp, hw, ("dp_replicate",)))
        comm_total["DP all-reduce"] = t
        breakdown["DP comm (exposed)"] = max(0.0, t - DP_OVERLAP * mb.backward_s)
    if fsdp > 1 and z in (1, 2):
        fbw = comm.bandwidth(inp, hw, ("dp_shard", "cp"))
        rs, ag = comm.all_gather_s(train * 4, fsdp, fbw), comm.all_gather_s(train * 4, fsdp, fbw)
        comm_total["ZeRO reduce-scatter + all-gather"] = rs + ag
        breakdown["ZeRO comm (exposed)"] = max(0.0, rs - DP_OVERLAP * mb.backward_s) + ag
    if inp.activation_offload != "none" or inp.unified_memory != "none":
        tokens, seq = tokens_per_microbatch(inp), inp.seq_len
        model = memory_model(inp, tokens, seq)
        if inp.activation_offload != "none":
            off = sum(v.at(tokens, seq) for k, v in model.cpu.items() if "offloaded" in k or "saved" in k)
            one_way = off / in_flight(inp, 0) / hw.host_bytes_s  # per micro-batch, each direction
            comm_total["activation offload"] = 2 * one_way * m
            if inp.activation_offload == "streamed":  # side stream, behind the next block's compute
                exp = max(0.0, one_way - mb.forward_s) + max(0.0, one_way - mb.backward_s)
            else:  # save_on_cpu copies on the compute stream
                exp = 2 * one_way
            breakdown["activation offload (exposed)"] = exp * m
        if inp.unified_memory != "none":
            managed = sum(v.at(tokens, seq) for v in model.managed.values())
            breakdown["unified memory migration"] = 2 * managed / hw.host_bytes_s
