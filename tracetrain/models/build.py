"""The model's architecture and its materialisation; the transforms are applied by train/assemble.py.

`model_args_from_config`: a preset (or a Hugging Face checkpoint's config.json) plus the config's
overrides. `materialize`: built on the meta device (no memory), allocated directly on the target device
in the requested dtype, then initialised there with a seeded generator — a 7B model never exists in
fp32 on the CPU. Everything that changes the model after that (weights from a checkpoint, MoE, LoRA,
attention backend, kernels, FP8, parallelism, recomputation, compile) is a row of the ordered table
`tracetrain.train.assemble.TRANSFORMS`.
"""

from __future__ import annotations

import dataclasses

import torch

from tracetrain.config import Config
from tracetrain.errors import ConfigError
from tracetrain.models.llama import ModelArgs, Transformer
from tracetrain.models.presets import PRESETS, get_preset

_OVERRIDES = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size")


def model_args_from_config(cfg: Config) -> ModelArgs:
    """The architecture: a preset (or a HF checkpoint's config.json) plus the config's overrides."""
    m = cfg.model
    if m.init_from:
        from tracetrain.models.hf import load_hf_config

        args = load_hf_config(m.init_from)
    elif m.preset in PRESETS:
        args = get_preset(m.preset)
    else:
        raise ConfigError(
            f"config key 'model.preset': {m.preset!r} is not a preset; choose one of {', '.join(PRESETS)}"
        )
    changes = {k: getattr(m, k) for k in _OVERRIDES if getattr(m, k) is not None}
    if m.init_from and changes:
        raise ConfigError(
            f"config keys {', '.join('model.' + k for k in changes)} cannot change the shape "
            f"of a loaded checkpoint ({m.init_from})"
        )
    # A loaded checkpoint keeps its own context length (exported configs must not understate it).
    max_seq_len = max(args.max_seq_len, cfg.data.seq_len) if m.init_from else cfg.data.seq_len
    args = dataclasses.replace(args, **changes, max_seq_len=max_seq_len, init_std=m.init_std)
    try:
        args.validate()
    except ValueError as e:
        raise ConfigError(f"model shape: {e}") from None
    return args


def materialize(args: ModelArgs, device: torch.device, seed: int, dtype: torch.dtype = torch.float32) -> Transformer:
    """Build on meta, allocate on `device` in `dtype`, and initialise with a seeded generator."""
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device=device)
    if dtype != torch.float32:
        model.to(dtype)
        model.rope_inv_freq.data = model.rope_inv_freq.float()  # rotary frequencies stay float32
    model.tie_weights()  # to_empty replaces parameters, which breaks the tie
    torch.manual_seed(seed)
    model.init_weights()
    return model
