"""Config as TOML text: reading a config file and `--section.key=value` overrides, checking that the
written config.toml reads back, and the Markdown reference of every key.

Reading is bounded and every failure is one ConfigError naming the file or the override; nothing here
knows the config tree's sections (`tracetrain.config` passes them in).
"""

from __future__ import annotations

import dataclasses
import os
import stat
import tomllib
import typing
from pathlib import Path
from typing import Any

from tracetrain.config_fields import field_choices, table_type
from tracetrain.errors import ConfigError, utf8_text


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


def read_toml(path: Path) -> dict[str, Any]:
    """The tables of a TOML config file; every way reading it can fail is one ConfigError naming the file."""
    if path.is_dir():
        raise ConfigError(f"config file {path} is a directory; give a .toml file")
    if not path.exists():
        raise ConfigError(f"config file {path} does not exist")
    data = _read_limited(path)
    text = utf8_text(  # TOML is UTF-8 by definition
        data,
        lambda line, byte: ConfigError(
            f"{path}: line {line}: byte 0x{byte:02x} is not UTF-8 text (TOML files must be saved as UTF-8)"
        ),
    )
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    except (RecursionError, ValueError) as e:
        raise ConfigError(f"{path}: {_toml_failure(e)}") from None


def toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):  # an entry of a list of tables, written inline
        return "{" + ", ".join(f"{k} = {toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"cannot write {v!r} as TOML")


def check_read_back(text: str, tables: dict[str, dict[str, Any]]) -> None:
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
        f"| `{name}[].{f.name}` | `{toml_value(f.default)}` | {_allowed_text(table, f)} | {f.metadata['doc']} |"
        for f in dataclasses.fields(table)
    ]


def render_reference(sections: dict[str, type]) -> str:
    """The reference of the config tree whose sections are `sections` (name -> section class) as Markdown:
    every key with its default, what it allows and its doc."""
    out: list[str] = []
    for name, section in sections.items():
        out += [f"### [{name}]", "", "| key | default | allowed | meaning |", "|---|---|---|---|"]
        for f in dataclasses.fields(section):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[operator]  # a field without a default has a default_factory (the list fields)
            allowed = _allowed_text(section, f)
            shown = f"({f.metadata.get('unset', 'preset')})" if default is None else f"`{toml_value(default)}`"
            out.append(f"| `{f.name}` | {shown} | {allowed} | {f.metadata['doc']} |")
            table = table_type(typing.get_type_hints(section)[f.name])
            if table is not None:
                out += _table_rows(f.name, table)
        out.append("")
    return "\n".join(out)
