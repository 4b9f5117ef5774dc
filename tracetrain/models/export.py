"""`tracetrain export`: a trained run as a folder that transformers (or PEFT) uses as is, written safely.

Safety of the output folder (`export_folder`): an export never deletes what the user did not name. The
target must be new or empty; `overwrite` replaces only an earlier tracetrain export, recognised by its
manifest (`tracetrain_export.json`, listing every file it wrote) and holding nothing else, so a run
directory, a checkpoint or a folder with any other file is refused with one line. Files are written
into a temporary sibling (created with the normal, umask-honouring mode, not mkdtemp's 0700) that is
renamed into place; an earlier export is renamed aside first and deleted only after that.

Contents (`export_run_hf`): config.json with bos/eos/pad ids; generation_config.json, whose
`eos_token_id` lists every stop id (EOS and end-of-turn ids, so transformers' `generate` stops where
`tracetrain generate` does), starting from the base checkpoint's when `model.init_from` has one; the
tokenizer files with the chat template the run trained with; safetensors weights (sharded above
`max_shard_bytes`); a short model card (README.md); the manifest.

Dtype (`run_weights_dtype`, `--dtype auto`, the default): the dtype the run's weights are stored in, so
an export neither rounds nor pads them: the checkpoint's tensors (fp32 for full fine-tuning, whatever
train.precision computed in), and for a LoRA checkpoint that holds only adapters, the frozen base's
(lora.base_dtype when set, else the dtype of the model.init_from files). `--dtype bf16|fp16|fp32` converts.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn

from tracetrain import __version__
from tracetrain.errors import CheckpointError, ConfigError
from tracetrain.models.hf import check_adapter_args, checkpoint_files, write_hf_weights, write_peft_adapter
from tracetrain.models.hf_config import hf_config_dict, read_json
from tracetrain.models.llama import ModelArgs
from tracetrain.models.lora import is_lora_key, lora_state_dict
from tracetrain.safe_load import open_safetensors

if TYPE_CHECKING:
    from tracetrain.progress import Progress

MANIFEST = "tracetrain_export.json"
EXPORT_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DTYPE_CHOICES = ("auto", *EXPORT_DTYPES)  # `--dtype`: auto = the run's weights dtype (`run_weights_dtype`)
_STORED_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}  # safetensors' names
_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


# ----------------------------------------------------------------------------------------------------
# The output folder: refuse anything but new, empty or an earlier export; write aside, rename into place


def _earlier_export_foreign(out_dir: Path) -> str | None:
    """None when `out_dir` holds an earlier tracetrain export and nothing else; else why it is not one."""
    manifest = out_dir / MANIFEST
    try:
        listed = json.loads(manifest.read_text())["files"] if manifest.is_file() else None
    except (OSError, ValueError, KeyError, TypeError):
        listed = None
    if not isinstance(listed, list):
        return f"it is not a tracetrain export (no valid {MANIFEST})"
    known = {MANIFEST, *map(str, listed)}
    known |= {parent.as_posix() for name in list(known) for parent in Path(name).parents if str(parent) != "."}
    for path in sorted(out_dir.rglob("*")):
        rel = path.relative_to(out_dir).as_posix()
        if rel not in known:
            return f"it holds {rel}, which the earlier export did not write"
    return None


def _kind_of_folder(out_dir: Path) -> str | None:
    """'a run directory' / 'a checkpoint folder' when `out_dir` is one: named in the refusal."""
    if (out_dir / "checkpoints").is_dir() or (out_dir / "metrics.jsonl").is_file():
        return "a tracetrain run directory"
    if out_dir.name == "checkpoints" and (out_dir.parent / "config.toml").is_file():
        return "a run's checkpoints folder"
    weights = (out_dir / "model.safetensors").is_file() or (out_dir / "dcp").is_dir()
    if (out_dir / "config.toml").is_file() and weights:
        return "a tracetrain checkpoint folder"
    return None


def _nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _enclosing_run_dir(out: Path) -> Path | None:
    """The run directory that `out` would sit inside (at any depth), if any: a run's rotation removes whole
    checkpoint folders and a claim may reuse the directory, so nothing exported there is safe. Resolved
    first, so neither `..` nor a symbolic link hides the run directory."""
    for folder in out.resolve().parents:
        # A run directory always has config.toml, and its lock (train/rundir.py LOCK_NAME; models/ does not
        # import train/) or its checkpoints: a lone `.lock` is not enough (pytest's temp folders have one).
        marks = (folder / ".lock").is_file() or (folder / "checkpoints").is_dir()
        if marks and (folder / "config.toml").is_file():
            return folder
    return None


def check_export_target(out_dir: str | Path, overwrite: bool) -> None:
    """CheckpointError (one line) unless `out_dir` may receive an export; changes nothing on disk.

    Allowed: a path that does not exist yet (under a writable folder), an empty folder, and, with
    `overwrite`, a folder holding an earlier tracetrain export and nothing else.
    """
    out = Path(os.path.abspath(out_dir))  # `--hf .` or `x/..`: the folder by its own name
    if out.is_symlink():
        raise CheckpointError(f"export folder {out} is a symbolic link; name a real folder")
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"export folder {out} is an existing file, not a folder; name a new or empty folder")
    if out.parent.name == "checkpoints":
        raise CheckpointError(f"export folder {out} would sit among a run's checkpoints; export elsewhere")
    if out.is_dir() and any(out.iterdir()):
        kind = _kind_of_folder(out)
        if kind is not None:
            raise CheckpointError(f"export folder {out} is {kind}; exports never replace one, name a new folder")
        foreign = _earlier_export_foreign(out)
        if foreign is not None:
            raise CheckpointError(
                f"export folder {out} exists and is not empty ({foreign}); name a new or empty "
                f"folder (--overwrite replaces only an earlier tracetrain export)"
            )
        if not overwrite:
            raise CheckpointError(
                f"export folder {out} holds an earlier tracetrain export; pass --overwrite to replace it"
            )
    run_dir = _enclosing_run_dir(out)
    if run_dir is not None:
        raise CheckpointError(
            f"export folder {out} is inside the run directory {run_dir}, whose checkpoint rotation and "
            "resume may delete it; export to a folder outside any run directory"
        )
    base = _nearest_existing(out.parent)
    if not base.is_dir():
        raise CheckpointError(f"cannot export to {out}: {base} is a file, not a folder")
    if not os.access(base, os.W_OK | os.X_OK):
        raise CheckpointError(f"cannot export to {out}: {base} is not writable")


def _set_normal_modes(root: Path) -> None:
    """Files 0666 and folders 0777, less the umask: safetensors writes its files 0600, and a model folder
    is meant to be shared (read by a serving user, copied, uploaded). os.umask can only be read by setting it."""
    umask = os.umask(0o022)
    os.umask(umask)
    for path in [root, *root.rglob("*")]:
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


def _list_files(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


@contextlib.contextmanager
def export_folder(
    out_dir: Path, kind: Literal["hf", "peft"], overwrite: bool, source_checkpoint: Path | None = None
) -> Iterator[Path]:
    """Yield a new temporary sibling of `out_dir` to fill; on success write the manifest and rename it into
    place (an earlier export is renamed aside first and deleted after); on error remove it.

    `out_dir` is checked first (`check_export_target`); a failed write (read-only place, full disk) is a
    one-line CheckpointError. Folders get mode 0777 and files 0666, less the umask, as any other tool's.
    """
    out_dir = Path(os.path.abspath(out_dir))  # `--hf .`: a sibling needs the folder's own name
    check_export_target(out_dir, overwrite)
    token = f"{os.getpid()}-{secrets.token_hex(4)}"
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{token}")
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
    except OSError as e:
        raise CheckpointError(f"cannot export to {out_dir}: {e.strerror} ({e.filename})") from None
    try:
        yield tmp
        manifest = {
            "tracetrain_export": kind,
            "tracetrain_version": __version__,
            "source_checkpoint": str(source_checkpoint.resolve()) if source_checkpoint else None,
            "files": _list_files(tmp),
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        _set_normal_modes(tmp)
        aside = out_dir.with_name(f".{out_dir.name}.old-{token}")
        if out_dir.exists():  # empty, or an earlier export (checked above)
            out_dir.rename(aside)
        tmp.rename(out_dir)
        shutil.rmtree(aside, ignore_errors=True)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"cannot write the export to {out_dir}: {e.strerror} ({e.filename})") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# ----------------------------------------------------------------------------------------------------
# Options


# ---------------------------------------------------------------------------------------------------
# A model as a Hugging Face folder or a PEFT adapter (the Python API; `tracetrain export` is below)


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
    the tokenizer, generation config and model card) is `export_run_hf`.
    """
    with export_folder(Path(out_dir), "hf", overwrite) as tmp:
        config = hf_config_dict(args, dtype, bos_token_id, eos_token_id, pad_token_id)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        write_hf_weights(model, args, tmp, dtype, max_shard_bytes)


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
    if not lora_state_dict(model):  # checked before any folder is touched
        raise ValueError("model has no LoRA adapters to export; apply_lora first")
    check_adapter_args(model, rank, targets)
    with export_folder(Path(out_dir), "peft", overwrite) as tmp:
        write_peft_adapter(model, tmp, rank, alpha, dropout, targets, base_model_name_or_path)


def parse_size(text: str) -> int:
    """'5GB' -> 5 * 10**9 bytes ('KB'/'MB'/'GB' decimal, 'KiB'/'MiB'/'GiB' binary, a bare number = bytes)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    unit = m.group(2).upper() if m else ""
    if m is None or unit not in _SIZE_UNITS or float(m.group(1)) <= 0:
        raise ConfigError(f"--max-shard-size {text!r}: expected a positive size like 5GB, 500MB or 2GiB")
    return int(float(m.group(1)) * _SIZE_UNITS[unit])


def _stored_dtype(file: Path) -> torch.dtype | None:
    """The dtype of the first floating-point weight (not a LoRA adapter) of a safetensors file, read from
    its header."""
    with open_safetensors(file) as f:
        for key in f.keys():  # noqa: SIM118 (safe_open has keys(), no iteration)
            dtype = _STORED_DTYPES.get(f.get_slice(key).get_dtype())
            if dtype is not None and not is_lora_key(key):
                return dtype
    return None


def run_weights_dtype(loaded: Any) -> tuple[torch.dtype, str]:
    """`--dtype auto`: the dtype the run's weights are stored in, and where it was read (module docstring)."""
    cfg, ckpt = loaded.cfg, loaded.checkpoint
    if loaded.spec.adapters_only:  # the checkpoint holds adapters; the base comes from model.init_from
        if loaded.spec.asked("lora.base_dtype") and loaded.spec.lora_base_dtype is not None:
            return loaded.spec.lora_base_dtype, "lora.base_dtype"
        base = Path(cfg.model.init_from)
        first = sorted(set(checkpoint_files(base).values()))[0]
        dtype = _stored_dtype(base / first)
        where = f"the frozen base's files ({base})"
    elif (ckpt / "model.safetensors").is_file():
        dtype, where = _stored_dtype(ckpt / "model.safetensors"), "the checkpoint's weights"
    else:  # a sharded (DCP) checkpoint, gathered into the rebuilt model in the dtype it was saved from
        dtype, where = next(p.dtype for p in loaded.model.parameters() if p.is_floating_point()), "the checkpoint"
    if dtype is None or dtype not in EXPORT_DTYPES.values():
        return torch.float32, f"{where} hold {dtype}; fp32 keeps every value"
    return dtype, where


# ----------------------------------------------------------------------------------------------------
# Token ids, generation config, tokenizer files, model card


def _base_json(init_from: str, name: str) -> dict[str, Any]:
    path = Path(init_from) / name if init_from else None
    return read_json(path) if path is not None and path.is_file() else {}


def _ids(value: Any) -> list[int]:
    return [value] if isinstance(value, int) else [v for v in value if isinstance(v, int)] if value else []


def special_token_ids(tok: Any, init_from: str = "") -> dict[str, Any]:
    """{"bos_token_id", "eos_token_id", "pad_token_id"} for config.json and generation_config.json.

    eos: the base checkpoint's (generation_config.json, else config.json) followed by every stop id of the
    tokenizer not already there; one id is written as an int, several as a list (transformers stops at
    any). bos and pad: the base config's when set, else the tokenizer's.
    """
    base_cfg, base_gen = _base_json(init_from, "config.json"), _base_json(init_from, "generation_config.json")
    eos = _ids(base_gen.get("eos_token_id")) or _ids(base_cfg.get("eos_token_id"))
    for i in (tok.eos_id, *tok.stop_ids):
        if i not in eos:
            eos.append(i)
    bos = base_cfg.get("bos_token_id")
    pad = base_cfg.get("pad_token_id")
    return {
        "bos_token_id": tok.bos_id if bos is None else bos,
        "eos_token_id": eos[0] if len(eos) == 1 else eos,
        "pad_token_id": tok.pad_id if pad is None else pad,
    }


def generation_config_dict(tok: Any, init_from: str = "") -> dict[str, Any]:
    """The base checkpoint's generation_config.json (sampling defaults kept) with our token ids, else ids only."""
    gen = _base_json(init_from, "generation_config.json")
    gen.update(special_token_ids(tok, init_from))
    return gen


def write_tokenizer_files(tok: Any, chat_template: str | None, out_dir: Path) -> list[str]:
    """Tokenizer files with the run's chat template into `out_dir`; returns notes for the user."""
    if not tok.has_hf_form:
        return [
            f"note: the {tok.name} tokenizer has no Hugging Face form; no tokenizer files were written "
            f"(ids: bos {tok.bos_id}, eos {tok.eos_id}, pad {tok.pad_id})"
        ]
    tok.save_hf_files(out_dir, chat_template)
    return []


def _tokenizer_note(tok: Any) -> str:
    return f"`{tok.name}`" if tok.has_hf_form else f"{tok.name} (no Hugging Face form; none written)"


def _checkpoint_step(ckpt: Path) -> int | None:
    m = re.fullmatch(r"step_(\d+)", ckpt.name)
    return int(m.group(1)) if m else None


def _held_out_loss(ckpt: Path) -> str:
    """The run's final held-out loss from summary.json, said to be at this checkpoint only when it is."""
    run_dir = ckpt.parent.parent if ckpt.parent.name == "checkpoints" else None
    summary_path = run_dir / "summary.json" if run_dir else None
    if summary_path is None or not summary_path.is_file():
        return "not recorded (no summary.json)"
    summary = read_json(summary_path)
    if "eval_loss" not in summary:
        return "not recorded in summary.json"
    at_this = Path(str(summary.get("checkpoint", ""))).name == ckpt.name
    where = "at this checkpoint" if at_this else f"at the run's end ({summary.get('checkpoint', '?')})"
    return f"{summary['eval_loss']:.4f} {where}"


def model_card(cfg: Any, ckpt: Path, dtype: torch.dtype, kind: str, tokenizer_note: str) -> str:
    """A short README.md: what the export is, where it came from and how it was trained."""
    base = (
        f"`{Path(cfg.model.init_from).resolve()}`"
        if cfg.model.init_from
        else f"none (trained from random init, preset `{cfg.model.preset}`)"
    )
    data = f"{cfg.data.kind}" + (f", `{cfg.data.path}`" if cfg.data.path else "")
    step = _checkpoint_step(ckpt)
    rows = [
        ("Base model", base),
        ("Training", f"{cfg.train.mode}, {cfg.train.steps} steps configured"),
        ("Data", data),
        ("Tokenizer", tokenizer_note),
        ("Checkpoint step", str(step) if step else "?"),
        ("Final held-out loss", _held_out_loss(ckpt)),
        ("Weights", f"{str(dtype).removeprefix('torch.')}"),
    ]
    load = (
        "AutoModelForCausalLM.from_pretrained(path)"
        if kind == "hf"
        else "PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), path)"
    )
    table = "\n".join(f"| {k} | {v} |" for k, v in rows)
    return (
        f"---\nlibrary_name: {'transformers' if kind == 'hf' else 'peft'}\ntags: [tracetrain]\n---\n\n"
        f"# {ckpt.parent.parent.name if ckpt.parent.name == 'checkpoints' else ckpt.name}\n\n"
        f"Exported by tracetrain {__version__} from checkpoint `{ckpt.resolve()}`.\n\n"
        f"| | |\n|---|---|\n{table}\n\nLoad with `{load}`; `generation_config.json` lists the stop ids.\n"
    )


# ----------------------------------------------------------------------------------------------------
# Whole runs


def export_run_hf(
    loaded: Any,
    out_dir: str | Path,
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
    max_shard_bytes: int = 5 * 10**9,
    progress: Progress | None = None,
    *,
    chat_template: str | None,
    args: ModelArgs | None = None,
    write_weights: Callable[[Path, torch.dtype], None] | None = None,
) -> list[str]:
    """A trained run (`inference.load_trained`) as a transformers checkpoint folder, adapters merged.

    `dtype` None: the run's weights dtype (`run_weights_dtype`). Returns notes for the user (the dtype
    chosen for it; no tokenizer files for the byte tokenizer). `progress` hears the weight bytes written
    (tracetrain/progress.py). `args` and `write_weights(folder, dtype)` replace the loaded model when there
    is none: a sharded checkpoint is streamed tensor by tensor instead (train/sharded_export.py).
    """
    cfg, tok, model = loaded.cfg, loaded.tokenizer, loaded.model
    args = args or model.args
    notes = []
    if dtype is None:
        dtype, where = run_weights_dtype(loaded)
        name = str(dtype).removeprefix("torch.")
        notes.append(f"weights: {name}, as the run stores them ({where}); --dtype bf16/fp16/fp32 converts")
    ids = special_token_ids(tok, cfg.model.init_from)
    with export_folder(Path(out_dir), "hf", overwrite, loaded.checkpoint) as tmp:
        (tmp / "config.json").write_text(json.dumps(hf_config_dict(args, dtype, **ids), indent=2))
        gen = generation_config_dict(tok, cfg.model.init_from)
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2))
        notes += write_tokenizer_files(tok, chat_template, tmp)
        if write_weights is not None:
            write_weights(tmp, dtype)
        else:
            write_hf_weights(model, args, tmp, dtype, max_shard_bytes, progress)
        (tmp / "README.md").write_text(model_card(cfg, loaded.checkpoint, dtype, "hf", _tokenizer_note(tok)))
    return notes


def export_run_peft(
    loaded: Any, out_dir: str | Path, overwrite: bool = False, *, chat_template: str | None
) -> list[str]:
    """A LoRA run's adapters as a PEFT adapter folder with the tokenizer files (`chat_template`: the run's,
    data/chat.py `resolve_chat_template`); returns notes for the user."""
    cfg, tok, lc = loaded.cfg, loaded.tokenizer, loaded.cfg.lora
    base = str(Path(cfg.model.init_from).resolve()) if cfg.model.init_from else ""
    notes = (
        []
        if base
        else [
            "note: the run has no base checkpoint (model.init_from is empty), so the adapter "
            "names none; PEFT needs the base weights: --hf exports a merged model instead"
        ]
    )
    with export_folder(Path(out_dir), "peft", overwrite, loaded.checkpoint) as tmp:
        write_peft_adapter(loaded.model, tmp, lc.rank, lc.alpha, lc.dropout, lc.targets, base)
        notes += write_tokenizer_files(tok, chat_template, tmp)
        dtype = next(iter(lora_state_dict(loaded.model).values())).dtype
        (tmp / "README.md").write_text(model_card(cfg, loaded.checkpoint, dtype, "peft", _tokenizer_note(tok)))
    return notes
