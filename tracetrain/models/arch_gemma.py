"""Gemma 2 and Gemma 3 (text) as plain modules over the Llama ones (models/llama.py).

What differs from Llama, as in `transformers`' Gemma2ForCausalLM / Gemma3ForCausalLM:
- the embedding output is multiplied by sqrt(dim) (rounded to the activation dtype first, as HF does);
- RMSNorm scales by (1 + weight), in float32, and its weights start at zero (`GemmaRMSNorm`);
- the MLP is GeGLU: gelu (tanh approximation) of the gate times up (`GemmaFeedForward`);
- each block norms around both sub-layers: input -> attention -> post_attention_layernorm -> residual,
  pre_feedforward_layernorm -> MLP -> post_feedforward_layernorm -> residual (`GemmaBlock`);
- scores are scaled by query_pre_attn_scalar^-1/2 (not head_dim's) and, in Gemma 2, soft-capped,
  cap * tanh(scores / cap), before the softmax; the logits are soft-capped the same way;
- layers are "sliding" (each token sees the `local_window` tokens up to itself) or "full"; Gemma 3
  rotates the sliding layers with their own base (rope_local_theta) and the full ones with the global
  base, optionally divided by a linear factor; Gemma 3 norms q and k per head before the rotation.

Masks: the block's `mask` is built here per layer kind (`GemmaTransformer.layer_masks`): the document
mask of `mask_fn` for full layers and the same mask cut to the window for sliding ones. SDPA takes both
(Gemma 3); soft-capped scores have no SDPA kernel, so Gemma 2 runs `softcapped_attention`, which
materialises the (seq x seq) scores per head (the eager path HF recommends for Gemma 2 training).
"""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.bias import CausalBias

from tracetrain.models.arch import ArchFamily, ConfigReader
from tracetrain.models.attention import cached_attention, lower_right_causal_mask
from tracetrain.models.llama import (
    Attention,
    KVCache,
    KVCacheLayer,
    ModelArgs,
    RMSNorm,
    Transformer,
    TransformerBlock,
)

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

GEMMA_FAMILIES = ("gemma2", "gemma3")


class GemmaRMSNorm(RMSNorm):
    """x / rms(x) * (1 + weight), all in float32, cast back at the end (HF's Gemma order of rounding)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class GemmaFeedForward(nn.Module):
    """GeGLU: down(gelu_tanh(gate(x)) * up(x)). Not a `FeedForward`: the SwiGLU kernels must not take it."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(args.dim, args.ffn_dim, bias=False)
        self.up_proj = nn.Linear(args.dim, args.ffn_dim, bias=False)
        self.down_proj = nn.Linear(args.ffn_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


def softcapped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, cap: float
) -> torch.Tensor:
    """Attention with scores cap * tanh(scores / cap): q (batch, heads, s, hd), k/v (batch, kv_heads, keys, hd),
    `mask` a bool (batch | 1, 1, s, keys) or None (causal, the last s of the keys). Softmax in float32."""
    n_rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
    scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5  # (batch, heads, s, keys)
    scores = torch.tanh(scores / cap) * cap
    if mask is None:
        mask = lower_right_causal_mask(q.shape[2], k.shape[2], q.device)
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores.float(), dim=-1).to(v.dtype) @ v


class GemmaAttention(Attention):
    """Llama's attention with Gemma's score scale, optional q/k norms and optional soft-capping."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args)
        # SDPA scales by head_dim^-1/2; Gemma by query_pre_attn_scalar^-1/2: q takes the ratio.
        scalar = args.query_pre_attn_scalar or args.head_dim
        self.q_scale = math.sqrt(args.head_dim / scalar)
        self.softcap = args.attn_logit_softcap
        if args.qk_norm:  # Gemma 3 (Attention made Llama's RMSNorm here; Identity without q/k norms)
            self.q_norm = GemmaRMSNorm(args.head_dim, args.norm_eps)
            self.k_norm = GemmaRMSNorm(args.head_dim, args.norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | BlockMask | CausalBias | None,
        cache: KVCacheLayer | None = None,
    ) -> torch.Tensor:
        b, s, _ = x.shape  # (batch, seq, dim)
        q = self.q_proj(x).view(b, s, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(b, s, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rope_fn(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        if cache is not None:
            k, v = cache.update(k, v)  # (batch, kv_heads, cached + seq, head_dim)
        if self.softcap:
            out = softcapped_attention(q, k, v, mask, self.softcap)  # type: ignore[arg-type]  # Gemma's masks are dense bool (layer_masks)
        elif cache is not None:
            out = cached_attention(q, k, v, mask)  # type: ignore[arg-type]  # Gemma's masks are dense bool (layer_masks)
        else:
            out = self.attn_core(q, k, v, mask)  # (batch, heads, seq, head_dim)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class GemmaBlock(TransformerBlock):
    """x + post_attn_norm(attn(input_norm(x))), then + post_ffw_norm(mlp(pre_ffw_norm(x)))."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args)
        self.input_layernorm = GemmaRMSNorm(args.dim, args.norm_eps)
        self.self_attn = GemmaAttention(args)
        self.post_attention_layernorm = GemmaRMSNorm(args.dim, args.norm_eps)
        self.mlp = GemmaFeedForward(args)  # GeGLU, the same three projections
        self.pre_feedforward_layernorm = GemmaRMSNorm(args.dim, args.norm_eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(args.dim, args.norm_eps)

    def attend(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | BlockMask | CausalBias | None,
        cache: KVCacheLayer | None = None,
    ) -> torch.Tensor:
        """Gemma's attention half: norm, attention, norm, add (`TransformerBlock.forward` runs it, then ffn)."""
        return x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, mask, cache))

    def ffn(self, x: torch.Tensor) -> torch.Tensor:
        """Gemma's feed-forward half: norm, MLP, norm (token by token, so the tiled MLP can tile it)."""
        return self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


def gemma_rope_buffers(args: ModelArgs) -> dict[str, torch.Tensor]:
    """Inverse frequencies (rotary_dim / 2,) float32: `rope_inv_freq` for full layers (divided by the
    linear factor), `rope_inv_freq_local` for sliding ones (their own base)."""
    hd = args.rotary_dim
    exponents = torch.arange(0, hd, 2, dtype=torch.float32) / hd
    local = 1.0 / ((args.rope_local_theta or args.rope_theta) ** exponents)
    full = 1.0 / (args.rope_theta**exponents) / args.rope_linear_factor
    return {"rope_inv_freq": full, "rope_inv_freq_local": local}


def window_band(q_pos: torch.Tensor, num_keys: int, window: int) -> torch.Tensor:
    """(s, num_keys) bool: key j is within `window` tokens of query position q (q - j < window)."""
    k_pos = torch.arange(num_keys, device=q_pos.device)
    return k_pos[None, :] > q_pos[:, None] - window


class GemmaTransformer(Transformer):
    """The Gemma 2 / Gemma 3 decoder (see the module docstring); same interface as `Transformer`."""

    rope_inv_freq_local: torch.Tensor  # registered buffer, the sliding layers' (rotary_dim / 2,)

    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args)
        self.layers = nn.ModuleList(GemmaBlock(args) for _ in range(args.n_layers))
        self.norm = GemmaRMSNorm(args.dim, args.norm_eps)
        for name, value in gemma_rope_buffers(args).items():
            self.register_buffer(name, value, persistent=False)
        self.sliding = [t == "sliding" for t in args.layer_types] or [False] * args.n_layers
        self.tie_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """As `Transformer.init_weights`, with Gemma's norms at zero (they scale by 1 + weight)."""
        super().init_weights()
        for name, buf in gemma_rope_buffers(self.args).items():
            getattr(self, name).copy_(buf)
        for mod in self.modules():
            if isinstance(mod, GemmaRMSNorm):
                nn.init.zeros_(mod.weight)

    def _rope_with(self, inv_freq: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids.float().unsqueeze(-1) * inv_freq  # (batch, seq, rotary_dim / 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    def layer_masks(
        self, s: int, document_ids: torch.Tensor | None, cache: KVCache | None, device: torch.device
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(full layers' mask, sliding layers' mask), dense bool (batch | 1, 1, s, keys) or None (causal)."""
        full: object
        if cache is not None:
            full = cache.attention_mask(s)
            if isinstance(full, CausalBias):  # the softcapped and windowed layers take dense masks
                full = lower_right_causal_mask(s, full.seq_len_kv, device)
            keys = full.shape[-1]  # a dense mask now
            # models/kv_cache.py's caches know their query positions (a fixed-shape decode step's are on
            # the device); llama.KVCache's are the next s.
            positions = getattr(cache, "query_positions", None)
            q_pos = positions(s) if positions else torch.arange(cache.length, cache.length + s, device=device)
        else:
            full = self.mask_fn(document_ids) if document_ids is not None else None
            keys, q_pos = s, torch.arange(s, device=device)
        if not isinstance(full, torch.Tensor | None):
            raise TypeError(f"Gemma's layer masks need a dense mask, got {type(full).__name__} (use sdpa attention)")
        window = self.args.local_window
        if not any(self.sliding) or not window or (cache is None and s <= window):
            return full, full
        band = window_band(q_pos, keys, window)[None, None]  # (1, 1, s, keys)
        causal = lower_right_causal_mask(s, keys, device) if full is None else full
        return full, causal & band

    def layer_inputs(
        self,
        tokens: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | BlockMask | CausalBias | None]]]:
        """The scaled embeddings and each block's (cos, sin, mask): full and sliding layers differ in both."""
        position_ids = self.positions(tokens, position_ids, cache)
        mask_full, mask_local = self.layer_masks(tokens.shape[1], document_ids, cache, tokens.device)
        full = (*self._rope_with(self.rope_inv_freq, position_ids), mask_full)
        local = (*self._rope_with(self.rope_inv_freq_local, position_ids), mask_local)
        h = self.embed_tokens(tokens)  # (batch, seq, dim)
        h = h * torch.tensor(self.args.dim**0.5, dtype=h.dtype)  # HF rounds the scale to the dtype first
        return h, [local if sliding else full for sliding in self.sliding]

    def forward(
        self,
        tokens: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        cache: KVCache | None = None,
        *,
        labels: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits (batch, seq, vocab), soft-capped when the model caps them; `labels` as `Transformer`'s
        (the fused loss has no soft-capping: tracetrain/spec.py turns it off for such a model)."""
        if labels is not None:
            assert not self.args.final_logit_softcap, "fused cross-entropy does not soft-cap the logits"
            return super().forward(tokens, position_ids, document_ids, cache, labels=labels)
        return self.logits(self.forward_hidden(tokens, position_ids, document_ids, cache))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        cap = self.args.final_logit_softcap
        return torch.tanh(logits / cap) * cap if cap else logits


# ----------------------------------------------------------------------------------------------------
# config.json <-> ModelArgs: the transformers-5 form (`rope_parameters` per layer kind, `layer_types`) and
# the published checkpoints' form (`rope_theta`, `rope_scaling`, `rope_local_base_freq`,
# `sliding_window_pattern`) are both read.


def _layer_types(reader: ConfigReader, n_layers: int, every: int) -> tuple[str, ...]:
    """'sliding'/'full' per layer: `layer_types`, else every `every`-th layer full (Gemma 2: 2, Gemma 3: 6)."""
    names = reader.get("layer_types")
    if names is None:
        every = reader.positive_int("sliding_window_pattern", every)
        return tuple("full" if (i + 1) % every == 0 else "sliding" for i in range(n_layers))
    kinds = {"sliding_attention": "sliding", "full_attention": "full"}
    if not isinstance(names, list) or len(names) != n_layers or any(n not in kinds for n in names):
        raise reader.fail(
            f"layer_types = {json.dumps(names)[:80]} is not allowed; it must list "
            f"'sliding_attention' or 'full_attention' for each of the {n_layers} layers"
        )
    return tuple(kinds[n] for n in names)


def _rope_entry(reader: ConfigReader, params: Any, allowed: tuple[str, ...]) -> dict[str, Any]:
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise reader.fail(f"rope_scaling = {json.dumps(params)} is not allowed; it must be an object")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in allowed:
        raise reader.fail(f"rope_type '{rope_type}' is not supported; supported: {', '.join(allowed)}")
    return params


def _rope_fields(reader: ConfigReader) -> dict[str, Any]:
    """Global base and linear factor (full layers), local base (sliding layers)."""
    params = reader.get("rope_parameters") or {}
    nested = isinstance(params, dict) and "full_attention" in params
    full = _rope_entry(
        reader, params["full_attention"] if nested else params or reader.get("rope_scaling"), ("default", "linear")
    )
    local = _rope_entry(reader, params.get("sliding_attention") if nested else None, ("default",))
    theta = reader.positive_float("rope_theta", 10000.0, full.get("rope_theta", reader.get("rope_theta", 10000.0)))
    is_linear = full.get("rope_type", full.get("type")) == "linear"
    return {
        "rope_theta": theta,
        "rope_local_theta": reader.positive_float(
            "rope_local_base_freq", theta, local.get("rope_theta", reader.get("rope_local_base_freq", theta))
        ),
        "rope_linear_factor": reader.positive_float(
            "rope_scaling.factor", 1.0, full.get("factor", 1.0) if is_linear else 1.0
        ),
    }


def _optional_cap(reader: ConfigReader, key: str) -> float:
    return 0.0 if reader.get(key) is None else reader.positive_float(key, 1.0)


def _gemma_fields(reader: ConfigReader, family: str) -> dict[str, Any]:
    act = reader.get("hidden_activation") or reader.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise reader.fail(f"hidden_activation '{act}' is not supported; supported: gelu_pytorch_tanh")
    reader.refuse_if("attention_bias", "Gemma checkpoints have no attention biases")
    n_layers, n_heads = reader.positive_int("num_hidden_layers"), reader.positive_int("num_attention_heads")
    head_dim = reader.positive_int("head_dim", reader.positive_int("hidden_size") // n_heads)
    return {
        **_rope_fields(reader),
        "family": family,
        "tie_embeddings": reader.flag("tie_word_embeddings", True),
        "max_seq_len": reader.positive_int("max_position_embeddings", 8192),
        "query_pre_attn_scalar": reader.positive_float("query_pre_attn_scalar", float(head_dim)),
        "attn_logit_softcap": _optional_cap(reader, "attn_logit_softcapping"),
        "final_logit_softcap": _optional_cap(reader, "final_logit_softcapping"),
        "local_window": reader.positive_int("sliding_window") if reader.get("sliding_window") is not None else 0,
        "layer_types": _layer_types(reader, n_layers, 2 if family == "gemma2" else 6),
        "qk_norm": family == "gemma3",
    }


def _int_if_whole(value: float) -> float | int:
    """transformers 5 types query_pre_attn_scalar as an int (and refuses 256.0)."""
    return int(value) if float(value).is_integer() else value


def _gemma_keys(args: ModelArgs) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": _int_if_whole(args.query_pre_attn_scalar or args.head_dim),
        "attn_logit_softcapping": args.attn_logit_softcap or None,
        "final_logit_softcapping": args.final_logit_softcap or None,
        "sliding_window": args.local_window or None,
        "layer_types": [f"{t}_attention" for t in args.layer_types] or None,
        "attention_bias": False,
    }
    if args.family == "gemma3":
        cfg["rope_local_base_freq"] = args.rope_local_theta or args.rope_theta
        if args.rope_linear_factor != 1.0:
            cfg["rope_scaling"] = {"rope_type": "linear", "factor": args.rope_linear_factor}
    return cfg


GEMMA2 = ArchFamily(
    "gemma2",
    "Gemma2ForCausalLM",
    matches=lambda a: a.family == "gemma2",
    parse=lambda reader: _gemma_fields(reader, "gemma2"),
    export_keys=_gemma_keys,
    own_rope_and_act=True,
)
GEMMA3 = ArchFamily(
    "gemma3_text",
    "Gemma3ForCausalLM",
    matches=lambda a: a.family == "gemma3",
    parse=lambda reader: _gemma_fields(reader, "gemma3"),
    export_keys=_gemma_keys,
    own_rope_and_act=True,
)
