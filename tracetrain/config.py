"""The typed config tree: one dataclass per section, loaded from TOML plus dotted CLI overrides.

Every field has a default and a one-line doc (`metadata["doc"]`), and a `Literal` type of choices or a numeric
range. Validation happens once, in `load_config`, and a bad value raises `ConfigError` naming the key,
the value and what is allowed. The resolved tree is written to the run directory with `to_toml`, so a
run can be reproduced (and resumed) from its own `config.toml`.

The sections themselves are declared in `config_sections.py`, the checks of one value (type, choices,
range, unknown keys) in `config_fields.py`, and reading and writing TOML in `config_toml.py`; this module
holds the `Config` tree, loading and the rules across fields, and is where all of them are imported from
(`from tracetrain.config import DataSection, parse_override`).
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tracetrain.config_fields import (
    check_device_spec,
    check_value,
    field_choices,
    key_hint,
    table_type,
)
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
from tracetrain.config_toml import (
    CONFIG_FILE_LIMIT_BYTES,
    check_read_back,
    parse_override,
    read_toml,
    render_reference,
)
from tracetrain.errors import ConfigError

# `from tracetrain.config import X` keeps working for what moved to config_fields / config_toml.
__all__ = [
    "CONFIG_FILE_LIMIT_BYTES",
    "CheckpointSection",
    "Config",
    "DataSection",
    "LoggingSection",
    "LoraSection",
    "MemorySection",
    "ModelSection",
    "OptimSection",
    "ParallelSection",
    "PreferenceSection",
    "ProfileSection",
    "TrainSection",
    "check_device_spec",
    "check_warmup",
    "describe_warmup",
    "field_choices",
    "from_dict",
    "load_config",
    "parse_override",
    "reference_markdown",
    "resolve_warmup",
    "table_type",
    "to_dict",
    "to_toml",
]


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


_SECTION_OWNER: dict[str, type] = {f.name: f.default_factory for f in dataclasses.fields(Config)}  # type: ignore[misc]  # every Config field is a section built by its default_factory (a class), never MISSING


def _all_keys() -> list[str]:
    return [f"{name}.{f.name}" for name, owner in _SECTION_OWNER.items() for f in dataclasses.fields(owner)]


def _unknown(kind: str, name: str, known: list[str], where: str) -> ConfigError:
    hint = (
        [h]
        if kind == "config key" and (h := key_hint(name, _all_keys()))
        else difflib.get_close_matches(name, known, n=1)
    )
    suggestion = f" (did you mean '{hint[0]}'?)" if hint else f"; known: {', '.join(sorted(known))}"
    return ConfigError(f"{where}unknown {kind} '{name}'{suggestion}")


def _checked_section(section_name: str, values: Any, where: str) -> dict[str, Any]:
    """One section's keys, each checked on its own (known key, type, range); `where` prefixes errors."""
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
            checked[key] = check_value(f"{section_name}.{key}", fields[key], value, owner)
        except ConfigError as e:
            raise ConfigError(f"{where}{e}") from None
    return checked


def from_dict(raw: dict[str, Any], where: str = "") -> Config:
    """Build and validate a Config from nested dicts (TOML layout). `where` prefixes error messages."""
    sections = {}
    for name, values in raw.items():
        checked = _checked_section(name, values, where)  # first: it names an unknown section
        sections[name] = _SECTION_OWNER[name](**checked)
    cfg = Config(**sections)
    _check_cross_fields(cfg, where)
    return cfg


def apply_overrides(raw: dict[str, Any], overrides: Sequence[str]) -> None:
    """Merge command-line style overrides (`--optim.lr=3e-4`) into `raw` (TOML layout). Each is checked
    on its own first, so that a bad override is reported as the command line's, not as the config
    file's (whose name prefixes the errors of `from_dict`)."""
    for arg in overrides:
        key, value = parse_override(arg)
        section, name = key.split(".", 1)
        _checked_section(section, {name: value}, "")
        raw.setdefault(section, {})
        if not isinstance(raw[section], dict):
            raise ConfigError(f"override {arg!r}: '{section}' is not a config section")
        raw[section][name] = value


# ----------------------------------------------------------------------------------------------------
# Rules across fields (run once by from_dict, after every field passed its own checks)


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
    if mem.recompute_pointwise == "on" and cfg.train.mode != "lora":
        raise ConfigError(
            f"{where}config key 'memory.recompute_pointwise' = 'on' recomputes LoRA adapters' inputs; train.mode = "
            f"'{cfg.train.mode}' has none: set train.mode = 'lora' or memory.recompute_pointwise = 'auto' or 'off'"
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


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Load a TOML config (or the defaults when `path` is None), apply overrides, validate once."""
    raw: dict[str, Any] = {}
    where = ""
    if path is not None:
        path = Path(path)
        where = f"{path}: "
        raw = read_toml(path)
    apply_overrides(raw, overrides or [])
    return from_dict(raw, where)


def to_dict(cfg: Config) -> dict[str, dict[str, Any]]:
    return dataclasses.asdict(cfg)


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
    check_read_back(text, tables)
    return text


def reference_markdown() -> str:
    """The config reference (every section and key, default and doc) as Markdown, for the docs."""
    return render_reference(_SECTION_OWNER)
