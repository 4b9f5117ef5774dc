"""Readers for the data files users have, shared by every data kind: rows of fields from

    JSONL                  one JSON object per line (also a `.json` file that is really JSONL)
    JSON array             a `.json` file holding one list of objects
    Parquet                a `.parquet` file (needs pyarrow: `pip install tracetrain[parquet]`)
    datasets folder        what `datasets.Dataset.save_to_disk` writes (Arrow files + state.json), or a
                           DatasetDict folder, whose split `split` ("train" unless said) is read (needs pyarrow too)
    hf:NAME[:CONFIG]       a Hugging Face dataset from the local cache, offline (hf_datasets.py)

Every row is located for error messages: `file:LINE` for JSONL, `file: row N` (0-based) for arrays,
Parquet and datasets folders. A bad row raises one-line DataError `<where>: <reason>`, or, with
`data.skip_bad_lines`, is counted and skipped. A JSON value nested too deeply for Python's parser is a
bad row like any other, not a RecursionError.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO, TypeVar

from tracetrain.data.hf_datasets import hf_batches, hf_files, is_hf
from tracetrain.data.token_cache import content_digest, files_digest
from tracetrain.errors import DataError
from tracetrain.progress import Progress

T = TypeVar("T")
# (where, the row's value or the DataError that says why it is unreadable)
RawRow = tuple[str, Any]

_ARROW_EXTRA = "pip install 'tracetrain[parquet]'"


def require_data_path(path: str, key: str) -> None:
    """A data file or folder that is not there is a DataError naming the path and the config key
    (an hf: dataset is looked up when it is read)."""
    if not is_hf(path) and not Path(path).exists():
        raise DataError(f"data file {path} does not exist (config key '{key}')")


def data_digest(path: str, key: str, split: str, progress: Progress | None = None) -> str:
    """A hash of the bytes `path` holds: a file, a folder, or the Arrow files of an hf: dataset's split."""
    if is_hf(path):
        return f"{path} [{split}] " + files_digest([Path(f) for f in hf_files(path, split, key)], None, path, progress)
    return content_digest(path, progress)


def check_data_file(path: str, key: str) -> None:
    """DataError naming the path and `key` (a config key, or a flag such as --prompts-file) unless `path`
    is a file."""
    where = key if key.startswith("--") else f"config key '{key}'"
    if Path(path).is_dir():
        raise DataError(f"data file {path} is a folder; name a file ({where})")
    if not Path(path).is_file():
        raise DataError(f"data file {path} does not exist ({where})")


def open_data_file(path: str, key: str) -> TextIO:
    """Open a data file for text reading, or raise DataError naming the path and the config key."""
    check_data_file(path, key)
    return open(path, encoding="utf-8")


def is_record_file(path: str) -> bool:
    """Does `path` hold rows of fields (JSONL, JSON, Parquet, a datasets folder) rather than plain text?"""
    return is_hf(path) or Path(path).is_dir() or Path(path).suffix.lower() in (".jsonl", ".json", ".parquet")


@dataclass
class ReadPosition:
    """How far a reader has got through a data file, for progress: `done` of `total` `unit`s
    ("bytes" for JSONL and plain text, "rows" for the others; total None when unknown), and the rows
    used and skipped as bad so far."""

    done: int = 0
    total: int | None = None
    unit: str = "rows"
    rows: int = 0
    bad: int = 0


def read_rows(
    path: str, key: str, parse: Callable[[dict[str, Any]], T], skip_bad_lines: bool, split: str = "train"
) -> tuple[list[tuple[str, T]], int]:
    """`parse` applied to every row of `path` -> ([(where, parsed row)], number of bad rows skipped).

    `parse` gets a dict and raises DataError with the reason (without the location) for a bad row.
    Raises DataError when no row is usable.
    """
    position = ReadPosition()
    out = list(iter_rows(path, key, parse, skip_bad_lines, position, split))
    return out, position.bad


def iter_rows(
    path: str,
    key: str,
    parse: Callable[[dict[str, Any]], T],
    skip_bad_lines: bool,
    position: ReadPosition,
    split: str = "train",
) -> Iterator[tuple[str, T]]:
    """`read_rows` one row at a time, for files larger than memory; `position` follows the reading;
    `split`: the split read from an hf: dataset or a DatasetDict folder.

    Raises DataError (once every row is read) when no row was usable.
    """
    for where, value in _raw_rows(path, key, position, split):
        try:
            if isinstance(value, DataError):
                raise value
            if not isinstance(value, dict):
                raise DataError(f"not a JSON object (got {type(value).__name__})")
            parsed = parse(value)
        except DataError as e:
            if not skip_bad_lines:
                raise DataError(f"{where}: {e}") from None
            position.bad += 1
            continue
        position.rows += 1
        yield where, parsed
    if not position.rows:
        what = f"all {position.bad} rows are bad" if position.bad else "the file has no rows"
        raise DataError(f"{path}: no usable examples ({what}; config key '{key}')")


def _raw_rows(path: str, key: str, position: ReadPosition, split: str) -> Iterator[RawRow]:
    """Every row of `path`, in the format its name (and, for .json, its first character) says."""
    if is_hf(path):
        batches, position.total = hf_batches(path, split, key)
        return _counted(_table_rows(batches, f"{path} [{split}]"), position)
    p = Path(path)
    if p.is_dir():
        return _counted(_dataset_folder_rows(p, key, split), position)
    require_data_path(path, key)
    suffix = p.suffix.lower()
    if suffix == ".parquet":
        return _parquet_rows(p, position)
    if suffix == ".json" and _first_char(p) == "[":
        return _counted(_json_array_rows(p), position)
    return _jsonl_rows(path, key, position)


def _counted(rows: Iterator[RawRow], position: ReadPosition) -> Iterator[RawRow]:
    for row in rows:
        position.done += 1
        yield row


def _first_char(path: Path) -> str:
    with open(path, "rb") as f:
        head = f.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")  # BOM and leading whitespace
    return head[:1].decode("ascii", errors="replace")


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _loads(text: str) -> Any:
    """json.loads, with the ways it fails turned into a DataError reason."""
    try:
        return _no_lone_surrogates(json.loads(text), text)
    except json.JSONDecodeError as e:
        return DataError(f"not valid JSON ({e.msg} at column {e.colno})")
    except RecursionError:
        # Python's parser recurses once per nesting level; no training row is legitimately that deep.
        return DataError("JSON nested too deeply to read")
    except ValueError as e:  # an integer of more digits than Python converts (sys.get_int_max_str_digits)
        return DataError(f"not readable JSON ({str(e).splitlines()[0]})")


def _no_lone_surrogates(value: Any, text: str) -> Any:
    """`value`, or a DataError when a `\\udXXX` escape decoded to half a surrogate pair: such text cannot
    be encoded as UTF-8, so no tokenizer can read it. The costly check runs only where an escape is."""
    if _SURROGATE_ESCAPE.search(text) is None:
        return value
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        return DataError(
            f"text with a lone surrogate escape (\\u{ord(e.object[e.start]):04x}), which is not Unicode text"
        )
    return value


def _jsonl_rows(path: str, key: str, position: ReadPosition) -> Iterator[RawRow]:
    """Lines read as bytes and decoded one at a time: the position is exact, and so is a bad line's number."""
    open_data_file(path, key).close()  # the one error for a missing file
    position.total, position.unit = Path(path).stat().st_size, "bytes"
    line_no = 0
    with open(path, "rb") as f:
        for raw in f:
            line_no += 1
            position.done += len(raw)
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{path}:{line_no}: not valid UTF-8 text ({e.reason} at byte {e.start})") from None
            if "\r" in line:  # old Mac line ends: numbered as Python's text mode (universal newlines) does
                for i, part in enumerate(line.replace("\r\n", "\n").replace("\r", "\n").split("\n")):
                    if part.strip():
                        yield f"{path}:{line_no + i}", _loads(part)
                line_no += line.replace("\r\n", "\n").count("\r")
            elif line.strip():
                yield f"{path}:{line_no}", _loads(line)


def _json_array_rows(path: Path) -> Iterator[RawRow]:
    """Elements of a top-level JSON array, decoded one at a time so that one bad element is one bad row."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not valid UTF-8 text ({e.reason} at byte {e.start})") from None
    decoder = json.JSONDecoder()
    pos = _skip_space(text, text.index("[") + 1)
    index = 0
    while pos < len(text) and text[pos] != "]":
        start = pos
        try:
            value, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            # The rest of the array cannot be located reliably after a syntax error: the file is bad.
            raise DataError(
                f"{path}: row {index}: not valid JSON ({e.msg} at line {e.lineno} column "
                f"{e.colno}); the file is unreadable from there"
            ) from None
        except RecursionError:
            value, pos = DataError("JSON nested too deeply to read"), _end_of_value(text, pos)
        except ValueError as e:  # a number past Python's digit limit
            value, pos = DataError(f"not readable JSON ({str(e).splitlines()[0]})"), _end_of_value(text, pos)
        yield f"{path}: row {index}", _no_lone_surrogates(value, text[start:pos])
        index += 1
        pos = _skip_space(text, pos)
        if pos < len(text) and text[pos] == ",":
            pos = _skip_space(text, pos + 1)
    if pos >= len(text):
        raise DataError(f"{path}: not valid JSON (the array is not closed with ']')")


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


def _end_of_value(text: str, pos: int) -> int:
    """Index just past the JSON array/object starting at `pos`, by bracket counting (strings skipped).

    Only used for a value too deep for the recursive parser, which is rare, so plain Python speed is fine.
    """
    depth, in_string, escaped = 0, False, False
    for i in range(pos, len(text)):
        c = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "[{":
            depth += 1
        elif c in "]}":
            depth -= 1
            if depth == 0:
                return i + 1
    raise DataError(f"not valid JSON (a value starting at character {pos} is never closed)")


def _pyarrow() -> Any:
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError:
        raise DataError(f"reading Parquet files and datasets folders needs pyarrow; {_ARROW_EXTRA}") from None
    return pyarrow


def _table_rows(batches: Iterator[Any], where: str, start: int = 0) -> Iterator[RawRow]:
    index = start
    for batch in batches:
        for row in batch.to_pylist():
            yield f"{where}: row {index}", row
            index += 1


def _parquet_rows(path: Path, position: ReadPosition) -> Iterator[RawRow]:
    pa = _pyarrow()
    try:
        file = pa.parquet.ParquetFile(path)
        batches = file.iter_batches()
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: not a readable Parquet file ({str(e).splitlines()[0]})") from None
    position.total = file.metadata.num_rows
    return _counted(_table_rows(batches, str(path)), position)


def _dataset_folder_rows(folder: Path, key: str, split: str) -> Iterator[RawRow]:
    """A `save_to_disk` folder: its Arrow stream files, in the order state.json lists them."""
    if (folder / "dataset_dict.json").is_file():
        splits = json.loads((folder / "dataset_dict.json").read_text()).get("splits", [])
        if split not in splits:
            raise DataError(
                f"{folder}: a DatasetDict folder without a '{split}' split (splits: "
                f"{', '.join(splits) or 'none'}); point config key '{key}' at one split's folder"
            )
        folder = folder / split
    state = folder / "state.json"
    if not state.is_file():
        raise DataError(
            f"{folder}: a folder but not a Hugging Face datasets folder (no state.json or "
            f"dataset_dict.json; config key '{key}' takes a file or a save_to_disk folder)"
        )
    pa = _pyarrow()
    files = [folder / f["filename"] for f in json.loads(state.read_text()).get("_data_files", [])]
    index = 0
    for file in files:
        try:
            reader = pa.ipc.open_stream(pa.memory_map(str(file)))
        except (pa.ArrowException, OSError) as e:
            raise DataError(f"{file}: not a readable Arrow file ({str(e).splitlines()[0]})") from None
        for where, row in _table_rows(iter(reader), str(folder), index):
            index += 1
            yield where, row
