"""Per-GPU memory of a training step: what each item holds, in bytes, at each phase of the step, and
the peak, which is the largest phase and not the sum of every item's maximum.

Static items (P = parameters on this GPU after tp/pp/ep, see params.py; fsdp = dp_shard * cp). The
trainer builds every data-parallel flavour on FSDP2, so every ZeRO stage shards weights, gradients and
AdamW states over fsdp; the stages differ in the gathered copies they keep (FSDP buffers below). Measured
by storage on gloo for ZeRO-1/2/3 and DDP: tests/plan/test_plan_zero_measured.py.
  weights            4P for tracetrain's fp32 full-FT params; LoRA: frozen base at its dtype (2 for bf16)
                     + 4 per fp32 adapter (under fp8 the two E4M3 copies of a block weight replace its bf16 copy, which moves to the host); with optimizer offload the GPU keeps 2-byte bf16 weights
  gradients          4 per trainable param; optimizer offload (tracetrain.memory.optimizer_offload)
                     copies each bf16 grad out as soon as it is complete: one weight's worth on the GPU
  AdamW states       8 per trainable param (exp_avg + exp_avg_sq, fp32); +4 fp32 master if param_dtype=bf16;
                     optimizer offload keeps 18 bytes/param on the host (bf16 staging, fp32 grad, master,
                     moments)
  AdamW temporaries  0 for the fused kernel; foreach keeps one fp32 temporary per param (sqrt(exp_avg_sq))
  autocast copies    2 per weight that autocast casts (params.cast_params): alive from the forward until
                     each layer's backward; 0 with FSDP mixed precision (any data-parallel layout with
                     bf16 compute: bf16 weights are gathered instead)
  FSDP buffers       gathered weights are bf16 under FSDP mixed precision (bf16 compute), else the
                     stored dtype. ZeRO-3: two blocks' gathered weights (current + prefetch; all blocks
                     when reshard_after_forward is off), one block's unsharded fp32 grads before
                     reduce-scatter, the gathered lm_head near the loss. ZeRO-1/2 and DDP (no reshard
                     after forward): every unit's gathered weights from the first forward to the last
                     backward; ZeRO-1 and DDP also accumulate unsharded fp32 gradients between
                     micro-batches (reduced once per step). fsdp_cpu_offload moves the shards
                     (weights, grads, AdamW states: 16 bytes per trainable param) to the host
Per-micro-batch items (activations.py, bytes per token x tokens T = micro_batch * seq_len / cp, divided
by tp as each item's split says): block activations x blocks x micro-batches in flight, outside-block
items, the loss buffers.

Phases (the peak is the largest; every one is affine in T, which the HTML slider model relies on):
  build             before the first step: this rank's shard of the weights in their final dtype + one
                    fp32 chunk of initial values; load (model.init_from): the shard + one checkpoint
                    read in transit (build_phase.py)
  forward end       static + autocast copies of every weight (the cache lives until autocast exits)
                    + all activations [+ gradients of earlier micro-batches when accumulating]
  loss forward      static + kept copies + activations + logits, fp32 copy, log-probs (c+4+4)V per token
  backward start    static + kept copies + activations + 12V per token (log-probs, two fp32 grads)
  block backward    two moments of one block's backward (activations.py): its MLP's and its attention's
                    backward, each with the block's saved tensors (rematerialised when recomputed, with
                    its weight copies; less the kept input they alias), the residual-stream gradient
                    and that backward's gradients and kernel buffers; the activations the loss's
                    backward freed (final norm, eager lm_head input) are gone; with activation offload
                    every gradient exists (block 0's backward, the last, holds as much as any other)
  backward end      static + all gradients (+ a tied embedding's dense gradient before it is added)
  optimizer step    static + all gradients + optimizer temporaries
With the fused lm_head + cross-entropy (fused_ce, tp = pp = 1) the two loss phases hold its buffers
instead (activations.fused_ce_items). Pipeline + FSDP (any ZeRO stage) adds "pipeline backward end":
the stage's gathered weights and unsharded fp32 gradients, which torch.distributed.pipelining keeps
until the step's single reduce-scatter.
Gradients exist at the forward only from the second micro-batch of a step on (zero_grad sets them to
None), which is why a single-micro-batch step peaks at backward start with no gradients at all.

Pipeline stages hold micro-batches in flight: GPipe all m, 1F1B pp - stage, interleaved (Megatron)
2(pp - 1 - stage) + (v - 1)pp + 1 model chunks of L/(pp v) blocks. The plan reports the worst stage.
The tiled norm + MLP (memory/tiled_mlp.py) holds the feed-forward half's items and gradients for one
tile at a time (a constant in the MLP backward); its blocks keep their mid residual instead (activations.py).
Activation offload (tracetrain.memory.activation_offload) moves block activations and the autocast
weight copies they keep to pinned host memory: "streamed" keeps two blocks on the GPU (the last block,
never offloaded, and one in transfer), "save_on_cpu" one block, and also copies the saved parameters
(a LoRA base's frozen weights) every step; outside-block tensors and the loss buffers stay.

The allocator's peak (torch.cuda.max_memory_allocated) is what the phases model (measured within 0.5%
on 19 single-GPU configurations, benchmarks/plan_accuracy.py). The device must also hold the CUDA
context and what the caching allocator reserves beyond the allocated bytes; the host (per node) must
hold every GPU's offloaded bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tracetrain.memory.activation_offload import DEFAULT_MIN_OFFLOAD_BYTES, PinnedBufferPool, num_offloaded_blocks
from tracetrain.plan import activations as act
from tracetrain.plan.activations import Affine
from tracetrain.plan.build_phase import BUILD_PHASES, SHARD_ITEM, build_items, build_phases
from tracetrain.plan.inputs import PlanInput
from tracetrain.plan.params import (
    StageParams,
    cast_params,
    expert_shards,
    frozen_bytes,
    largest_projection,
    nf4_params,
    stage_params,
)

GIB = 2**30
# CUDA context, cuBLAS/cuDNN workspaces and NCCL buffers live outside torch's allocator: ~0.5 GiB of
# context on Hopper with lazy module loading plus workspaces; more with NCCL communicators.
CUDA_CONTEXT_BYTES = 0.6 * GIB
NCCL_BUFFERS_BYTES = 0.5 * GIB
# Reserved / allocated at the peak: blocks the caching allocator holds but cannot reuse. With
# expandable segments (tracetrain's default) a few percent; with fixed segments ~10-15% is common.
FRAGMENTATION = {True: 0.04, False: 0.12}
# Items of the early phases that are gradients already (a block's backward then adds no "gradients").
GRADIENT_ITEMS = {"gradients", "FSDP unsharded grads (pipeline)", "FSDP unsharded grads (accumulating)"}


@dataclass(frozen=True)
class OffloadedTensor:
    """One saved tensor of every offloaded block: `per_token` bytes per token this rank holds (a micro-batch's
    tokens / `cp`), at most `tile_tokens` of them per tensor (0: all), `blocks` offloaded blocks x
    `micro_batches` in flight."""

    per_token: float
    blocks: int
    micro_batches: int
    cp: int = 1
    tile_tokens: int = 0

    def sizes(self, tokens: float) -> tuple[int, int]:
        """(bytes of one tensor, how many the host holds) for `tokens` tokens per micro-batch."""
        local, count = tokens / self.cp, self.blocks * self.micro_batches
        if self.tile_tokens and local > self.tile_tokens:
            return math.ceil(self.per_token * self.tile_tokens), count * math.ceil(local / self.tile_tokens)
        return math.ceil(self.per_token * local), count


@dataclass
class MemoryModel:
    """Items of one GPU (the worst pipeline stage) and which items each phase holds."""

    stage: int
    items: dict[str, Affine]
    phases: dict[str, list[str]]
    cpu: dict[str, Affine] = field(default_factory=dict)
    managed: dict[str, Affine] = field(default_factory=dict)
    # Streamed offload: the saved tensors of one offloaded block whose sizes are known, for the pinned
    # pool's rounding (`pinned_pool_rounding`).
    offloaded_tensors: list[OffloadedTensor] = field(default_factory=list)

    def phase_bytes(self, phase: str, tokens: float, seq: float) -> float:
        return sum(self.items[n].at(tokens, seq) for n in self.phases[phase])

    def peak(self, tokens: float, seq: float) -> tuple[str, float]:
        return max(((p, self.phase_bytes(p, tokens, seq)) for p in self.phases), key=lambda kv: kv[1])


def resident_blocks(inp: PlanInput, n: int) -> int:
    """Blocks' worth of offloadable activations on the GPU at the peak with activation offload.

    save_on_cpu: the one block whose tensors are being copied. streamed: the n - k blocks that are never
    offloaded (k = `num_offloaded_blocks`, the first ones; the last block always stays) and the one
    offloaded block copied back first when backward starts (its memory replaces the last block's).
    """
    if inp.activation_offload == "save_on_cpu":
        return 1
    return min(n, n - num_offloaded_blocks(n, inp.activation_offload_fraction) + 1)


def in_flight(inp: PlanInput, stage: int) -> float:
    """Micro-batches (in units of this stage's blocks) whose activations a stage holds at once."""
    m, pp, v = inp.num_microbatches, inp.pp, inp.pp_virtual_stages
    if pp == 1:
        return 1.0
    if inp.pp_schedule == "gpipe":
        return float(m)
    if inp.pp_schedule == "1f1b" or v == 1:
        return float(min(m, pp - stage))
    chunks = 2 * (pp - 1 - stage) + (v - 1) * pp + 1
    return min(chunks, m * v) / v


def _static(inp: PlanInput, sp: StageParams, nm: act.Numerics) -> tuple[dict[str, Affine], dict[str, Affine]]:
    """GPU items that do not depend on the batch, and the host copies optimizer offload keeps."""
    # FSDP2 (parallel/data_parallel.py) shards every parameter over dp_shard * cp whatever the ZeRO stage;
    # stages 1 and 2 differ from 3 in the gathered copies they keep (stage_model), not in the shards.
    fsdp = inp.dp_shard * inp.cp
    sh_p = sh_g = sh_o = fsdp
    train = sp.total if inp.mode == "full" else sp.adapters
    if inp.ep > 1 and inp.mode == "full":
        # Experts are already split over ep, which borrowed its ranks from dp_shard: data parallelism
        # shards them over fsdp / ep ranks only. Counted as if sharded like the rest (same bytes).
        train += sp.num_blocks * sp.experts * (fsdp / expert_shards(inp) - 1)
    frozen_w = frozen_bytes(inp, sp, nm.w)  # NF4 projections at 4.127 bits (QLoRA)
    frozen_b = frozen_w / sh_p
    cpu: dict[str, Affine] = {}
    if inp.optimizer_offload:
        # tracetrain.memory.optimizer_offload: bf16 weights on the GPU, each gradient copied out and
        # freed as soon as it is accumulated (one weight's worth alive), 18 bytes/param on the host.
        largest = max(inp.model.vocab_size * inp.model.dim / inp.tp, inp.model.dim * inp.model.ffn_dim / inp.tp)
        items = {
            "weights": Affine(frozen_b + train * nm.c / sh_p),
            "gradients": Affine(min(train, largest) * nm.c),
            "AdamW states": Affine(),
            "AdamW temporaries": Affine(),
        }
        cpu["optimizer (bf16 staging, fp32 grads, master, moments)"] = Affine(train * 18 / sh_o)
        return items, cpu
    if inp.fsdp_cpu_offload:
        # FSDP2 CPUOffloadPolicy: sharded fp32 weights, grads and AdamW states stay in host memory; the
        # GPU only ever holds gathered blocks (the "FSDP buffers" items).
        cpu["FSDP shards (weights, grads, AdamW)"] = Affine((frozen_w + train * 16) / fsdp)
        return {
            "weights": Affine(),
            "gradients": Affine(),
            "AdamW states": Affine(),
            "AdamW temporaries": Affine(),
        }, cpu
    train_w = 2 if inp.param_dtype == "bf16" else 4
    master = 4 if inp.param_dtype == "bf16" else 0
    items = {
        "weights": Affine(frozen_b + train * train_w / sh_p),
        "gradients": Affine(train * train_w / sh_g),
        "AdamW states": Affine(train * (8 + master) / sh_o),
        "AdamW temporaries": Affine(0.0 if inp.fused_adamw else train * 4 / sh_o),
    }
    return items, cpu


def _activations(
    inp: PlanInput, stage: int, nm: act.Numerics, cpu: dict[str, Affine], offloaded: list[OffloadedTensor]
) -> dict[str, Affine]:
    """Activation items of one GPU: kept block activations x micro-batches in flight, what offload
    leaves on the GPU, what stays of them through the blocks' backward, and one block's backward working
    sets (all per token of the micro-batch, cp-split)."""
    args, tp, sp_on = inp.model, inp.tp, inp.sequence_parallel
    first, last = stage == 0, stage == inp.pp - 1
    moe = float(inp.top_k) if inp.num_experts else 1.0
    backend, path = act.attention_backend(args, nm, inp.attention), act.block_path(inp)
    whole = act.block_items(args, nm, moe_factor=moe, backend=backend, path=path)  # untiled: the backward's
    items = whole
    first_items = act.block_items(
        args, nm, first_lora_block=inp.mode == "lora", moe_factor=moe, backend=backend, path=path
    )
    if inp.tiled_mlp_tokens > 0:
        items, _ = act.tiled_block_items(items, args, nm, inp.tiled_mlp_tokens)
        first_items, _ = act.tiled_block_items(first_items, args, nm, inp.tiled_mlp_tokens)
    blk_none = act.shard(items, tp, sp_on)
    blk_first = act.shard(first_items, tp, sp_on)
    kept = {
        "none": blk_none,
        "selective": act.shard(act.selective_items(args, nm, moe), tp, sp_on),
        "full": act.shard(act.full_recompute_items(args, nm), tp, sp_on),
    }[inp.recompute]
    n = stage_params(inp, stage).num_blocks
    n_ckpt = 0 if inp.recompute == "none" else math.ceil(n / inp.recompute_every)
    per_mb = kept * n_ckpt + blk_none * (n - n_ckpt)
    if first and n_ckpt == 0 and inp.mode == "lora":
        per_mb += blk_first - blk_none  # block 0 (checkpointed whenever anything is) gets no input grad
    outside_items = act.outside_items(args, nm, first_stage=first, last_stage=last, fused_ce=inp.fused_ce)
    outside = act.shard(outside_items, tp, sp_on)
    loss_side = act.shard([i for i in outside_items if i.loss_side], tp, sp_on)
    k = in_flight(inp, stage)
    blocks = per_mb * k
    if inp.activation_offload != "none" and n * k > 2:
        biggest = blk_none if n_ckpt < n else kept
        on_gpu = biggest * resident_blocks(inp, n)
        # The host keeps every offloaded block's copy until that block's backward is done, the one being
        # copied back included (streamed: a pool of k blocks' buffers; save_on_cpu: every block). Counting
        # one block fewer put the host 3% low at 64k tokens (llama3.1-8b LoRA, 31 of 32 blocks offloaded).
        stays = (
            0
            if inp.activation_offload == "save_on_cpu"
            else n - num_offloaded_blocks(n, inp.activation_offload_fraction)
        )
        cpu["offloaded activations"] = (blocks - biggest * stays) * (1 / inp.cp)
        blocks = on_gpu
        if inp.activation_offload == "streamed" and (n_ckpt == 0 or (inp.recompute == "full" and n_ckpt == n)):
            # Each tensor an offloaded block saves, where the items name them (an item that does not is
            # counted without rounding): the block input alone under full recomputation.
            kinds = act.full_recompute_items(args, nm) if n_ckpt else items
            for item in kinds:
                div = tp if item.split == "tp" or (item.split == "sp" and sp_on) else 1
                offloaded += [
                    OffloadedTensor(t / div, n - stays, int(k), inp.cp, item.tile_tokens) for t in item.tensors
                ]
    return {
        "activations": (blocks + outside * k) * (1 / inp.cp),
        # the final norm's (and an eager lm_head's) saved input dies in the loss's backward, before any block's
        "activations (blocks' backward)": (blocks + outside * k - loss_side) * (1 / inp.cp),
        **_backward_working_sets(inp, nm, whole, moe, backend, recomputed=n_ckpt > 0),
    }


def _backward_working_sets(
    inp: PlanInput, nm: act.Numerics, block: list[act.Item], moe: float, backend: act.Backend, recomputed: bool
) -> dict[str, Affine]:
    """One block's backward beyond the kept activations, at its two largest moments (bytes, cp-split).

    A recomputed block first reruns its forward: its saved tensors (`block`, untiled) are all live again,
    less the block input the checkpoint kept (`block_input_alias`); without recomputation they are in
    "activations" already. Then, MLP first (backward runs the block in reverse):
      MLP backward        the saved tensors, the residual-stream gradient and the SwiGLU backward's
                          gradients (`mlp_backward_items`; a compiled block under full recomputation:
                          `compiled_recomputed_mlp_backward_items`, whose kernel also takes each
                          adapted gate/up's base and adapter outputs apart and writes scaled gradient
                          copies for the adapters). Tiled: the feed-forward half's saved tensors
                          and gradients exist for one tile (a constant); the block keeps the tiles' input
                          (the mid residual) and holds the residual gradient twice (the incoming one and
                          the mid residual's, summed from the tiles' slices).
      attention backward  the attention half's saved tensors (the MLP's are freed) and the attention
                          kernel's backward buffers (`attention_backward_items`, residual gradient included).
    """
    args, tp, sp_on, cp = inp.model, inp.tp, inp.sequence_parallel, inp.cp
    alias = act.block_input_alias(args, nm, act.block_path(inp)) if inp.recompute == "full" else 0.0
    unalias = Affine(0.0, -alias)
    attn_saved = act.shard([i for i in block if not i.mlp], tp, sp_on) + unalias if recomputed else Affine()
    residual = act.shard([act.residual_gradient(args, nm)], tp, sp_on)
    mlp_grads = act.mlp_backward_items(args, nm, moe)
    if inp.tiled_mlp_tokens > 0:
        tile_tokens = min(inp.tiled_mlp_tokens, tokens_per_microbatch(inp) / cp)
        tile_items = [i for i in block if i.mlp] + mlp_grads
        tile = Affine(act.shard(tile_items, tp, sp_on).per_token * tile_tokens * cp)  # a constant (divided below)
        mid = act.shard([act.Item("tile inputs (mid residual)", nm.x * args.dim, "sp")], tp, sp_on)
        mlp = attn_saved + (mid if recomputed else Affine()) + residual * 2 + tile
    else:
        mlp = (act.shard(block, tp, sp_on) + unalias if recomputed else Affine()) + residual
        if recomputed and inp.recompute == "full" and act.block_path(inp) == "compile":
            mlp_grads = act.compiled_recomputed_mlp_backward_items(args, nm, moe)  # the LoRA adds fused into it
        mlp += act.shard(mlp_grads, tp, sp_on)
    attention = attn_saved + act.shard(act.attention_backward_items(args, nm, backend), tp, sp_on)
    return {"block backward (MLP)": mlp * (1 / cp), "block backward (attention)": attention * (1 / cp)}


def stage_model(inp: PlanInput, stage: int) -> MemoryModel:
    """The memory items and phases of one GPU of pipeline stage `stage`."""
    args, nm = inp.model, act.numerics(inp)
    sp = stage_params(inp, stage)
    first, last = stage == 0, stage == inp.pp - 1
    items, cpu = _static(inp, sp, nm)
    if inp.precision == "fp8" and inp.mode == "lora":
        # kernels/fp8.py quantises each frozen base weight once, in the two E4M3 layouts _scaled_mm
        # needs (forward and input gradient: 2 bytes per block matmul weight on the GPU) and moves the
        # bf16 base weight to the host: the GPU holds what bf16 LoRA holds, the host 2 bytes more each.
        cpu["bf16 copies of the FP8 base weights"] = Affine(2.0 * sp.num_blocks * sp.block_linear)
    offloaded: list[OffloadedTensor] = []
    items.update(_activations(inp, stage, nm, cpu, offloaded))
    n = sp.num_blocks
    n_ckpt = 0 if inp.recompute == "none" else math.ceil(n / inp.recompute_every)
    k = in_flight(inp, stage)

    # Autocast weight copies: all of them during the forward, those that saved tensors keep afterwards.
    cast_block, cast_outside = cast_params(inp, sp, autocast=nm.autocast, weight_bytes=nm.w)
    zero3 = inp.zero3
    if inp.fsdp_mixed_precision:  # FSDP gathers bf16 weights: autocast has nothing to cast
        cast_block = cast_outside = 0.0
        if inp.ep > 1 and expert_shards(inp) == 1 and inp.mode == "full":
            # ...but experts FSDP ignores stay float32: each expert matmul saves its bf16 cast
            cast_block = sp.experts
    if inp.fused_ce:  # the fused head casts lm_head's weight itself, outside autocast's cache
        cast_outside = 0.0
    per_block_cast = 2 * cast_block
    casts_all = n * per_block_cast + 2 * cast_outside
    casts_kept = casts_all - n_ckpt * per_block_cast
    if inp.activation_offload != "none" and n * k > 2:
        # Copies are not parameters: offload moves them with the activations (but the last block's).
        on_gpu = per_block_cast * resident_blocks(inp, n) + 2 * cast_outside
        cpu["offloaded weight copies"] = Affine(max(0.0, casts_kept - on_gpu) * k)
        casts_kept = min(casts_kept, on_gpu)
        if inp.activation_offload == "save_on_cpu" and inp.mode == "lora" and nm.w == nm.c:
            # save_on_cpu copies saved parameters too: a LoRA base's frozen weights, kept by each mm.
            cpu["saved parameters (save_on_cpu)"] = Affine(sp.num_blocks * sp.block_linear * nm.w * k)
    items["autocast copies (all)"] = Affine(casts_all)
    items["autocast copies (kept)"] = Affine(casts_kept)
    items["autocast copies (1 block)"] = Affine(per_block_cast)
    loss_div = (inp.tp if inp.loss_parallel else 1) * inp.cp
    if last and inp.fused_ce:
        chunk = min(inp.fused_ce_chunk, tokens_per_microbatch(inp) / inp.cp)
        fwd, bwd = act.fused_ce_items(args, nm, chunk)
        items["fused CE (forward)"], items["fused CE (backward)"] = fwd * (1 / inp.cp), bwd * (1 / inp.cp)
        items["log-probs in flight"] = Affine()
    elif last:
        items["logits + fp32 copy"] = Affine(0.0, act.loss_forward_per_token(args, nm) / loss_div)
        items["loss gradients"] = Affine(0.0, act.loss_backward_per_token(args) / loss_div)
        items["log-probs in flight"] = Affine(0.0, act.loss_saved_per_token(args) * (k - 1) / loss_div)
    else:
        items["log-probs in flight"] = Affine()
    # FSDP's gathered copies: bf16 under mixed precision, else the stored dtype (the shards x fsdp).
    fsdp, train = inp.dp_shard * inp.cp, (sp.total if inp.mode == "full" else sp.adapters)
    gather_bytes = 2.0 if inp.fsdp_mixed_precision else nm.w
    # One block's unsharded fp32 gradients before its reduce-scatter: FSDP2 allocates them for the
    # parameters that require a gradient only (a LoRA block: its adapters, not the frozen base).
    block_grads = 4 * (sp.block if inp.mode == "full" else sp.adapters / max(1, n))
    if zero3:
        head_gather = args.vocab_size * args.dim / inp.tp * gather_bytes if last else 0.0
        # Gathered blocks: the current one and a prefetched one; without resharding after forward
        # every block stays gathered until its backward.
        gathered = (2 if inp.reshard_after_forward else n) * sp.block * gather_bytes
        items["FSDP gathered weights"] = Affine(gathered)
        items["FSDP gathered weights + grads"] = Affine(gathered + block_grads + head_gather)
    elif inp.data_parallel:
        # ZeRO-1/2 and replication (reshard_after_forward off): each unit's gathered weights live from
        # its forward to its backward of the step's last micro-batch (kept between micro-batches), and
        # one block's unsharded fp32 gradients wait for the reduce-scatter (or all-reduce) in backward.
        unsharded = items["weights"].const * fsdp if not inp.fsdp_mixed_precision else sp.total * 2.0
        items["FSDP unsharded weights"] = Affine(unsharded)
        items["FSDP unsharded weights + grads"] = Affine(unsharded + block_grads)
    if inp.defers_reduce_scatter and inp.pp == 1:
        # ZeRO-1 / replication with accumulation: every micro-batch but the last adds to unsharded
        # gradients (fp32 under mixed precision: FSDP's to_accumulated_grad_if_needed), reduced once.
        items["FSDP unsharded grads (accumulating)"] = Affine(train * (4 if inp.fsdp_mixed_precision else nm.w))
    # Tied embeddings: lm_head's grad is .grad already when the embedding's dense grad arrives to be
    # added (untied, AccumulateGrad just adopts it).
    tied = first and last and args.tie_embeddings and inp.mode == "full"
    emb_grad = args.vocab_size * args.dim / inp.tp * 4 if tied else 0.0
    items["embedding grad (dense)"] = Affine(emb_grad)
    items["NCCL buffers"] = Affine(NCCL_BUFFERS_BYTES if inp.num_gpus > 1 else 0.0)
    # QLoRA: the one projection dequantised at a time (forward, and again for its input gradient).
    items["NF4 weight, dequantised (1 projection)"] = Affine(
        largest_projection(inp) * nm.c if nf4_params(inp, sp) else 0.0
    )
    if inp.data_parallel and inp.pp > 1:
        # torch.distributed.pipelining runs every micro-batch's backward of an FSDP stage with
        # reshard_after_backward and gradient sync off (stage.backward_maybe_with_nosync), whatever the
        # ZeRO stage: the stage's weights stay gathered and FSDP accumulates unsharded float32 gradients
        # (to_accumulated_grad_if_needed) until one reduce-scatter after the last micro-batch.
        items["FSDP unsharded grads (pipeline)"] = Affine(train * 4)
        items["FSDP unsharded weights + grads (pipeline)"] = Affine(sp.total * gather_bytes + train * 4)
        items["activations, one micro-batch done"] = items["activations"] * ((k - 1) / k)
    phases = _phases(inp, last)
    built, staged = build_items(inp, sp, nm.w)
    items.update(built)
    cpu.update(staged)
    phases.update(build_phases(inp))
    managed: dict[str, Affine] = {}
    if inp.unified_memory != "none":
        for name in ["AdamW states"] + (["weights"] if inp.unified_memory == "model" else []):
            managed[name], items[name] = items[name], Affine()
    return MemoryModel(stage, items, phases, cpu, managed, offloaded)


def pinned_pool_rounding(mm: MemoryModel, tokens: float) -> float:
    """Host bytes the streamed offload's pinned pool allocates beyond the offloaded tensors themselves, on
    one GPU: torch's pinned allocator rounds each allocation up to a power of two, and the pool carves its
    buffers out of power-of-two blocks (`PinnedBufferPool.allocated_bytes`): 4.2 GiB on 67.8 at 286,720
    tokens with 31 block inputs of 2.19 GiB (measured on an H100: 73.4 GiB resident, 1.2 of it the process's
    own), nothing where the tensors are powers of two (64k tokens). Tensors the activation items do not
    name (`Item.tensors`: compiled blocks, selective recomputation) are counted without rounding."""
    extra = 0.0
    for tensor in mm.offloaded_tensors:  # the pool carves one block's worth (`blocks` buffers) at a time
        nbytes, count = tensor.sizes(tokens)
        if nbytes >= DEFAULT_MIN_OFFLOAD_BYTES:  # smaller ones stay on the GPU (counted on the host: < 1 MiB each)
            extra += PinnedBufferPool.allocated_bytes(count, nbytes, tensor.blocks) - count * nbytes
    return extra


def _phases(inp: PlanInput, last: bool) -> dict[str, list[str]]:
    """Which items each phase of the step holds (module docstring)."""
    static = ["weights", "AdamW states", "NCCL buffers", "NF4 weight, dequantised (1 projection)"]
    pipelined_fsdp = inp.data_parallel and inp.pp > 1
    early = static + (["gradients"] if inp.num_microbatches > 1 else [])
    if pipelined_fsdp:  # sharded gradients appear only at the step's single reduce-scatter
        early = static + ["FSDP unsharded grads (pipeline)"]
    elif inp.defers_reduce_scatter and inp.num_microbatches > 1:  # ZeRO-1 / replication
        early = static + ["FSDP unsharded grads (accumulating)"]
    fs_fwd, fs_bwd, fs_end = [], [], []
    if inp.zero3:
        fs_fwd, fs_bwd = ["FSDP gathered weights"], ["FSDP gathered weights + grads"]
        fs_end = fs_bwd
    elif inp.data_parallel:  # kept gathered from the first forward; resharded by the last backward
        fs_fwd, fs_bwd = ["FSDP unsharded weights"], ["FSDP unsharded weights + grads"]
    kept = ["autocast copies (kept)", "activations", "log-probs in flight"]
    phases = {"forward end": early + fs_fwd + ["autocast copies (all)", "activations", "log-probs in flight"]}
    if last and inp.fused_ce:
        phases["loss forward"] = early + fs_bwd + kept + ["fused CE (forward)"]
        phases["backward start"] = early + fs_bwd + kept + ["fused CE (backward)"]
    elif last:
        phases["loss forward"] = early + fs_bwd + kept + ["logits + fp32 copy"]
        phases["backward start"] = early + fs_bwd + kept + ["loss gradients"]
    if pipelined_fsdp:  # a micro-batch's backward done: every block gathered, its grads accumulated
        phases["pipeline backward end"] = static + [
            "FSDP unsharded weights + grads (pipeline)",
            "autocast copies (kept)",
            "activations, one micro-batch done",
            "log-probs in flight",
        ]
    # A block's backward (module docstring); a recomputed block holds its weight copies again. Block i's
    # backward holds the kept activations of blocks <= i and the gradients of blocks > i. With activation
    # offload the GPU holds the same resident blocks at every i, so the last block backpropagated (block
    # 0) is the largest and has every gradient; without it the first (all activations, no block gradients
    # yet) is counted here and the other end is close to "backward end".
    in_backward = ["autocast copies (kept)", "activations (blocks' backward)", "log-probs in flight"]
    offloaded = inp.activation_offload != "none"
    in_backward += ["gradients"] if offloaded and not set(early) & GRADIENT_ITEMS else []
    in_backward += ["autocast copies (1 block)"] if inp.recompute != "none" else []
    for moment in ("block backward (MLP)", "block backward (attention)"):
        phases[moment] = early + fs_bwd + in_backward + [moment]
    phases["backward end"] = static + fs_end + ["gradients", "embedding grad (dense)"]
    phases["optimizer step"] = static + ["gradients", "AdamW temporaries"]
    return phases


def memory_model(inp: PlanInput, tokens: float, seq: float) -> MemoryModel:
    """The stage with the highest peak (first and last are the candidates; with pp = 1 they coincide)."""
    models = [stage_model(inp, s) for s in sorted({0, inp.pp - 1})]
    return max(models, key=lambda m: m.peak(tokens, seq)[1])


@dataclass
class MemoryPlan:
    """Bytes on one GPU at its peak phase, and what the device must hold on top."""

    stage: int
    peak_phase: str
    peak_bytes: float  # comparable to torch.cuda.max_memory_allocated
    breakdown: dict[str, float]  # items of the peak phase
    phases: dict[str, float]
    fragmentation_bytes: float
    context_bytes: float
    required_bytes: float  # peak + fragmentation + context
    build_peak_bytes: float  # the largest of the build and load phases (build_phase.py)
    build_required_bytes: float  # build_peak_bytes + its fragmentation + context
    step_peak_bytes: float  # the largest phase of a training step
    capacity_bytes: float
    cpu_bytes: dict[str, float]  # per GPU
    managed_bytes: dict[str, float]
    host_bytes_per_node: float  # cpu + managed bytes of every GPU on one node
    host_capacity_bytes: float

    @property
    def fits(self) -> bool:
        return self.required_bytes <= self.capacity_bytes and self.host_bytes_per_node <= self.host_capacity_bytes

    @property
    def spare_bytes(self) -> float:
        return self.capacity_bytes - self.required_bytes


def tokens_per_microbatch(inp: PlanInput) -> float:
    """Tokens of one micro-batch before the cp split (the affine models divide by cp themselves)."""
    return float(inp.micro_batch * inp.seq_len)


def plan_memory(inp: PlanInput) -> MemoryPlan:
    tokens, seq = tokens_per_microbatch(inp), inp.seq_len
    mm = memory_model(inp, tokens, seq)
    phase, peak = mm.peak(tokens, seq)
    phases = {p: mm.phase_bytes(p, tokens, seq) for p in mm.phases}
    build_peak = max(v for p, v in phases.items() if p in BUILD_PHASES)
    frag = FRAGMENTATION[inp.expandable_segments] * peak
    cpu_bytes = {k: v.at(tokens, seq) for k, v in mm.cpu.items()}
    if mm.offloaded_tensors:
        cpu_bytes["pinned pool rounding"] = pinned_pool_rounding(mm, tokens)
    host = (sum(cpu_bytes.values()) + sum(v.at(tokens, seq) for v in mm.managed.values())) * inp.gpus_on_node
    hw = inp.hardware()
    return MemoryPlan(
        stage=mm.stage,
        peak_phase=phase,
        peak_bytes=peak,
        breakdown=_merge({n: mm.items[n].at(tokens, seq) for n in mm.phases[phase]}),
        phases=phases,
        fragmentation_bytes=frag,
        context_bytes=CUDA_CONTEXT_BYTES,
        required_bytes=peak + frag + CUDA_CONTEXT_BYTES,
        build_peak_bytes=build_peak,
        build_required_bytes=build_peak * (1 + FRAGMENTATION[inp.expandable_segments]) + CUDA_CONTEXT_BYTES,
        step_peak_bytes=max(v for p, v in phases.items() if p not in BUILD_PHASES),
        capacity_bytes=hw.memory_bytes,
        cpu_bytes=cpu_bytes,
        managed_bytes={k: v.at(tokens, seq) for k, v in mm.managed.items()},
        host_bytes_per_node=host,
        host_capacity_bytes=hw.host_memory_bytes,
    )


DISPLAY = {
    SHARD_ITEM: "weights",
    "autocast copies (all)": "autocast bf16 weight copies",
    "autocast copies (kept)": "autocast bf16 weight copies",
    "autocast copies (1 block)": "autocast bf16 weight copies",
    "log-probs in flight": "logits / loss",
    "logits + fp32 copy": "logits / loss",
    "loss gradients": "logits / loss",
    "activations (blocks' backward)": "activations",
    "block backward (MLP)": "activations",
    "block backward (attention)": "activations",
    "FSDP gathered weights": "FSDP buffers",
    "fused CE (forward)": "logits / loss",
    "fused CE (backward)": "logits / loss",
    "activations, one micro-batch done": "activations",
    "FSDP unsharded grads (pipeline)": "FSDP buffers",
    "FSDP unsharded weights + grads (pipeline)": "FSDP buffers",
    "FSDP gathered weights + grads": "FSDP buffers",
    "FSDP unsharded weights": "FSDP buffers",
    "FSDP unsharded weights + grads": "FSDP buffers",
    "FSDP unsharded grads (accumulating)": "gradients",
}


def _merge(items: dict[str, float]) -> dict[str, float]:
    """Fold the phase-specific item names into the display rows (and drop empty ones)."""
    out: dict[str, float] = {}
    for name, value in items.items():
        key = DISPLAY.get(name, name)
        out[key] = out.get(key, 0.0) + value
    return {k: v for k, v in out.items() if v > 0}
