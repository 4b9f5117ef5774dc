"""Qwen3 and Qwen3-MoE checkpoints (`Qwen3ForCausalLM`, `Qwen3MoeForCausalLM`).

Qwen3 is Llama with an RMSNorm over each head's queries and keys before the rotary embedding
(`self_attn.q_norm` / `k_norm`, one weight of head_dim each), no q/k/v bias, and a head size of its
own (128 at every width: q_proj is dim -> n_heads * 128). Qwen3-MoE replaces the MLP of its sparse
blocks by routed experts (models/moe.py): `num_experts` SwiGLU experts of `moe_intermediate_size`, each
token to `num_experts_per_tok` of them, their probabilities renormalised when `norm_topk_prob`; a block
is sparse unless it is listed in `mlp_only_layers` or `(layer + 1) % decoder_sparse_step != 0` (those
keep a dense MLP of `intermediate_size`). Its checkpoints hold one tensor per expert
(`mlp.experts.E.gate_proj.weight`) and the router as `mlp.gate.weight`.

Qwen3's optional sliding window (`use_sliding_window`, per layer from `max_window_layers`) is refused
with one line: the released checkpoints leave it off.
"""

from __future__ import annotations

from typing import Any

from tracetrain.models.arch import ArchFamily, ConfigReader, moe_pieces
from tracetrain.models.llama import ModelArgs


def _qwen3(reader: ConfigReader) -> dict[str, Any]:
    reader.refuse_if("use_sliding_window", "Qwen3's per-layer sliding window is not implemented; set it false")
    reader.refuse_if("attention_bias", "Qwen3 checkpoints have no attention biases")
    return {"qk_norm": True}


def _qwen3_keys(args: ModelArgs) -> dict[str, Any]:
    return {
        "attention_bias": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": args.n_layers,
    }


def _dense_layers(reader: ConfigReader, n_layers: int) -> tuple[int, ...]:
    """Blocks with a dense MLP: listed in mlp_only_layers, or off the decoder_sparse_step grid (as HF's)."""
    only = set(reader.int_list("mlp_only_layers"))
    step = reader.positive_int("decoder_sparse_step", 1)
    return tuple(i for i in range(n_layers) if i in only or (i + 1) % step)


def _qwen3_moe(reader: ConfigReader) -> dict[str, Any]:
    # transformers 5 writes num_local_experts; 4.x (and the released checkpoints) num_experts.
    key = "num_experts" if reader.get("num_experts") is not None else "num_local_experts"
    return {
        **_qwen3(reader),
        "num_experts": reader.positive_int(key),
        "experts_top_k": reader.positive_int("num_experts_per_tok"),
        "moe_ffn_dim": reader.positive_int("moe_intermediate_size"),
        "moe_norm_topk": reader.flag("norm_topk_prob", False),
        "dense_layers": _dense_layers(reader, reader.positive_int("num_hidden_layers")),
    }


def _qwen3_moe_keys(args: ModelArgs) -> dict[str, Any]:
    return {
        **_qwen3_keys(args),
        "num_experts": args.num_experts,
        "num_experts_per_tok": args.experts_top_k,
        "moe_intermediate_size": args.expert_ffn_dim,
        "norm_topk_prob": args.moe_norm_topk,
        "decoder_sparse_step": 1,
        "mlp_only_layers": sorted(args.dense_layers),
        "output_router_logits": False,
    }


QWEN3 = ArchFamily(
    "qwen3",
    "Qwen3ForCausalLM",
    matches=lambda a: a.qk_norm and not (a.qkv_bias or a.num_experts or a.sliding_window),
    parse=_qwen3,
    export_keys=_qwen3_keys,
)
QWEN3_MOE = ArchFamily(
    "qwen3_moe",
    "Qwen3MoeForCausalLM",
    matches=lambda a: a.qk_norm and a.num_experts > 0 and not (a.qkv_bias or a.sliding_window),
    parse=_qwen3_moe,
    export_keys=_qwen3_moe_keys,
    pieces=moe_pieces("mlp.gate.weight", lambda proj, e: f"mlp.experts.{e}.{proj}.weight"),
)
