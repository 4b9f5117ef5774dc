"""`tuned.toml`: the user's config as they wrote it, plus only the keys tune changed, each with its reason.

The user's own tables (their config file and command-line overrides, not the resolved defaults) are
written back by the project's TOML library (tomli-w, as `config.to_toml`), and every changed key gets a
comment line above it with the measured gain. The text is read back and loaded before it is written: it
must give exactly the tuned config, or nothing is written. The write is atomic and never follows a
symbolic link (train/rundir.py `atomic_write_text`).
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import tomli_w

from tracetrain.config import Config, from_dict
from tracetrain.errors import TracetrainError
from tracetrain.train.rundir import atomic_write_text


def tuned_text(
    raw: dict[str, dict[str, Any]], changes: dict[str, Any], comments: dict[str, str], header: list[str]
) -> str:
    """The TOML text: `header` comment lines, then each section of `raw` with `changes` applied (changed
    keys first in their section, each under its comment)."""
    sections: dict[str, dict[str, Any]] = {name: dict(body) for name, body in raw.items()}
    by_section: dict[str, dict[str, Any]] = {}
    for key, value in changes.items():
        section, name = key.split(".", 1)
        by_section.setdefault(section, {})[name] = value
        sections.setdefault(section, {}).pop(name, None)
    chunks = ["".join(f"# {line}\n" for line in header)]
    for section in dict.fromkeys([*sections, *by_section]):
        rest = sections.get(section, {})
        lines = [f"[{section}]"]
        for name, value in by_section.get(section, {}).items():
            lines.append(f"# {comments.get(f'{section}.{name}', 'changed by tracetrain tune')}")
            lines.append(tomli_w.dumps({name: value}).rstrip("\n"))
        body = tomli_w.dumps({section: rest}) if rest else ""
        # tomli-w writes the section's header first; the changed keys go right under it, before any
        # sub-table ([[data.sources]]) that would otherwise swallow them.
        body = body.split("\n", 1)[1] if body.startswith(f"[{section}]\n") else body
        chunks.append("\n".join(lines) + "\n" + body)
    return "\n".join(chunks)


def write_tuned(path: Path, text: str, expected: Config) -> None:
    """Write `text` to `path` once it loads back to `expected` (TracetrainError otherwise)."""
    try:
        loaded = from_dict(tomllib.loads(text))
    except (tomllib.TOMLDecodeError, TracetrainError) as e:
        raise TracetrainError(f"{path}: the tuned config does not load back ({e}); nothing written") from None
    if loaded != expected:
        raise TracetrainError(f"{path}: the tuned config does not load back to the tuned values; nothing written")
    atomic_write_text(path, text)
