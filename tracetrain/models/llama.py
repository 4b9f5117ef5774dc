"""Llama-family decoder as a plain nn.Module.

Covers Llama 2/3/3.1/3.2, Mistral (with its sliding window), Qwen2, Qwen3 and the MoE families
(Mixtral, Qwen3-MoE): RMSNorm, rotary embeddings (with Llama-3 frequency scaling), grouped-query
attention through `F.scaled_dot_product_attention`, SwiGLU MLP or routed SwiGLU experts
(models/moe.py), optional q/k/v bias, optional per-head q/k RMSNorm, tied or untied embeddings. Parameter names follow Hugging Face's Llama
layout (`layers.N.self_attn.q_proj`, `layers.N.mlp.gate_proj`, ...) so checkpoint and PEFT adapter
names map one to one, and the rotary embedding uses the same half-split ("rotate_half") layout as HF
checkpoints, so their q/k weights load without a permutation.

Precision, recomputation, LoRA, compile and parallelism are applied from outside (`apply_*`
transforms); nothing here knows about them. Packed sequences are handled by `document_ids`: tokens
attend only to earlier tokens of the same document (a block-diagonal causal mask).

Seams for speed transforms (tracetrain/kernels, tracetrain/models/attention.py), so that no model code
branches on an optimisation: `Transformer.mask_fn` turns document ids into whatever the attention
backend needs (a dense bool mask by default, a FlexAttention BlockMask after `apply_attention`),
`Attention.attn_core` is the attention kernel behind the projections (SDPA by default; a forward with a
KV cache uses `attention.cached_attention` instead, whose kernel choice follows the cache's mask), and
`Attention.rope_fn` applies the rotary embedding to q and k together (a fused kernel can replace it), and
`TransformerBlock.ffn` is the block's norm + MLP, a per-token function (the tiled MLP runs it tile by tile).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from tracetrain.config_sections import MODEL_SHAPE_LIMITS
from tracetrain.models.attention import SDPACore, cached_attention, dense_mask_fn
from tracetrain.models.moe import GroupedExperts, MoEFeedForward

if TYPE_CHECKING:
    from torch.nn.attention.bias import CausalBias
    from torch.nn.attention.flex_attention import BlockMask


@dataclass
class ModelArgs:
    """Architecture hyper-parameters. Everything the accounting functions need is here."""

    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_dim: int = 384
    vocab_size: int = 320
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # Llama-3.1-style frequency scaling: {"factor", "low_freq_factor", "high_freq_factor",
    # "original_max_position_embeddings"}; empty = plain RoPE.
    rope_scaling: dict[str, float] = field(default_factory=dict)
    max_seq_len: int = 2048
    qkv_bias: bool = False
    tie_embeddings: bool = False
    init_std: float = 0.02
    # Families beyond Llama (models/arch*.py); each default keeps the Llama layout.
    head_dim_override: int = 0  # per-head size when not dim // n_heads (Qwen3: 128 at any width); 0 = derived
    qk_norm: bool = False  # Qwen3: RMSNorm over each head's q and k (weights of head_dim), before RoPE
    sliding_window: int = 0  # Mistral: a query sees only the last `sliding_window` positions, itself included; 0 = all
    num_experts: int = 0  # mixture of experts (models/moe.py) in place of the dense MLP; 0 = dense
    experts_top_k: int = 0  # experts each token is routed to (MoE)
    moe_ffn_dim: int = 0  # each expert's hidden size; 0 = ffn_dim (Mixtral). Qwen3-MoE's moe_intermediate_size
    moe_norm_topk: bool = True  # renormalise the top-k router probabilities (Mixtral; Qwen3-MoE's norm_topk_prob)
    dense_layers: tuple[int, ...] = ()  # MoE model: blocks that keep the dense MLP (Qwen3-MoE's mlp_only_layers)
    # Gemma 2 / 3 (models/arch_gemma.py) and Phi-3 (models/arch_phi.py): `family` picks their module classes
    # (models/families.py); "llama" covers every family above.
    family: str = "llama"
    query_pre_attn_scalar: float = 0.0  # scores scaled by its -1/2 power instead of head_dim's; 0 = head_dim
    attn_logit_softcap: float = 0.0  # scores -> cap * tanh(scores / cap) before the softmax; 0 = off
    final_logit_softcap: float = 0.0  # logits -> cap * tanh(logits / cap); 0 = off
    local_window: int = 0  # tokens a "sliding" layer of `layer_types` sees, itself included (Gemma)
    layer_types: tuple[str, ...] = ()  # per layer "full" or "sliding" (a local_window layer); () = all full
    rope_local_theta: float = 0.0  # rope base of the sliding layers (Gemma 3); 0 = rope_theta
    rope_linear_factor: float = 1.0  # full layers' frequencies divided by it (Gemma 3's "linear" scaling)
    partial_rotary_factor: float = 1.0  # fraction of each head's dims that rotate (Phi-4-mini: 0.75)
    # Phi-3 "longrope": per-frequency divisors, the short set while positions stay below
    # `rope_original_max_len` and the long set beyond; cos/sin times `rope_attention_factor`. () = off.
    rope_short_factor: tuple[float, ...] = ()
    rope_long_factor: tuple[float, ...] = ()
    rope_original_max_len: int = 0
    rope_attention_factor: float = 1.0

    @property
    def head_dim(self) -> int:
        return self.head_dim_override or self.dim // self.n_heads

    @property
    def rotary_dim(self) -> int:
        """Leading dims of each head that the rotary embedding turns (all but Phi-4-mini's last quarter)."""
        return int(self.head_dim * self.partial_rotary_factor) // 2 * 2

    @property
    def q_dim(self) -> int:
        """Width of the queries (and of o_proj's input): n_heads * head_dim, dim unless head_dim is set."""
        return self.n_heads * self.head_dim

    @property
    def expert_ffn_dim(self) -> int:
        return self.moe_ffn_dim or self.ffn_dim

    def is_moe_layer(self, layer: int) -> bool:
        """Block `layer` routes its tokens to experts (an MoE model, and not one of its dense layers)."""
        return self.num_experts > 0 and layer not in self.dense_layers

    def validate(self) -> None:
        for name, limit in MODEL_SHAPE_LIMITS.items():
            value = getattr(self, name, None)
            low = 0 if name == "num_experts" else 1  # 0 experts: a dense model
            if isinstance(value, int) and not low <= value <= limit:
                raise ValueError(f"{name} = {value} is out of range (allowed: {low} to {limit:,})")
        for name in ("head_dim_override", "moe_ffn_dim"):
            if not 0 <= getattr(self, name) <= MODEL_SHAPE_LIMITS["ffn_dim"]:
                raise ValueError(
                    f"{name} = {getattr(self, name)} is out of range (allowed: 0 to {MODEL_SHAPE_LIMITS['ffn_dim']:,})"
                )
        if self.dim % self.n_heads and not self.head_dim_override:
            raise ValueError(f"dim {self.dim} is not divisible by n_heads {self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads {self.n_heads} is not divisible by n_kv_heads {self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for rotary embeddings")
        if self.num_experts and not 0 < self.experts_top_k <= self.num_experts:
            raise ValueError(f"experts_top_k {self.experts_top_k} must be in 1..num_experts ({self.num_experts})")
        if any(t not in ("full", "sliding") for t in self.layer_types) or len(self.layer_types) not in (
            0,
            self.n_layers,
        ):
            raise ValueError(f"layer_types must name 'full' or 'sliding' for each of the {self.n_layers} layers")
        if self.sliding_window < 0:
            raise ValueError(f"sliding_window {self.sliding_window} must be >= 0 (0 = no window)")


def rope_inv_freq(args: ModelArgs) -> torch.Tensor:
    """Inverse frequencies (head_dim / 2,), float32, with Llama-3 scaling when configured."""
    hd = args.rotary_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    s = args.rope_scaling
    if not s:
        return inv_freq
    # Llama 3.1: long wavelengths are divided by `factor`, short ones kept, the band between blended.
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_mid, blended, scaled)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (batch, heads, seq, head_dim); cos/sin: (batch, seq, head_dim) float32."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (x.float() * cos + rotate_half(x.float()) * sin).to(x.dtype)


def apply_rope_qk(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding of queries and keys: the default `Attention.rope_fn`."""
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 for stability, then scale in the input dtype (as HF Llama does).
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        kv_dim = args.n_kv_heads * args.head_dim
        self.q_proj = nn.Linear(args.dim, args.q_dim, bias=args.qkv_bias)
        self.k_proj = nn.Linear(args.dim, kv_dim, bias=args.qkv_bias)
        self.v_proj = nn.Linear(args.dim, kv_dim, bias=args.qkv_bias)
        self.o_proj = nn.Linear(args.q_dim, args.dim, bias=False)
        # Qwen3: per-head RMSNorm of q and k (one weight of head_dim shared by all heads), before RoPE.
        self.q_norm = RMSNorm(args.head_dim, args.norm_eps) if args.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(args.head_dim, args.norm_eps) if args.qk_norm else nn.Identity()
        self.rope_fn = apply_rope_qk  # (q, k, cos, sin) -> (q, k); a fused kernel may replace it
        self.attn_core: nn.Module = SDPACore()  # (q, k, v, mask) -> (batch, heads, seq, head_dim)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | BlockMask | CausalBias | None,
        cache: KVCacheLayer | None = None,
    ) -> torch.Tensor:
        b, s, _ = x.shape  # (batch, seq, dim)
        q = self.q_norm(self.q_proj(x).view(b, s, self.n_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, s, self.n_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = self.rope_fn(q, k, cos, sin)
        if cache is not None:  # generation: the cache's mask picks a GQA-capable kernel (attention.py)
            k, v = cache.update(k, v)  # (batch, kv_heads, cached + seq, head_dim)
            out = cached_attention(q, k, v, mask)  # type: ignore[arg-type]  # BlockMask reaches only the flex core, which takes it; (batch, heads, seq, head_dim)
        else:
            out = self.attn_core(q, k, v, mask)  # (batch, heads, seq, head_dim)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(args.dim, args.ffn_dim, bias=False)
        self.up_proj = nn.Linear(args.dim, args.ffn_dim, bias=False)
        self.down_proj = nn.Linear(args.ffn_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, layer: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.dim, args.norm_eps)
        self.self_attn = Attention(args)
        self.post_attention_layernorm = RMSNorm(args.dim, args.norm_eps)
        self.mlp: nn.Module = (
            MoEFeedForward(args.dim, args.expert_ffn_dim, args.num_experts, args.experts_top_k, args.moe_norm_topk)
            if args.is_moe_layer(layer)
            else FeedForward(args)
        )

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | BlockMask | CausalBias | None,
        cache: KVCacheLayer | None = None,
    ) -> torch.Tensor:
        x = self.attend(x, cos, sin, mask, cache)
        return x + self.ffn(x)

    def attend(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | BlockMask | CausalBias | None,
        cache: KVCacheLayer | None = None,
    ) -> torch.Tensor:
        """The attention half with its residual: norm, attention, add (an MoE block's compiled part)."""
        return x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache)

    def ffn(self, x: torch.Tensor) -> torch.Tensor:
        """The feed-forward half without its residual: norm, then MLP, token by token (memory/tiled_mlp.py
        runs it over sequence tiles)."""
        return self.mlp(self.post_attention_layernorm(x))


class Transformer(nn.Module):
    """The decoder. `forward(tokens, position_ids, document_ids) -> logits (batch, seq, vocab)`."""

    # Registered buffers, declared so the checker knows their type (nn.Module types attributes Tensor | Module).
    rope_inv_freq: torch.Tensor  # (head_dim / 2,) float32

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        args.validate()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args, i) for i in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.lm_head = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.register_buffer("rope_inv_freq", rope_inv_freq(args), persistent=False)
        # (batch, seq) document ids -> the attention mask every block receives; built once per batch.
        self.mask_fn = dense_mask_fn(args)
        # (hidden (tokens, dim), lm_head weight, labels (tokens,)) -> summed loss without full logits; set by
        # the fused cross-entropy transform (kernels/fused_ce.py `apply_fused_ce`), None = logits only.
        self.fused_loss: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.args.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @torch.no_grad()
    def init_weights(self) -> None:
        """Random init (normal, std init_std; residual outputs scaled by 1/sqrt(2 * n_layers)).

        Called after `to_empty` when the model was built on the meta device.
        """
        std = self.args.init_std
        self.rope_inv_freq.copy_(rope_inv_freq(self.args))
        nn.init.normal_(self.embed_tokens.weight, std=std)
        for block in self.layers:
            for name, mod in block.named_modules():
                if isinstance(mod, nn.Linear):
                    out_proj = name.endswith(("o_proj", "down_proj"))
                    nn.init.normal_(mod.weight, std=std / math.sqrt(2 * self.args.n_layers) if out_proj else std)
                    if mod.bias is not None:
                        nn.init.zeros_(mod.bias)
                elif isinstance(mod, RMSNorm):
                    nn.init.ones_(mod.weight)
                elif isinstance(mod, GroupedExperts):
                    mod.init_weights(std, std / math.sqrt(2 * self.args.n_layers))
        nn.init.ones_(self.norm.weight)
        if not self.args.tie_embeddings:
            nn.init.normal_(self.lm_head.weight, std=std)

    def rope(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(batch, seq) positions -> cos, sin of shape (batch, seq, head_dim), float32."""
        freqs = position_ids.float().unsqueeze(-1) * self.rope_inv_freq  # (batch, seq, head_dim / 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    def forward_hidden(
        self,
        tokens: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        """Final normed hidden states (batch, seq, dim); the loss may apply lm_head itself (chunked)."""
        h, layer_inputs = self.layer_inputs(tokens, position_ids, document_ids, cache)
        return self.run_layers(h, layer_inputs, cache)

    def layer_inputs(
        self,
        tokens: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | BlockMask | CausalBias | None]]]:
        """The embedded tokens (batch, seq, dim) and each block's (cos, sin, mask): what `run_layers` takes.
        With a cache the mask is the cache's (`attention_mask`), else built from `document_ids`."""
        b, s = tokens.shape
        cos, sin = self.rope(self.positions(tokens, position_ids, cache))
        if document_ids is None and cache is None and 0 < self.args.sliding_window < s:
            document_ids = tokens.new_zeros(b, s)  # one document: SDPA's is_causal has no window, the mask has
        mask = self.mask_fn(document_ids) if document_ids is not None else None
        if cache is not None:
            mask = cache.attention_mask(s)
        h = self.embed_tokens(tokens)  # (batch, seq, dim)
        return h, [(cos, sin, mask)] * len(self.layers)

    def positions(self, tokens: torch.Tensor, position_ids: torch.Tensor | None, cache: KVCache | None) -> torch.Tensor:
        """`position_ids` (batch, seq), or by default the positions after the cache's (from 0 without one)."""
        if position_ids is not None:
            return position_ids
        b, s = tokens.shape
        start = cache.length if cache is not None else 0
        return torch.arange(start, start + s, device=tokens.device).expand(b, s)

    def run_layers(
        self,
        h: torch.Tensor,
        layer_inputs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | BlockMask | CausalBias | None]],
        cache: KVCache | None,
        last_block: Callable[..., torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """The blocks over the embedded tokens `h` (batch, seq, dim), block i with the rotary cos/sin and the
        mask of `layer_inputs[i]`; then the cache moves past the new positions, and the final norm.
        `last_block(block, h, cos, sin, mask, cache_layer)`, given, runs the last block instead of its own call
        (generation's prefill runs it at the last position alone: models/prefill.py `forward_last`)."""
        last, s = len(self.layers) - 1, h.shape[1]  # (last_block's output may hold fewer positions)
        for i, layer in enumerate(self.layers):
            cos, sin, mask = layer_inputs[i]
            kv = cache.layers[i] if cache is not None else None
            if i == last and last_block is not None:
                h = last_block(layer, h, cos, sin, mask, kv)
            else:
                h = layer(h, cos, sin, mask, kv)
        if cache is not None:
            cache.advance(s)
        return self.norm(h)

    def forward(
        self,
        tokens: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        cache: KVCache | None = None,
        *,
        labels: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits (batch, seq, vocab); or, with `labels`, the summed cross-entropy through the fused head
        that `apply_fused_ce` attached (kernels/fused_ce.py), never materialising the full logits.
        The loss goes through `forward` (not `forward_hidden`) so that module hooks on the root (FSDP's
        lazy init, root unshard and stream bookkeeping) run exactly as for the logits path."""
        hidden = self.forward_hidden(tokens, position_ids, document_ids, cache)
        if labels is not None:
            if self.fused_loss is None:
                raise RuntimeError("forward(labels=...) needs the fused cross-entropy head: apply_fused_ce first")
            return self.fused_loss(hidden.flatten(0, 1), self.lm_head.weight, labels.flatten())
        return self.logits(hidden)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The output head over final hidden states (..., dim) -> (..., vocab); a family that transforms
        its logits (Gemma 2's soft-capping) overrides it, so generation's last-position head agrees."""
        return self.lm_head(hidden)


class KVCacheLayer:
    """One layer's preallocated keys and values: (batch, kv_heads, max_len, head_dim)."""

    def __init__(self, owner: KVCache, k: torch.Tensor, v: torch.Tensor) -> None:
        self.owner, self.k, self.v = owner, k, v

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        start, end = self.owner.length, self.owner.length + k.shape[2]
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        return self.k[:, :, :end], self.v[:, :, :end]


class KVCache:
    """Static KV cache for generation. Rows may be left-padded: `pad_mask` (batch, max_len) marks
    positions that hold real tokens, so padded prompts never receive attention."""

    def __init__(self, args: ModelArgs, batch: int, max_len: int, device: torch.device, dtype: torch.dtype) -> None:
        shape = (batch, args.n_kv_heads, max_len, args.head_dim)
        self.layers = [
            KVCacheLayer(
                self, torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=dtype)
            )
            for _ in range(args.n_layers)
        ]
        self.length = 0
        self.max_len = max_len
        self.valid = torch.ones(batch, max_len, dtype=torch.bool, device=device)
        self.sliding_window = args.sliding_window

    def attention_mask(self, s: int) -> torch.Tensor:
        """(batch, 1, s, length + s) bool: causal within the new tokens, and no padded positions."""
        end = self.length + s
        if end > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} tokens; {end} requested")
        q_pos = torch.arange(self.length, end, device=self.valid.device).unsqueeze(1)
        k_pos = torch.arange(end, device=self.valid.device).unsqueeze(0)
        causal = k_pos <= q_pos  # (s, end)
        if self.sliding_window:
            causal &= k_pos > q_pos - self.sliding_window
        return (causal.unsqueeze(0) & self.valid[:, None, :end]).unsqueeze(1)

    def advance(self, s: int) -> None:
        self.length += s
