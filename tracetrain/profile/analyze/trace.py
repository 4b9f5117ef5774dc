"""Parse a PyTorch profiler (Kineto) Chrome trace into compact columns.

What we keep from `traceEvents` (everything else, e.g. `python_function` stacks, metadata `M`
events, `Trace` spans, `gpu_user_annotation`, is counted or ignored; unknown fields are tolerated):

- host ranges (`ph: "X"`): `cpu_op` (with `Input Dims`/`Input type` when shapes were recorded),
  `user_annotation` (record_function ranges such as `ProfilerStep#N`, `tracetrain/forward`),
  `cuda_runtime`/`cuda_driver` (launches and syncs, carrying `args.correlation`);
- GPU activities (`ph: "X"`): `kernel`, `gpu_memcpy` (`args.bytes`), `gpu_memset`, each with
  `args.device`, `args.stream`, `args.correlation`;
- `ac2g` flow starts (`ph: "s"`), the launch side of a launch -> kernel arrow, used when a kernel's
  runtime event is missing;
- `[memory]` instant events (`args["Total Allocated"]`, `"Total Reserved"`, `"Device Id"`);
- unified-memory activity (names with `Unified Memory`, `page fault`, or a `uvm`/`unified` category);
- CUPTI range-profiler ranges (`cuda_profiler_range`, from torch.profiler's `experimental_config` with
  `profiler_metrics`): one per profiled kernel (or range), its hardware counters in `args`. Kineto runs
  that profiler instead of kernel tracing, so such a trace has no kernel events; it replays each kernel
  to count and gives every range an even share of the profiled span, so their times are placeholders
  (`CounterRanges`, analysed by `counters.py`).

Older Kineto spellings (`Kernel`, `Memcpy`, `Runtime`, `Operator`) map to the same kinds; in those
older schemas (2021) record_function ranges (`ProfilerStep#N`, `enumerate(DataLoader)#...`, phases) are
`Operator`/`cpu_op` events, read as annotations by their name (`categories.is_range_name`). An event
whose duration is negative, NaN, missing or longer than a week (or whose timestamp is absurd) is dropped
and counted in a note, never measured. Each event
becomes one row of typed numpy columns; names and recorded shapes are interned, so a trace of N
events costs about 60 bytes per kept event, not the size of its JSON.

An Nsight Systems SQLite export is read by `nsys.py` into the same `Trace`; reader.py picks the reader
by the file's header, not its name.
"""

from __future__ import annotations

import contextlib
import gc
import gzip
import json
import re
import zlib
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tracetrain.errors import TracetrainError
from tracetrain.profile.analyze.categories import is_range_name
from tracetrain.profile.analyze.columns import ANNOTATION, KERNEL, MEMCPY, MEMSET, OP, RUNTIME, Columns
from tracetrain.profile.analyze.jsonstream import orjson, read_trace_document
from tracetrain.profile.analyze.link import link_launches

_HOST_CATS = {
    "cpu_op": OP,
    "operator": OP,
    "user_annotation": ANNOTATION,
    "cuda_runtime": RUNTIME,
    "cuda_driver": RUNTIME,
    "runtime": RUNTIME,
    "driver": RUNTIME,
}
_GPU_CATS = {"kernel": KERNEL, "gpu_memcpy": MEMCPY, "memcpy": MEMCPY, "gpu_memset": MEMSET, "memset": MEMSET}
# Category -> (group, kind); looked up as written first, lower-cased for older spellings ("Kernel").
_CATEGORIES = {
    **{cat: ("host", kind) for cat, kind in _HOST_CATS.items()},
    **{cat: ("gpu", kind) for cat, kind in _GPU_CATS.items()},
}
_UNIFIED_NAME = re.compile(r"unified memory|page ?fault", re.I)
PROFILER_RANGE_CAT = "cuda_profiler_range"
_UNIFIED_CAT = re.compile(r"uvm|unified", re.I)
# Column specs: name -> array typecode. Rows are added positionally, in this order.
# A week of microseconds: no profiled window is longer. Timestamps are microseconds since an epoch
# (Unix time is 1.8e15 now), so 1e17 leaves centuries of room.
MAX_EVENT_US = 7 * 86400 * 1e6
MAX_TIMESTAMP_US = 1e17

_HOST_COLUMNS = {"ts": "d", "dur": "d", "kind": "b", "name": "l", "thread": "l", "corr": "q", "shape": "l"}
_GPU_COLUMNS = {
    "ts": "d",
    "dur": "d",
    "kind": "b",
    "name": "l",
    "device": "l",
    "stream": "q",
    "corr": "q",
    "bytes": "q",
}
_FLOW_COLUMNS = {"corr": "q", "ts": "d", "thread": "l"}
# NCCL kernels' metadata (PyTorch >= 2.3 writes it into the kernel's args): the GPU row, the
# process group and collective names (interned in `names`), and the message size in elements.
_COMM_COLUMNS = {"row": "q", "group": "l", "collective": "l", "nelems": "q"}
_MEMORY_COLUMNS = {"ts": "d", "allocated": "q", "reserved": "q", "device": "l"}
_UNIFIED_COLUMNS = {"ts": "d", "dur": "d", "bytes": "q"}


@dataclass(frozen=True)
class CounterRanges:
    """CUPTI range-profiler ranges (`cuda_profiler_range` events) and the counters each recorded.
    `dur` is the trace's placeholder (Kineto splits the profiled span evenly), never a kernel time."""

    name: np.ndarray  # (n,) index into Trace.names: the kernel's (or range's) name
    dur: np.ndarray  # (n,) µs
    values: dict[str, np.ndarray]  # counter name -> (n,) float; NaN where a range lacks the counter

    def __len__(self) -> int:
        return len(self.name)

    @staticmethod
    def empty() -> CounterRanges:
        return CounterRanges(np.zeros(0, dtype=np.int64), np.zeros(0), {})


@dataclass
class Trace:
    """One rank's parsed trace. Times are microseconds on the trace's clock.

    `host` columns: ts, dur, kind (OP/ANNOTATION/RUNTIME), name (index into `names`), thread
    (index into `threads`), corr (CUDA correlation id or -1), shape (index into `shapes` or -1).
    `comm` columns: row (into `gpu`), group and collective (into `names`), nelems: the NCCL metadata
    PyTorch writes into a collective kernel's args (empty for older traces).
    `gpu` columns: ts, dur, kind (KERNEL/MEMCPY/MEMSET), name, device, stream, corr, bytes (-1 if
    unknown), plus from linking: launch_ts (host time of the launching runtime call, NaN if
    unknown), op (innermost `cpu_op` around the launch, -1) and gemm_op (innermost matmul-like op).
    """

    path: str
    rank: int
    world_size: int
    device_name: str | None
    device_memory_bytes: int | None
    names: list[str]
    threads: list[str]
    shapes: list[str]  # JSON `[Input Dims, Input type]`
    host: Columns
    gpu: Columns
    memory: Columns
    unified: Columns
    window: tuple[float, float]
    num_python_events: int = 0
    notes: list[str] = field(default_factory=list)
    counter_ranges: CounterRanges = field(default_factory=CounterRanges.empty)
    comm: Columns = field(default_factory=lambda: _to_numpy(_Rows(_COMM_COLUMNS)))


class _Rows:
    """Typed columns being filled; `add` takes one value per column, in the spec's order. The hot
    path appends through `appends` (one bound `array.append` per column) instead."""

    def __init__(self, spec: dict[str, str]) -> None:
        self.columns = {key: array(typecode) for key, typecode in spec.items()}
        self.appends: list[Callable[[Any], None]] = [column.append for column in self.columns.values()]

    def add(self, *values: Any) -> None:
        for append, value in zip(self.appends, values):
            append(value)


class _Builder:
    """Accumulates compact rows while the document streams past.

    This runs once per event (millions on a long run), so it is written for speed: numbers that are
    already `float`/`int` skip the conversion helpers, per-name and per-thread facts are computed
    once and cached, and recorded shapes are interned by a cheap key (see `_shape`)."""

    def __init__(self) -> None:
        self.names: dict[str, int] = {}
        self.threads: dict[str, int] = {}
        self.shapes: dict[str, int] = {}
        self.host, self.gpu = _Rows(_HOST_COLUMNS), _Rows(_GPU_COLUMNS)
        self.flows, self.memory = _Rows(_FLOW_COLUMNS), _Rows(_MEMORY_COLUMNS)
        self.unified = _Rows(_UNIFIED_COLUMNS)
        self.comm = _Rows(_COMM_COLUMNS)
        self.ranges = _Rows({"name": "l", "dur": "d"})  # CUPTI range-profiler ranges
        self.range_counters: list[dict[str, Any]] = []  # their args: counter name -> value
        self.num_python = 0
        self.num_invalid = 0  # events dropped for a negative, NaN, missing or absurd duration
        self.range_names: dict[int, bool] = {}  # name index -> is_range_name(name)
        self.unified_names: dict[str, bool] = {}  # GPU activity name -> unified-memory activity
        self.thread_keys: dict[tuple[int, int], int] = {}  # (pid, tid), both ints -> thread index
        self.shape_keys: dict[bytes | str, int] = {}  # cheap key of [Input Dims, Input type] -> shape index

    def _intern(self, table: dict[str, int], key: str) -> int:
        index = table.get(key)
        if index is None:
            index = table[key] = len(table)
        return index

    def add(self, event: Any) -> None:
        if type(event) is not dict:  # both decoders give plain dicts; anything else is not an event
            return
        phase = event.get("ph")
        if phase == "X":
            self._add_complete(event)
        elif phase == "s" and event.get("cat") == "ac2g":
            self.flows.add(_int(event.get("id")), _float(event.get("ts")), self._thread(event))
        elif phase == "i" and event.get("name") == "[memory]":
            args = _args(event)
            self.memory.add(
                _float(event.get("ts")),
                _int(args.get("Total Allocated"), 0),
                _int(args.get("Total Reserved"), 0),
                _int(args.get("Device Id")),
            )

    def _add_complete(self, event: dict[str, Any]) -> None:
        cat = event.get("cat", "")
        found = _CATEGORIES.get(cat) if type(cat) is str else None
        group, kind = found or _CATEGORIES.get(str(cat).lower(), ("", 0))
        dur = _float(event.get("dur"))
        # NaN, negative, infinite or longer than any profiled window (`dur: 1e308` summed to 1e308 s):
        # no interval to measure. Timestamps past the bound would stretch the window the same way.
        if group and not (0 <= dur < MAX_EVENT_US and abs(_float(event.get("ts"))) < MAX_TIMESTAMP_US):
            self.num_invalid += 1
            return
        name = event.get("name", "")
        if type(name) is not str:
            name = str(name)
        if group == "host":
            self._add_host(event, kind, name, dur)
        elif group == "gpu" and not self._is_unified(name):
            args = _args(event)
            if "Collective name" in args:
                self._add_comm(args)
            ts_, dur_, kind_, name_, device_, stream_, corr_, bytes_ = self.gpu.appends
            ts_(_float(event.get("ts")))
            dur_(dur)
            kind_(kind)
            name_(self._intern(self.names, name))
            device_(_int(args.get("device", event.get("pid")), 0))
            stream_(_int(args.get("stream", event.get("tid"))))
            corr_(_int(args.get("correlation")))
            bytes_(_int(args.get("bytes")))
        elif cat == PROFILER_RANGE_CAT:
            self.ranges.add(self._intern(self.names, name), dur)
            self.range_counters.append(_args(event))
        elif group == "gpu" or _UNIFIED_CAT.search(str(cat)) or self._is_unified(name):
            self.unified.add(_float(event.get("ts")), dur, _int(_args(event).get("bytes")))
        elif cat == "python_function":
            self.num_python += 1

    def _add_comm(self, args: dict[str, Any]) -> None:
        """NCCL metadata of the GPU row about to be added (its index is the current row count)."""
        self.comm.add(
            len(self.gpu.columns["ts"]),
            self._intern(self.names, str(args.get("Process Group Name", ""))),
            self._intern(self.names, str(args.get("Collective name", ""))),
            _int(args.get("In msg nelems")),
        )

    def _add_host(self, event: dict[str, Any], kind: int, name: str, dur: float) -> None:
        name_index = self.names.get(name)
        if name_index is None:
            name_index = self.names[name] = len(self.names)
        if kind == OP and self._is_range(name_index, name):
            kind = ANNOTATION
        args = _args(event)
        ts_, dur_, kind_, name_, thread_, corr_, shape_ = self.host.appends
        ts_(_float(event.get("ts")))
        dur_(dur)
        kind_(kind)
        name_(name_index)
        thread_(self._thread(event))
        corr_(_int(args.get("correlation")))
        dims = args.get("Input Dims") if kind == OP else None
        shape_(-1 if dims is None else self._shape([dims, args.get("Input type", [])]))

    def _is_range(self, name_index: int, name: str) -> bool:
        """Whether an operator event is really a record_function range (2021 schemas), once per name."""
        found = self.range_names.get(name_index)
        if found is None:
            found = self.range_names[name_index] = is_range_name(name)
        return found

    def _is_unified(self, name: str) -> bool:
        """Whether a GPU activity's name says unified memory (a page fault, a migration), once per name."""
        found = self.unified_names.get(name)
        if found is None:
            found = self.unified_names[name] = bool(_UNIFIED_NAME.search(name))
        return found

    def _thread(self, event: dict[str, Any]) -> int:
        pid, tid = event.get("pid"), event.get("tid")
        if type(pid) is not int or type(tid) is not int:  # the label tells 1 from 1.0 and "1"
            return self._intern(self.threads, f"{pid}/{tid}")
        index = self.thread_keys.get((pid, tid))
        if index is None:
            index = self.thread_keys[pid, tid] = self._intern(self.threads, f"{pid}/{tid}")
        return index

    def _shape(self, value: list[Any]) -> int:
        """Index of `[Input Dims, Input type]` in `shapes`, which holds its `json.dumps` text.

        Encoding every op's shapes with `json.dumps` was a tenth of the parse; orjson's encoding is
        ten times cheaper and, for what the decoders return, equal exactly when the values are equal,
        except that it writes NaN as `null` (NaN reaches here only from the standard decoder) and
        refuses integers beyond 64 bits. Keys with `null` or refused ones fall back to the text
        itself; the two kinds of key are `bytes` and `str`, so they never collide."""
        key: bytes | str | None = None
        if orjson is not None:
            # orjson.JSONEncodeError (a TypeError): an integer beyond 64 bits, a lone surrogate.
            with contextlib.suppress(TypeError):
                key = orjson.dumps(value)
            if key is not None and b"null" in key:
                key = None
        text = None
        if key is None:
            key = text = json.dumps(value)
        index = self.shape_keys.get(key)
        if index is None:
            index = self.shape_keys[key] = self._intern(self.shapes, text or json.dumps(value))
        return index


def _args(event: dict[str, Any]) -> dict[str, Any]:
    args = event.get("args")
    return args if type(args) is dict else {}


def _float(value: Any) -> float:
    if type(value) is float:
        return value
    try:
        return float(value)
    except (TypeError, ValueError):
        return float("nan")


def _int(value: Any, default: int = -1) -> int:
    """An integer field, or `default` when missing, malformed or outside int64 (traces are untrusted)."""
    if type(value) is int and -(2**63) <= value < 2**63:
        return value
    if value is None:
        return default
    try:
        number = int(value)
    except (TypeError, ValueError, OverflowError):
        return default
    return number if -(2**63) <= number < 2**63 else default


def _to_numpy(rows: _Rows) -> Columns:
    """Numpy views of the filled arrays (no copy)."""
    return Columns(
        {
            key: np.frombuffer(col, dtype=col.typecode) if len(col) else np.zeros(0, dtype=col.typecode)
            for key, col in rows.columns.items()
        }
    )


def _counter_ranges(builder: _Builder) -> CounterRanges:
    """The ranges' columns and one float column per counter that some range recorded as a number."""
    rows = _to_numpy(builder.ranges)
    keys = sorted({key for args in builder.range_counters for key in args})
    values = {key: np.array([_float(args.get(key)) for args in builder.range_counters]) for key in keys}
    return CounterRanges(rows.name, rows.dur, {k: v for k, v in values.items() if np.isfinite(v).any()})


def _open_text(path: Path):
    """A text stream over a plain or gzip file (detected by its magic bytes, not its suffix)."""
    with open(path, "rb") as raw:
        magic = raw.read(2)
    if magic == b"\x1f\x8b":
        return gzip.open(path, "rt", encoding="utf-8", errors="replace")
    return open(path, encoding="utf-8", errors="replace")


def _read(path: Path) -> tuple[_Builder, dict[str, Any]]:
    if not path.is_file():
        raise TracetrainError(f"trace file not found: {path}")
    builder = _Builder()
    # Decoding makes millions of short-lived dicts and lists that never form reference cycles; the
    # cyclic collector would walk them again and again (about a seventh of the parse), so it waits.
    collecting = gc.isenabled()
    gc.disable()
    try:
        with _open_text(path) as text:
            others = read_trace_document(text, builder.add)
    except (ValueError, OSError, EOFError, zlib.error) as error:
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise TracetrainError(f"{path}: not a readable JSON trace ({reason})") from None
    except RecursionError:  # the decoder recurses once per nesting level; no profiler writes that deep
        raise TracetrainError(f"{path}: not a readable JSON trace (nested too deeply)") from None
    finally:
        if collecting:
            gc.enable()
    if "traceEvents" not in others:
        raise TracetrainError(f"{path}: no 'traceEvents' list; is this a PyTorch profiler trace?")
    return builder, others


def _device_info(others: dict[str, Any], device_name: str | None) -> tuple[str | None, int | None]:
    """Device name (argument first, else the trace's deviceProperties) and memory in bytes."""
    props = others.get("deviceProperties")
    first = props[0] if isinstance(props, list) and props and isinstance(props[0], dict) else {}
    memory = _int(first.get("totalGlobalMem"))
    name = first.get("name")  # a forged trace may put anything here; only a string names a device
    return device_name or (name if isinstance(name, str) else None) or None, memory if memory > 0 else None


def _window(host: Columns, gpu: Columns) -> tuple[float, float]:
    """From the first to the last event of the profiled window (host and GPU, all kinds)."""
    starts = np.concatenate([host.ts, gpu.ts])
    ends = np.concatenate([host.ts + host.dur, gpu.ts + gpu.dur])
    finite = np.isfinite(starts) & np.isfinite(ends)
    if not finite.any():
        return 0.0, 0.0
    return float(starts[finite].min()), float(ends[finite].max())


def parse_kineto(path: str | Path, *, rank: int = 0, device_name: str | None = None) -> Trace:
    """Stream one Kineto JSON trace file into a `Trace`. `rank` is used when the trace has no distributedInfo.

    Raises TracetrainError naming the file when it is missing, not JSON, has no `traceEvents`, or has
    no host or GPU events at all. A CPU-only trace (no GPU events) parses, with a note; so does a CUPTI
    range-profiler trace, with a note saying what its counter ranges hold and what they cannot give.
    `reader.parse_trace` picks this reader or nsys.py's by the file's header.
    """
    path = Path(path)
    builder, others = _read(path)
    host, gpu = _to_numpy(builder.host), _to_numpy(builder.gpu)
    ranges = _counter_ranges(builder)
    if len(host) == 0 and len(gpu) == 0 and len(ranges) == 0:
        raise TracetrainError(f"{path}: no profiler events (cpu_op, kernel, ...) in traceEvents")
    found = others.get("distributedInfo")
    info: dict = found if isinstance(found, dict) else {}
    name, memory = _device_info(others, device_name)
    names = list(builder.names)
    gpu_links = link_launches(host, gpu, _to_numpy(builder.flows), names)
    trace = Trace(
        path=str(path),
        rank=_int(info.get("rank"), rank),
        world_size=_int(info.get("world_size"), 1),
        device_name=name,
        device_memory_bytes=memory,
        names=names,
        threads=list(builder.threads),
        shapes=list(builder.shapes),
        host=host,
        gpu=Columns({**gpu.data, **gpu_links}),
        memory=_to_numpy(builder.memory),
        unified=_to_numpy(builder.unified),
        window=_window(host, gpu),
        num_python_events=builder.num_python,
        counter_ranges=ranges,
        comm=_to_numpy(builder.comm),
    )
    if builder.num_invalid:
        trace.notes.append(
            f"{path.name}: dropped {builder.num_invalid} events with invalid durations (negative, NaN, "
            "missing, longer than a week or at an absurd timestamp)"
        )
    if len(ranges):
        trace.notes.append(_counter_note(path.name, ranges, has_kernels=len(gpu) > 0))
    elif len(gpu) == 0:
        trace.notes.append(
            f"{path.name}: no GPU events (kernels, copies); was the profiler run with "
            "ProfilerActivity.CUDA on a GPU? GPU analyses are empty."
        )
    return trace


def _counter_note(file: str, ranges: CounterRanges, has_kernels: bool) -> str:
    """What a trace with CUPTI range-profiler ranges holds, and what cannot be computed from them."""
    durations = np.unique(ranges.dur[np.isfinite(ranges.dur)])
    timing = f" (here every range lasts {durations[0]:,.0f} µs)" if len(durations) == 1 else ""
    held = (
        f"{file}: {len(ranges)} CUPTI range-profiler ranges (cuda_profiler_range) recording "
        f"{len(ranges.values)} hardware counters; the counter tables show them."
    )
    if has_kernels:
        return held + " Their times are placeholders, so they are not counted as GPU time."
    return (
        held + " Kineto runs this profiler instead of kernel tracing: no kernel, copy or memset has a time. It "
        "replays every kernel to count and splits the profiled span evenly between the ranges" + timing + ", so "
        "GPU time, utilisation, idle causes, overlap and the bound verdict cannot be computed, and the host "
        "times below include the replays."
    )
