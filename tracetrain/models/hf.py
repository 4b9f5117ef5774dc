"""Hugging Face interop: read and write `transformers` checkpoints and PEFT LoRA adapters.

The model's parameter names already follow HF's Llama layout, and its rotary embedding uses HF's
half-split layout, so conversion is only a renaming (`model.` prefix) with no permutation of q/k.

Supported architectures: LlamaForCausalLM, MistralForCausalLM and Qwen2ForCausalLM (q/k/v bias).
Sliding-window attention (Mistral's `sliding_window`, Qwen2's `use_sliding_window`) is ignored:
the model attends to the full causal context, which is identical while sequences are no longer than
the window (4096 for Mistral 7B v0.1; later Mistral and Qwen2 checkpoints disable it).

Weights are streamed block by block (`safetensors.safe_open(...).get_slice`, models/hf_load.py) into the
existing parameters or into each rank's shards, so no rank ever reads or holds a whole checkpoint.
Exports are written to a temporary directory and renamed into place, so a crash never leaves a
half-written checkpoint behind.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from tracetrain.errors import CheckpointError
from tracetrain.models.dora import DoRALinear
from tracetrain.models.hf_load import HFCheckpoint, local_name
from tracetrain.models.llama import ModelArgs
from tracetrain.models.lora import (
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

SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_PEFT_PREFIX = "base_model.model."


# ----------------------------------------------------------------------------------------------------
# config.json -> ModelArgs


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise CheckpointError(f"{path} does not exist")
    try:
        data = json.loads(path.read_bytes())  # bytes: JSON is UTF-8, whatever the locale says
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read it ({e.strerror})") from None
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{path}: not UTF-8 text (byte {e.start}); JSON files must be UTF-8") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON: {e}") from None
    except RecursionError:  # the decoder recurses once per nesting level
        raise CheckpointError(f"{path}: JSON nested too deeply to read") from None
    except ValueError as e:  # an integer of more digits than Python converts
        raise CheckpointError(f"{path}: not readable JSON ({str(e).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object {{...}}, got {type(data).__name__}")
    return data


def _shape_int(cfg: dict[str, Any], key: str, where: Path, default: int | None = None) -> int:
    """A positive integer of config.json: a string, float or bool there is a broken file, not a size."""
    value = cfg.get(key)
    if value is None:
        if default is None:
            raise CheckpointError(f"{where}: required key '{key}' is missing")
        return default
    # bool is a subclass of int in Python (true would read as 1).
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise CheckpointError(f"{where}: {key} = {json.dumps(value)} is not allowed; it must be a positive integer")
    return value


def _positive_float(value: Any, key: str, where: Path) -> float:
    """A positive, finite number of config.json (eps, rope theta, scaling factors, init std)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise CheckpointError(f"{where}: {key} = {json.dumps(value)} is not allowed; it must be a positive number")
    return float(value)


def _flag(cfg: dict[str, Any], key: str, where: Path, default: bool) -> bool:
    value = cfg.get(key, default)
    if not isinstance(value, bool):  # bool("false") is True
        raise CheckpointError(f"{where}: {key} = {json.dumps(value)} is not allowed; it must be true or false")
    return value


def _check_architecture(cfg: dict[str, Any], where: Path) -> str:
    """The HF model_type of a supported architecture, else CheckpointError listing the supported ones."""
    archs = cfg.get("architectures") or []
    model_type = cfg.get("model_type", "")
    supported = ", ".join(SUPPORTED_ARCHITECTURES)
    if not isinstance(archs, list) or not isinstance(model_type, str):
        raise CheckpointError(f"{where}: 'architectures' must be a list and 'model_type' a string")
    if archs:
        if len(archs) != 1 or archs[0] not in SUPPORTED_ARCHITECTURES:
            raise CheckpointError(f"{where}: architecture {', '.join(archs)} is not supported; supported: {supported}")
        return SUPPORTED_ARCHITECTURES[archs[0]]
    if model_type not in SUPPORTED_ARCHITECTURES.values():
        raise CheckpointError(f"{where}: model_type '{model_type}' is not supported; supported: {supported}")
    return model_type


def _rope_from_config(cfg: dict[str, Any], where: Path) -> tuple[float, dict[str, float]]:
    """(rope_theta, llama3 scaling dict) from either transformers-5 `rope_parameters` or the older
    top-level `rope_theta` + `rope_scaling` keys."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise CheckpointError(f"{where}: rope_scaling = {json.dumps(params)} is not allowed; it must be an object")
    theta = _positive_float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)), "rope_theta", where)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, {}
    if rope_type != "llama3":
        raise CheckpointError(f"{where}: rope_type '{rope_type}' is not supported; supported: default, llama3")
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [k for k in keys if k not in params]
    if missing:
        raise CheckpointError(f"{where}: llama3 rope scaling needs {', '.join(missing)}")
    return theta, {k: _positive_float(params[k], f"rope_scaling.{k}", where) for k in keys}


def _check_unsupported_features(cfg: dict[str, Any], where: Path, dim: int, n_heads: int) -> None:
    """Features the plain model does not implement fail loudly instead of loading wrong weights."""
    if cfg.get("head_dim") not in (None, dim // n_heads):
        raise CheckpointError(
            f"{where}: head_dim {cfg['head_dim']} != hidden_size / num_attention_heads "
            f"({dim // n_heads}) is not supported"
        )
    if cfg.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{where}: hidden_act '{cfg['hidden_act']}' is not supported; supported: silu")
    # Llama's attention_bias also adds an o_proj bias, which the model (like Qwen2) does not have.
    for key in ("attention_bias", "mlp_bias"):
        if cfg.get(key):
            raise CheckpointError(f"{where}: {key} = true is not supported")


def load_hf_config(path: str | Path) -> ModelArgs:
    """ModelArgs from the `config.json` of a Hugging Face checkpoint directory."""
    where = Path(path) / "config.json"
    cfg = _read_json(where)
    model_type = _check_architecture(cfg, where)
    dim, n_heads = _shape_int(cfg, "hidden_size", where), _shape_int(cfg, "num_attention_heads", where)
    _check_unsupported_features(cfg, where, dim, n_heads)
    theta, scaling = _rope_from_config(cfg, where)
    args = ModelArgs(
        dim=dim,
        n_layers=_shape_int(cfg, "num_hidden_layers", where),
        n_heads=n_heads,
        n_kv_heads=_shape_int(cfg, "num_key_value_heads", where, default=n_heads),
        ffn_dim=_shape_int(cfg, "intermediate_size", where),
        vocab_size=_shape_int(cfg, "vocab_size", where),
        norm_eps=_positive_float(cfg.get("rms_norm_eps", 1e-6), "rms_norm_eps", where),
        rope_theta=theta,
        rope_scaling=scaling,
        max_seq_len=_shape_int(cfg, "max_position_embeddings", where, default=2048),
        qkv_bias=model_type == "qwen2",
        tie_embeddings=_flag(cfg, "tie_word_embeddings", where, False),
        init_std=_positive_float(cfg.get("initializer_range", 0.02), "initializer_range", where),
    )
    try:
        args.validate()
    except ValueError as e:
        raise CheckpointError(f"{where}: {e}") from None
    return args


# ----------------------------------------------------------------------------------------------------
# Weights: HF checkpoint -> model


def _hf_name(key: str) -> str:
    """The model's state-dict key (LoRA-wrapped or not) -> HF's key ('.base.' dropped, 'model.' added)."""
    name = key.replace(".base.", ".")
    return name if name.startswith("lm_head.") else "model." + name


def _checkpoint_files(path: Path) -> dict[str, str]:
    """HF tensor name -> file name holding it, from the index (sharded) or the single file's header."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map", {})
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
    tied = bool(getattr(getattr(model, "args", None), "tie_embeddings", False))
    checkpoint = HFCheckpoint(path, _checkpoint_files(path), tied=tied)
    shapes = _model_shapes(model)
    if tied:
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
# The writers below fill a folder they are given; `export_hf` / `export_peft_adapter` wrap them in
# `models/export.py::export_folder`, which refuses to replace anything but an earlier tracetrain export and
# renames a finished temporary sibling into place. `export.py` adds the run-level files (tokenizer,
# generation_config.json, model card) for `tracetrain export`.


def hf_config_dict(
    args: ModelArgs,
    dtype: torch.dtype,
    bos_token_id: int | None = None,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
) -> dict[str, Any]:
    """The `config.json` transformers needs: Qwen2ForCausalLM when q/k/v have biases, else Llama.

    Rope is written in the long-standing `rope_theta` + `rope_scaling` form, which transformers 4.x
    reads as is and 5.x converts to `rope_parameters`. `eos_token_id` may list several stop ids.
    """
    arch, model_type = ("Qwen2ForCausalLM", "qwen2") if args.qkv_bias else ("LlamaForCausalLM", "llama")
    scaling = {"rope_type": "llama3", **args.rope_scaling} if args.rope_scaling else None
    cfg: dict[str, Any] = {
        "architectures": [arch],
        "model_type": model_type,
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "hidden_act": "silu",
        "max_position_embeddings": args.max_seq_len,
        "rope_theta": args.rope_theta,
        "rope_scaling": scaling,
        "tie_word_embeddings": args.tie_embeddings,
        "initializer_range": args.init_std,
        "attention_dropout": 0.0,
        "use_cache": True,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "pad_token_id": pad_token_id,
        # transformers >= 4.56 reads `dtype`; older versions read `torch_dtype`.
        "torch_dtype": _DTYPE_NAMES[dtype],
        "dtype": _DTYPE_NAMES[dtype],
    }
    if args.qkv_bias:
        cfg.update(use_sliding_window=False, sliding_window=None, max_window_layers=args.n_layers)
    else:
        cfg.update(attention_bias=False, mlp_bias=False)
    return cfg


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

    LoRA adapters are merged into the written weights without changing `model`. Shards are built one
    at a time, so peak host memory is about one shard, not the whole model. `progress` hears the bytes
    converted and written so far, per tensor (tracetrain/progress.py).
    """
    state = {k: v for k, v in dense_state_dict(model).items() if not is_lora_key(k)}
    if args.tie_embeddings:
        state.pop("lm_head.weight", None)  # HF ties it on load; safetensors refuses shared storage anyway
    itemsize = torch.empty((), dtype=dtype).element_size()
    shards = _plan_shards({k: v.numel() * itemsize for k, v in state.items()}, max_shard_bytes)
    weight_map: dict[str, str] = {}
    total = sum(v.numel() * itemsize for v in state.values())
    done = 0
    for i, keys in enumerate(shards):
        file = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        what = f"exporting weights: shard {i + 1} of {len(shards)}"  # one bar (and ETA) for all shards
        tensors = {}
        for k in keys:
            tensors[_hf_name(k)] = _export_tensor(model, k, state[k], dtype)
            done += state[k].numel() * itemsize
            if progress:
                progress(what, done, total, "bytes")
        save_file(tensors, out_dir / file, metadata={"format": "pt"})  # transformers checks "format"
        weight_map.update(dict.fromkeys(tensors, file))
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def export_hf(
    model: nn.Module,
    args: ModelArgs,
    out_dir: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    max_shard_bytes: int = 5 * 10**9,
    bos_token_id: int | None = None,
    eos_token_id: int | list[int] | None = None,
    *,
    pad_token_id: int | None = None,
    overwrite: bool = True,
) -> None:
    """Write `config.json` and `model.safetensors` (or shards + index) loadable by transformers.

    `out_dir` must be new, empty, or (with `overwrite`, the default here, as before) an earlier tracetrain
    export; anything else raises CheckpointError and is left untouched. `tracetrain export` (which adds
    the tokenizer, generation config and model card) is `models/export.py::export_run_hf`.
    """
    from tracetrain.models.export import export_folder  # export.py builds on this module

    with export_folder(Path(out_dir), "hf", overwrite) as tmp:
        config = hf_config_dict(args, dtype, bos_token_id, eos_token_id, pad_token_id)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        write_hf_weights(model, args, tmp, dtype, max_shard_bytes)


# ----------------------------------------------------------------------------------------------------
# PEFT adapters


def _check_adapter_args(model: nn.Module, rank: int, targets: list[str]) -> None:
    """The config written must describe the adapters written, or PEFT would load them wrongly."""
    wrapped = {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}
    ranks = {m.rank for m in wrapped.values()}
    if ranks != {rank}:
        raise ValueError(f"rank {rank} does not match the model's adapters (rank {sorted(ranks)})")
    names = {n.rpartition(".")[2] for n in wrapped}
    if names != set(resolve_targets(targets)):
        raise ValueError(f"targets {targets} do not match the model's adapted layers {sorted(names)}")


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
    _check_adapter_args(model, rank, targets)
    dora = any(isinstance(m, DoRALinear) for m in model.modules())
    cfg = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": dropout,
        "target_modules": resolve_targets(targets),
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
    tensors = {_PEFT_PREFIX + _hf_name(k): v.detach().cpu().contiguous() for k, v in adapters.items()}
    (out_dir / "adapter_config.json").write_text(json.dumps(cfg, indent=2))
    save_file(tensors, out_dir / "adapter_model.safetensors", metadata={"format": "pt"})


def export_peft_adapter(
    model: nn.Module,
    out_dir: str | Path,
    rank: int,
    alpha: float,
    dropout: float,
    targets: list[str],
    base_model_name_or_path: str = "",
    *,
    overwrite: bool = True,
) -> None:
    """Write the model's adapters as a PEFT LoRA adapter (`adapter_config.json`, `adapter_model.safetensors`)
    that `peft.PeftModel.from_pretrained(hf_base_model, out_dir)` loads. `out_dir` as in `export_hf`."""
    from tracetrain.models.export import export_folder  # export.py builds on this module

    if not lora_state_dict(model):  # checked before any folder is touched
        raise ValueError("model has no LoRA adapters to export; apply_lora first")
    _check_adapter_args(model, rank, targets)
    with export_folder(Path(out_dir), "peft", overwrite) as tmp:
        write_peft_adapter(model, tmp, rank, alpha, dropout, targets, base_model_name_or_path)


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
    cfg = _read_json(where)
    if cfg.get("peft_type") != "LORA":
        raise CheckpointError(f"{where}: peft_type {cfg.get('peft_type')!r} is not supported; supported: LORA")
    used = [k for k in _PEFT_UNSUPPORTED if cfg.get(k)] + (["bias"] if cfg.get("bias", "none") != "none" else [])
    if used:
        raise CheckpointError(f"{where}: adapter options not supported: {', '.join(used)}")
    targets = cfg.get("target_modules")
    targets = [targets] if targets == "all-linear" else targets
    if not isinstance(targets, list):
        raise CheckpointError(f"{where}: target_modules {targets!r} must be a list of projection names")
    try:
        cfg["target_modules"] = resolve_targets(targets)
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
