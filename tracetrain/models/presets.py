"""Named architecture presets. Shapes follow the published Hugging Face configs of each model.

`PUBLISHED_PARAMS` holds the parameter counts those models publish; a test checks that the presets
(built on the meta device) reproduce them exactly.
"""

from __future__ import annotations

import dataclasses

from tracetrain.models.llama import ModelArgs

_LLAMA31_SCALING = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
_LLAMA32_SCALING = {**_LLAMA31_SCALING, "factor": 32.0}


def _qwen3(**shape: int | bool) -> ModelArgs:
    return ModelArgs(
        **shape,  # type: ignore[arg-type]  # the shape fields, ints and the tie flag
        vocab_size=151936,
        rope_theta=1000000.0,
        norm_eps=1e-6,
        qk_norm=True,
        head_dim_override=128,
    )


def _gemma2(dim: int, n_layers: int, n_heads: int, head_dim: int, ffn_dim: int) -> ModelArgs:
    """Gemma 2: GeGLU, 4 norms a block, soft-capped scores (50) and logits (30), 4096-token local layers
    alternating with global ones (the first local), scores scaled by dim / n_heads (head_dim for 2b, 9b)."""
    return ModelArgs(
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_heads // 2,
        ffn_dim=ffn_dim,
        vocab_size=256000,
        norm_eps=1e-6,
        max_seq_len=8192,
        tie_embeddings=True,
        family="gemma2",
        head_dim_override=head_dim,
        query_pre_attn_scalar=float(dim // n_heads if head_dim != 256 else 256),
        attn_logit_softcap=50.0,
        final_logit_softcap=30.0,
        local_window=4096,
        layer_types=tuple("sliding" if i % 2 == 0 else "full" for i in range(n_layers)),
    )


def _gemma3(dim: int, n_layers: int, n_heads: int, n_kv_heads: int, head_dim: int, ffn_dim: int) -> ModelArgs:
    """Gemma 3 (text): q/k norms, five 1024-token local layers (rope base 10k) to one global (1M, linear
    factor 8 from 4b up), no soft-capping; 1b: 512-token windows, no scaling, 32k context."""
    small = dim < 2048
    return ModelArgs(
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        ffn_dim=ffn_dim,
        vocab_size=262144 if small else 262208,
        norm_eps=1e-6,
        rope_theta=1000000.0,
        max_seq_len=32768 if small else 131072,
        tie_embeddings=True,
        family="gemma3",
        head_dim_override=head_dim,
        query_pre_attn_scalar=float(dim // n_heads if head_dim != 256 else 256),
        local_window=512 if small else 1024,
        layer_types=tuple("full" if (i + 1) % 6 == 0 else "sliding" for i in range(n_layers)),
        rope_local_theta=10000.0,
        rope_linear_factor=1.0 if small else 8.0,
        qk_norm=True,
    )


PRESETS: dict[str, ModelArgs] = {
    # Built-in default: byte-level vocabulary (259 ids, padded to 320), trains on 2 CPU cores in minutes.
    "tiny": ModelArgs(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=384, vocab_size=320),
    # A small model with the GPT-2 vocabulary (50257, padded to 50304) for quick real-data runs.
    "small": ModelArgs(
        dim=512, n_layers=8, n_heads=8, n_kv_heads=4, ffn_dim=1408, vocab_size=50304, tie_embeddings=True
    ),
    "llama2-7b": ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, ffn_dim=11008, vocab_size=32000),
    "llama2-13b": ModelArgs(dim=5120, n_layers=40, n_heads=40, n_kv_heads=40, ffn_dim=13824, vocab_size=32000),
    "llama2-70b": ModelArgs(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672, vocab_size=32000),
    "llama3-8b": ModelArgs(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=128256, rope_theta=500000.0
    ),
    "llama3-70b": ModelArgs(
        dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672, vocab_size=128256, rope_theta=500000.0
    ),
    "llama3.1-8b": ModelArgs(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=14336,
        vocab_size=128256,
        rope_theta=500000.0,
        rope_scaling=_LLAMA31_SCALING,
    ),
    "llama3.2-1b": ModelArgs(
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=8192,
        vocab_size=128256,
        rope_theta=500000.0,
        rope_scaling=_LLAMA32_SCALING,
        tie_embeddings=True,
    ),
    "llama3.2-3b": ModelArgs(
        dim=3072,
        n_layers=28,
        n_heads=24,
        n_kv_heads=8,
        ffn_dim=8192,
        vocab_size=128256,
        rope_theta=500000.0,
        rope_scaling=_LLAMA32_SCALING,
        tie_embeddings=True,
    ),
    "mistral-7b": ModelArgs(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=32000, rope_theta=1000000.0
    ),
    "qwen2-0.5b": ModelArgs(
        dim=896,
        n_layers=24,
        n_heads=14,
        n_kv_heads=2,
        ffn_dim=4864,
        vocab_size=151936,
        rope_theta=1000000.0,
        norm_eps=1e-6,
        qkv_bias=True,
        tie_embeddings=True,
    ),
    "qwen2-7b": ModelArgs(
        dim=3584,
        n_layers=28,
        n_heads=28,
        n_kv_heads=4,
        ffn_dim=18944,
        vocab_size=152064,
        rope_theta=1000000.0,
        norm_eps=1e-6,
        qkv_bias=True,
    ),
    # Qwen3: per-head q/k norms, head_dim 128 at every width (models/arch_qwen3.py); tied heads up to 4B.
    "qwen3-0.6b": _qwen3(dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, ffn_dim=3072, tie_embeddings=True),
    "qwen3-1.7b": _qwen3(dim=2048, n_layers=28, n_heads=16, n_kv_heads=8, ffn_dim=6144, tie_embeddings=True),
    "qwen3-4b": _qwen3(dim=2560, n_layers=36, n_heads=32, n_kv_heads=8, ffn_dim=9728, tie_embeddings=True),
    "qwen3-8b": _qwen3(dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, ffn_dim=12288),
    "qwen3-14b": _qwen3(dim=5120, n_layers=40, n_heads=40, n_kv_heads=8, ffn_dim=17408),
    "qwen3-32b": _qwen3(dim=5120, n_layers=64, n_heads=64, n_kv_heads=8, ffn_dim=25600),
    # 128 experts of 768, 8 per token, every block sparse; ffn_dim is the (unused) dense width of its config.
    "qwen3-30b-a3b": _qwen3(
        dim=2048,
        n_layers=48,
        n_heads=32,
        n_kv_heads=4,
        ffn_dim=6144,
        num_experts=128,
        experts_top_k=8,
        moe_ffn_dim=768,
        moe_norm_topk=True,
    ),
    "mixtral-8x7b": ModelArgs(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=14336,
        vocab_size=32000,
        rope_theta=1000000.0,
        num_experts=8,
        experts_top_k=2,
    ),
    "gemma2-2b": _gemma2(2304, 26, 8, 256, 9216),
    "gemma2-9b": _gemma2(3584, 42, 16, 256, 14336),
    "gemma2-27b": _gemma2(4608, 46, 32, 128, 36864),
    "gemma3-1b": _gemma3(1152, 26, 4, 1, 256, 6912),
    "gemma3-4b": _gemma3(2560, 34, 8, 4, 256, 10240),
    "gemma3-12b": _gemma3(3840, 48, 16, 8, 256, 15360),
    "gemma3-27b": _gemma3(5376, 62, 32, 16, 128, 21504),
    # Phi-3-mini-4k: Llama's shape with fused q/k/v and gate/up in its checkpoints (models/arch_phi.py).
    "phi3-mini": ModelArgs(
        dim=3072,
        n_layers=32,
        n_heads=32,
        n_kv_heads=32,
        ffn_dim=8192,
        vocab_size=32064,
        max_seq_len=4096,
        family="phi3",
    ),
    # Phi-4-mini's shape (GQA, 3/4 of each head rotates, tied embeddings). Its longrope factors are the
    # checkpoint's: model.init_from reads them; the preset rotates with plain rope up to 4096 positions.
    "phi4-mini": ModelArgs(
        dim=3072,
        n_layers=32,
        n_heads=24,
        n_kv_heads=8,
        ffn_dim=8192,
        vocab_size=200064,
        max_seq_len=4096,
        tie_embeddings=True,
        family="phi3",
        partial_rotary_factor=0.75,
    ),
}

# Parameter counts as published for the released checkpoints (embedding counted once when tied).
PUBLISHED_PARAMS: dict[str, int] = {
    "llama2-7b": 6_738_415_616,
    "llama2-13b": 13_015_864_320,
    "llama2-70b": 68_976_648_192,
    "llama3-8b": 8_030_261_248,
    "llama3-70b": 70_553_706_496,
    "llama3.1-8b": 8_030_261_248,
    "llama3.2-1b": 1_235_814_400,
    "llama3.2-3b": 3_212_749_824,
    "mistral-7b": 7_241_732_096,
    "qwen2-0.5b": 494_032_768,
    "qwen2-7b": 7_615_616_512,
    # The hub's safetensors counts of the tied Qwen3 models include the stored copy of the head:
    # 751_632_384 (0.6B) and 2_031_739_904 (1.7B) are these plus vocab x dim.
    "qwen3-0.6b": 596_049_920,
    "qwen3-1.7b": 1_720_574_976,
    "qwen3-4b": 4_022_468_096,
    "qwen3-8b": 8_190_735_360,
    "qwen3-14b": 14_768_307_200,
    "qwen3-32b": 32_762_123_264,
    "qwen3-30b-a3b": 30_532_122_624,
    "mixtral-8x7b": 46_702_792_704,
    "gemma2-2b": 2_614_341_888,
    "gemma2-9b": 9_241_705_984,
    "gemma2-27b": 27_227_128_320,
    "gemma3-1b": 999_885_952,
    "phi3-mini": 3_821_079_552,
    "phi4-mini": 3_836_021_760,
}


def get_preset(name: str) -> ModelArgs:
    """A fresh copy of a preset (callers may override fields)."""
    if name not in PRESETS:
        raise KeyError(name)
    return dataclasses.replace(PRESETS[name], rope_scaling=dict(PRESETS[name].rope_scaling))
