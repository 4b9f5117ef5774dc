"""Streaming reader for the one JSON object a PyTorch profiler writes.

A Kineto trace is `{"schemaVersion": ..., "deviceProperties": [...], "traceEvents": [ {...}, ... ], ...}`
where `traceEvents` holds almost all of the bytes (a long run can write gigabytes). `json.load` would
hold the whole text and every event dict at once, so we walk the top-level object by hand and decode
one event at a time with the C decoder (`raw_decode` at an offset into a sliding text buffer). Memory
stays at one buffer (a few MiB) plus whatever the caller keeps per event.

Top-level values other than `traceEvents` are small (device properties, distributed info) and are
returned whole. A bare array (the Chrome "JSON array" form) is read as the event list. A trailing comma
before `]`, which some trace writers emit, is tolerated.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any, TextIO

_WHITESPACE = re.compile(r"[ \t\n\r]*")
_SEPARATOR = re.compile(r"[ \t\n\r]*,[ \t\n\r]*")
_DECODER = json.JSONDecoder(strict=False)  # tolerate raw control characters in names
_CHUNK_CHARS = 1 << 20
# One event or top-level value larger than this is not a profiler trace (and would defeat streaming).
_MAX_VALUE_CHARS = 64 << 20


class _Stream:
    """A text buffer over a file with just enough of a tokenizer to walk one object and one array."""

    def __init__(self, text: TextIO) -> None:
        self.text = text
        self.buf = ""
        self.pos = 0
        self.eof = False

    def _fill(self) -> bool:
        """Append the next chunk, dropping what was consumed; False at end of file."""
        if self.eof:
            return False
        chunk = self.text.read(_CHUNK_CHARS)
        if not chunk:
            self.eof = True
            return False
        self.buf = self.buf[self.pos :] + chunk
        self.pos = 0
        return True

    def peek(self) -> str:
        """The next non-whitespace character, not consumed; "" at end of file."""
        while True:
            self.pos = _WHITESPACE.match(self.buf, self.pos).end()  # type: ignore[union-attr]
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


def _read_array(stream: _Stream, on_item: Callable[[Any], None]) -> None:
    """Call `on_item` for each element of the array whose `[` comes next."""
    stream.expect("[")
    while True:
        char = stream.peek()
        if char == "]":
            stream.pos += 1
            return
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
