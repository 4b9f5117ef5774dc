"""Parameters held by one GPU: how tensor, pipeline and expert parallelism split the model, and how
many of those weights autocast copies to bf16. Counts (not bytes); `memory.py` turns them into bytes.

Tensor parallelism (Megatron/torchtitan plan): q/k/v/gate/up column-wise, o/down row-wise, the
embedding and lm_head by vocabulary; RMSNorm weights are replicated. So a block holds
(block_params - norms) / tp + norms parameters per rank (norms: 2d, Gemma's 4d), the embedding and head V*d/tp each.
Pipeline parallelism: the blocks split as parallel/pipeline.py `split_layers` splits them (pp, or
pp x virtual stages with interleaving, contiguous runs as even as possible, the extra blocks on the
earliest stages: 126 layers over 8 stages = 6 x 16 + 2 x 15), a rank holding its stages s = rank + i pp;
the embedding on the first stage, final norm and lm_head on the last (tied embeddings: the last stage
holds its own copy of the tied matrix). Stage 0 therefore holds the most blocks.
MoE (models/moe.py): a block's MLP becomes `num_experts` SwiGLU experts of ffn_dim plus a d x E
router; experts are split over ep (and tp) ranks. Expert parallelism borrows its ranks from dp_shard
(parallel/expert_parallel.py), so data parallelism shards each expert over the remaining
dp_shard * cp / ep ranks only (`expert_shards`); with none left FSDP ignores the experts, which then
stay float32 and are cast by autocast at every use.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tracetrain.models.accounting import block_norm_params, block_params, lora_params, num_params
from tracetrain.models.qlora import NF4_BITS_PER_PARAM
from tracetrain.parallel.pipeline import split_layers
from tracetrain.plan.inputs import PlanInput


@dataclass(frozen=True)
class StageParams:
    """Parameter counts on one GPU of pipeline stage `stage`, before data-parallel sharding."""

    stage: int
    num_blocks: int
    block: float  # one block, after tp/ep
    embedding: float  # 0 unless first stage
    head: float  # lm_head (+ final norm) on the last stage; 0 elsewhere
    adapters: float  # LoRA adapters on this stage (replicated across tp)
    block_linear: float  # matmul weights of one block (what autocast casts), after tp/ep
    first_block_qkv: float  # q/k/v weights of block 0 (a LoRA base there casts but keeps nothing)
    experts: float = 0.0  # MoE expert weights of one block on this GPU (after ep/tp), inside `block`

    @property
    def total(self) -> float:
        return self.num_blocks * self.block + self.embedding + self.head + self.adapters


def mlp_params(inp: PlanInput) -> int:
    """SwiGLU parameters of one block: 3*d*f dense, or E experts + a d x E router."""
    a = inp.model
    dense = 3 * a.dim * a.ffn_dim
    return dense * inp.num_experts + a.dim * inp.num_experts if inp.num_experts else dense


def total_params(inp: PlanInput) -> int:
    """Model parameters (accounting.num_params, plus the extra experts of a MoE variant)."""
    a = inp.model
    return num_params(a) + a.n_layers * (mlp_params(inp) - 3 * a.dim * a.ffn_dim)


def adapter_params(inp: PlanInput) -> int:
    """LoRA parameters: an MoE block's experts are not linear layers, so only its attention is adapted."""
    a = inp.model
    if inp.num_experts:
        a = dataclasses.replace(a, num_experts=inp.num_experts, experts_top_k=inp.top_k)
    return lora_params(a, inp.lora_rank, list(inp.lora_targets), inp.lora_dora)


def trainable_params(inp: PlanInput) -> int:
    if inp.mode == "full":
        return total_params(inp)
    return adapter_params(inp)


def nf4_params(inp: PlanInput, sp: StageParams) -> float:
    """Weights this stage holds in NF4 (QLoRA: every block projection; MoE experts and the router's
    matrix are not `nn.Linear` projections and stay at the base dtype); 0 without lora.base_quant."""
    if inp.mode != "lora" or inp.lora_base_quant != "nf4":
        return 0.0
    router = inp.model.dim * inp.num_experts  # not split by tp (stage_params)
    return sp.num_blocks * (sp.block_linear - sp.experts - (router if inp.num_experts else 0.0))


def frozen_bytes(inp: PlanInput, sp: StageParams, base_bytes: float) -> float:
    """Bytes of this stage's frozen weights before data-parallel sharding: `base_bytes` each, the NF4 ones
    at NF4_BITS_PER_PARAM (4.127 bits: codes, int8 block scales, float32 scale of scales)."""
    trainable = sp.total if inp.mode == "full" else sp.adapters
    quantised = nf4_params(inp, sp)
    return (sp.total - trainable - quantised) * base_bytes + quantised * NF4_BITS_PER_PARAM / 8


def largest_projection(inp: PlanInput) -> float:
    """Elements of the largest block projection (after tp): the one NF4 weight dequantised at a time."""
    a = inp.model
    return max(a.dim * a.ffn_dim, a.dim * a.n_heads * a.head_dim) / inp.tp


def stage_params(inp: PlanInput, stage: int) -> StageParams:
    a, tp = inp.model, inp.tp
    d, q, kv = a.dim, a.q_dim, a.n_kv_heads * a.head_dim
    norms = block_norm_params(a)  # replicated over tp (Gemma: four of dim)
    attn = block_params(a) - 3 * d * a.ffn_dim - norms  # projections (+ q/k/v bias, q/k norms)
    mlp = mlp_params(inp)
    experts = 0.0
    if inp.num_experts:
        router = d * inp.num_experts
        experts = (mlp - router) / (inp.ep * tp)
        mlp_local = experts + router
    else:
        mlp_local = mlp / tp
    block = attn / tp + mlp_local + norms
    block_linear = (2 * d * q + 2 * d * kv) / tp + mlp_local - (d * inp.num_experts if inp.num_experts else 0)
    first, last = stage == 0, stage == inp.pp - 1
    vd = a.vocab_size * d / tp
    embedding = vd if first else 0.0
    head = 0.0
    if last:
        separate = not a.tie_embeddings or inp.pp > 1
        head = (vd if separate else 0.0) + d
    num_blocks = blocks_on_rank(inp, stage)
    adapters = 0.0
    if inp.mode == "lora":
        adapters = adapter_params(inp) * num_blocks / a.n_layers
    return StageParams(
        stage,
        num_blocks,
        block,
        embedding,
        head,
        adapters,
        block_linear,
        (d * q + 2 * d * kv) / tp if first else 0.0,
        experts,
    )


def blocks_on_rank(inp: PlanInput, rank: int) -> int:
    """Transformer blocks pipeline rank `rank` holds (all of them without a pipeline)."""
    v = inp.pp_virtual_stages if inp.pp_schedule == "interleaved_1f1b" else 1
    layers = split_layers(inp.model.n_layers, inp.pp * v)
    return sum(len(layers[rank + i * inp.pp]) for i in range(v))


def expert_shards(inp: PlanInput) -> int:
    """Data-parallel ranks one expert weight is sharded over (data_parallel.expert_dp_mesh)."""
    return max(1, inp.dp_shard * inp.cp // inp.ep)


def cast_params(inp: PlanInput, sp: StageParams, *, autocast: bool, weight_bytes: int) -> tuple[float, float]:
    """Weights whose bf16 autocast copy is kept from forward to backward on this stage, as
    (per block, outside the blocks): total = num_blocks * per_block + outside.

    Full FT with fp32 params: every linear weight, lm_head included (cached once per forward).
    LoRA: the adapters (fp32, cached) and, with a base autocast must cast (fp32, or the bf16 base under
    fp16 autocast), every frozen linear whose input needs a gradient: all but block 0's q/k/v (and
    those adapters' lora_A, whose input needs none either).
    """
    if not autocast or (weight_bytes == 2 and inp.mode == "full"):
        return 0.0, 0.0
    a = inp.model
    head_linear = a.vocab_size * a.dim / inp.tp if sp.stage == inp.pp - 1 else 0.0
    if inp.mode == "full":
        return sp.block_linear, head_linear
    adapters_per_block = sp.adapters / max(1, sp.num_blocks)
    first_qkv_adapters = 0.0
    if sp.stage == 0:
        first_qkv_adapters = sum(inp.lora_rank * a.dim for t in ("q_proj", "k_proj", "v_proj") if t in inp.lora_targets)
    # A 2-byte LoRA base is bf16 (there is no fp16 base option): fp16 autocast casts and caches it.
    if weight_bytes == 4 or inp.precision == "fp16":
        return sp.block_linear + adapters_per_block, head_linear - sp.first_block_qkv - first_qkv_adapters
    return adapters_per_block, -first_qkv_adapters
