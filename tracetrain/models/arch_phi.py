"""Phi-3 and Phi-4-mini (Phi3ForCausalLM) as the Llama model with Phi's rotary embedding.

Phi-3's blocks compute what Llama's do; its checkpoints differ in layout and in the rotary embedding:
- q, k and v are one `qkv_proj` (rows: q, then k, then v) and gate and up one `gate_up_proj` (rows: gate,
  then up). Here they stay separate Linear layers, so LoRA targets, tensor parallelism, FP8 and the fused
  kernels see the same modules as for Llama: `phi3_pieces` says which rows of the fused tensor each one
  is (models/hf_load.py `Piece`), so a shard reads only its rows and an export writes them fused again.
- "longrope" (Phi-3-mini-128k, Phi-4-mini): each frequency is divided by a per-frequency factor, the
  short set while every position of the forward is below original_max_position_embeddings and the long
  set beyond (decided on the device, `torch.where`, as HF does, so no host sync), and cos/sin are
  multiplied by an attention factor, sqrt(1 + ln(max / original) / ln(original)) unless the config sets it.
- partial rotary (Phi-4-mini: 0.75): only the first `rotary_dim` dims of each head rotate.
"""

from __future__ import annotations

import json
import math
from typing import Any

import torch

from tracetrain.models.arch import ArchFamily, ConfigReader, same_name
from tracetrain.models.hf_load import Piece
from tracetrain.models.llama import ModelArgs, Transformer, apply_rope

FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_PART_OF = {part: fused for fused, parts in FUSED_PARTS.items() for part in parts}


def apply_partial_rope_qk(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding of the first cos.shape[-1] dims of each head; the rest pass through."""
    r = cos.shape[-1]
    q = torch.cat((apply_rope(q[..., :r], cos, sin), q[..., r:]), dim=-1)
    k = torch.cat((apply_rope(k[..., :r], cos, sin), k[..., r:]), dim=-1)
    return q, k


def phi_rope_buffers(args: ModelArgs) -> dict[str, torch.Tensor]:
    """`rope_inv_freq` (the short factors under longrope) and, for longrope, `rope_inv_freq_long`."""
    hd = args.rotary_dim
    base = 1.0 / (args.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    if not args.rope_long_factor:
        return {"rope_inv_freq": base}
    short = torch.tensor(args.rope_short_factor, dtype=torch.float32)
    long = torch.tensor(args.rope_long_factor, dtype=torch.float32)
    return {"rope_inv_freq": base / short, "rope_inv_freq_long": base / long}


def phi3_pieces(name: str, shape: tuple[int, ...], args: ModelArgs) -> list[Piece]:
    """Our q/k/v (gate/up) weight is rows of the checkpoint's qkv_proj (gate_up_proj); the rest keep their names."""
    where = fused_rows(args, name)
    if where is None:
        return same_name(name, shape, args)
    return [Piece(where[0], 0, shape[0], hf_start=where[1])]


def longrope_attention_factor(factor: float, original_max_len: int) -> float:
    """cos/sin scale of longrope for a context `factor` times the original, when the config gives none (HF's)."""
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original_max_len))


class PhiTransformer(Transformer):
    """Llama's decoder with Phi's rotary embedding (module docstring); same interface as `Transformer`."""

    rope_inv_freq_long: torch.Tensor  # registered buffer, longrope only (rotary_dim / 2,)

    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args)
        for name, value in phi_rope_buffers(args).items():
            self.register_buffer(name, value, persistent=False)
        if args.rotary_dim < args.head_dim:
            for block in self.layers:
                block.self_attn.rope_fn = apply_partial_rope_qk  # type: ignore[union-attr]  # nn.Module attributes are typed Tensor | Module in torch's stubs

    @torch.no_grad()
    def init_weights(self) -> None:
        super().init_weights()
        for name, buf in phi_rope_buffers(self.args).items():
            getattr(self, name).copy_(buf)

    def rope(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(batch, seq) positions -> cos, sin (batch, seq, rotary_dim), float32 (longrope: module docstring)."""
        inv_freq: torch.Tensor = self.rope_inv_freq
        scale = 1.0
        if self.args.rope_long_factor:
            beyond = position_ids.max() + 1 > self.args.rope_original_max_len  # a device scalar: no sync
            inv_freq = torch.where(beyond, self.rope_inv_freq_long, inv_freq)
            scale = self.args.rope_attention_factor
        freqs = position_ids.float().unsqueeze(-1) * inv_freq  # (batch, seq, rotary_dim / 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * scale, emb.sin() * scale


def fused_rows(args: ModelArgs, name: str) -> tuple[str, int] | None:
    """(the fused tensor's name, first row) holding our parameter `name`, or None when it is not fused.

    'layers.3.self_attn.k_proj.weight' -> ('layers.3.self_attn.qkv_proj.weight', q_dim)."""
    module, _, leaf = name.rpartition(".")
    parent, _, proj = module.rpartition(".")
    fused = _PART_OF.get(proj)
    if fused is None:
        return None
    parts = FUSED_PARTS[fused]
    first = sum(_part_rows(args, p) for p in parts[: parts.index(proj)])
    return f"{parent}.{fused}.{leaf}", first


def _part_rows(args: ModelArgs, part: str) -> int:
    """Rows (output features) of one part of a fused projection: q_proj, k_proj, v_proj, gate_proj, up_proj."""
    return {"q_proj": args.q_dim, "gate_proj": args.ffn_dim, "up_proj": args.ffn_dim}.get(
        part, args.n_kv_heads * args.head_dim
    )


def _adapter_key(key: str) -> tuple[str, str, str]:
    """'layers.0.self_attn.k_proj.lora_A.weight' -> ('layers.0.self_attn', 'k_proj', 'A.weight')."""
    module, _, rest = key.partition(".lora_")
    parent, _, proj = module.rpartition(".")
    return parent, proj, rest


def peft_targets(targets: list[str]) -> list[str]:
    """Our LoRA targets -> the checkpoint's module names: q/k/v_proj -> qkv_proj, gate/up_proj -> gate_up_proj."""
    return list(dict.fromkeys(_PART_OF.get(t, t) for t in targets))


def fused_adapters(
    adapters: dict[str, torch.Tensor], args: ModelArgs, rank: int
) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """Separate adapters of q/k/v (gate/up) as one exact adapter of the fused projection, and the rank of each
    fused kind: A stacks the parts' A (rank x parts rows), B places each part's B on its own rows and
    columns (zeros elsewhere), so B @ A is each part's update on its rows. Alpha must grow with the rank
    (PEFT's alpha_pattern) for the scale alpha / rank to stay the same."""
    parts: dict[str, dict[str, dict[str, torch.Tensor]]] = {}  # fused module -> part -> "A"/"B" -> tensor
    out: dict[str, torch.Tensor] = {}
    for key, value in adapters.items():
        parent, proj, rest = _adapter_key(key)
        if proj not in _PART_OF:
            out[key] = value
            continue
        parts.setdefault(f"{parent}.{_PART_OF[proj]}", {}).setdefault(proj, {})[rest[0]] = value
    ranks: dict[str, int] = {}
    for fused, held in parts.items():
        parent, _, kind = fused.rpartition(".")
        names = [p for p in FUSED_PARTS[kind] if p in held]
        rows = {p: fused_rows(args, f"{parent}.{p}.weight")[1] for p in FUSED_PARTS[kind]}  # type: ignore[index]  # every name in FUSED_PARTS is fused, so fused_rows never returns None
        last = FUSED_PARTS[kind][-1]
        total = rows[last] + _part_rows(args, last)
        lora_b = held[names[0]]["B"].new_zeros(total, rank * len(names))  # (fused out, rank x parts)
        for j, p in enumerate(names):
            b = held[p]["B"]  # (part out, rank)
            lora_b[rows[p] : rows[p] + b.shape[0], j * rank : (j + 1) * rank] = b
        out[f"{fused}.lora_A.weight"] = torch.cat([held[p]["A"] for p in names])
        out[f"{fused}.lora_B.weight"] = lora_b
        ranks[kind] = rank * len(names)
    return out, ranks


def _longrope_fields(reader: ConfigReader, params: dict[str, Any], rotary_dim: int, max_len: int) -> dict[str, Any]:
    half = rotary_dim // 2
    factors = {}
    for key in ("short_factor", "long_factor"):
        value = params.get(key)
        if not isinstance(value, list) or len(value) != half:
            raise reader.fail(f"rope_scaling.{key} must list {half} numbers (rotary dims / 2)")
        factors[key] = tuple(reader.positive_float(f"rope_scaling.{key}", 1.0, v) for v in value)
    original = params.get("original_max_position_embeddings", reader.get("original_max_position_embeddings"))
    if not isinstance(original, int) or isinstance(original, bool) or original <= 0:
        raise reader.fail(f"longrope needs original_max_position_embeddings (a positive integer), got {original!r}")
    attention = params.get("attention_factor")
    if attention is None:
        attention = longrope_attention_factor(params.get("factor") or max_len / original, original)
    return {
        "rope_short_factor": factors["short_factor"],
        "rope_long_factor": factors["long_factor"],
        "rope_original_max_len": original,
        "rope_attention_factor": reader.positive_float("rope_scaling.attention_factor", 1.0, attention),
    }


def _phi3_fields(reader: ConfigReader) -> dict[str, Any]:
    if reader.get("hidden_act", "silu") != "silu":
        raise reader.fail(f"hidden_act '{reader.get('hidden_act')}' is not supported; supported: silu")
    reader.refuse_if("attention_bias", "Phi-3 checkpoints have no attention biases")
    params = reader.get("rope_parameters") or reader.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise reader.fail(f"rope_scaling = {json.dumps(params)} is not allowed; it must be an object")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "longrope"):
        raise reader.fail(f"rope_type '{rope_type}' is not supported; supported: default, longrope")
    partial = params.get("partial_rotary_factor", reader.get("partial_rotary_factor", 1.0))
    fields: dict[str, Any] = {
        "family": "phi3",
        "rope_theta": reader.positive_float(
            "rope_theta", 10000.0, params.get("rope_theta", reader.get("rope_theta", 10000.0))
        ),
        "partial_rotary_factor": min(reader.positive_float("partial_rotary_factor", 1.0, partial), 1.0),
    }
    if rope_type == "longrope":
        n_heads = reader.positive_int("num_attention_heads")
        head_dim = reader.positive_int("head_dim", reader.positive_int("hidden_size") // n_heads)
        rotary = int(head_dim * fields["partial_rotary_factor"]) // 2 * 2
        fields |= _longrope_fields(reader, params, rotary, reader.positive_int("max_position_embeddings", 4096))
    return fields


def _phi3_keys(args: ModelArgs) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "partial_rotary_factor": args.partial_rotary_factor,
        "original_max_position_embeddings": args.rope_original_max_len or args.max_seq_len,
    }
    if args.rope_long_factor:
        # The attention factor is written out: HF would otherwise derive it from max_position_embeddings,
        # which a run may have raised to its own seq_len.
        cfg["rope_scaling"] = {
            "type": "longrope",
            "short_factor": list(args.rope_short_factor),
            "long_factor": list(args.rope_long_factor),
            "attention_factor": args.rope_attention_factor,
        }
    return cfg


PHI3 = ArchFamily(
    "phi3",
    "Phi3ForCausalLM",
    matches=lambda a: a.family == "phi3",
    parse=_phi3_fields,
    export_keys=_phi3_keys,
    pieces=phi3_pieces,
    own_rope_and_act=True,
)


def split_targets(targets: list[str]) -> list[str]:
    """A PEFT adapter's target_modules with the fused names replaced by our parts (qkv_proj -> q/k/v_proj)."""
    return [part for t in targets for part in FUSED_PARTS.get(t, (t,))]


def split_adapters(tensors: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """A fused projection's adapter as one adapter per part, exactly: each part keeps A (shared input side) and
    its own rows of B, so B_part @ A is the part's rows of the fused update (same rank and alpha)."""
    out: dict[str, torch.Tensor] = {}
    for key, value in tensors.items():  # 'layers.0.self_attn.qkv_proj.lora_B.weight'
        parent, fused, rest = _adapter_key(key)
        if fused not in FUSED_PARTS:
            out[key] = value
            continue
        for part in FUSED_PARTS[fused]:
            where = fused_rows(args, f"{parent}.{part}.weight")
            assert where is not None
            b_rows = value[where[1] : where[1] + _part_rows(args, part)]
            out[f"{parent}.{part}.lora_{rest}"] = value.clone() if rest.startswith("A") else b_rows.clone()
    return out
