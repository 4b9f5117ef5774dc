"""A whole optimizer step: micro-batches (time.py) x their number, exposed communication (collective_time.py),
once-per-step work (gradient accumulation, AdamW, DP sync, offload transfers) and the pipeline bubble.
Formulas and overlap rules are in time.py's docstring."""

from __future__ import annotations

import math
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
    train = sp.total if inp.mode == "full" else sp.adapters
    act_bytes = tokens * a.dim * nm.c
    total: dict[str, float] = {}
    exposed: dict[str, float] = {}
    if inp.tp > 1:
        passes = 2 + (1 if inp.recompute == "full" else 0)  # forward, backward (+ recomputed forward)
        t = passes * n * 2 * comm.all_reduce_s(act_bytes, inp.tp, comm.bandwidth(inp, hw, ("tp",)))
        total["TP"] = exposed["TP"] = t
    if inp.cp > 1:
        _cp_all_gather(inp, hw, nm, tokens, n, exposed, total)
    if inp.ep > 1:
        t = (
            2
            * 2
            * n
            * comm.all_to_all_s(tokens * inp.top_k * a.dim * nm.c, inp.ep, comm.bandwidth(inp, hw, ("dp_shard", "cp")))
        )
        total["EP"] = exposed["EP"] = t
    fsdp = inp.dp_shard * inp.cp
    if inp.zero_stage == 3 and (fsdp > 1 or inp.fsdp_cpu_offload) and (inp.pp == 1 or inp.fsdp_cpu_offload):
        _fsdp_per_microbatch(inp, hw, mb, sp.total, train, n, exposed, total)
    if inp.pp > 1:
        t = 2 * comm.all_to_all_s(
            2 * act_bytes / (inp.tp if inp.sequence_parallel else 1), 2, comm.bandwidth(inp, hw, ("pp",))
        )
        total["PP send/recv"] = exposed["PP send/recv"] = t
    return exposed, total


def hidden_cost(comm_s: float, compute_s: float, hbm_bytes: float, hw: Hardware) -> float:
    """Exposed seconds of `comm_s` of communication issued behind `compute_s` of independent compute:
    what the compute cannot cover, plus the HBM traffic the NCCL kernels add while they overlap it
    (`hbm_bytes`, charged at memory speed for the overlapped share: the copies they make through HBM
    and the SMs they hold slow the kernels they run beside)."""
    if comm_s <= 0:
        return 0.0
    hidden = min(comm_s, compute_s)
    return max(0.0, comm_s - compute_s) + hidden / comm_s * hbm_bytes / (hw.hbm_bytes_s * HBM_EFFICIENCY)


def _fsdp_gather_reduce_s(
    inp: PlanInput, hw: Hardware, gather_bytes: float, reduce_bytes: float, num_blocks: int
) -> tuple[float, float]:
    """Seconds of one all-gather of `gather_bytes` and of one reduce-scatter of `reduce_bytes` over
    dp_shard * cp, each issued unit by unit (one FSDP unit per block and the root): the wire time plus the
    latency of every call."""
    fsdp = inp.dp_shard * inp.cp
    bw = comm.bandwidth(inp, hw, ("dp_shard", "cp"))
    units = num_blocks + 1
    latency = (units - 1) * comm.COLLECTIVE_LATENCY_S if fsdp > 1 else 0.0  # all_gather_s counts one call
    return comm.all_gather_s(gather_bytes, fsdp, bw) + latency, comm.all_gather_s(reduce_bytes, fsdp, bw) + latency


def _fsdp_per_microbatch(
    inp: PlanInput,
    hw: Hardware,
    mb: MicroBatchTime,
    params: float,
    train: float,
    num_blocks: int,
    exposed: dict[str, float],
    total: dict[str, float],
) -> None:
    """ZeRO-3 (FSDP2) per micro-batch: bf16 all-gather in forward (and again in backward with
    reshard_after_forward), fp32 reduce-scatter in backward, one call per block. Each overlaps the
    compute of its pass (hidden_cost) except the first gather of each pass and the last reduce-scatter,
    which have nothing to hide behind; every call adds its latency. FSDP2's copy-out of the gathered
    buffer (read + write 2 bytes per parameter) and copy-in of the bf16 grads into the fp32 reduce-scatter
    buffer (read 2, write 4) are memory-bound passes on the GPU."""
    fsdp = inp.dp_shard * inp.cp
    units = num_blocks + 1  # one FSDP unit per block and the root (embedding, norm, head)
    ag, rs = _fsdp_gather_reduce_s(inp, hw, params * 2, train * 4, num_blocks)
    again = inp.reshard_after_forward
    ag_bwd = ag if again else 0.0
    # HBM bytes the NCCL kernels move per byte on the wire: gathers read and write it (2), reductions
    # also read the local partial (3).
    hbm_fwd = 2 * comm.wire_bytes(params * 2, fsdp)
    hbm_bwd = hbm_fwd * again + 3 * comm.wire_bytes(train * 4, fsdp)
    if inp.fsdp_cpu_offload:  # shards come from, and grads go to, host memory in each pass
        host = hw.host_bytes_s
        ag += params * 4 / fsdp / host
        ag_bwd += params * 4 / fsdp / host if again else 0.0
        rs += train * 4 / fsdp / host
    total["FSDP"] = ag + ag_bwd + rs
    calls = units * (2 + again) if fsdp > 1 else 0
    edges = (ag + ag_bwd + rs) / units  # first gather of each pass, last reduce-scatter
    exposed["FSDP"] = (
        hidden_cost(ag, mb.forward_s, hbm_fwd, hw)
        + hidden_cost(ag_bwd + rs, mb.backward_s, hbm_bwd, hw)
        + edges
        + calls * comm.COLLECTIVE_LATENCY_S
    )
    if fsdp > 1:
        copies = (4 * params * (1 + again) + 6 * train) / (hw.hbm_bytes_s * HBM_EFFICIENCY)
        exposed["FSDP copy-in/out"] = copies


def _cp_all_gather(
    inp: PlanInput,
    hw: Hardware,
    nm: Numerics,
    tokens: float,
    num_blocks: int,
    exposed: dict[str, float],
    total: dict[str, float],
) -> None:
    """Context parallelism as parallel/context_parallel.py runs it (not a ring): each block's forward
    all-gathers the keys and values of the whole sequence (n_kv_heads, compute dtype) before its two
    attention calls, again in a recomputed forward, and the backward reduce-scatters their gradients.
    Nothing is issued behind compute, so all of it is exposed."""
    a = inp.model
    kv_bytes = 2 * tokens * inp.cp * a.n_kv_heads * a.head_dim / inp.tp * nm.c  # whole sequence
    bw = comm.bandwidth(inp, hw, ("cp",))
    n_ckpt = math.ceil(num_blocks / inp.recompute_every) if inp.recompute == "full" else 0
    gathers = num_blocks + n_ckpt
    t = (gathers + num_blocks) * comm.all_gather_s(kv_bytes, inp.cp, bw)
    total["CP"] = exposed["CP"] = t


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
        _add(breakdown, k if "copy" in k else f"{k} comm (exposed)", v * m)
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
    train = sp.total if inp.mode == "full" else sp.adapters
    # FSDP2 shards gradients and AdamW states over dp_shard * cp whatever the ZeRO stage (memory.py).
    local = train / (inp.dp_shard * inp.cp)
    accum = accumulation_bytes(inp, train)
    if inp.mode == "full" and stage == 0:  # dense embedding grad (+ adding it to lm_head's)
        accum += m * (8 + (12 if a.tie_embeddings and inp.pp == 1 else 0)) * a.vocab_size * a.dim / inp.tp
    if inp.optimizer_offload:
        # tracetrain.memory.optimizer_offload: each bf16 grad goes to the host during backward (side
        # stream) and a worker accumulates it in fp32; the step is a fused CPU AdamW chunk by chunk,
        # each chunk's bf16 weights uploading while the next one updates.
        host = hw.host_bytes_s
        d2h = local * 2 / host
        accumulate = local * CPU_ACCUMULATE_BYTES_PER_PARAM / hw.cpu_bytes_s
        comm_total["offload D2H grads"] = d2h * m
        breakdown["offload: grads to host (exposed)"] = m * max(0.0, max(d2h, accumulate) - mb.backward_s)
        cpu_adam = local * CPU_ADAM_BYTES_PER_PARAM / hw.cpu_bytes_s
        h2d = local * 2 / host
        breakdown["offload: CPU AdamW"] = cpu_adam
        breakdown["offload: weights to GPU (exposed)"] = max(0.0, h2d - cpu_adam) + h2d / 32
    elif inp.fsdp_cpu_offload:
        breakdown["grad accumulation"] = accum / bw
        breakdown["CPU AdamW (FSDP offload)"] = local * CPU_ADAM_BYTES_PER_PARAM / hw.cpu_bytes_s
    else:
        breakdown["grad accumulation"] = accum / bw
        clip_folded = inp.num_gpus == 1 and inp.precision != "fp16"  # train/step.py `fold_clip`
        breakdown["optimizer"] = local * tr.adamw_bytes_per_param(inp.fused_adamw, clip_folded) / bw
    _dp_sync(inp, hw, mb, sp.total, train, sp.num_blocks, breakdown, comm_total)
    _offload_transfers(inp, hw, mb, breakdown, comm_total)


def accumulation_bytes(inp: PlanInput, train: float) -> float:
    """HBM bytes one step spends adding micro-batch gradients together, where the trainer adds them
    (parallel/data_parallel.py on FSDP2; torch.distributed.pipelining), for `train` trainable parameters
    of this GPU (after tp / pp, before data-parallel sharding):
      no data parallelism   autograd's .grad += g in the weights' dtype: read 2, write 1 per element,
                            from the second micro-batch on
      ZeRO-2/3, no pipeline each micro-batch's gradients are reduce-scattered at once; FSDP adds the
                            fp32 shard to .grad (HSDP: to its partial reduce output): 12 bytes per
                            element of the 1 / (dp_shard * cp) shard, from the second micro-batch on
      ZeRO-1, replication,  gradient sync is off until the last micro-batch (under a pipeline for every
      any stage under pp    micro-batch: pipelining reduces once after the schedule), so the unsharded
                            gradients accumulate: under bf16 mixed precision into FSDP's fp32 buffer,
                            the first micro-batch's bf16 grad upcast (read 2, write 4,
                            to_accumulated_grad_if_needed), each later one added (read 2 + 4, write 4);
                            in fp32, by autograd (12). The memory model holds that unsharded buffer.
    """
    m, w = inp.num_microbatches, 2 if inp.param_dtype == "bf16" else 4
    if not inp.data_parallel:
        return (m - 1) * 3 * w * train
    if not (inp.defers_reduce_scatter or inp.pp > 1):
        return (m - 1) * 3 * w * train / (inp.dp_shard * inp.cp)
    if not inp.fsdp_mixed_precision:
        return (m - 1) * 3 * w * train
    if m == 1 and inp.pp == 1:  # reduced straight from the bf16 grad (the copy-in casts it)
        return 0.0
    return (6 + 10 * (m - 1)) * train


def _dp_sync(
    inp: PlanInput,
    hw: Hardware,
    mb: MicroBatchTime,
    params: float,
    train: float,
    num_blocks: int,
    breakdown: dict[str, float],
    comm_total: dict[str, float],
) -> None:
    """Data-parallel communication outside ZeRO-3's per-micro-batch path (_fsdp_per_microbatch), as
    parallel/data_parallel.py's table runs it on FSDP2:
      gathers   ZeRO-1/2 gather every unit's weights in the step's first forward and keep them to the
                last backward: behind that forward's compute (FSDP2 issues unit i+1's gather while unit i
                computes), the first one exposed. ZeRO-3 under a pipeline gathers again for each
                micro-batch's backward (its forward resharded them).
      reduce    ZeRO-2 reduce-scatters fp32 gradients every micro-batch, ZeRO-1 once, behind backward.
      HSDP      the reduce-scattered fp32 shard (1 / (dp_shard * cp) of the gradients, every stage) is
                all-reduced across dp_replicate once per step, behind the last backward.
    Under a pipeline, torch.distributed.pipelining runs every FSDP reduction once after the schedule
    (perform_reduce_grad, which then waits for it): nothing is left to hide it behind, so it is exposed,
    and FSDP's copy-in of the fp32 accumulated gradients (read 4, write 4) and copy-out of each gather
    are memory-bound passes, as ZeRO-3's copies are."""
    m, fsdp = inp.num_microbatches, inp.dp_shard * inp.cp
    pipelined = inp.pp > 1 and not inp.fsdp_cpu_offload
    if fsdp > 1 and (not inp.zero3 or pipelined):
        units = num_blocks + 1
        reduces = m if inp.zero_stage >= 2 and inp.pp == 1 else 1
        gathers = m if inp.zero3 and inp.reshard_after_forward else 1
        gather_bytes = params * (2 if inp.fsdp_mixed_precision else 4)
        ag_once, rs_once = _fsdp_gather_reduce_s(inp, hw, gather_bytes, train * 4, num_blocks)
        rs = reduces * rs_once
        ag = gathers * ag_once
        comm_total["FSDP" if inp.zero3 else "ZeRO reduce-scatter + all-gather"] = rs + ag
        hbm_rs = 3 * comm.wire_bytes(train * 4, fsdp) * reduces
        rs_exposed = rs if pipelined else hidden_cost(rs, DP_OVERLAP * mb.backward_s * reduces, hbm_rs, hw)
        if inp.zero3:
            ag_exposed = hidden_cost(ag, mb.backward_s * m, 0.0, hw)
        else:
            hbm_ag = 2 * comm.wire_bytes(gather_bytes, fsdp)
            ag_exposed = hidden_cost(ag, mb.forward_s, hbm_ag, hw) + ag / units
        breakdown["FSDP comm (exposed)" if inp.zero3 else "ZeRO comm (exposed)"] = rs_exposed + ag_exposed
        # Copy-in reads the fp32 accumulated gradients (or fp32 grads) and writes fp32: 8; bf16 grads: 6.
        accumulated = inp.pp > 1 or (inp.defers_reduce_scatter and m > 1)
        copy_in = 6 if inp.fsdp_mixed_precision and not accumulated else 8
        copies = 2 * gather_bytes * gathers + copy_in * train * reduces
        breakdown["FSDP copy-in/out"] = copies / (hw.hbm_bytes_s * HBM_EFFICIENCY)
    if inp.dp_replicate > 1:
        n = inp.dp_replicate
        shard_bytes = train * 4 / fsdp  # fp32 (reduce_dtype), what the reduce-scatter left on this rank
        t = comm.all_reduce_s(shard_bytes, n, comm.bandwidth(inp, hw, ("dp_replicate",)))
        comm_total["DP all-reduce"] = t
        hbm = 5 * comm.wire_bytes(shard_bytes, n)  # reduce-scatter (3 per wire byte) + all-gather (2)
        breakdown["DP comm (exposed)"] = t if pipelined else hidden_cost(t, DP_OVERLAP * mb.backward_s, hbm, hw)


def _offload_transfers(
    inp: PlanInput, hw: Hardware, mb: MicroBatchTime, breakdown: dict[str, float], comm_total: dict[str, float]
) -> None:
    """Activation offload's copies and unified memory's page migration, once per step."""
    m = inp.num_microbatches
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
