"""Streaming reader for the one JSON object a PyTorch profiler writes.

A Kineto trace is `{"schemaVersion": ..., "deviceProperties": [...], "traceEvents": [ {...}, ... ], ...}`
where `traceEvents` holds almost all of the bytes (a long run can write gigabytes). `json.load` would
hold the whole text and every event dict at once, so we walk the top-level object by hand and decode
one event at a time with the C decoder (`raw_decode` at an offset into a sliding text buffer). Memory
stays at one buffer (a few MiB; with orjson, also one batch's decoded events and orjson's working
document for it) plus whatever the caller keeps per event.

Top-level values other than `traceEvents` are small (device properties, distributed info) and are
returned whole. A bare array (the Chrome "JSON array" form) is read as the event list. A trailing comma
before `]`, which some trace writers emit, is tolerated.

Speed-up with orjson (optional, `pip install tracetrain[analyze-fast]`): decoding one event at a time
costs a Python round trip per event, so when orjson is importable the events in the next 128 KiB of
the buffer, up to its last `},` (preferably one that ends a line, as the profiler writes them), are
decoded in one call as the list `[` + those events + `]`. That text parses only when the `}` really closes an event (inside a
string or a nested object it leaves a string or a bracket open), so a wrong cut can fail but never
give other events. Where orjson would read a value differently from the standard decoder it fails
instead (NaN, raw control characters, lone surrogates), except integers beyond 64 bits, which it turns
into floats: text holding a run of 19 digits or more (not a fraction's) is left to the standard
decoder. After a failure the events up to the cut are read one at a time with the standard decoder, so
the result is the same with or without orjson.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Callable
from typing import Any, TextIO

try:
    import orjson
except ImportError:  # optional: the standard decoder gives the same events, slower
    orjson = None  # type: ignore[assignment]  # None marks orjson as not installed; the reader checks it before use

_WHITESPACE = re.compile(r"[ \t\n\r]*")
_SEPARATOR = re.compile(r"[ \t\n\r]*,[ \t\n\r]*")
_DECODER = json.JSONDecoder(strict=False)  # tolerate raw control characters in names
_CHUNK_CHARS = 1 << 20
# Text decoded by one orjson call. orjson first parses the text into a working document of 12 bytes a
# character (3.13 allocates it through Python's allocator, so tracemalloc sees it; 3.8 did not), then
# builds the dicts: a batch of a whole 1 MiB chunk cost 13 MB at once, and a 50 MB trace peaked at
# 27 MB (23.5 MB RSS) against 12 MB with the standard decoder. 128 KiB batches (about 500 events a
# call) peak at the standard decoder's 12 MB and parse as fast (1.36 s CPU, 1.48 s with 1 MiB).
_BATCH_CHARS = 1 << 17
# One event or top-level value larger than this is not a profiler trace (and would defeat streaming).
_MAX_VALUE_CHARS = 64 << 20
# Every digit as "0", so that a run of 19 digits is found by `bytes.find` (a regex is 20x slower).
_DIGITS_AS_ZERO = bytes.maketrans(b"123456789", b"000000000")
_DIGIT_RUN = b"0" * 19
# Where one event ends and the next begins, likeliest first: the profiler writes one `},` per line.
_BOUNDARIES = ("},\n", "},{", "}, {", "},")


class _Stream:
    """A text buffer over a file with just enough of a tokenizer to walk one object and one array."""

    def __init__(self, text: TextIO) -> None:
        self.text = text
        self.buf = ""
        self.pos = 0
        self.base = 0  # characters dropped before `buf` starts: `base + pos` is the position in the file
        self.eof = False
        self.slow_until = 0  # file position before which events are decoded one at a time

    def _fill(self) -> bool:
        """Append the next chunk, dropping what was consumed; False at end of file."""
        if self.eof:
            return False
        chunk = self.text.read(_CHUNK_CHARS)
        if not chunk:
            self.eof = True
            return False
        self.base += self.pos
        self.buf = self.buf[self.pos :] + chunk
        self.pos = 0
        return True

    def peek(self) -> str:
        """The next non-whitespace character, not consumed; "" at end of file."""
        while True:
            self.pos = _WHITESPACE.match(self.buf, self.pos).end()  # type: ignore[union-attr]  # _WHITESPACE matches the empty string, so match() never returns None
            if self.pos < len(self.buf):
                return self.buf[self.pos]
            if not self._fill():
                return ""

    def expect(self, char: str) -> None:
        found = self.peek()
        if found != char:
            raise ValueError(f"expected {char!r} but found {_describe(found)}")
        self.pos += 1

    def value(self) -> Any:
        """Decode the next JSON value, reading more text while it is cut off by the buffer's end."""
        if self.pos >= len(self.buf) or self.buf[self.pos] in " \t\n\r":
            self.peek()
        while True:
            try:
                obj, end = _DECODER.raw_decode(self.buf, self.pos)
            except json.JSONDecodeError:
                if self.eof or len(self.buf) - self.pos > _MAX_VALUE_CHARS:
                    raise
                self._fill()
                continue
            # A number at the buffer's end may continue in the next chunk: only accept a value
            # that is followed by something, or that ends the file.
            if end < len(self.buf) or self.eof:
                self.pos = end
                return obj
            self._fill()


def _describe(char: str) -> str:
    return repr(char) if char else "end of file"


def _read_batch(stream: _Stream, on_item: Callable[[Any], None]) -> bool:
    """With orjson, decode the events from `stream.pos` up to the last `},` within `_BATCH_CHARS` in one
    call and step past them and their comma; False (nothing consumed) where the standard decoder must read."""
    if orjson is None or stream.base + stream.pos < stream.slow_until:
        return False
    if len(stream.buf) - stream.pos < _BATCH_CHARS:
        stream._fill()  # a whole batch, not the tail left after the previous one
    buf, start = stream.buf, stream.pos
    end = start + _BATCH_CHARS
    cut = -1
    for boundary in _BOUNDARIES:  # "}," also ends `{lambda()#1},` inside C++ kernel names
        cut = buf.rfind(boundary, start, end + len(boundary))
        if cut >= 0:
            break
    if cut < 0:
        return False
    items = None
    text = buf[start : cut + 1]
    if not _has_long_integer(text):
        with contextlib.suppress(orjson.JSONDecodeError):  # a cut inside a string, NaN, ...: read slowly
            items = orjson.loads("[" + text + "]")
    if items is None:
        stream.slow_until = stream.base + cut + 1
        return False
    for item in items:
        on_item(item)
    stream.pos = cut + 2
    return True


def _has_long_integer(text: str) -> bool:
    """Whether `text` may hold an integer beyond 64 bits: a run of 19 digits or more that is not the
    fractional part of a number (a run inside a string also counts: a slower read, not a wrong one)."""
    digits = text.encode("utf-8", "replace").translate(_DIGITS_AS_ZERO)
    pos = digits.find(_DIGIT_RUN)
    while pos >= 0:  # `find` stops at the first digit of a run
        if pos == 0 or digits[pos - 1] != ord("."):
            return True
        end = pos + len(_DIGIT_RUN)
        while end < len(digits) and digits[end] == ord("0"):
            end += 1
        pos = digits.find(_DIGIT_RUN, end)
    return False


def _read_array(stream: _Stream, on_item: Callable[[Any], None]) -> None:
    """Call `on_item` for each element of the array whose `[` comes next."""
    stream.expect("[")
    while True:
        char = stream.peek()
        if char == "]":
            stream.pos += 1
            return
        if _read_batch(stream, on_item):
            continue
        on_item(stream.value())
        match = _SEPARATOR.match(stream.buf, stream.pos)  # fast path: `,` and spacing in the buffer
        if match and match.end() < len(stream.buf):
            stream.pos = match.end()
            continue
        char = stream.peek()
        if char == ",":
            stream.pos += 1
        elif char != "]":
            raise ValueError(f"expected ',' or ']' in the event list, found {_describe(char)}")


def read_trace_document(text: TextIO, on_event: Callable[[Any], None]) -> dict[str, Any]:
    """Stream `text`, calling `on_event` for each element of `traceEvents`.

    Returns the other top-level keys, plus `"traceEvents": True` when the event list was present.
    Raises ValueError (or json.JSONDecodeError, a subclass) on malformed text.
    """
    stream = _Stream(text)
    if stream.peek() == "[":
        _read_array(stream, on_event)
        return {"traceEvents": True}
    stream.expect("{")
    others: dict[str, Any] = {}
    while stream.peek() != "}":
        key = stream.value()
        if not isinstance(key, str):
            raise ValueError("top-level object has a non-string key")
        stream.expect(":")
        if key == "traceEvents" and stream.peek() == "[":
            _read_array(stream, on_event)
            others[key] = True
        else:
            others[key] = stream.value()
        if stream.peek() == ",":
            stream.pos += 1
    stream.expect("}")
    return others
