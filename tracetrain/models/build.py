"""Build the model a config asks for: architecture, materialisation, weights, and the transforms.

The model is built on the meta device (no memory), materialised directly on the target device, then
initialised there — a 7B model never exists in fp32 on the CPU. Transforms are applied here, in one
place and in a fixed order:

1. weights: random init, or a Hugging Face checkpoint (`model.init_from`)
2. LoRA (`train.mode = "lora"`): wraps target projections and freezes the rest; it comes before any
   wrapping transform so that later ones (recomputation, compile, sharding) see the final modules.
3. Attention backend (`train.attention`) and fused kernels (`train.fused_kernels`): swapped in after
   LoRA (the LoRA kernel replaces existing adapters) and before recomputation and compile, so both
   see the final modules.
4. FP8 (`train.fp8`, kernels/fp8.py): after LoRA, whose frozen bases are the layers quantised once (the
   adapters stay in their dtype); before recomputation and compile, which must see the FP8 matmuls.
5. Activation recomputation (`memory.recompute`): checkpoints whole blocks, or (selective) keeps only
   matmul and attention outputs. After LoRA, so adapters are recomputed too; before compile and
   sharding, which must see the checkpointed blocks. (Activation offload hooks are attached by the
   trainer, which owns the forward context they run in.)
6. Regional compile (`train.compile`): each block compiled on its own, static shapes.
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
        raise ConfigError(f"config key 'model.preset': {m.preset!r} is not a preset; "
                          f"choose one of {', '.join(PRESETS)}")
    changes = {k: getattr(m, k) for k in _OVERRIDES if getattr(m, k) is not None}
    if m.init_from and changes:
        raise ConfigError(f"config keys {', '.join('model.' + k for k in changes)} cannot change the shape "
                          f"of a loaded checkpoint ({m.init_from})")
    # A loaded checkpoint keeps its own context length (exported configs must not understate it).
    max_seq_len = max(args.max_seq_len, cfg.data.seq_len) if m.init_from else cfg.data.seq_len
    args = dataclasses.replace(args, **changes, max_seq_len=max_seq_len, init_std=m.init_std)
    try:
        args.validate()
    except ValueError as e:
        raise ConfigError(f"model shape: {e}") from None
    return args


def materialize(args: ModelArgs, device: torch.device, seed: int,
                dtype: torch.dtype = torch.float32) -> Transformer:
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


def build_model(cfg: Config, device: torch.device, base_dtype: torch.dtype | None = None, *,
                distributed: bool = False) -> Transformer:
    """The model for `cfg`, with weights loaded and transforms applied (see module docstring).

    `distributed`: leave recomputation and compile to `tracetrain.parallel.parallelize`, which must
    apply them between tensor parallelism and FSDP (TP/SP -> recomputation -> compile -> FSDP).
    """
    args = model_args_from_config(cfg)
    from tracetrain.kernels.fp8 import check_fp8_device
    check_fp8_device(cfg.train.fp8, device)  # before a 7B model is materialised
    # A LoRA base is frozen: allocate it in its final dtype at once (a 7B base never exists in fp32).
    # With optimizer offload the fp32 master copy lives on the host: the GPU holds bf16 weights only.
    dtype = torch.float32
    if cfg.train.mode == "lora" and base_dtype is not None:
        dtype = base_dtype
    elif cfg.memory.optimizer_offload:
        dtype = torch.bfloat16
    model = materialize(args, device, cfg.train.seed, dtype)
    if cfg.model.init_from:
        from tracetrain.models.hf import load_hf_weights
        load_hf_weights(model, cfg.model.init_from)
    if cfg.model.num_experts > 0:  # Mixtral-style MoE blocks in place of the dense MLPs, before LoRA
        from tracetrain.models.moe import apply_moe, set_aux_loss_weight
        apply_moe(model, cfg.model.num_experts, cfg.model.experts_top_k)
        # The load-balancing term is the mean over every forward pass of a step: its micro-batches on
        # every data- and context-parallel rank.
        par = cfg.parallel
        passes = cfg.train.grad_accum_steps * par.dp_replicate * par.dp_shard * par.cp
        set_aux_loss_weight(model, cfg.model.moe_aux_loss_coef / passes)
    if cfg.train.mode == "lora":
        from tracetrain.models.lora import apply_lora
        lc = cfg.lora
        try:
            apply_lora(model, rank=lc.rank, alpha=lc.alpha, dropout=lc.dropout, targets=lc.targets,
                       base_dtype=base_dtype,
                       adapter_dtype=torch.bfloat16 if lc.adapter_dtype == "bf16" else torch.float32)
        except ValueError as e:
            raise ConfigError(f"config key 'lora.targets': {e}") from None
    from tracetrain.models.attention import apply_attention, resolve_attention
    apply_attention(model, resolve_attention(cfg.train.attention, device, packed=cfg.data.pack,
                                             seq_len=cfg.data.seq_len))  # type: ignore[arg-type]
    compile_on = resolve_switch(cfg.train.compile, device)
    if resolve_switch(cfg.train.fused_kernels, device, unless=compile_on):
        from tracetrain.kernels.apply import apply_fused_kernels
        apply_fused_kernels(model)
    if cfg.train.fp8 != "none":
        from tracetrain.kernels.fp8 import apply_fp8
        apply_fp8(model, cfg.train.fp8)  # type: ignore[arg-type]
    if distributed:
        return model
    if cfg.memory.recompute != "none":
        from tracetrain.memory.recompute import apply_recompute
        apply_recompute(model, cfg.memory.recompute, cfg.memory.recompute_every)
    if compile_on:
        from tracetrain.kernels.apply import apply_compile
        apply_compile(model)
    return model


def resolve_switch(value: str, device: torch.device, unless: bool = False) -> bool:
    """'on' / 'off' as said; 'auto' = on for CUDA (unless `unless`), measured to win there (docs/speed.md)."""
    return value == "on" or (value == "auto" and device.type == "cuda" and not unless)
