"""Instruction row formats: which fields of a row hold the instruction, the optional context and the response.

    alpaca              instruction / input / output          (Stanford Alpaca, most "-alpaca" datasets)
    dolly               instruction / context / response      (databricks-dolly-15k)
    prompt_completion   prompt / completion                   (OpenAI-style fine-tuning files, TRL)
    fields              data.instruction_field / context_field / response_field, as configured

`data.format = "auto"` (the default) means `fields` when any `*_field` key differs from its default (the
user named the fields), else the first named format whose instruction and response fields the first row
has. It is decided once per file, from its first readable row, and recorded in the data statistics
(`DataStats.format`). Every format is then rendered by `data.template` (the Alpaca prompt by default, with
or without the input) and trained on the response only (unless `data.train_on_prompt`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from tracetrain.config import DataSection
from tracetrain.errors import DataError

# format -> (instruction, context ('' = none), response) field names
NAMED_FORMATS: dict[str, tuple[str, str, str]] = {
    "alpaca": ("instruction", "input", "output"),
    "dolly": ("instruction", "context", "response"),
    "prompt_completion": ("prompt", "", "completion"),
}
_FIELD_KEYS = ("instruction_field", "context_field", "response_field")
_CHAT_FIELDS = ("messages", "conversations")


@dataclass(frozen=True)
class RowFields:
    """The resolved format of one instruction file and the field names it reads."""

    format: str  # alpaca, dolly, prompt_completion or fields
    instruction: str
    context: str  # '' = no context field
    response: str
    detected: bool  # decided by data.format = "auto"

    def describe(self) -> str:
        """E.g. "alpaca (auto: instruction/input/output)", for statistics and messages."""
        names = "/".join(n for n in (self.instruction, self.context, self.response) if n)
        return f"{self.format} ({'auto: ' if self.detected else ''}{names})"


def _configured(data: DataSection) -> RowFields:
    return RowFields("fields", data.instruction_field, data.context_field, data.response_field, False)


def _named(name: str, detected: bool) -> RowFields:
    return RowFields(name, *NAMED_FORMATS[name], detected)


def fields_set(data: DataSection) -> bool:
    """Did the user name the fields (any `*_field` key differs from its default)?"""
    defaults = {f.name: f.default for f in dataclasses.fields(DataSection)}
    return any(getattr(data, k) != defaults[k] for k in _FIELD_KEYS)


def resolve_fields(data: DataSection, first_row: dict[str, Any], key: str) -> RowFields:
    """The fields `data.format` reads; for 'auto', detected from `first_row` (of the file config `key` names).

    Raises DataError (a bad row: with data.skip_bad_lines the next row decides) when 'auto' recognises no format.
    """
    if data.format == "fields" or (data.format == "auto" and fields_set(data)):
        return _configured(data)
    if data.format != "auto":
        return _named(data.format, False)
    for name, (instruction, _, response) in NAMED_FORMATS.items():
        if instruction in first_row and response in first_row:
            return _named(name, True)
    present = ", ".join(map(repr, first_row)) or "none"
    kind_key = key.rsplit(".", 1)[0] + ".kind" if key.startswith("data.sources[") else "data.kind"
    if any(f in first_row for f in _CHAT_FIELDS):
        hint = f"it looks like chat data: set {kind_key} = 'chat'"
    elif "text" in first_row:
        hint = f"it looks like plain text: set {kind_key} = 'text'"
    else:
        hint = "name the fields with data.instruction_field / data.response_field"
    raise DataError(
        f"data.format = 'auto' recognises no instruction format in this row (fields: {present}; known: "
        f"alpaca, dolly, prompt_completion); {hint}"
    )


def prompt_fields(data: DataSection, row: dict[str, Any]) -> tuple[str, str]:
    """(instruction field, context field) of a prompt row for generation (a row with no response): the
    configured fields, the named format's, or for 'auto' the format whose instruction and context fields
    the row has (Alpaca's `input`, Dolly's `context`)."""
    if data.format == "fields" or (data.format == "auto" and fields_set(data)):
        return data.instruction_field, data.context_field
    if data.format != "auto":
        instruction, context, _ = NAMED_FORMATS[data.format]
        return instruction, context
    for instruction, context, _ in NAMED_FORMATS.values():
        if instruction in row and context and context in row:
            return instruction, context
    return data.instruction_field, data.context_field
