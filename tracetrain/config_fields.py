"""The checks of one config value: its type, its choices (a `Literal`), its numeric range, the tables of a
`[[section.key]]` list, and the hint for a key that does not exist.

`tracetrain.config` runs them for every key it loads; they know no section by name, only the field and
the dataclass (section or table) that declares it, so this module imports nothing of the config tree.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from typing import Any, Literal

from tracetrain.errors import ConfigError


def _allowed_types(tp: Any) -> tuple[tuple[type, ...], bool]:
    """Python types a TOML value may have for annotation `tp`, and whether None is allowed."""
    optional = False
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        optional = len(args) < len(typing.get_args(tp))
        tp = args[0]
    if typing.get_origin(tp) is list:
        return (list,), optional
    if typing.get_origin(tp) is Literal:
        return (str,), optional
    return {int: (int,), float: (int, float), bool: (bool,), str: (str,)}[tp], optional


def field_choices(section: type, name: str) -> tuple[str, ...]:
    """The values a `Literal`-typed config field allows (empty for free-form fields)."""
    tp = typing.get_type_hints(section)[name]
    return typing.get_args(tp) if typing.get_origin(tp) is Literal else ()


def _describe(tp: Any) -> str:
    kinds, optional = _allowed_types(tp)
    names = {int: "an integer", float: "a number", bool: "true or false", str: "a string", list: "a list"}
    return names[kinds[-1]] + (" (or omitted)" if optional else "")


def table_type(tp: Any) -> type | None:
    """The dataclass a `list[Table]` field holds (TOML `[[section.key]]` tables), else None."""
    if typing.get_origin(tp) is list:
        (arg,) = typing.get_args(tp)
        if dataclasses.is_dataclass(arg):
            return arg  # type: ignore[return-value]  # a dataclass type, not an instance
    return None


def _check_tables(key: str, table: type, value: Any) -> list[Any]:
    """A list of tables -> a list of `table` instances, each key checked as a field is (errors name `key[i].name`)."""
    fields = {f.name: f for f in dataclasses.fields(table)}
    if not isinstance(value, list) or not all(isinstance(v, dict | table) for v in value):
        raise ConfigError(
            f"config key '{key}': {value!r} is not a list of tables ([[{key}]] entries with {', '.join(fields)})"
        )
    out = []
    for i, entry in enumerate(value):
        items = entry if isinstance(entry, dict) else dataclasses.asdict(entry)
        checked = {}
        for name, v in items.items():
            if name not in fields:
                raise ConfigError(f"unknown config key '{key}[{i}].{name}'; allowed: {', '.join(fields)}")
            checked[name] = check_value(f"{key}[{i}].{name}", fields[name], v, table)
        out.append(table(**checked))
    return out


def check_value(key: str, f: dataclasses.Field, value: Any, owner: type) -> Any:
    """`value` for field `f` of section (or table) class `owner`, checked against its type, choices and range
    (an int given for a float becomes a float); a ConfigError naming `key` otherwise."""
    tp = typing.get_type_hints(owner)[f.name]
    if (table := table_type(tp)) is not None:
        return _check_tables(key, table, value)
    kinds, optional = _allowed_types(tp)
    if value is None and optional:
        return None
    if list in kinds and isinstance(value, str):
        # --lora.targets=all-linear, --lora.targets=q_proj,v_proj: a word or comma-separated words.
        value = [v.strip() for v in value.split(",") if v.strip()]
    choices = typing.get_args(tp) if typing.get_origin(tp) is Literal else ()
    if choices and not isinstance(value, str):  # e.g. true for an "auto" / "on" / "off" switch
        allowed = ", ".join(repr(c) for c in choices)
        raise ConfigError(f"config key '{key}': {value!r} is not allowed; choose one of {allowed}")
    # bool is a subclass of int: reject true/false where a number is expected.
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise ConfigError(f"config key '{key}': {value!r} is not {_describe(tp)}")
    if float in kinds:
        value = float(value)  # type: ignore[arg-type]  # an int or float: checked by isinstance above
        # TOML spells inf and nan, and 1e400 overflows to inf: no float setting means anything there.
        if not math.isfinite(value):
            raise ConfigError(f"config key '{key}': {value!r} is not a finite number")
    if list in kinds and not all(isinstance(v, str) for v in value):
        raise ConfigError(f"config key '{key}': {value!r} must be a list of strings")
    meta = f.metadata
    if choices and value not in choices:
        allowed = ", ".join(repr(c) for c in choices)
        raise ConfigError(f"config key '{key}': {value!r} is not allowed; choose one of {allowed}")
    for bound, ok, word in (
        ("ge", lambda v, b: v >= b, ">="),
        ("gt", lambda v, b: v > b, ">"),
        ("le", lambda v, b: v <= b, "<="),
    ):
        if meta.get(bound) is not None and not ok(value, meta[bound]):
            raise ConfigError(f"config key '{key}': {value!r} is out of range; it must be {word} {meta[bound]}")
    return value


def check_device_spec(spec: str, key: str = "config key 'train.device'") -> None:
    """The one rule for device names: 'auto', 'cpu', 'cuda' or 'cuda:N' (`key` names the setting in errors)."""
    if not (spec in ("auto", "cpu", "cuda") or (spec.startswith("cuda:") and spec[5:].isdigit())):
        raise ConfigError(f"{key}: {spec!r} is not allowed; use 'auto', 'cpu', 'cuda' or 'cuda:N'")


# What other tools (Hugging Face Trainer, PEFT, torchtitan) call some keys: `--optim.learning_rate` is met
# with "did you mean 'optim.lr'?".
ALIASES = {
    "learning_rate": "optim.lr",
    "max_steps": "train.steps",
    "num_train_steps": "train.steps",
    "batch_size": "train.micro_batch_size",
    "per_device_train_batch_size": "train.micro_batch_size",
    "local_batch_size": "train.micro_batch_size",
    "gradient_accumulation_steps": "train.grad_accum_steps",
    "max_seq_length": "data.seq_len",
    "max_length": "data.seq_len",
    "seq_length": "data.seq_len",
    "r": "lora.rank",
    "lora_r": "lora.rank",
    "lora_alpha": "lora.alpha",
    "lora_dropout": "lora.dropout",
    "target_modules": "lora.targets",
    "model_name_or_path": "model.init_from",
    "gradient_checkpointing": "memory.recompute",
    "activation_checkpointing": "memory.recompute",
    "dataloader_num_workers": "data.num_workers",
    "bf16": "train.precision",
    "fp16": "train.precision",
    "mixed_precision": "train.precision",
    "warmup": "optim.warmup_steps",
    "lr_scheduler_type": "optim.schedule",
}


def key_hint(name: str, keys: list[str]) -> str | None:
    """The key of `keys` (every `section.key`) meant by an unknown `section.key`: an alias of its last
    component, a close match of that component in any section, or a close match of the whole name."""
    last = name.rsplit(".", 1)[-1]
    if last in ALIASES and ALIASES[last] in keys:
        return ALIASES[last]
    by_last: dict[str, str] = {}
    for key in keys:
        by_last.setdefault(key.rsplit(".", 1)[-1], key)
    same = [k for k in keys if k.rsplit(".", 1)[-1] == last]
    if same:
        return same[0]
    close = difflib.get_close_matches(last, list(by_last), n=1, cutoff=0.75)
    if close:
        return by_last[close[0]]
    whole = difflib.get_close_matches(name, keys, n=1)
    return whole[0] if whole else None
