"""The Python API: what `tracetrain train` does, as a call.

    import tracetrain

    rows = [{"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}, ...]
    result = tracetrain.train("configs/chat-lora.toml", data=rows, overrides=["--train.steps=50"],
                              callbacks=[PrintLoss()])
    result.model, result.tokenizer, result.run_dir, result.summary

A config is a TOML path, a `Config` (frozen; change it with `cfg.replace({"optim.lr": 1e-4})`), or a
dict in the TOML layout; whichever it is, it is validated exactly as the command line validates it.
`data` / `eval_data` are rows in the shape `data.kind` reads from a file (chat: `messages` or ShareGPT
`conversations`; instruction: the instruction/context/response fields; text: the text field). They are
written once to `<train.output_dir>/datasets/<kind>-<sha256>.jsonl` (named by their content, never
overwritten) and the run's config points at that file, so the run can be resumed and reproduced from
its own config.toml like any other.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tracetrain.config import Config, apply_overrides, from_dict, to_dict
from tracetrain.config_toml import read_toml
from tracetrain.errors import ConfigError
from tracetrain.models.build import model_args_from_config
from tracetrain.train.loop import TrainResult
from tracetrain.validate import validate_run


def train(
    config: Config | str | Path | Mapping[str, Any] | None = None,
    *,
    data: Iterable[Mapping[str, Any]] | None = None,
    eval_data: Iterable[Mapping[str, Any]] | None = None,
    callbacks: Sequence[Any] = (),
    overrides: Sequence[str] = (),
    run_name: str | None = None,
) -> TrainResult:
    """Train as `tracetrain train` would and return the result with the trained model.

    `callbacks`: objects with any of `on_step(step, metrics)`, `on_eval(step, metrics)`,
    `on_save(step, path)` (see `tracetrain.train.loop.Callbacks`). `overrides`: dotted command-line style
    overrides (`--optim.lr=1e-4`) applied on top of `config`. Errors in the config or the rows raise
    `tracetrain.errors.ConfigError` naming the key or row.
    """
    from tracetrain.train.loop import train as run_training

    if isinstance(callbacks, (str, bytes)) or not isinstance(callbacks, Iterable):
        raise ConfigError(f"callbacks must be a list of callback objects, not {type(callbacks).__name__}")
    if isinstance(overrides, (str, bytes)) or not isinstance(overrides, Iterable):
        raise ConfigError(f"overrides must be a list of '--section.key=value' strings, not {type(overrides).__name__}")
    raw, where = _raw(config, list(overrides) + ([f"--train.run_name={run_name}"] if run_name else []))
    defaults = Config()
    kind = raw.get("data", {}).get("kind", defaults.data.kind)
    files: list[tuple[Path, str]] = []  # (path, text) of the rows, written once the config is known good
    for arg, key, rows in (("data", "data.path", data), ("eval_data", "data.eval_path", eval_data)):
        if rows is None:
            continue
        if kind == "synthetic":
            raise ConfigError(
                f"{arg}= rows were given but config key 'data.kind' is 'synthetic'; "
                "set it to 'chat', 'instruction' or 'text'"
            )
        folder = Path(raw.get("train", {}).get("output_dir", defaults.train.output_dir)) / "datasets"
        path, text = rows_file(rows, folder, kind, key, arg)
        raw.setdefault("data", {})[key.split(".")[1]] = str(path)
        files.append((path, text))
    # Validated whatever its origin: a Config built or changed in Python gets the command line's checks,
    # before the rows are written (a refused config leaves nothing behind).
    cfg = from_dict(raw, where)
    validate_run(cfg, model_args_from_config(cfg))
    for path, text in files:
        write_once(path, text)
    return run_training(cfg, callbacks=callbacks)


def _raw(
    config: Config | str | Path | Mapping[str, Any] | None, overrides: list[str]
) -> tuple[dict[str, dict[str, Any]], str]:
    """The config as nested dicts (TOML layout) with the overrides applied, not yet validated."""
    where = ""
    if config is None:
        raw: dict[str, dict[str, Any]] = {}
    elif isinstance(config, (str, Path)):
        where = f"{config}: "
        raw = read_toml(Path(config))
    elif isinstance(config, Config):
        raw = {name: {k: v for k, v in values.items() if v is not None} for name, values in to_dict(config).items()}
    elif isinstance(config, Mapping):
        raw = {}
        for k, v in config.items():
            if not isinstance(v, Mapping):
                raise ConfigError(f"config section {k!r} must be a dict of keys, got {type(v).__name__} {v!r:.60}")
            raw[k] = dict(v)
    else:
        raise ConfigError(
            f"config must be a Config, a TOML file path, a dict of sections or None, not {type(config).__name__}"
        )
    apply_overrides(raw, overrides)
    return raw, where


def rows_file(
    rows: Iterable[Mapping[str, Any]], folder: Path, kind: str, key: str, arg: str = "data"
) -> tuple[Path, str]:
    """The rows as JSONL text, and the file in `folder` that holds them (named by kind and content).
    `arg` is the parameter they came in (data, eval_data), `key` the config key they stand for."""
    if isinstance(rows, (str, bytes, Path, Mapping)) or not isinstance(rows, Iterable):
        raise ConfigError(
            f"{arg}= takes rows (a list of dicts of fields), not a {type(rows).__name__}; "
            f"a data file goes in config key '{key}'"
        )
    lines = []
    for i, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise ConfigError(f"{key}: row {i} is a {type(row).__name__}, not a dict of fields")
        try:
            lines.append(json.dumps(dict(row), ensure_ascii=False, sort_keys=True))
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{key}: row {i} cannot be written as JSON ({e})") from None
    if not lines:
        raise ConfigError(f"{key}: no rows were given")
    text = "\n".join(lines) + "\n"
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]
    return folder / f"{kind}-{digest}.jsonl", text


def write_once(path: Path, text: str) -> None:
    """`text` at `path`, written atomically unless the file already holds it."""
    if path.is_file() and path.read_text(encoding="utf-8") == text:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{os.getpid()}.tmp"
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def write_rows(rows: Iterable[Mapping[str, Any]], folder: Path, kind: str, key: str) -> Path:
    """The rows as JSONL in `folder`, named by kind and content (written atomically, once)."""
    path, text = rows_file(rows, folder, kind, key)
    write_once(path, text)
    return path
