"""Hugging Face interop: read and write `transformers` checkpoints and PEFT LoRA adapters.

The model's parameter names already follow HF's Llama layout, and its rotary embedding uses HF's
half-split layout, so for most tensors conversion is only a renaming (`model.` prefix) with no
permutation of q/k; a family whose checkpoints name or cut tensors otherwise (Mixtral's and Qwen3-MoE's
one tensor per expert) says where each of the model's tensors lies (`ArchFamily.pieces`, models/arch.py).
The families and their config.json keys: models/families.py and models/hf_config.py
(`load_hf_config`, `hf_config_dict`, re-exported here).

Weights are streamed block by block (`safetensors.safe_open(...).get_slice`, models/hf_load.py) into the
existing parameters or into each rank's shards, so no rank ever reads or holds a whole checkpoint.
Exports are written to a temporary directory and renamed into place, so a crash never leaves a
half-written checkpoint behind.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from tracetrain.errors import CheckpointError
from tracetrain.models.families import family_of_args
from tracetrain.models.hf_config import hf_config_dict, load_hf_config, read_json
from tracetrain.models.hf_load import HFCheckpoint, Piece, local_name
from tracetrain.models.llama import ModelArgs
from tracetrain.models.lora import (
    DoRALinear,
    LoRALinear,
    apply_lora,
    is_lora_key,
    load_lora_state_dict,
    lora_state_dict,
    resolve_targets,
)
from tracetrain.models.qlora import NF4Linear, dense_state_dict
from tracetrain.safe_load import open_safetensors

if TYPE_CHECKING:
    from tracetrain.progress import Progress

__all__ = ["hf_config_dict", "load_hf_config", "load_hf_weights"]
_PEFT_PREFIX = "base_model.model."


# ----------------------------------------------------------------------------------------------------
# Weights: HF checkpoint -> model


def _hf_name(key: str) -> str:
    """The model's state-dict key (LoRA-wrapped or not) -> HF's key ('.base.' dropped, 'model.' added)."""
    return _hf_key(key.replace(".base.", "."))


def _hf_key(local: str) -> str:
    """A local name (no 'model.') -> the key HF files use."""
    return local if local.startswith("lm_head.") else "model." + local


def checkpoint_files(path: Path) -> dict[str, str]:
    """HF tensor name -> file name holding it, from the index (sharded) or the single file's header."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map", {})
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: 'weight_map' is {type(weight_map).__name__}, not an object")
        for name, shard in weight_map.items():
            # A shard is a file of this folder: a path elsewhere ('../x', '/etc/passwd') is never read.
            if not isinstance(shard, str) or not re.fullmatch(r"[^/\\\x00]+", shard) or shard in (".", ".."):
                raise CheckpointError(f"{index}: 'weight_map' names {shard!r} for {name!r}, not a file name")
        for shard in sorted(set(weight_map.values())):
            if not (path / shard).is_file():
                raise CheckpointError(f"{path / shard} (listed in {index.name}) does not exist")
        return weight_map
    single = path / "model.safetensors"
    if not single.is_file():
        raise CheckpointError(f"{path} has neither model.safetensors nor model.safetensors.index.json")
    with open_safetensors(single) as f:
        return dict.fromkeys(f.keys(), single.name)


def _model_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Local (HF-style, no 'model.') name -> full shape of what the checkpoint must hold; LoRA adapters are not in HF files."""
    state = dense_state_dict(model, keep_vars=True)
    return {local_name(_hf_name(k)): tuple(v.shape) for k, v in state.items() if not is_lora_key(k)}


def open_hf_checkpoint(path: str | Path, model: nn.Module) -> HFCheckpoint:
    """The checkpoint at `path` for `model` (on any device, meta included; LoRA-wrapped or not), its names
    and shapes checked against the model's (headers only): one CheckpointError line on a mismatch."""
    path = Path(path)
    args: ModelArgs = model.args  # type: ignore[assignment]  # the plain model (Transformer) carries its args
    family = family_of_args(args)
    checkpoint = HFCheckpoint(
        path,
        checkpoint_files(path),
        tied=args.tie_embeddings,
        pieces=lambda name, shape: family.pieces(name, shape, args),
    )
    shapes = _model_shapes(model)
    if args.tie_embeddings:
        shapes.pop("lm_head.weight", None)
    checkpoint.check(shapes)
    return checkpoint


@torch.no_grad()
def load_hf_weights(model: nn.Module, path: str | Path) -> None:
    """Copy a HF checkpoint's tensors (single or sharded safetensors) into `model`'s parameters in place.

    Works on a model already on any device and in any dtype (tensors are converted on copy), and on a
    LoRA-wrapped model (the `.base` weights are filled). Names and shapes are all checked before
    anything is copied. A sharded model reads its shards through `materialize_parts` instead.
    """
    checkpoint = open_hf_checkpoint(path, model)
    for name, p in model.state_dict(keep_vars=True).items():
        if not is_lora_key(name):
            checkpoint.fill(p.data, local_name(_hf_name(name)), tuple(p.shape), (0,) * p.dim())
    checkpoint.close()


# ----------------------------------------------------------------------------------------------------
# Export: model -> HF checkpoint
#
# The writers below fill a folder they are given. Writing a folder to disk is models/export.py's:
# `export_hf` / `export_peft_adapter` there wrap these writers in `export_folder`, which refuses to replace
# anything but an earlier tracetrain export and renames a finished temporary sibling into place, and
# `tracetrain export` adds the run-level files (tokenizer, generation_config.json, model card).


def _export_tensor(model: nn.Module, key: str, value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One tensor as written: LoRA-wrapped weights merged (into a new tensor), cast, on the CPU."""
    module_name, _, leaf = key.rpartition(".")
    owner = model.get_submodule(module_name.removesuffix(".base")) if leaf == "weight" else None
    if module_name.endswith(".base") and isinstance(owner, LoRALinear):
        value = owner.merged_weight(dtype)
    elif isinstance(owner, NF4Linear):  # a QLoRA projection without adapter: dequantised
        value = owner.weight
    return value.detach().to(device="cpu", dtype=dtype).contiguous()


def _plan_shards(sizes: dict[str, int], max_shard_bytes: int) -> list[list[str]]:
    """Greedy, in state-dict order: a new shard starts when the next tensor would overflow this one."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, size in sizes.items():
        if shards[-1] and used + size > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def _export_parts(args: ModelArgs, state: dict[str, torch.Tensor]) -> dict[str, list[tuple[str, Piece]]]:
    """HF key -> the pieces of the model's tensors (state key, piece) it is made of, in state order."""
    family = family_of_args(args)
    parts: dict[str, list[tuple[str, Piece]]] = {}
    for key, value in state.items():
        for piece in family.pieces(local_name(_hf_name(key)), tuple(value.shape), args):
            parts.setdefault(_hf_key(piece.hf_name), []).append((key, piece))
    return parts


def _piece_numel(value: torch.Tensor, piece: Piece) -> int:
    return value[0].numel() * piece.rows if value.dim() else 1


class _Converter:
    """The model's tensors as written (merged, cast, on the CPU), the last one kept: the experts of a
    block are several HF tensors cut from one of the model's."""

    def __init__(self, model: nn.Module, state: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
        self.model, self.state, self.dtype = model, state, dtype
        self.key, self.value = "", torch.empty(0)

    def hf_tensor(self, parts: list[tuple[str, Piece]]) -> torch.Tensor:
        chunks = []
        for key, piece in sorted(parts, key=lambda kp: kp[1].hf_start):
            if key != self.key:
                self.key, self.value = key, _export_tensor(self.model, key, self.state[key], self.dtype)
            if piece.stacked:
                chunks.append(self.value[piece.start])
            else:
                chunks.append(self.value[piece.start : piece.start + piece.rows] if self.value.dim() else self.value)
        return chunks[0] if len(chunks) == 1 else torch.cat(chunks)


@torch.no_grad()
def write_hf_weights(
    model: nn.Module,
    args: ModelArgs,
    out_dir: Path,
    dtype: torch.dtype,
    max_shard_bytes: int,
    progress: Progress | None = None,
) -> None:
    """`model.safetensors`, or shards + `model.safetensors.index.json`, into the existing folder `out_dir`.

    LoRA adapters are merged into the written weights without changing `model`; tensors are named and
    cut as the family's checkpoints hold them (`ArchFamily.pieces`). Shards are built one at a time, so
    peak host memory is about one shard, not the whole model. `progress` hears the bytes converted and
    written so far, per tensor (tracetrain/progress.py).
    """
    state = {k: v for k, v in dense_state_dict(model).items() if not is_lora_key(k)}
    if args.tie_embeddings:
        state.pop("lm_head.weight", None)  # HF ties it on load; safetensors refuses shared storage anyway
    itemsize = torch.empty((), dtype=dtype).element_size()
    parts = _export_parts(args, state)
    sizes = {hf: sum(_piece_numel(state[k], p) for k, p in ps) * itemsize for hf, ps in parts.items()}
    shards = _plan_shards(sizes, max_shard_bytes)
    converter = _Converter(model, state, dtype)
    weight_map: dict[str, str] = {}
    total, done = sum(sizes.values()), 0
    for i, keys in enumerate(shards):
        file = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        what = f"exporting weights: shard {i + 1} of {len(shards)}"  # one bar (and ETA) for all shards
        tensors = {}
        for hf in keys:
            tensors[hf] = converter.hf_tensor(parts[hf]).contiguous()
            done += sizes[hf]
            if progress:
                progress(what, done, total, "bytes")
        save_file(tensors, out_dir / file, metadata={"format": "pt"})  # transformers checks "format"
        weight_map.update(dict.fromkeys(tensors, file))
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


# ----------------------------------------------------------------------------------------------------
# PEFT adapters


def check_adapter_args(model: nn.Module, rank: int, targets: list[str]) -> list[str]:
    """The config written must describe the adapters written, or PEFT would load them wrongly. Returns the
    target names to write: those adapted (an MoE model's experts are not linear layers, so a target that
    names only expert projections adapts nothing there and is left out)."""
    wrapped = {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}
    ranks = {m.rank for m in wrapped.values()}
    if ranks != {rank}:
        raise ValueError(f"rank {rank} does not match the model's adapters (rank {sorted(ranks)})")
    names = {n.rpartition(".")[2] for n in wrapped}
    linear = {n.rpartition(".")[2] for n, m in model.named_modules() if isinstance(m, (nn.Linear, LoRALinear))}
    wanted = [t for t in resolve_targets(targets) if t in linear]
    if names != set(wanted):
        raise ValueError(f"targets {targets} do not match the model's adapted layers {sorted(names)}")
    dense_mlp = sorted(names & {"gate_proj", "up_proj", "down_proj"})
    if dense_mlp and getattr(model, "args", None) is not None and model.args.num_experts:  # type: ignore[union-attr]  # the plain model's args
        raise ValueError(
            f"a PEFT adapter of an MoE model cannot hold the dense blocks' {', '.join(dense_mlp)} adapters: "
            "transformers 5 maps those names onto the experts; export --hf (merged), or train with "
            "lora.targets on the attention projections"
        )
    return wanted


def write_peft_adapter(
    model: nn.Module,
    out_dir: Path,
    rank: int,
    alpha: float,
    dropout: float,
    targets: list[str],
    base_model_name_or_path: str = "",
) -> None:
    """`adapter_config.json` and `adapter_model.safetensors` into the existing folder `out_dir`."""
    adapters = lora_state_dict(model)
    if not adapters:
        raise ValueError("model has no LoRA adapters to export; apply_lora first")
    adapted = check_adapter_args(model, rank, targets)
    dora = any(isinstance(m, DoRALinear) for m in model.modules())
    cfg = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": dropout,
        "target_modules": adapted,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "base_model_name_or_path": base_model_name_or_path,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "use_rslora": False,
        "use_dora": dora,
        "lora_bias": False,
    }
    args = getattr(model, "args", None)
    if args is not None and args.family == "phi3":  # adapters of the fused qkv_proj / gate_up_proj
        from tracetrain.models.arch_phi import fused_adapters, peft_targets

        if dora:  # a fused DoRA magnitude needs the rows of unadapted parts too: not written
            raise CheckpointError(
                "--peft of a Phi-3 DoRA run is not supported (fused qkv_proj / gate_up_proj); --hf merges it"
            )

        adapters, ranks = fused_adapters(adapters, args, rank)
        cfg["target_modules"] = peft_targets(resolve_targets(targets))
        cfg["rank_pattern"] = {kind: r for kind, r in ranks.items() if r != rank}
        cfg["alpha_pattern"] = {kind: alpha * r / rank for kind, r in ranks.items() if r != rank}
    tensors = {_PEFT_PREFIX + _hf_name(k): v.detach().cpu().contiguous() for k, v in adapters.items()}
    (out_dir / "adapter_config.json").write_text(json.dumps(cfg, indent=2))
    save_file(tensors, out_dir / "adapter_model.safetensors", metadata={"format": "pt"})


# Adapter features with no equivalent here; a set value would silently change what the adapter computes.
_PEFT_UNSUPPORTED = (
    "use_rslora",
    "fan_in_fan_out",
    "lora_bias",
    "rank_pattern",
    "alpha_pattern",
    "modules_to_save",
    "layers_to_transform",
    "layer_replication",
    "target_parameters",
    "trainable_token_indices",
)


def _read_peft_config(adapter_dir: Path) -> dict[str, Any]:
    where = adapter_dir / "adapter_config.json"
    cfg = read_json(where)
    if cfg.get("peft_type") != "LORA":
        raise CheckpointError(f"{where}: peft_type {cfg.get('peft_type')!r} is not supported; supported: LORA")
    used = [k for k in _PEFT_UNSUPPORTED if cfg.get(k)] + (["bias"] if cfg.get("bias", "none") != "none" else [])
    if used:
        raise CheckpointError(f"{where}: adapter options not supported: {', '.join(used)}")
    targets = cfg.get("target_modules")
    targets = [targets] if targets == "all-linear" else targets
    if not isinstance(targets, list):
        raise CheckpointError(f"{where}: target_modules {targets!r} must be a list of projection names")
    from tracetrain.models.arch_phi import split_targets  # Phi-3's qkv_proj / gate_up_proj: our parts

    try:
        cfg["target_modules"] = resolve_targets(split_targets(targets))
    except ValueError as e:
        raise CheckpointError(f"{where}: {e}") from None
    return cfg


def load_peft_adapter(
    model: nn.Module,
    adapter_dir: str | Path,
    base_dtype: torch.dtype | None = None,
    adapter_dtype: torch.dtype = torch.float32,
) -> int:
    """Apply LoRA as a PEFT adapter describes it and load its tensors, to continue training from it.

    Returns the number of trainable parameters (as `apply_lora`).
    """
    adapter_dir = Path(adapter_dir)
    cfg = _read_peft_config(adapter_dir)
    file = adapter_dir / "adapter_model.safetensors"
    if not file.is_file():
        raise CheckpointError(f"{file} does not exist")
    with safe_open(file, framework="pt") as f:
        # 'base_model.model.model.layers.0...lora_A.weight' -> 'layers.0...lora_A.weight'
        tensors = {local_name(k.removeprefix(_PEFT_PREFIX)): f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    args = getattr(model, "args", None)
    if args is not None and args.family == "phi3":  # adapters of qkv_proj / gate_up_proj, split exactly
        from tracetrain.models.arch_phi import split_adapters

        tensors = split_adapters(tensors, args)
    count = apply_lora(
        model,
        cfg["r"],
        cfg["lora_alpha"],
        cfg.get("lora_dropout", 0.0),
        cfg["target_modules"],
        base_dtype,
        adapter_dtype,
        dora=bool(cfg.get("use_dora")),
    )
    try:
        load_lora_state_dict(model, tensors)
    except CheckpointError as e:
        raise CheckpointError(f"{file}: {e}") from None
    return count
