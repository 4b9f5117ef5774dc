"""Read an Nsight Systems SQLite export (`nsys export --type sqlite report.nsys-rep`) into `Trace`s.

Built from NVIDIA's documented export schema (the Nsight Systems "SQLite Schema Reference" and "SQLite
Schema Event Values" pages, and the queries of nsys's own stats reports) and tested on synthetic
exports only (`tests/nsys_gen.py`): no real `nsys export` file has been read by it. What is read:

| table: columns                                      | becomes                                         |
|-----------------------------------------------------|-------------------------------------------------|
| CUPTI_ACTIVITY_KIND_KERNEL: start, end, deviceId,   | GPU `KERNEL` rows named by the demangled name   |
|   streamId, correlationId, globalPid, demangledName | (Kineto's kernel names are demangled too)       |
| CUPTI_ACTIVITY_KIND_MEMCPY: the same less the name, | `MEMCPY` rows named as Kineto does,             |
|   bytes, copyKind, srcKind, dstKind                 | `Memcpy HtoD (Pageable -> Device)`; unified-    |
|                                                     | memory copy kinds go to the `unified` columns   |
| CUPTI_ACTIVITY_KIND_MEMSET: ..., bytes, memKind     | `MEMSET` rows, `Memset (Device)`                |
| CUPTI_ACTIVITY_KIND_RUNTIME: start, end, globalTid, | host `RUNTIME` rows (CUDA runtime and driver    |
|   correlationId, nameId                             | calls), the `_v7000` symbol version dropped     |
| NVTX_EVENTS: start, end, eventType, globalTid,      | host `ANNOTATION` rows from push/pop and        |
|   text, textId                                      | start/end ranges; `step N` -> `ProfilerStep#N`  |
| StringIds: id, value                                | the names behind nameId, textId, demangledName  |
| TARGET_INFO_GPU: id, name, totalMemory;             | device name and memory                          |
|   TARGET_INFO_CUDA_DEVICE: pid, cudaId, gpuId       |                                                 |
| ENUM_CUDA_MEMCPY_OPER, ENUM_CUDA_MEM_KIND           | copy and memory kinds (when the export has      |
|                                                     | them; else the documented values below)         |

Tables are created lazily by nsys, so any but the kernel table may be missing; a missing one reads as
empty. Times are integer nanoseconds in the export and microseconds in a `Trace`: `_us` converts, in
one place. A thread is `pid/tid` decoded from the serialized `globalTid` (pid = bits 24-47, tid =
bits 0-23; `globalPid` is `globalTid` with the tid bits zero).

Correlation ids are unique within one process only, and `nsys profile torchrun ...` records every
rank's process in one export. So each process that ran GPU work becomes its own `Trace` (one rank),
ordered by the GPU it used, then by pid; host rows are matched to it through the pid bits of
`globalTid`.

Not in an export, so empty here: `cpu_op` ranges and their recorded shapes (GEMM FLOP/s need them),
allocator `[memory]` events, `ac2g` flows (correlation ids link launches instead).
"""

from __future__ import annotations

import re
import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from tracetrain.errors import TracetrainError
from tracetrain.profile.analyze.link import link_launches

# The Kineto reader's column specs and typed-row buffers: both readers fill the same `Trace`.
from tracetrain.profile.analyze.trace import (
    _FLOW_COLUMNS,
    _GPU_COLUMNS,
    _HOST_COLUMNS,
    _MEMORY_COLUMNS,
    _UNIFIED_COLUMNS,
    ANNOTATION,
    KERNEL,
    MEMCPY,
    MEMSET,
    RUNTIME,
    Columns,
    Trace,
    _Rows,
    _to_numpy,
    _window,
)

SQLITE_MAGIC = b"SQLite format 3\x00"  # the first 16 bytes of every SQLite database (Nsight Systems export)

NS_PER_US = 1000.0
_CHUNK_ROWS = 8192
_KERNELS, _MEMCPY, _MEMSET = ("CUPTI_ACTIVITY_KIND_KERNEL", "CUPTI_ACTIVITY_KIND_MEMCPY", "CUPTI_ACTIVITY_KIND_MEMSET")
_RUNTIME, _NVTX = "CUPTI_ACTIVITY_KIND_RUNTIME", "NVTX_EVENTS"
# NVTX_EVENTS.eventType of ranges: NvtxPushPopRange, NvtxStartEndRange, and the NVTXT twins that nsys's
# own NVTX reports read alongside them (marks, 34, and domain/category records are not ranges).
_NVTX_RANGE_TYPES = (59, 60, 70, 71)
# ENUM_CUDA_MEMCPY_OPER and ENUM_CUDA_MEM_KIND as documented ("SQLite Schema Event Values"); an export
# that carries the enum tables is read from them instead. Note the memory kinds are nsys's own
# numbering (Pageable = 0), not CUPTI's (where 0 is Unknown).
_COPY_KINDS = {
    0: "CUDA_MEMCPY_KIND_UNKNOWN",
    1: "CUDA_MEMCPY_KIND_HTOD",
    2: "CUDA_MEMCPY_KIND_DTOH",
    3: "CUDA_MEMCPY_KIND_HTOA",
    4: "CUDA_MEMCPY_KIND_ATOH",
    5: "CUDA_MEMCPY_KIND_ATOA",
    6: "CUDA_MEMCPY_KIND_ATOD",
    7: "CUDA_MEMCPY_KIND_DTOA",
    8: "CUDA_MEMCPY_KIND_DTOD",
    9: "CUDA_MEMCPY_KIND_HTOH",
    10: "CUDA_MEMCPY_KIND_PTOP",
    11: "CUDA_MEMCPY_KIND_UVM_HTOD",
    12: "CUDA_MEMCPY_KIND_UVM_DTOH",
    13: "CUDA_MEMCPY_KIND_UVM_DTOD",
}
_MEM_KINDS = {
    0: "Pageable",
    1: "Pinned",
    2: "Device",
    3: "Array",
    4: "Managed",
    5: "Device Static",
    6: "Managed Static",
    7: "Unknown",
}
_API_VERSION = re.compile(r"_v\d{4}$")  # cudaLaunchKernel_v7000; not cuMemcpyDtoH_v2, a real name
_STEP_RANGE = re.compile(r"^step (\d+)$")  # tracetrain's NVTX step range (profile/capture.py)


def _us(ns: np.ndarray) -> np.ndarray:
    """Export nanoseconds -> `Trace` microseconds: the reader's one unit conversion."""
    return ns.astype(np.float64) / NS_PER_US


def _copy_label(symbol: str) -> str:
    """`HtoD` from `CUDA_MEMCPY_KIND_HTOD`, spelled as Kineto names copies; `Unknown` otherwise."""
    src, sep, dst = symbol.removeprefix("CUDA_MEMCPY_KIND_").partition("TO")
    return f"{src}to{dst}" if sep and len(src) == len(dst) == 1 else "Unknown"


def _thread_label(global_tid: int) -> str:
    return f"{(global_tid >> 24) & 0xFFFFFF}/{global_tid & 0xFFFFFF}"


class _Interner:
    """Strings -> dense indices, as `Trace.names` / `Trace.threads` hold them."""

    def __init__(self) -> None:
        self.index: dict[str, int] = {}

    def add(self, key: str) -> int:
        return self.index.setdefault(key, len(self.index))

    def codes(self, keys: np.ndarray, label: Callable[[int], str]) -> np.ndarray:
        """The index of `label(key)` for every key; each distinct key is labelled once."""
        unique, inverse = np.unique(keys, return_inverse=True)
        table = np.fromiter((self.add(label(int(k))) for k in unique.tolist()), np.int64, len(unique))
        return table[inverse.reshape(-1)]


class _Export:
    """An open export: which tables and columns it has, its strings and enum labels."""

    def __init__(self, path: Path, conn: sqlite3.Connection) -> None:
        self.path, self.conn = path, conn
        self.tables = {name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        self._strings: dict[int, str] = {}
        self.copy_kinds = self._enum("ENUM_CUDA_MEMCPY_OPER", "name", _COPY_KINDS)
        self.mem_kinds = self._enum("ENUM_CUDA_MEM_KIND", "label", _MEM_KINDS)

    def columns(self, table: str) -> set[str]:
        return {row[1] for row in self.conn.execute(f"PRAGMA table_info({table})")}

    def column(self, table: str, name: str, default: str) -> str:
        """`name`, or the SQL literal `default` when this export's table lacks the column."""
        return name if name in self.columns(table) else default

    def string(self, string_id: int) -> str:
        if string_id not in self._strings:
            row = self.conn.execute("SELECT value FROM StringIds WHERE id = ?", (string_id,)).fetchone()
            self._strings[string_id] = row[0] if row and row[0] is not None else f"<string {string_id}>"
        return self._strings[string_id]

    def chunks(self, sql: str, params: tuple = ()) -> Iterator[np.ndarray]:
        """An all-integer query, `_CHUNK_ROWS` rows at a time, each chunk a (rows, columns) int64 array."""
        cursor = self.conn.execute(sql, params)
        while rows := cursor.fetchmany(_CHUNK_ROWS):
            yield np.array(rows, dtype=np.int64)

    def _enum(self, table: str, column: str, default: dict[int, str]) -> dict[int, str]:
        if table not in self.tables or column not in self.columns(table):
            return default
        return {**default, **{i: v for i, v in self.conn.execute(f"SELECT id, {column} FROM {table}") if v is not None}}


def _gpu_where(process: int | None) -> tuple[str, tuple]:
    return ("globalPid IS ?", (process,)) if process is not None else ("1", ())


def _host_where(process: int | None) -> tuple[str, tuple]:
    # A thread belongs to the process whose globalPid equals its globalTid less the tid bits.
    return ("globalTid >> 24 = ?", (process >> 24,)) if process is not None else ("1", ())


class _Tables:
    """The `Trace` columns of one process, filled a chunk of rows at a time."""

    def __init__(self, export: _Export) -> None:
        self.export = export
        self.host, self.gpu, self.unified = _Rows(_HOST_COLUMNS), _Rows(_GPU_COLUMNS), _Rows(_UNIFIED_COLUMNS)
        self.names, self.threads = _Interner(), _Interner()
        self.last_end_ns = 0

    def append(self, rows: _Rows, start_ns: np.ndarray, end_ns: np.ndarray, **values: np.ndarray | int) -> None:
        """One chunk of rows; times convert from ns to µs here, and a column not given is -1 (unknown)."""
        values = {"ts": _us(start_ns), "dur": _us(end_ns - start_ns), **values}
        for key, column in rows.columns.items():
            value = np.broadcast_to(values.get(key, -1), start_ns.shape)
            column.frombytes(np.ascontiguousarray(value, dtype=column.typecode).tobytes())
        self.last_end_ns = max(self.last_end_ns, int(end_ns.max(initial=0)))

    def kernels(self, process: int | None) -> None:
        where, params = _gpu_where(process)
        for chunk in self.export.chunks(
            f"SELECT start, end, deviceId, streamId, coalesce(correlationId, -1), "
            f"demangledName FROM {_KERNELS} WHERE {where}",
            params,
        ):
            self.append(
                self.gpu,
                chunk[:, 0],
                chunk[:, 1],
                kind=KERNEL,
                device=chunk[:, 2],
                stream=chunk[:, 3],
                corr=chunk[:, 4],
                name=self.names.codes(chunk[:, 5], self.export.string),
            )

    def copies(self, process: int | None) -> None:
        """Copies (GPU rows) and unified-memory migrations (`unified` rows)."""
        if _MEMCPY not in self.export.tables:
            return
        where, params = _gpu_where(process)
        src, dst = (self.export.column(_MEMCPY, kind, "-1") for kind in ("srcKind", "dstKind"))
        uvm = [kind for kind, symbol in self.export.copy_kinds.items() if "_UVM_" in symbol]
        for chunk in self.export.chunks(
            f"SELECT start, end, deviceId, streamId, coalesce(correlationId, -1), "
            f"bytes, copyKind, coalesce({src}, -1), coalesce({dst}, -1) "
            f"FROM {_MEMCPY} WHERE {where}",
            params,
        ):
            unified = np.isin(chunk[:, 6], uvm)
            self.append(self.unified, chunk[unified, 0], chunk[unified, 1], bytes=chunk[unified, 5])
            copy = chunk[~unified]
            keys = ((copy[:, 6] & 0xFF) << 16) | ((copy[:, 7] & 0xFF) << 8) | (copy[:, 8] & 0xFF)
            self.append(
                self.gpu,
                copy[:, 0],
                copy[:, 1],
                kind=MEMCPY,
                device=copy[:, 2],
                stream=copy[:, 3],
                corr=copy[:, 4],
                bytes=copy[:, 5],
                name=self.names.codes(keys, self._copy_name),
            )

    def _copy_name(self, key: int) -> str:
        """Kineto's name for a copy, `Memcpy HtoD (Pageable -> Device)`, from copy and memory kinds."""
        kinds = self.export.mem_kinds
        return (
            f"Memcpy {_copy_label(self.export.copy_kinds.get(key >> 16, ''))} "
            f"({kinds.get((key >> 8) & 0xFF, 'Unknown')} -> {kinds.get(key & 0xFF, 'Unknown')})"
        )

    def memsets(self, process: int | None) -> None:
        if _MEMSET not in self.export.tables:
            return
        where, params = _gpu_where(process)
        mem_kind = self.export.column(_MEMSET, "memKind", "2")  # older exports: device memory
        kinds = self.export.mem_kinds
        for chunk in self.export.chunks(
            f"SELECT start, end, deviceId, streamId, coalesce(correlationId, -1), "
            f"bytes, coalesce({mem_kind}, -1) FROM {_MEMSET} WHERE {where}",
            params,
        ):
            self.append(
                self.gpu,
                chunk[:, 0],
                chunk[:, 1],
                kind=MEMSET,
                device=chunk[:, 2],
                stream=chunk[:, 3],
                corr=chunk[:, 4],
                bytes=chunk[:, 5],
                name=self.names.codes(chunk[:, 6], lambda k: f"Memset ({kinds.get(k, 'Unknown')})"),
            )

    def runtime(self, process: int | None) -> None:
        if _RUNTIME not in self.export.tables:
            return
        where, params = _host_where(process)
        for chunk in self.export.chunks(
            f"SELECT start, end, coalesce(globalTid, 0), coalesce(correlationId, -1), "
            f"nameId FROM {_RUNTIME} WHERE {where}",
            params,
        ):
            self.append(
                self.host,
                chunk[:, 0],
                chunk[:, 1],
                kind=RUNTIME,
                corr=chunk[:, 3],
                thread=self.threads.codes(chunk[:, 2], _thread_label),
                name=self.names.codes(chunk[:, 4], lambda k: _API_VERSION.sub("", self.export.string(k))),
            )

    def nvtx(self, process: int | None) -> None:
        """NVTX ranges, read last: one never closed in the capture (NULL end) runs to the end of the
        last GPU activity or CUDA call."""
        if _NVTX not in self.export.tables:
            return
        where, params = _host_where(process)
        kinds = ", ".join(map(str, _NVTX_RANGE_TYPES))
        cursor = self.export.conn.execute(
            f"SELECT start, end, coalesce(globalTid, 0), textId, text "
            f"FROM {_NVTX} WHERE eventType IN ({kinds}) AND {where}",
            params,
        )
        open_end_ns = self.last_end_ns
        while rows := cursor.fetchmany(_CHUNK_ROWS):
            start = np.array([row[0] for row in rows], np.int64)
            end = np.array([max(open_end_ns, row[0]) if row[1] is None else row[1] for row in rows], np.int64)
            thread = np.array([self.threads.add(_thread_label(row[2])) for row in rows], np.int64)
            name = np.array([self.names.add(_nvtx_name(self.export, row[3], row[4])) for row in rows], np.int64)
            self.append(self.host, start, end, kind=ANNOTATION, thread=thread, name=name)


def _nvtx_name(export: _Export, text_id: int | None, text: str | None) -> str:
    """A registered string (textId) or the plain text; tracetrain's `step N` reads as a profiler step,
    so steps and their analyses work as with Kineto's `ProfilerStep#N`."""
    name = export.string(text_id) if text_id is not None else (text or "")
    step = _STEP_RANGE.match(name)
    return f"ProfilerStep#{step.group(1)}" if step else name


def _processes(export: _Export) -> list[int | None]:
    """globalPid of each process with GPU activity, ordered by its lowest device id, then globalPid
    (None: one process, for an export without process ids)."""
    tables = [t for t in (_KERNELS, _MEMCPY, _MEMSET) if t in export.tables]
    if not all("globalPid" in export.columns(t) for t in tables):
        return [None]
    union = " UNION ALL ".join(f"SELECT globalPid, deviceId FROM {t}" for t in tables)
    found = [
        pid
        for pid, _ in export.conn.execute(
            f"SELECT globalPid, min(deviceId) FROM ({union}) GROUP BY globalPid ORDER BY 2, 1"
        )
    ]
    return found or [None]


def _device_info(export: _Export, process: int | None, device: int) -> tuple[str | None, int | None]:
    """Name and memory (bytes) of the GPU the process used most. `deviceId` is the process's CUDA
    ordinal; TARGET_INFO_CUDA_DEVICE maps (pid, cudaId) to TARGET_INFO_GPU's id where present."""
    if "TARGET_INFO_GPU" not in export.tables or device < 0:
        return None, None
    memory = export.column("TARGET_INFO_GPU", "totalMemory", "NULL")
    gpus = {
        gpu: (name, mem) for gpu, name, mem in export.conn.execute(f"SELECT id, name, {memory} FROM TARGET_INFO_GPU")
    }
    gpu_id = device
    if "TARGET_INFO_CUDA_DEVICE" in export.tables and process is not None:
        row = export.conn.execute(
            "SELECT gpuId FROM TARGET_INFO_CUDA_DEVICE WHERE pid = ? AND cudaId = ?",
            ((process >> 24) & 0xFFFFFF, device),
        ).fetchone()
        gpu_id = row[0] if row and row[0] is not None else device
    if gpu_id not in gpus and len(set(gpus.values())) == 1:
        gpu_id = next(iter(gpus))  # one kind of GPU in the machine: it is that one
    name, mem = gpus.get(gpu_id, (None, None))
    return name or None, mem if isinstance(mem, int) and mem > 0 else None


def _process_trace(export: _Export, process: int | None, rank: int, world_size: int, device_name: str | None) -> Trace:
    tables = _Tables(export)
    for read in (tables.kernels, tables.copies, tables.memsets, tables.runtime, tables.nvtx):
        read(process)
    host, gpu = _to_numpy(tables.host), _to_numpy(tables.gpu)
    names = list(tables.names.index)
    links = link_launches(host, gpu, _to_numpy(_Rows(_FLOW_COLUMNS)), names)
    device = int(np.argmax(np.bincount(gpu.device, weights=gpu.dur))) if len(gpu) else -1
    trace_name, memory = _device_info(export, process, device)
    pid = f" (pid {(process >> 24) & 0xFFFFFF})" if world_size > 1 and process is not None else ""
    trace = Trace(
        path=f"{export.path}{pid}",
        rank=rank,
        world_size=world_size,
        device_name=device_name or trace_name,
        device_memory_bytes=memory,
        names=names,
        threads=list(tables.threads.index),
        shapes=[],
        host=host,
        gpu=Columns({**gpu.data, **links}),
        memory=_to_numpy(_Rows(_MEMORY_COLUMNS)),
        unified=_to_numpy(tables.unified),
        window=_window(host, gpu),
    )
    if world_size > 1:
        trace.notes.append(
            f"{export.path.name}: {world_size} GPU processes; ranks are numbered in GPU order "
            "(an export records no torch.distributed rank)"
        )
    if not (host.kind == ANNOTATION).any():
        trace.notes.append(
            f"{export.path.name}: no NVTX ranges (capture with `nsys profile -t cuda,nvtx`): no steps or phases"
        )
    return trace


def _open(path: Path) -> sqlite3.Connection:
    # Read-only and immutable (an export is a finished file): SQLite takes no locks, so an export on a
    # read-only or lock-less (network) file system reads too.
    return sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro&immutable=1", uri=True)


def is_sqlite(path: str | Path) -> bool:
    """Whether the file starts with SQLite's header (whatever its name)."""
    with open(path, "rb") as raw:
        return raw.read(len(SQLITE_MAGIC)) == SQLITE_MAGIC


def read_nsys(path: str | Path, *, rank: int = 0, device_name: str | None = None) -> Iterator[Trace]:
    """One `Trace` per process of the export that ran GPU work, ranks numbered from `rank`.

    Raises TracetrainError naming the file when it is not an SQLite database, is unreadable, or has no
    CUPTI_ACTIVITY_KIND_KERNEL table (a report captured without CUDA tracing).
    """
    path = Path(path)
    if not is_sqlite(path):
        raise TracetrainError(
            f"{path}: not an SQLite database (no 'SQLite format 3' header); expected the "
            "output of `nsys export --type sqlite`"
        )
    conn = None
    try:
        conn = _open(path)
        export = _Export(path, conn)
        if _KERNELS not in export.tables:
            raise TracetrainError(
                f"{path}: no {_KERNELS} table; was the report captured with CUDA tracing "
                "(`nsys profile -t cuda,nvtx`) and exported with `nsys export --type sqlite`?"
            )
        processes = _processes(export)
        for index, process in enumerate(processes):
            yield _process_trace(export, process, rank + index, len(processes), device_name)
    except sqlite3.Error as error:
        raise TracetrainError(f"{path}: not a readable Nsight Systems export ({error})") from None
    finally:
        if conn is not None:
            conn.close()
