"""Prompt records for `tracetrain generate`: a prompts file (JSONL) or `--prompt` texts, wrapped in the
run's prompt template as the model saw prompts in training. The records are plain dicts that
models/generate.py `generate_records` takes; reading and templating live here, beside the training
data's formats, so that models/ does not read data files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tracetrain.config import DataSection
from tracetrain.data.files import open_data_file
from tracetrain.data.formats import prompt_fields
from tracetrain.data.instruction import format_prompt
from tracetrain.errors import DataError
from tracetrain.models.generate import MAX_NEW_TOKENS_LIMIT


def prompt_record(obj: dict[str, Any], data: DataSection, raw: bool = False) -> dict[str, Any]:
    """One prompt (a JSON object) -> {"prompt", "text", "stop", "max_new_tokens"}; ValueError if malformed.

    The object holds `prompt`, or the run's instruction field and optional context field (as
    `data.format` names them: Alpaca's `input`, Dolly's `context`, or the configured fields). Both are wrapped in the run's prompt template, as the model saw prompts in training,
    unless `raw` (a `prompt` is then sent as is). Optional: `stop` (a string or a list of strings) and
    `max_new_tokens`. `data` is the run's `DataSection`.
    """
    template = "plain" if data.kind == "synthetic" else data.template
    templated = data.kind in ("instruction", "synthetic")
    instruction_field, context_field = prompt_fields(data, obj)  # as data.format reads training rows
    if isinstance(obj.get("prompt"), str):
        prompt = obj["prompt"]
        text = prompt if raw or not templated else format_prompt(template, prompt)
    elif isinstance(obj.get(instruction_field), str):
        prompt = obj[instruction_field]
        context = obj.get(context_field) if context_field else None
        text = format_prompt(template if templated else "plain", prompt, context if isinstance(context, str) else "")
    else:
        raise ValueError(
            f"needs a string field 'prompt' or {instruction_field!r} "
            f"(fields present: {', '.join(map(repr, obj)) or 'none'})"
        )
    stop = obj.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not (isinstance(stop, list) and all(isinstance(x, str) and x for x in stop)):
        raise ValueError("'stop' must be a non-empty string or a list of them")
    budget = obj.get("max_new_tokens")
    if budget is not None and (
        isinstance(budget, bool) or not isinstance(budget, int) or not 0 <= budget <= MAX_NEW_TOKENS_LIMIT
    ):
        raise ValueError(f"'max_new_tokens' must be an integer from 0 to {MAX_NEW_TOKENS_LIMIT:,}")
    return {"prompt": prompt, "text": text, "stop": stop, "max_new_tokens": budget}


def _prompt_line(line: str, path: str | Path, line_no: int, data: DataSection, raw: bool) -> dict[str, Any]:
    """One line of a prompts file as a record; DataError `file:line: reason`."""
    try:
        obj = json.loads(line)
        if not isinstance(obj, dict):
            raise ValueError(f"not a JSON object (got {type(obj).__name__})")
        return prompt_record(obj, data, raw)
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{line_no}: not valid JSON ({e.msg} at column {e.colno})") from None
    except RecursionError:
        raise DataError(f"{path}:{line_no}: JSON nested too deeply to read") from None
    except ValueError as e:
        raise DataError(f"{path}:{line_no}: {str(e).splitlines()[0]}") from None


def read_prompts_jsonl(path: str | Path, data: DataSection, raw: bool = False) -> list[dict[str, Any]]:
    """A prompts file (one JSON object per line, see `prompt_record`) -> records; DataError `file:line: ...`."""
    records = []
    line_no = 0
    with open_data_file(str(path), "--prompts-file") as f:
        try:
            for line_no, line in enumerate(f, 1):
                if line.strip():
                    records.append(_prompt_line(line, path, line_no, data, raw))
        except UnicodeDecodeError as e:
            raise DataError(f"{path}:{line_no + 1}: not UTF-8 text (byte 0x{e.object[e.start]:02x})") from None
    if not records:
        raise DataError(f"{path}: no prompts")
    return records
