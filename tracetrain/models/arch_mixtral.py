"""Mixtral checkpoints (`MixtralForCausalLM`): Mistral's attention with routed experts in every block.

Each block's MLP is `num_local_experts` SwiGLU experts of `intermediate_size` (models/moe.py), each token
sent to `num_experts_per_tok` (2) of them with their renormalised router probabilities. The checkpoints
hold the router as `block_sparse_moe.gate.weight` and one tensor per expert and projection:
`block_sparse_moe.experts.E.w1` (gate), `w3` (up), `w2` (down). `sliding_window` is honoured as for
Mistral. `router_jitter_noise` (a training-time perturbation of the router's input) is not applied.
A model trained here with `model.num_experts` on a preset exports as Mixtral.
"""

from __future__ import annotations

from typing import Any

from tracetrain.models.arch import ArchFamily, ConfigReader, moe_pieces
from tracetrain.models.llama import ModelArgs

_W = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}


def _mixtral(reader: ConfigReader) -> dict[str, Any]:
    reader.refuse_if("attention_bias", "the model has no attention biases")
    window = reader.get("sliding_window")
    return {
        "num_experts": reader.positive_int("num_local_experts"),
        "experts_top_k": reader.positive_int("num_experts_per_tok"),
        "sliding_window": reader.positive_int("sliding_window") if window is not None else 0,
    }


def _mixtral_keys(args: ModelArgs) -> dict[str, Any]:
    return {
        "num_local_experts": args.num_experts,
        "num_experts_per_tok": args.experts_top_k,
        "sliding_window": args.sliding_window or None,
        "router_jitter_noise": 0.0,
        "output_router_logits": False,
    }


def _computes(args: ModelArgs) -> bool:
    plain_experts = args.moe_norm_topk and not args.dense_layers and args.expert_ffn_dim == args.ffn_dim
    return args.num_experts > 0 and plain_experts and not (args.qkv_bias or args.qk_norm)


MIXTRAL = ArchFamily(
    "mixtral",
    "MixtralForCausalLM",
    matches=_computes,
    parse=_mixtral,
    export_keys=_mixtral_keys,
    pieces=moe_pieces(
        "block_sparse_moe.gate.weight", lambda proj, e: f"block_sparse_moe.experts.{e}.{_W[proj]}.weight"
    ),
)
