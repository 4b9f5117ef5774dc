"""Counting from first principles: parameters, FLOPs per token, bytes. Shared by the trainer's metrics
and the planner, so there is one formula in one place.

FLOP conventions (stated in the README):
- A matmul of an (m, k) by (k, n) matrix costs 2*m*k*n FLOPs. Per token, a linear layer with P weights
  costs 2P forward, 2P for the input gradient and 2P for the weight gradient.
- Causal attention is counted at half of the full score matrix: per layer and token, QK^T and PV cost
  2 * seq * (n_heads * head_dim) forward together; backward costs twice the forward. A sliding window
  w < seq (Mistral; Gemma's local layers) leaves w - w^2 / (2 seq) keys per query on average instead of seq / 2.
- Full training: 3x forward (the usual 6N + attention). LoRA: frozen weights need no weight gradient,
  so 4 FLOPs per frozen weight and token, 6 per adapter weight, attention 3x forward.
- Mixture of experts (`num_experts` > 0): each token passes through `top_k` experts of the MLP's
  shape plus the router (dim x num_experts), so the MLP counts top_k times and the router once: the
  "active" parameters. Expert weights a token does not visit cost it nothing. A model's own experts
  (`ModelArgs.num_experts`: Mixtral, Qwen3-MoE, `model.num_experts`) count per block, dense blocks of
  an MoE model (Qwen3-MoE's mlp_only_layers) as dense; the planner passes an MoE variant of a dense
  shape as `num_experts` / `top_k` instead.
- Attention widths are n_heads * head_dim (`q_dim`), not always dim (Qwen3's head_dim is 128 at any width).
- Model FLOPs (MFU) count only the math the algorithm needs; hardware FLOPs (HFU) add what activation
  recomputation repeats: one more forward for full recomputation. Selective recomputation (as in
  tracetrain.memory.recompute) keeps every matmul and attention output and recomputes only norms and
  elementwise ops, whose FLOPs are negligible next to the matmuls: it adds no counted FLOPs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from tracetrain.models.llama import ModelArgs


def attention_params(args: ModelArgs) -> int:
    """Parameters of one block's attention: projections (q and o of n_heads * head_dim), q/k/v biases,
    and Qwen3's per-head q/k norms (head_dim weights each)."""
    d, q, kv = args.dim, args.q_dim, args.n_kv_heads * args.head_dim
    bias = q + 2 * kv if args.qkv_bias else 0
    qk_norm = 2 * args.head_dim if args.qk_norm else 0
    return 2 * d * q + 2 * d * kv + bias + qk_norm


def mlp_params(args: ModelArgs, layer: int = 0) -> int:
    """Parameters of block `layer`'s MLP: SwiGLU (3 d f), or its experts and their d x E router."""
    if args.is_moe_layer(layer):
        return args.num_experts * 3 * args.dim * args.expert_ffn_dim + args.dim * args.num_experts
    return 3 * args.dim * args.ffn_dim


def block_norm_params(args: ModelArgs) -> int:
    """Norm weights of one block around its sub-layers: two of dim, four in Gemma (before and after both)."""
    return (4 if args.family.startswith("gemma") else 2) * args.dim


def block_params(args: ModelArgs, layer: int = 0) -> int:
    """Parameters of transformer block `layer` (attention, MLP, norms)."""
    return attention_params(args) + mlp_params(args, layer) + block_norm_params(args)


def num_params(args: ModelArgs) -> int:
    """Exact parameter count, as `sum(p.numel())` over unique parameters of the built model."""
    embed = args.vocab_size * args.dim
    head = 0 if args.tie_embeddings else args.vocab_size * args.dim
    return embed + sum(block_params(args, i) for i in range(args.n_layers)) + args.dim + head


def _active_mlp(args: ModelArgs, layer: int, num_experts: int, top_k: int) -> int:
    """MLP weights one token multiplies by in block `layer`: top_k experts and the router, or the dense MLP."""
    d = args.dim
    if num_experts > 0:  # an MoE variant of a dense `args` (the planner's, models/moe.py apply_moe)
        if not 0 < top_k <= num_experts:
            raise ValueError(f"top_k {top_k} must be in 1..num_experts ({num_experts})")
        return top_k * 3 * d * args.ffn_dim + d * num_experts
    if args.is_moe_layer(layer):
        return args.experts_top_k * 3 * d * args.expert_ffn_dim + d * args.num_experts
    return 3 * d * args.ffn_dim


def num_matmul_params(args: ModelArgs, num_experts: int = 0, top_k: int = 0) -> int:
    """Weights that take part in a matmul for every token: all linear layers and the output head
    (the embedding lookup is a gather, not a matmul; norms and biases are negligible and excluded).
    MoE (`args.num_experts` > 0, or `num_experts` > 0 for an MoE variant of a dense `args`): the active
    weights, top_k experts plus the router."""
    d, kv = args.dim, args.n_kv_heads * args.head_dim
    attn = 2 * d * args.q_dim + 2 * d * kv
    mlp = sum(_active_mlp(args, i, num_experts, top_k) for i in range(args.n_layers))
    return args.n_layers * attn + mlp + args.vocab_size * args.dim


def lora_params(args: ModelArgs, rank: int, targets: list[str], dora: bool = False) -> int:
    """Adapter parameters for LoRA of `rank` on the named projections of every block (with `dora`, plus
    DoRA's magnitude vector: one value per output feature of each adapted projection). An MoE block's
    experts are not linear layers: only its attention is adapted."""
    d, q, kv, f = args.dim, args.q_dim, args.n_kv_heads * args.head_dim, args.ffn_dim
    attn = {"q_proj": (d, q), "k_proj": (d, kv), "v_proj": (d, kv), "o_proj": (q, d)}
    mlp = {"gate_proj": (d, f), "up_proj": (d, f), "down_proj": (f, d)}
    names = [*attn, *mlp] if "all-linear" in targets else targets

    def per(shapes: dict[str, tuple[int, int]]) -> int:
        return sum(rank * (i + o) + (o if dora else 0) for n, (i, o) in shapes.items() if n in names)

    dense = sum(1 for i in range(args.n_layers) if not args.is_moe_layer(i))
    return args.n_layers * per(attn) + dense * per(mlp)


@dataclass(frozen=True)
class TokenFlops:
    """FLOPs per trained token: `model` for MFU, `hardware` (with recomputation) for HFU."""

    model: float
    hardware: float


def attention_forward_flops(args: ModelArgs, seq_len: int) -> float:
    """Causal attention scores and weighted sum, forward, per token, all layers."""
    total = 0.0
    for layer in range(args.n_layers):  # Gemma: local layers of `local_window`, global ones; Mistral: all windowed
        local = args.layer_types and args.layer_types[layer] == "sliding"
        window = args.local_window if local else args.sliding_window
        # Keys a query sees, on average: half the row when causal; with a shorter window, all but the ramp.
        total += seq_len / 2 if not 0 < window < seq_len else window - window * window / (2 * seq_len)
    return 4.0 * total * args.q_dim


def training_flops_per_token(
    args: ModelArgs,
    seq_len: int,
    *,
    mode: Literal["full", "lora"] = "full",
    num_lora_params: int = 0,
    recompute: Literal["none", "selective", "full"] = "none",
    num_experts: int = 0,
    top_k: int = 0,
) -> TokenFlops:
    """FLOPs per token of one training step (forward + backward), by the conventions above."""
    n = num_matmul_params(args, num_experts, top_k)
    attn = attention_forward_flops(args, seq_len)
    forward = 2.0 * n + 2.0 * num_lora_params + attn
    if mode == "full":
        model = 6.0 * n + 3.0 * attn
    else:
        model = 4.0 * n + 6.0 * num_lora_params + 3.0 * attn
    extra = {"none": 0.0, "selective": 0.0, "full": forward}[recompute]
    return TokenFlops(model=model, hardware=model + extra)


def inference_flops_per_token(args: ModelArgs, context_len: int) -> float:
    """Forward FLOPs for one new token attending to `context_len` earlier tokens (non-causal row)."""
    return 2.0 * num_matmul_params(args) + 4.0 * args.n_layers * context_len * args.q_dim


def weight_bytes(args: ModelArgs, bytes_per_param: int) -> int:
    return num_params(args) * bytes_per_param


def kv_cache_bytes_per_token(args: ModelArgs, dtype_bytes: int) -> int:
    """KV-cache bytes one token of one sequence holds: a key and a value per layer and KV head."""
    return 2 * args.n_layers * args.n_kv_heads * args.head_dim * dtype_bytes


def kv_cache_bytes(args: ModelArgs, batch: int, num_tokens: int, dtype_bytes: int) -> int:
    """KV-cache bytes of `batch` sequences of `num_tokens` positions (e.g. a preallocated cache's max_len)."""
    return batch * num_tokens * kv_cache_bytes_per_token(args, dtype_bytes)
