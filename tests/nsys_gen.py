"""Generate small Nsight Systems SQLite exports with known answers, for the nsys reader's tests.

The tables follow NVIDIA's documented export schema (`nsys export --type sqlite`): a subset of each
table's columns (those the analyzer reads, plus the NOT NULL ones around them), the documented enum
values (ENUM_CUDA_MEMCPY_OPER, ENUM_CUDA_MEM_KIND, NVTX eventType), serialized ids (globalPid =
pid << 24, globalTid = globalPid | tid) and a table only when it has rows, as nsys creates them lazily.
These are synthetic: nothing here was checked against a real export.

Two ways to build one:
- `NsysExportBuilder`: rows by hand, with times in µs relative to the session origin (like
  `traces_gen.KinetoTraceBuilder`), stored as integer ns;
- `from_kineto(doc)`: the events of a generated Kineto trace (`traces_gen`) as an export, so the two
  readers can be checked against each other on the same scenario.
"""

from __future__ import annotations

import re
import sqlite3
from pathlib import Path
from typing import Any

import traces_gen as gen

ORIGIN_NS = 1_234_567_000  # session-relative ns of the builder's time 0, like a real export's `start`
H100_GPU = {"name": "NVIDIA H100 80GB HBM3", "totalMemory": 85_045_821_440, "smCount": 132}
PUSH_POP, START_END, MARK = 59, 60, 34  # ENUM_NSYS_EVENT_TYPE
COPY_KINDS = {"HtoD": 1, "DtoH": 2, "DtoD": 8, "HtoH": 9, "PtoP": 10, "UVM_HtoD": 11, "UVM_DtoH": 12}
MEM_KINDS = {"Pageable": 0, "Pinned": 1, "Device": 2, "Managed": 4}  # nsys's numbering, not CUPTI's

_SCHEMA = {
    "StringIds": "id INTEGER NOT NULL PRIMARY KEY, value TEXT NOT NULL",
    "TARGET_INFO_GPU": "vmId INTEGER NOT NULL, id INTEGER NOT NULL, name TEXT, busLocation TEXT, "
                       "totalMemory INTEGER, smCount INTEGER, cuDevice INTEGER",
    "TARGET_INFO_CUDA_DEVICE": "gpuId INTEGER, cudaId INTEGER NOT NULL, pid INTEGER NOT NULL, uuid TEXT",
    "CUPTI_ACTIVITY_KIND_KERNEL": "start INTEGER NOT NULL, end INTEGER NOT NULL, deviceId INTEGER NOT NULL, "
                                  "contextId INTEGER NOT NULL, streamId INTEGER NOT NULL, correlationId INTEGER, "
                                  "globalPid INTEGER, demangledName INTEGER NOT NULL, shortName INTEGER NOT NULL, "
                                  "registersPerThread INTEGER NOT NULL, gridX INTEGER NOT NULL, "
                                  "blockX INTEGER NOT NULL, gridId INTEGER NOT NULL",
    "CUPTI_ACTIVITY_KIND_MEMCPY": "start INTEGER NOT NULL, end INTEGER NOT NULL, deviceId INTEGER NOT NULL, "
                                  "contextId INTEGER NOT NULL, streamId INTEGER NOT NULL, correlationId INTEGER, "
                                  "globalPid INTEGER, bytes INTEGER NOT NULL, copyKind INTEGER NOT NULL, "
                                  "srcKind INTEGER, dstKind INTEGER",
    "CUPTI_ACTIVITY_KIND_MEMSET": "start INTEGER NOT NULL, end INTEGER NOT NULL, deviceId INTEGER NOT NULL, "
                                  "contextId INTEGER NOT NULL, streamId INTEGER NOT NULL, correlationId INTEGER, "
                                  "globalPid INTEGER, value INTEGER NOT NULL, bytes INTEGER NOT NULL, "
                                  "memKind INTEGER",
    "CUPTI_ACTIVITY_KIND_RUNTIME": "start INTEGER NOT NULL, end INTEGER NOT NULL, eventClass INTEGER NOT NULL, "
                                   "globalTid INTEGER, correlationId INTEGER, nameId INTEGER NOT NULL, "
                                   "returnValue INTEGER NOT NULL",
    "NVTX_EVENTS": "start INTEGER NOT NULL, end INTEGER, eventType INTEGER NOT NULL, rangeId INTEGER, "
                   "category INTEGER, color INTEGER, text TEXT, globalTid INTEGER, endGlobalTid INTEGER, "
                   "textId INTEGER, domainId INTEGER",
    "ENUM_CUDA_MEMCPY_OPER": "id INTEGER NOT NULL PRIMARY KEY, name TEXT, label TEXT",
    "ENUM_CUDA_MEM_KIND": "id INTEGER NOT NULL PRIMARY KEY, name TEXT, label TEXT",
}
_ENUM_ROWS = {
    "ENUM_CUDA_MEMCPY_OPER": [(0, "CUDA_MEMCPY_KIND_UNKNOWN", "Unknown"),
                              (1, "CUDA_MEMCPY_KIND_HTOD", "Host-to-Device"),
                              (2, "CUDA_MEMCPY_KIND_DTOH", "Device-to-Host"),
                              (8, "CUDA_MEMCPY_KIND_DTOD", "Device-to-Device"),
                              (10, "CUDA_MEMCPY_KIND_PTOP", "Peer-to-Peer"),
                              (11, "CUDA_MEMCPY_KIND_UVM_HTOD", "Unified Host-to-Device"),
                              (12, "CUDA_MEMCPY_KIND_UVM_DTOH", "Unified Device-to-Host")],
    "ENUM_CUDA_MEM_KIND": [(0, "CUDA_MEMOPR_MEMORY_KIND_PAGEABLE", "Pageable"),
                           (1, "CUDA_MEMOPR_MEMORY_KIND_PINNED", "Pinned"),
                           (2, "CUDA_MEMOPR_MEMORY_KIND_DEVICE", "Device"),
                           (4, "CUDA_MEMOPR_MEMORY_KIND_MANAGED", "Managed"),
                           (7, "CUDA_MEMOPR_MEMORY_KIND_UNKNOWN", "Unknown")],
}


def ns(us: float) -> int:
    """Builder time (µs from the origin) -> export timestamp (ns)."""
    return ORIGIN_NS + round(us * 1000)


class NsysExportBuilder:
    """Rows of an export; `pid`/`tid` (and `device`) may be changed between calls, as in traces_gen."""

    def __init__(self, *, pid: int = 4242, gpu: dict | None = H100_GPU, enums: bool = True) -> None:
        self.pid, self.tid, self.device = pid, pid, 0
        self.gpus = [gpu] if gpu else []
        self.enums = enums
        self.rows: dict[str, list[tuple]] = {table: [] for table in _SCHEMA}
        self.strings: dict[str, int] = {}
        self.next_corr = 100

    @property
    def global_pid(self) -> int:
        return self.pid << 24  # hardware and VM ids 0

    def string(self, value: str) -> int:
        if value not in self.strings:
            self.strings[value] = len(self.strings) + 1
            self.rows["StringIds"].append((self.strings[value], value))
        return self.strings[value]

    def nvtx(self, name: str, ts: float, dur: float | None, *, event_type: int = PUSH_POP,
             registered: bool = False) -> None:
        """An NVTX range (`dur` None: never closed); `registered` stores the name as a textId."""
        text, text_id = (None, self.string(name)) if registered else (name, None)
        end = None if dur is None else ns(ts + dur)
        self.rows["NVTX_EVENTS"].append((ns(ts), end, event_type, None, None, None, text,
                                         self.global_pid | self.tid, None, text_id, 0))

    def runtime(self, name: str, ts: float, dur: float, corr: int | None = None) -> None:
        """A CUDA API call; runtime functions carry nsys's `_v<version>` suffix (`cudaLaunchKernel_v7000`)."""
        symbol = f"{name}_v7000" if name.startswith("cuda") else name
        self.rows["CUPTI_ACTIVITY_KIND_RUNTIME"].append((ns(ts), ns(ts + dur), 0, self.global_pid | self.tid,
                                                         corr, self.string(symbol), 0))

    def kernel(self, name: str, start: float, dur: float, corr: int | None, *, stream: int = 7) -> None:
        short = re.sub(r"^void ", "", name).split("<")[0].split("(")[0].split("::")[-1]
        self.rows["CUPTI_ACTIVITY_KIND_KERNEL"].append((ns(start), ns(start + dur), self.device, 1, stream, corr,
                                                        self.global_pid, self.string(name), self.string(short),
                                                        32, 132, 256, len(self.rows["CUPTI_ACTIVITY_KIND_KERNEL"])))

    def memcpy(self, start: float, dur: float, nbytes: int, corr: int | None, *, copy: str = "HtoD",
               src: str = "Pageable", dst: str = "Device", stream: int = 7) -> None:
        self.rows["CUPTI_ACTIVITY_KIND_MEMCPY"].append((ns(start), ns(start + dur), self.device, 1, stream, corr,
                                                        self.global_pid, nbytes, COPY_KINDS[copy],
                                                        MEM_KINDS[src], MEM_KINDS[dst]))

    def memset(self, start: float, dur: float, nbytes: int, corr: int | None, *, stream: int = 7) -> None:
        self.rows["CUPTI_ACTIVITY_KIND_MEMSET"].append((ns(start), ns(start + dur), self.device, 1, stream, corr,
                                                        self.global_pid, 0, nbytes, MEM_KINDS["Device"]))

    def gpu(self, name: str, launch_ts: float, start: float, dur: float, *, launch: str = "cudaLaunchKernel",
            launch_dur: float = 4.0, stream: int = 7) -> int:
        """A kernel and the runtime call at `launch_ts` that launched it (same correlation id)."""
        corr = self.next_corr
        self.next_corr += 1
        self.runtime(launch, launch_ts, launch_dur, corr)
        self.kernel(name, start, dur, corr, stream=stream)
        return corr

    def write(self, path: Path) -> Path:
        """The export as an SQLite file: only tables with rows (StringIds always), like nsys."""
        for cuda_id, gpu in enumerate(self.gpus):
            row = (0, cuda_id, gpu["name"], f"0000:{cuda_id:02x}:00.0", gpu["totalMemory"], gpu["smCount"], cuda_id)
            if row not in self.rows["TARGET_INFO_GPU"]:
                self.rows["TARGET_INFO_GPU"].append(row)
        if self.enums:
            self.rows.update({table: list(rows) for table, rows in _ENUM_ROWS.items()})
        path.unlink(missing_ok=True)
        with sqlite3.connect(path) as db:
            for table, rows in self.rows.items():
                if not rows and table != "StringIds":
                    continue
                db.execute(f"CREATE TABLE {table} ({_SCHEMA[table]})")
                if rows:
                    db.executemany(f"INSERT INTO {table} VALUES ({', '.join('?' * len(rows[0]))})", rows)
        db.close()
        return path


_HOST_CATS = ("user_annotation", "cuda_runtime", "cuda_driver")
_KINETO_COPY = re.compile(r"^Memcpy (\w+) \(([\w ]+) -> ([\w ]+)\)$")


def from_kineto(doc: dict[str, Any]) -> NsysExportBuilder:
    """The export Nsight Systems would hold for a generated Kineto trace: user annotations become NVTX
    push/pop ranges (`ProfilerStep#N` becomes tracetrain's `step N`), `cuda_runtime` events runtime
    calls, kernels / copies / memsets CUPTI rows with the same correlation ids. `cpu_op` ranges, flows
    and `[memory]` events have no counterpart in an export and are dropped."""
    props = doc.get("deviceProperties") or []
    gpu = {"name": props[0]["name"], "totalMemory": props[0]["totalGlobalMem"], "smCount": 132} if props else None
    host = [e for e in doc["traceEvents"] if e.get("ph") == "X" and e.get("cat") in _HOST_CATS]
    b = NsysExportBuilder(pid=int(host[0]["pid"]) if host else 4242, gpu=gpu)
    for event in doc["traceEvents"]:
        if event.get("ph") == "X":
            _add_kineto_event(b, event)
    return b


def _add_kineto_event(b: NsysExportBuilder, event: dict[str, Any]) -> None:
    cat, name, args = event.get("cat"), event["name"], event.get("args") or {}
    ts, dur = event["ts"] - gen.T0, event["dur"]
    if cat in _HOST_CATS:
        b.pid, b.tid = int(event["pid"]), int(event["tid"])
        if cat == "user_annotation":
            b.nvtx(re.sub(r"^ProfilerStep#(\d+)$", r"step \1", name), ts, dur)
        else:
            b.runtime(name, ts, dur, args.get("correlation"))
        return
    if cat not in ("kernel", "gpu_memcpy", "gpu_memset"):
        return
    b.device, stream, corr = int(args.get("device", 0)), int(args.get("stream", 7)), args.get("correlation")
    copy = _KINETO_COPY.match(name)
    if cat == "kernel":
        b.kernel(name, ts, dur, corr, stream=stream)
    elif cat == "gpu_memset":
        b.memset(ts, dur, args.get("bytes") or 0, corr, stream=stream)
    elif copy:
        b.memcpy(ts, dur, args["bytes"], corr, copy=copy[1], src=copy[2], dst=copy[3], stream=stream)
    else:  # "Unified Memory Memcpy HtoD" and the like: a unified-memory migration
        direction = "UVM_DtoH" if "DtoH" in name else "UVM_HtoD"
        b.memcpy(ts, dur, args.get("bytes") or 0, corr, copy=direction, src="Managed", dst="Managed",
                 stream=stream)
