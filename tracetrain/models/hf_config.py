"""A Hugging Face checkpoint's `config.json` <-> `ModelArgs`, for every supported family.

The keys every family shares (sizes, head size, norm eps, rope, tied embeddings, init std) are read
and written here; each family's own keys (q/k/v bias, q/k norms, sliding window, experts) by its entry
in models/families.py (what an entry holds: models/arch.py). A value the plain model cannot compute is
refused with one line naming the file and the key, never loaded into wrong weights.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from tracetrain.errors import CheckpointError, ConfigError
from tracetrain.models.arch import ConfigReader
from tracetrain.models.families import family_of_args, family_of_config
from tracetrain.models.llama import ModelArgs

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from `path`; one CheckpointError line for anything else."""
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


def _rope(reader: ConfigReader) -> tuple[float, dict[str, float]]:
    """(rope_theta, llama3 scaling dict) from either transformers-5 `rope_parameters` or the older
    top-level `rope_theta` + `rope_scaling` keys."""
    params = reader.get("rope_parameters") or reader.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise reader.fail(f"rope_scaling = {json.dumps(params)} is not allowed; it must be an object")
    theta = reader.positive_float("rope_theta", 10000.0, params.get("rope_theta", reader.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, {}
    if rope_type != "llama3":
        raise reader.fail(f"rope_type '{rope_type}' is not supported; supported: default, llama3")
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [k for k in keys if k not in params]
    if missing:
        raise reader.fail(f"llama3 rope scaling needs {', '.join(missing)}")
    return theta, {k: reader.positive_float(f"rope_scaling.{k}", 1.0, params[k]) for k in keys}


def _shared_fields(reader: ConfigReader, own_rope_and_act: bool = False) -> dict[str, Any]:
    """The ModelArgs fields every family stores under the same keys (activation and rope: unless the family
    reads its own, `ArchFamily.own_rope_and_act`)."""
    dim, n_heads = reader.positive_int("hidden_size"), reader.positive_int("num_attention_heads")
    head_dim = reader.positive_int("head_dim") if reader.get("head_dim") is not None else 0  # 0: dim // n_heads
    if reader.get("hidden_act", "silu") != "silu" and not own_rope_and_act:
        raise reader.fail(f"hidden_act '{reader.get('hidden_act')}' is not supported; supported: silu")
    theta, scaling = (10000.0, {}) if own_rope_and_act else _rope(reader)
    return {
        "dim": dim,
        "n_layers": reader.positive_int("num_hidden_layers"),
        "n_heads": n_heads,
        "n_kv_heads": reader.positive_int("num_key_value_heads", n_heads),
        "ffn_dim": reader.positive_int("intermediate_size"),
        "vocab_size": reader.positive_int("vocab_size"),
        "norm_eps": reader.positive_float("rms_norm_eps", 1e-6),
        "rope_theta": theta,
        "rope_scaling": scaling,
        "max_seq_len": reader.positive_int("max_position_embeddings", 2048),
        "tie_embeddings": reader.flag("tie_word_embeddings", False),
        "init_std": reader.positive_float("initializer_range", 0.02),
        "head_dim_override": head_dim if head_dim * n_heads != dim else 0,  # Qwen3: 128 whatever the width
    }


def require_checkpoint_folder(path: str | Path) -> None:
    """`model.init_from` names a Hugging Face checkpoint folder (one holding config.json): one ConfigError
    line naming the key otherwise."""
    folder = Path(path)
    if not folder.exists():
        what = "does not exist"
    elif not folder.is_dir():
        what = "is a file, not a Hugging Face checkpoint folder"
    elif not (folder / "config.json").is_file():
        what = "has no config.json, so it is not a Hugging Face checkpoint folder"
    else:
        return
    raise ConfigError(f"checkpoint folder {folder} {what} (config key 'model.init_from')")


def load_hf_config(path: str | Path) -> ModelArgs:
    """ModelArgs from the `config.json` of a Hugging Face checkpoint directory."""
    where = Path(path) / "config.json"
    reader = ConfigReader(read_json(where), where)
    family = family_of_config(reader)
    fields = {**_shared_fields(reader, family.own_rope_and_act), **family.parse(reader)}
    try:
        args = ModelArgs(**fields)
        args.validate()
    except ValueError as e:
        raise CheckpointError(f"{where}: {e}") from None
    return args


def hf_config_dict(
    args: ModelArgs,
    dtype: torch.dtype,
    bos_token_id: int | None = None,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
) -> dict[str, Any]:
    """The `config.json` transformers needs, of the family that computes this model (families.py).

    Rope is written in the long-standing `rope_theta` + `rope_scaling` form, which transformers 4.x
    reads as is and 5.x converts to `rope_parameters`. `eos_token_id` may list several stop ids.
    """
    family = family_of_args(args)
    scaling = {"rope_type": "llama3", **args.rope_scaling} if args.rope_scaling else None
    cfg: dict[str, Any] = {
        "architectures": [family.hf_class],
        "model_type": family.model_type,
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
    cfg.update(family.export_keys(args))
    return cfg
