"""The table of Hugging Face architecture families (models/arch.py says what an entry holds).

Llama, Mistral and Qwen2 are here; Qwen3 and Qwen3-MoE in models/arch_qwen3.py; Mixtral in
models/arch_mixtral.py; Gemma 2 / 3 in models/arch_gemma.py and Phi-3 in models/arch_phi.py, which also
hold their module classes (`transformer_class`, `rope_buffers` below pick them by `ModelArgs.family`). `FAMILIES` is ordered most specific first: `family_of_args` picks the first
entry whose `matches` accepts a model, so an export writes the family that computes what the model
computes (Llama, the last, matches any model the others do not claim).
"""

from __future__ import annotations

from typing import Any

import torch

from tracetrain.models.arch import ArchFamily, ConfigReader
from tracetrain.models.arch_gemma import GEMMA2, GEMMA3, GemmaTransformer, gemma_rope_buffers
from tracetrain.models.arch_mixtral import MIXTRAL
from tracetrain.models.arch_phi import PHI3, PhiTransformer, phi_rope_buffers
from tracetrain.models.arch_qwen3 import QWEN3, QWEN3_MOE
from tracetrain.models.llama import ModelArgs, Transformer, rope_inv_freq


def _llama(reader: ConfigReader) -> dict[str, Any]:
    # Llama's attention_bias also adds an o_proj bias, which the model (like Qwen2) does not have.
    reader.refuse_if("attention_bias", "the model has no attention biases (Qwen2's q/k/v biases are)")
    reader.refuse_if("mlp_bias", "the model's MLP has no biases")
    return {}


def _mistral(reader: ConfigReader) -> dict[str, Any]:
    window = reader.positive_int("sliding_window") if reader.get("sliding_window") is not None else 0
    return {**_llama(reader), "sliding_window": window}


def _mistral_keys(args: ModelArgs) -> dict[str, Any]:
    return {"sliding_window": args.sliding_window or None}


def _qwen2(reader: ConfigReader) -> dict[str, Any]:
    reader.refuse_if("use_sliding_window", "Qwen2's per-layer sliding window is not implemented; set it false")
    return {"qkv_bias": True}


def _qwen2_keys(args: ModelArgs) -> dict[str, Any]:
    return {"use_sliding_window": False, "sliding_window": None, "max_window_layers": args.n_layers}


LLAMA = ArchFamily(
    "llama",
    "LlamaForCausalLM",
    matches=lambda a: a.family == "llama" and not (a.qkv_bias or a.qk_norm or a.num_experts or a.sliding_window),
    parse=_llama,
    export_keys=lambda a: {"attention_bias": False, "mlp_bias": False},
)
MISTRAL = ArchFamily(
    "mistral",
    "MistralForCausalLM",
    matches=lambda a: a.sliding_window > 0 and not (a.qkv_bias or a.qk_norm or a.num_experts),
    parse=_mistral,
    export_keys=_mistral_keys,
)
QWEN2 = ArchFamily(
    "qwen2",
    "Qwen2ForCausalLM",
    # Qwen2's config has no head_dim key: its heads are always dim // n_heads.
    matches=lambda a: a.qkv_bias and not (a.qk_norm or a.num_experts or a.sliding_window or a.head_dim_override),
    parse=_qwen2,
    export_keys=_qwen2_keys,
)

FAMILIES: tuple[ArchFamily, ...] = (GEMMA2, GEMMA3, PHI3, QWEN3_MOE, MIXTRAL, QWEN3, QWEN2, MISTRAL, LLAMA)


def supported_names() -> str:
    return ", ".join(f.hf_class for f in FAMILIES)


def family_of_config(reader: ConfigReader) -> ArchFamily:
    """The family of a config.json (its `architectures`, else its `model_type`), or one line listing them."""
    archs = reader.get("architectures") or []
    model_type = reader.get("model_type", "")
    if not isinstance(archs, list) or not isinstance(model_type, str):
        raise reader.fail("'architectures' must be a list and 'model_type' a string")
    by_class = {f.hf_class: f for f in FAMILIES}
    if archs:
        if len(archs) != 1 or archs[0] not in by_class:
            raise reader.fail(
                f"architecture {', '.join(map(str, archs))} is not supported; supported: {supported_names()}"
            )
        return by_class[archs[0]]
    by_type = {f.model_type: f for f in FAMILIES}
    if model_type not in by_type:
        raise reader.fail(f"model_type '{model_type}' is not supported; supported: {supported_names()}")
    return by_type[model_type]


def family_of_args(args: ModelArgs) -> ArchFamily:
    """The family an export of a model of `args` is written as (the first in `FAMILIES` that matches)."""
    for family in FAMILIES:
        if family.matches(args):
            return family
    raise ValueError(
        "no Hugging Face architecture computes this model "
        f"(qkv_bias={args.qkv_bias}, qk_norm={args.qk_norm}, num_experts={args.num_experts}, "
        f"sliding_window={args.sliding_window}); supported: {supported_names()}"
    )


def transformer_class(args: ModelArgs) -> type[Transformer]:
    """The decoder class of `args.family`: Gemma's and Phi-3's own, `Transformer` for every other family."""
    return {"gemma2": GemmaTransformer, "gemma3": GemmaTransformer, "phi3": PhiTransformer}.get(
        args.family, Transformer
    )


def rope_buffers(args: ModelArgs) -> dict[str, torch.Tensor]:
    """Name -> initial value (float32) of every rotary buffer the family's model registers."""
    if args.family in ("gemma2", "gemma3"):
        return gemma_rope_buffers(args)
    if args.family == "phi3":
        return phi_rope_buffers(args)
    return {"rope_inv_freq": rope_inv_freq(args)}


def layout_refusal(args: ModelArgs, *, tp: int, pp: int, cp: int, sequence_parallel: bool) -> tuple[str, str] | None:
    """(config key, why) of the first layout `args.family` does not run, else None (validate.py refuses it)."""
    gemma = args.family in ("gemma2", "gemma3")
    if pp > 1 and (gemma or args.rope_long_factor):
        return "parallel.pp", "a pipeline stage runs Llama's embedding, rotary embedding and head, not this model's"
    if cp > 1 and gemma:
        return "parallel.cp", "context parallelism replaces the attention core, which Gemma's windows and caps bypass"
    if tp > 1 and sequence_parallel and gemma:
        return "parallel.sequence_parallel", "Gemma's pre/post feed-forward norms are not in the sequence-parallel plan"
    return None


def kernel_limits(args: ModelArgs) -> tuple[tuple[str, ...], str]:
    """(fused kernels that do not apply to this family, why); kernels/apply.py swaps Llama's classes only."""
    if args.family in ("gemma2", "gemma3"):
        return ("rmsnorm", "swiglu"), "Gemma's (1 + weight) RMSNorm and GeGLU MLP have no fused kernel"
    if args.rotary_dim < args.head_dim:
        return ("rope",), "the fused rotary kernel turns whole heads, not a partial rotary_dim"
    return (), ""
