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
}


def get_preset(name: str) -> ModelArgs:
    """A fresh copy of a preset (callers may override fields)."""
    if name not in PRESETS:
        raise KeyError(name)
    return dataclasses.replace(PRESETS[name], rope_scaling=dict(PRESETS[name].rope_scaling))
