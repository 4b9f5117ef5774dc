"""The typed config tree: one dataclass per section, loaded from TOML plus dotted CLI overrides.

Every field has a default and a one-line doc (`metadata["doc"]`), and a `Literal` type of choices or a numeric
range. Validation happens once, in `load_config`, and a bad value raises `ConfigError` naming the key,
the value and what is allowed. The resolved tree is written to the run directory with `to_toml`, so a
run can be reproduced (and resumed) from its own `config.toml`.

The sections themselves are declared in `config_sections.py`; this module is where they are imported from
(`from tracetrain.config import DataSection`), next to the `Config` that holds them.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import stat
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from tracetrain.config_sections import (
    CheckpointSection,
    DataSection,
    LoggingSection,
    LoraSection,
    MemorySection,
    ModelSection,
    OptimSection,
    ParallelSection,
    PreferenceSection,
    ProfileSection,
    TrainSection,
)
from tracetrain.errors import ConfigError


@dataclass(frozen=True)
class Config:
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection = field(default_factory=TrainSection)
    optim: OptimSection = field(default_factory=OptimSection)
    lora: LoraSection = field(default_factory=LoraSection)
    preference: PreferenceSection = field(default_factory=PreferenceSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
    memory: MemorySection = field(default_factory=MemorySection)
    profile: ProfileSection = field(default_factory=ProfileSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)

    def replace(self, changes: dict[str, Any]) -> Config:
        """A validated copy with dotted keys changed: `cfg.replace({"optim.lr": 1e-4, "train.steps": 100})`.
        Every check of `load_config` runs again (field values and cross-field rules)."""
        raw: dict[str, dict[str, Any]] = {
            name: {k: v for k, v in values.items() if v is not None} for name, values in to_dict(self).items()
        }
        for key, value in changes.items():
            section, dot, name = key.partition(".")
            if not dot:
                raise ConfigError(f"config key {key!r}: use the dotted form section.key (e.g. 'optim.lr')")
            raw.setdefault(section, {})[name] = value
        return from_dict(raw)


# ----------------------------------------------------------------------------------------------------
# Loading and validation


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
            checked[name] = _check_value(f"{key}[{i}].{name}", fields[name], v, table)
        out.append(table(**checked))
    return out


def _check_value(key: str, f: dataclasses.Field, value: Any, owner: type | None = None) -> Any:
    tp = typing.get_type_hints(owner or _SECTION_OWNER[key.split(".")[0]])[f.name]
    if (table := table_type(tp)) is not None:
        return _check_tables(key, table, value)
    kinds, optional = _allowed_types(tp)
    if value is None and optional:
        return None
    if list in kinds and isinstance(value, str):
        # --lora.targets=all-linear, --lora.targets=q_proj,v_proj: a word or comma-separated words.
        value = [v.strip() for v in value.split(",") if v.strip()]
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
    choices = typing.get_args(tp) if typing.get_origin(tp) is Literal else ()
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


_SECTION_OWNER: dict[str, type] = {f.name: f.default_factory for f in dataclasses.fields(Config)}  # type: ignore[misc]  # every Config field is a section built by its default_factory (a class), never MISSING


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


def _all_keys() -> list[str]:
    return [f"{name}.{f.name}" for name, owner in _SECTION_OWNER.items() for f in dataclasses.fields(owner)]


def _key_hint(name: str) -> str | None:
    """The key meant by an unknown `section.key`: an alias of its last component, a close match of that
    component in any section, or a close match of the whole name."""
    last = name.rsplit(".", 1)[-1]
    keys = _all_keys()
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


def _unknown(kind: str, name: str, known: list[str], where: str) -> ConfigError:
    hint = [h] if kind == "config key" and (h := _key_hint(name)) else difflib.get_close_matches(name, known, n=1)
    suggestion = f" (did you mean '{hint[0]}'?)" if hint else f"; known: {', '.join(sorted(known))}"
    return ConfigError(f"{where}unknown {kind} '{name}'{suggestion}")


def from_dict(raw: dict[str, Any], where: str = "") -> Config:
    """Build and validate a Config from nested dicts (TOML layout). `where` prefixes error messages."""
    sections: dict[str, Any] = {}
    for section_name, values in raw.items():
        if section_name not in _SECTION_OWNER:
            raise _unknown("config section", section_name, list(_SECTION_OWNER), where)
        if not isinstance(values, dict):
            raise ConfigError(f"{where}config section '{section_name}' must be a table, got {values!r}")
        owner = _SECTION_OWNER[section_name]
        fields = {f.name: f for f in dataclasses.fields(owner)}
        checked = {}
        for key, value in values.items():
            if key not in fields:
                raise _unknown("config key", f"{section_name}.{key}", [f"{section_name}.{k}" for k in fields], where)
            try:
                checked[key] = _check_value(f"{section_name}.{key}", fields[key], value)
            except ConfigError as e:
                raise ConfigError(f"{where}{e}") from None
        sections[section_name] = owner(**checked)
    cfg = Config(**sections)
    _check_cross_fields(cfg, where)
    return cfg


def check_device_spec(spec: str, key: str = "config key 'train.device'") -> None:
    """The one rule for device names: 'auto', 'cpu', 'cuda' or 'cuda:N' (`key` names the setting in errors)."""
    if not (spec in ("auto", "cpu", "cuda") or (spec.startswith("cuda:") and spec[5:].isdigit())):
        raise ConfigError(f"{key}: {spec!r} is not allowed; use 'auto', 'cpu', 'cuda' or 'cuda:N'")


# optim.warmup_steps unset: this share of the run's steps, at most WARMUP_MAX_STEPS steps.
WARMUP_MAX_STEPS = 50
WARMUP_SHARE = 0.1


def resolve_warmup(optim: OptimSection, total_steps: int) -> int:
    """The run's warm-up steps: optim.warmup_steps when set, else min(50, 10% of `total_steps`), which is
    always shorter than the run. The one rule; the scheduler and the start-up note both read it."""
    if optim.warmup_steps is not None:
        return optim.warmup_steps
    return min(WARMUP_MAX_STEPS, int(total_steps * WARMUP_SHARE))


def describe_warmup(optim: OptimSection, total_steps: int) -> str | None:
    """The start-up line for a warm-up the user did not set (None when set: they know it)."""
    if optim.warmup_steps is not None:
        return None
    steps = resolve_warmup(optim, total_steps)
    share = f"{WARMUP_SHARE:.0%} of {total_steps}"
    rule = share if steps < WARMUP_MAX_STEPS else f"{share}, at most {WARMUP_MAX_STEPS}"
    return f"warm-up: {steps} step{'s' if steps != 1 else ''} ({rule}; optim.warmup_steps not set)"


def check_warmup(optim: OptimSection, total_steps: int, where: str = "", source: str = "train.steps") -> None:
    """A warm-up the user set must end before the run does: else the learning rate never reaches optim.lr
    and never decays. An unset one adapts to the run (`resolve_warmup`) and is never refused.

    `total_steps` is the run's resolved number of optimizer steps: train.steps, or the count derived from
    train.epochs once the data is built (that caller passes it, and `source` = e.g. "train.epochs = 2").
    """
    if optim.warmup_steps is not None and optim.warmup_steps >= total_steps:
        raise ConfigError(
            f"{where}config key 'optim.warmup_steps': {optim.warmup_steps} is not shorter than the "
            f"run ({total_steps} steps from {source}); set it below {total_steps} "
            f"(e.g. --optim.warmup_steps={total_steps // 10})"
        )


def _check_data_path_used(data: DataSection, where: str) -> None:
    """Synthetic data reads no file: a data path given with it would be silently ignored."""
    if data.kind != "synthetic":
        return
    for key in ("path", "eval_path"):
        if getattr(data, key):
            # Listed from the field's own choices, so a new data kind needs no edit here.
            kinds = [k for k in field_choices(DataSection, "kind") if k != "synthetic"]
            raise ConfigError(
                f"{where}config key 'data.{key}': {getattr(data, key)!r} is ignored with "
                f"data.kind = 'synthetic'; set data.kind to one of {', '.join(kinds)}"
            )


def _check_sources(data: DataSection, where: str) -> None:
    """`[[data.sources]]` replaces data.path: the settings that would be silently ignored are refused."""
    if not data.sources:
        return
    for key, value, why in (
        ("data.path", data.path, "set data.path or [[data.sources]], not both"),
        ("data.eval_path", data.eval_path, "each source holds out data.eval_fraction instead"),
    ):
        if value:
            raise ConfigError(f"{where}config key '{key}': {value!r} is not used with data.sources; {why}")
    if data.kind not in ("instruction", "chat"):
        raise ConfigError(
            f"{where}config key 'data.kind': {data.kind!r} cannot be mixed from data.sources; use 'instruction' "
            "or 'chat' (the kind of sources that do not set their own)"
        )
    if data.tokenize == "on_the_fly":
        raise ConfigError(f"{where}config key 'data.tokenize': 'on_the_fly' is not supported with data.sources")
    for i, source in enumerate(data.sources):
        if not source.path:
            raise ConfigError(f"{where}config key 'data.sources[{i}].path' is required (a data file or hf:NAME)")
        if source.format and (source.kind or data.kind) != "instruction":
            raise ConfigError(
                f"{where}config key 'data.sources[{i}].format': {source.format!r} is for instruction sources; "
                "this one is chat"
            )


def _field(section: type, name: str) -> dataclasses.Field:
    return next(f for f in dataclasses.fields(section) if f.name == name)


def _check_cross_fields(cfg: Config, where: str) -> None:
    _check_data_path_used(cfg.data, where)
    if cfg.train.epochs and cfg.train.steps != TrainSection.steps:  # steps left at its default: epochs decides
        raise ConfigError(
            f"{where}config keys 'train.steps' ({cfg.train.steps}) and 'train.epochs' "
            f"({cfg.train.epochs}) are both set; set one (epochs sizes the run from the data)"
        )
    _check_sources(cfg.data, where)
    kinds = {s.kind or cfg.data.kind for s in cfg.data.sources} or {cfg.data.kind}
    if cfg.data.format != "auto" and "instruction" not in kinds:
        raise ConfigError(
            f"{where}config key 'data.format': {cfg.data.format!r} is for instruction data; it is ignored with "
            f"data.kind = {cfg.data.kind!r} (chat rows are recognised by their messages or conversations field)"
        )
    if cfg.data.kind in ("instruction", "chat", "text", "preference") and not cfg.data.path and not cfg.data.sources:
        raise ConfigError(f"{where}config key 'data.path' is required when data.kind = '{cfg.data.kind}'")
    _check_objective(cfg, where)
    if cfg.data.tokenize == "on_the_fly" and (cfg.data.pack or cfg.data.kind in ("text", "preference")):
        raise ConfigError(
            f"{where}config key 'data.tokenize': 'on_the_fly' needs data.pack = false and "
            "instruction or synthetic data (packing must know every length ahead of time)"
        )
    _check_lora_variants(cfg, where)
    mem = cfg.memory
    if mem.optimizer_offload and (cfg.train.mode == "lora" or cfg.train.precision == "fp16"):
        raise ConfigError(
            f"{where}config key 'memory.optimizer_offload' works with full fine-tuning in bf16 or "
            "fp32 (LoRA optimizer states are tiny; fp16 loss scaling is not supported with it)"
        )
    if mem.optimizer_offload and mem.unified_memory == "optimizer":
        raise ConfigError(
            f"{where}config keys 'memory.optimizer_offload' and memory.unified_memory = 'optimizer' "
            "both place optimizer states; choose one"
        )
    if cfg.data.num_workers == 0 and cfg.data.prefetch_factor != 2:
        raise ConfigError(f"{where}config key 'data.prefetch_factor' needs data.num_workers > 0")
    if cfg.train.attention == "flex" and cfg.train.device == "cpu":
        raise ConfigError(
            f"{where}config key 'train.attention': 'flex' trains on CUDA only (FlexAttention has no "
            "CPU backward); use 'sdpa' or 'auto'"
        )
    check_device_spec(cfg.train.device, f"{where}config key 'train.device'")
    _check_run_name(cfg.train.run_name, where)
    _check_profile(cfg, where)


def _check_objective(cfg: Config, where: str) -> None:
    """Preference objectives need preference pairs, and preference pairs need one of them."""
    objective, kind = cfg.train.objective, cfg.data.kind
    if objective != "sft" and kind != "preference":
        raise ConfigError(
            f"{where}config key 'train.objective': {objective!r} trains on preference pairs, but data.kind = "
            f"{kind!r}; set data.kind = 'preference' (rows with prompt / chosen / rejected)"
        )
    if kind == "preference" and objective == "sft":
        raise ConfigError(
            f"{where}config key 'data.kind': 'preference' pairs need train.objective = 'dpo' or 'simpo' "
            "(with 'sft' the rejected answers would be trained on)"
        )


def _check_lora_variants(cfg: Config, where: str) -> None:
    """QLoRA (lora.base_quant) and DoRA (lora.dora) change the LoRA layers: with full fine-tuning or an FP8
    base there is no such layer, so each combination is refused in one line."""
    lc = cfg.lora
    for key, on in (("lora.base_quant", lc.base_quant != "none"), ("lora.dora", lc.dora)):
        value = repr(lc.base_quant) if key == "lora.base_quant" else "true"
        if on and cfg.train.mode != "lora":
            raise ConfigError(
                f"{where}config key '{key}' = {value} changes the LoRA adapters; train.mode = "
                f"'{cfg.train.mode}' has none: set train.mode = 'lora' or leave {key} at its default"
            )
        if on and cfg.train.fp8 != "none":
            raise ConfigError(
                f"{where}config key '{key}' = {value} does not combine with train.fp8 = '{cfg.train.fp8}' "
                "(FP8 replaces the frozen base's matmul that QLoRA and DoRA read); choose one"
            )


def _check_run_name(name: str, where: str) -> None:
    """One folder inside train.output_dir: a name with '/' or '..' would put the run elsewhere."""
    if name and (len(name.encode()) > 200 or name in (".", "..") or any(c in name for c in "/\\\x00")):
        raise ConfigError(
            f"{where}config key 'train.run_name': {name[:40]!r}{'...' if len(name) > 40 else ''} is not a folder "
            "name (at most 200 bytes, without '/', '\\' or NUL, not '.' or '..')"
        )


def _check_profile(cfg: Config, where: str) -> None:
    """Ranks that name no rank, or a window the run never reaches, would capture nothing and exit 0."""
    bad = [r for r in cfg.profile.ranks if not (r == "all" or (r.isascii() and r.isdigit()))]
    if bad:
        raise ConfigError(
            f"{where}config key 'profile.ranks': {bad[0]!r} is not allowed; give rank numbers as strings "
            "(['0', '1']) or ['all']"
        )
    last = cfg.profile.start_step + cfg.profile.num_steps - 1
    if cfg.profile.enabled and not cfg.train.epochs and last > cfg.train.steps:
        raise ConfigError(
            f"{where}config keys 'profile.start_step' ({cfg.profile.start_step}) and 'profile.num_steps' "
            f"({cfg.profile.num_steps}) end at step {last}, past train.steps ({cfg.train.steps}); nothing "
            "would be captured"
        )


def parse_override(arg: str) -> tuple[str, Any]:
    """'--optim.lr=3e-4' -> ('optim.lr', 0.0003). Values are TOML literals; bare words are strings."""
    body = arg[2:] if arg.startswith("--") else arg
    if "=" not in body or "." not in body.split("=", 1)[0]:
        raise ConfigError(f"override {arg!r} must look like --section.key=value (e.g. --optim.lr=3e-4)")
    key, text = body.split("=", 1)
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text  # a bare word such as --data.path=my.jsonl
    except (RecursionError, ValueError) as e:  # [[[[...]]]] thousands deep; an integer of 5,000 digits
        shown = arg if len(arg) <= 60 else f"{arg[:40]}... ({len(arg):,} characters)"
        raise ConfigError(f"override {shown!r}: {_toml_failure(e)}") from None
    return key, value


# A config is a few kilobytes; reading stops here so that `--config /dev/zero` or a wrong multi-GB file
# is one line, not all the memory.
CONFIG_FILE_LIMIT_BYTES = 4 << 20


def _toml_failure(e: Exception) -> str:
    """The reason tomllib gave up, for the two ways that are not a TOMLDecodeError."""
    if isinstance(e, RecursionError):
        return "arrays or tables nested too deeply to read"
    return f"not readable TOML ({str(e).splitlines()[0]})"


def _read_limited(path: Path) -> bytes:
    """The bytes of a regular file of at most CONFIG_FILE_LIMIT_BYTES (devices, FIFOs and larger files are
    refused: a read of /dev/zero never ends)."""
    try:
        with path.open("rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise ConfigError(f"config file {path} is not a regular file; give a .toml file")
            data = f.read(CONFIG_FILE_LIMIT_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"config file {path}: cannot read it ({e.strerror})") from None
    if len(data) > CONFIG_FILE_LIMIT_BYTES:
        raise ConfigError(
            f"config file {path} is larger than {CONFIG_FILE_LIMIT_BYTES >> 20} MiB; a config is a few KB"
        )
    return data


def _read_toml(path: Path) -> dict[str, Any]:
    """The tables of a TOML config file; every way reading it can fail is one ConfigError naming the file."""
    if path.is_dir():
        raise ConfigError(f"config file {path} is a directory; give a .toml file")
    if not path.exists():
        raise ConfigError(f"config file {path} does not exist")
    data = _read_limited(path)
    try:
        text = data.decode("utf-8")  # TOML is UTF-8 by definition, whatever the locale says
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise ConfigError(
            f"{path}: line {line}: byte 0x{data[e.start]:02x} is not UTF-8 text (TOML files must be saved as UTF-8)"
        ) from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    except (RecursionError, ValueError) as e:
        raise ConfigError(f"{path}: {_toml_failure(e)}") from None


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Load a TOML config (or the defaults when `path` is None), apply overrides, validate once."""
    raw: dict[str, Any] = {}
    where = ""
    if path is not None:
        path = Path(path)
        where = f"{path}: "
        raw = _read_toml(path)
    for arg in overrides or []:
        key, value = parse_override(arg)
        section, name = key.split(".", 1)
        raw.setdefault(section, {})
        if not isinstance(raw[section], dict):
            raise ConfigError(f"override {arg!r}: '{section}' is not a config section")
        raw[section][name] = value
    return from_dict(raw, where)


def to_dict(cfg: Config) -> dict[str, dict[str, Any]]:
    return dataclasses.asdict(cfg)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):  # an entry of a list of tables, written inline
        return "{" + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"cannot write {v!r} as TOML")


def to_toml(cfg: Config) -> str:
    """The fully resolved config as TOML, written by a TOML library (tomli-w escapes control characters and
    quotes in strings) and read back before it is returned: a run whose config.toml could not be read by
    `eval`, `export` or `--resume` does not start. Unset optional fields (None) are written as comments
    saying who decides them ("(preset)", "(auto)"), so the file loads back with them unset."""
    import tomli_w

    chunks: list[str] = []
    tables = {section: {k: v for k, v in values.items() if v is not None} for section, values in to_dict(cfg).items()}
    for section, values in to_dict(cfg).items():
        unset = "".join(
            f"# {key} = ({_field(_SECTION_OWNER[section], key).metadata.get('unset', 'preset')})\n"
            for key, value in values.items()
            if value is None
        )
        chunks.append(tomli_w.dumps({section: tables[section]}) + unset)
    text = "\n".join(chunks)
    _check_read_back(text, tables)
    return text


def _check_read_back(text: str, tables: dict[str, dict[str, Any]]) -> None:
    """ConfigError unless `text` is UTF-8 TOML that reads back to `tables` exactly."""
    try:
        back = tomllib.loads(text.encode("utf-8").decode("utf-8"))
    except (UnicodeError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(
            f"the resolved config cannot be written as TOML ({e}); check the config's text values"
        ) from None
    for section, values in tables.items():
        for key, value in values.items():
            if back.get(section, {}).get(key) != value:
                raise ConfigError(
                    f"config key '{section}.{key}': {value!r} does not survive being written to config.toml; "
                    "use plain text"
                )


def _allowed_text(owner: type, f: dataclasses.Field) -> str:
    m = f.metadata
    choices = field_choices(owner, f.name)
    if choices:
        return " / ".join(repr(c) if c == "" else c for c in choices)
    bounds = (
        f">= {m['ge']}" if m.get("ge") is not None else "",
        f"> {m['gt']}" if m.get("gt") is not None else "",
        f"<= {m['le']}" if m.get("le") is not None else "",
    )
    return " ".join(s for s in bounds if s)


def _table_rows(name: str, table: type) -> list[str]:
    """Reference rows for the keys of each entry of a list-of-tables field (`sources[].path`, ...)."""
    return [
        f"| `{name}[].{f.name}` | `{_toml_value(f.default)}` | {_allowed_text(table, f)} | {f.metadata['doc']} |"
        for f in dataclasses.fields(table)
    ]


def reference_markdown() -> str:
    """The config reference (every section and key, default and doc) as Markdown, for the docs."""
    out: list[str] = []
    for sf in dataclasses.fields(Config):
        out += [f"### [{sf.name}]", "", "| key | default | allowed | meaning |", "|---|---|---|---|"]
        for f in dataclasses.fields(sf.default_factory()):  # type: ignore[operator]  # every Config field is a section with a default_factory, never MISSING
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[operator]  # a field without a default has a default_factory (the list fields)
            allowed = _allowed_text(sf.default_factory, f)  # type: ignore[arg-type]  # a section's default_factory is its class, typed as a factory callable
            shown = f"({f.metadata.get('unset', 'preset')})" if default is None else f"`{_toml_value(default)}`"
            out.append(f"| `{f.name}` | {shown} | {allowed} | {f.metadata['doc']} |")
            table = table_type(typing.get_type_hints(sf.default_factory)[f.name])
            if table is not None:
                out += _table_rows(f.name, table)
        out.append("")
    return "\n".join(out)
