"""The orjson fast path of the trace reader gives exactly what the standard decoder gives.

With orjson installed, the events in the reader's buffer are decoded in one call, cut at the last `},`
(jsonstream.py). Cuts inside strings or nested objects, values orjson reads differently (NaN, raw
control characters, lone surrogates, integers beyond 64 bits) and every formatting must still give
the same parsed trace as the standard decoder alone (orjson taken away, as when it is not installed)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import traces_gen as gen
from helpers import DATA

from tracetrain.profile.analyze import jsonstream, parse_trace
from tracetrain.profile.analyze import trace as trace_module

orjson = pytest.importorskip("orjson", reason="the fast path needs orjson (pip install tracetrain[analyze-fast])")


def _tricky_document() -> dict:
    """A generated trace with events that a careless batch decoder would get wrong, each far from the
    others so that each one alone decides how its batch is read."""
    doc = gen.gemm_heavy(steps=8)
    events = doc["traceEvents"]
    for i, event in enumerate(events):
        if event.get("cat") == "kernel" and i % 3 == 0:  # `},` and `}, {` inside a string
            event["name"] = "void f<{lambda(float)#1}, {lambda()#2}, float>(int)"
    t = gen.T0 + 100
    tricky = [
        {"ph": "X", "cat": "kernel", "name": "g<{lambda()#1},\nint>", "pid": 0, "tid": 7, "ts": t, "dur": 1,
         "args": {}},  # `},` and a (written raw) newline inside a string
        {"ph": "X", "cat": "cpu_op", "name": 18446744073709551617, "pid": 1, "tid": 1, "ts": t, "dur": 1,
         "args": {"Input Dims": [[18446744073709551617, 2]], "Input type": ["float"], "correlation": 2**64 + 1}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": t, "dur": 2,
         "args": {"correlation": -(2**63) - 1}},
        {"ph": "X", "cat": "kernel", "name": "nan_kernel", "pid": 0, "tid": 7, "ts": t, "dur": math.nan, "args": {}},
        {"ph": "X", "cat": "cpu_op", "name": "aten::\u00e9t\u00e9 \U0001f600", "pid": 1, "tid": 1, "ts": t,
         "dur": 3, "args": {"Input Dims": [[1.0, -0.0], [None]], "Input type": ["", "\ud800"]}},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1.0, "tid": "1", "ts": t, "dur": 4,
         "args": {"Input Dims": [[2, 3], [3, 4]], "Input type": ["float", "float"],
                  "Concrete Inputs": ["0.00017999999999999998", "1234567890123456789012"]}},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": t, "dur": 4,
         "args": {"Input Dims": [[2, 3], [3, 4]], "Input type": ["float", "float"], "nested": [{"a": {}}, {}]}},
        {"ph": "X", "cat": "cpu_op", "name": "aten::add", "pid": 1, "tid": 1, "ts": t, "dur": 1,
         "args": {"Input Dims": [[math.nan]], "Input type": ["float"]}},  # NaN: read by the standard decoder
        {"ph": "X", "cat": "cpu_op", "name": "aten::add", "pid": 1, "tid": 1, "ts": t, "dur": 1,
         "args": {"Input Dims": [[None]], "Input type": ["float"]}},  # ...and not the same shape as null
        7, "not an event", [],
    ]
    step = len(events) // (len(tricky) + 1)
    for i, event in reversed(list(enumerate(tricky))):
        events.insert((i + 1) * step, event)
    return doc


def _same(a, b) -> None:
    for key in ("names", "threads", "shapes", "window", "num_python_events", "notes", "device_name"):
        assert getattr(a, key) == getattr(b, key), key
    for table in ("host", "gpu", "memory", "unified"):
        ca, cb = getattr(a, table).data, getattr(b, table).data
        assert ca.keys() == cb.keys()
        for key in ca:
            assert ca[key].dtype == cb[key].dtype and np.array_equal(ca[key], cb[key], equal_nan=True), (table, key)


def _without_orjson(monkeypatch, path):
    with monkeypatch.context() as patch:
        patch.setattr(jsonstream, "orjson", None)
        patch.setattr(trace_module, "orjson", None)
        return parse_trace(path)


@pytest.mark.parametrize("indent", [None, 1])
@pytest.mark.parametrize("chunk", [97, 4096, 65536])
def test_fast_path_parses_the_same_trace_as_the_standard_decoder(tmp_path, monkeypatch, indent, chunk):
    monkeypatch.setattr(jsonstream, "_CHUNK_CHARS", chunk)
    text = json.dumps(_tricky_document(), indent=indent, ensure_ascii=False)
    text = text.replace("},\\nint", "},\nint")  # a raw newline in a name: the (non-strict) reader takes it
    path = tmp_path / "t.json"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    calls = []
    loads = orjson.loads
    monkeypatch.setattr(jsonstream, "orjson", type("Spy", (), {
        "JSONDecodeError": orjson.JSONDecodeError, "loads": staticmethod(lambda s: calls.append(1) or loads(s))}))
    fast = parse_trace(path)
    slow = _without_orjson(monkeypatch, path)
    _same(fast, slow)
    assert calls, "the fast path was never tried"
    assert len(fast.gpu) > 100 and "aten::\u00e9t\u00e9 \U0001f600" in fast.names and len(fast.shapes) >= 3


def test_fast_path_is_taken_on_a_real_trace(monkeypatch):
    path = DATA / "traces" / "real_rank0.json.gz"
    batches = []
    loads = orjson.loads

    def spy(text):
        items = loads(text)
        batches.append(len(items))
        return items

    monkeypatch.setattr(jsonstream, "orjson", type("Spy", (), {
        "JSONDecodeError": orjson.JSONDecodeError, "loads": staticmethod(spy)}))
    fast = parse_trace(path)
    _same(fast, _without_orjson(monkeypatch, path))
    # Nearly every event came in a batch, not one at a time.
    assert sum(batches) > 0.95 * (len(fast.host) + len(fast.gpu))
