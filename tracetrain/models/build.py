"""The model's architecture and its materialisation; the transforms are applied by train/assemble.py.

`model_args_from_config`: a preset (or a Hugging Face checkpoint's config.json) plus the config's
overrides. `build_on_meta`: the model on the meta device (no memory), in its final dtype. The layout
rows of `train/assemble.py` shard it there; `materialize_parts` then allocates only this rank's
shards on the target device and fills them with seeded values that do not depend on the layout
(models/init.py) or with a checkpoint's slices (models/hf_load.py): a rank never holds the whole
model, and a 70B model never exists in fp32 anywhere. Everything that changes the model (MoE, LoRA,
attention backend, kernels, FP8, parallelism, recomputation, compile, materialisation) is a row of the
ordered table `tracetrain.train.assemble.TRANSFORMS`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from tracetrain.config import Config
from tracetrain.errors import ConfigError
from tracetrain.models.families import rope_buffers, transformer_class
from tracetrain.models.init import canonical_name, fill_local, init_rule
from tracetrain.models.llama import ModelArgs, Transformer
from tracetrain.models.lora import DoRALinear
from tracetrain.models.presets import PRESETS, get_preset
from tracetrain.models.qlora import NF4Linear

_OVERRIDES = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size")


def model_args_from_config(cfg: Config) -> ModelArgs:
    """The architecture: a preset (or a HF checkpoint's config.json) plus the config's overrides."""
    m = cfg.model
    if m.init_from:
        from tracetrain.models.hf_config import load_hf_config, require_checkpoint_folder

        require_checkpoint_folder(m.init_from)
        args = load_hf_config(m.init_from)
    elif m.preset in PRESETS:
        args = get_preset(m.preset)
    else:
        raise ConfigError(
            f"config key 'model.preset': {m.preset!r} is not a preset; choose one of {', '.join(PRESETS)}"
        )
    changes: dict[str, Any] = {k: getattr(m, k) for k in _OVERRIDES if getattr(m, k) is not None}
    if m.init_from and changes:
        raise ConfigError(
            f"config keys {', '.join('model.' + k for k in changes)} cannot change the shape "
            f"of a loaded checkpoint ({m.init_from})"
        )
    if m.num_experts:  # an MoE variant of the preset (a checkpoint's experts come from its config.json)
        if m.init_from:
            raise ConfigError(
                f"config key 'model.num_experts' cannot turn the checkpoint {m.init_from} into a mixture of "
                "experts; an MoE checkpoint (Mixtral, Qwen3-MoE) brings its own experts: leave it 0"
            )
        if m.experts_top_k > m.num_experts:
            raise ConfigError(
                f"config key 'model.experts_top_k': {m.experts_top_k} exceeds model.num_experts = "
                f"{m.num_experts}; it must be <= {m.num_experts}"
            )
        changes.update(num_experts=m.num_experts, experts_top_k=m.experts_top_k)
    # A loaded checkpoint keeps its own context length (exported configs must not understate it).
    max_seq_len = max(args.max_seq_len, cfg.data.seq_len) if m.init_from else cfg.data.seq_len
    args = dataclasses.replace(args, **changes, max_seq_len=max_seq_len, init_std=m.init_std)
    try:
        args.validate()
    except ValueError as e:
        raise ConfigError(f"model shape: {e}") from None
    return args


class WeightSource(Protocol):
    """Where a parameter's values come from instead of the seeded init (a HF checkpoint, models/hf_load.py)."""

    def fill(self, local: torch.Tensor, name: str, shape: tuple[int, ...], offsets: tuple[int, ...]) -> bool:
        """Write this rank's block of the full tensor `name`; False if the source does not hold it."""
        ...


def build_on_meta(args: ModelArgs, dtype: torch.dtype = torch.float32) -> Transformer:
    """The model on the meta device (no memory), its parameters in `dtype`; rotary frequencies stay fp32."""
    with torch.device("meta"):
        model = transformer_class(args)(args)
        if dtype != torch.float32:
            model.to(dtype)
            for buf in model.buffers():  # the rotary frequencies (every buffer there is)
                buf.data = buf.float()
    return model


def local_block(p: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """(this rank's tensor, the full shape, the block's offsets in the full tensor) of a parameter."""
    if isinstance(p, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offsets = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        local = p._local_tensor
        assert tuple(local.shape) == tuple(shape), f"local shard {tuple(local.shape)} != DTensor's {shape}"
        return local, tuple(p.shape), tuple(offsets)
    return p.data, tuple(p.shape), (0,) * p.dim()


def _shared_params(part: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    # Parameters held by several modules (a tied head): `to_empty` gives each holder its own copy.
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in part.modules():
        for name, p in module._parameters.items():
            if p is not None:
                holders.setdefault(id(p), []).append((module, name))
    return [h for h in holders.values() if len(h) > 1]


@torch.no_grad()
def materialize_parts(
    parts: list[nn.Module],
    args: ModelArgs,
    device: torch.device,
    seed: int,
    *,
    params_device: torch.device | None = None,
    source: WeightSource | None = None,
) -> None:
    """Allocate each part's meta tensors (this rank's shards only, in their dtype) and fill them: from
    `source` where it holds the tensor, else seeded values independent of the layout (models/init.py).
    `params_device`: where parameters live when not on `device` (the host under FSDP's CPU offload).
    Parts already materialised (built for a test or a benchmark) are left as they are."""
    for part in parts:
        if not any(t.is_meta for t in [*part.parameters(), *part.buffers()]):
            continue
        shared = _shared_params(part)
        part.to_empty(device=params_device or device)
        for holders in shared:  # tie again to the first holder's (FSDP's primary) new parameter
            first = getattr(holders[0][0], holders[0][1])
            for module, name in holders[1:]:
                module._parameters[name] = first
        initial = rope_buffers(args)
        for module in part.modules():
            if isinstance(module, NF4Linear):
                continue  # its buffers are the quantised weight: filled below
            for name, buf in module._buffers.items():
                assert buf is not None and name in initial, f"no initial value for buffer {name!r}"
                module._buffers[name] = initial[name].to(device)
        for name, p in part.named_parameters():
            local, shape, offsets = local_block(p)
            canon = canonical_name(name, tied=args.tie_embeddings)
            if source is None or not source.fill(local, canon, shape, offsets):
                fill_local(local, canon, shape, offsets, init_rule(canon, shape, args), seed)
        _fill_quantised(part, args, device, seed, source)
        for module in part.modules():
            if isinstance(module, DoRALinear):
                module.reset_magnitude()  # ||W|| per row of the base just filled (a checkpoint may replace it)


def _fill_quantised(
    part: nn.Module, args: ModelArgs, device: torch.device, seed: int, source: WeightSource | None
) -> None:
    """Each NF4 weight (QLoRA) filled in full precision, one at a time, and quantised: the 16-bit weights
    never exist all at once (a 70B base fits one GPU in 4 bits, not in 16)."""
    for name, module in part.named_modules():
        if not isinstance(module, NF4Linear):
            continue
        canon = canonical_name(f"{name}.weight", tied=args.tie_embeddings)
        full = torch.empty(module.shape, dtype=module.dtype, device=module.codes.device)
        if source is None or not source.fill(full, canon, module.shape, (0, 0)):
            fill_local(full, canon, module.shape, (0, 0), init_rule(canon, module.shape, args), seed)
        module.quantise_(full)
        del full


def materialize(args: ModelArgs, device: torch.device, seed: int, dtype: torch.dtype = torch.float32) -> Transformer:
    """The whole model on `device` in `dtype`, seeded: the values of any layout's shards of the same seed."""
    model = build_on_meta(args, dtype)
    materialize_parts([model], args, device, seed)
    return model
