"""Which reader reads a trace file: a Kineto JSON trace (trace.py) holds one rank; an Nsight Systems
SQLite export (nsys.py, told by its header, not its name) holds one per GPU process. Both fill the same
`Trace`. The dispatch sits here, above both readers, so neither imports the other."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from tracetrain.errors import TracetrainError
from tracetrain.profile.analyze.nsys import is_sqlite, read_nsys
from tracetrain.profile.analyze.trace import Trace, parse_kineto

_SQLITE_SUFFIXES = (".sqlite", ".sqlite3")


def _is_nsys(path: Path) -> bool:
    # A `.sqlite` name without SQLite's header goes to nsys.py too: it raises, naming the file.
    return is_sqlite(path) or path.suffix in _SQLITE_SUFFIXES


def read_traces(path: str | Path, *, rank: int = 0, device_name: str | None = None) -> Iterator[Trace]:
    """Every rank's `Trace` in one file, parsed one at a time: a Kineto JSON trace holds one rank; an
    Nsight Systems SQLite export (told by its header, not its name) holds one per GPU process."""
    path = Path(path)
    if not path.is_file():
        raise TracetrainError(f"trace file not found: {path}")
    if _is_nsys(path):
        yield from read_nsys(path, rank=rank, device_name=device_name)
    else:
        yield parse_kineto(path, rank=rank, device_name=device_name)


def parse_trace(path: str | Path, *, rank: int = 0, device_name: str | None = None) -> Trace:
    """Stream one trace file into a `Trace`. `rank` is used when the trace has no distributedInfo.

    Raises TracetrainError naming the file when it is missing, not JSON, has no `traceEvents`, or has
    no host or GPU events at all. A CPU-only trace (no GPU events) parses, with a note; so does a CUPTI
    range-profiler trace, with a note saying what its counter ranges hold and what they cannot give. An
    Nsight Systems SQLite export of one GPU process parses too (`read_traces` reads one of several).
    """
    path = Path(path)
    if not (path.is_file() and _is_nsys(path)):
        return parse_kineto(path, rank=rank, device_name=device_name)
    traces = list(read_traces(path, rank=rank, device_name=device_name))
    if len(traces) > 1:
        raise TracetrainError(
            f"{path}: {len(traces)} GPU processes in one export; read them with read_traces() or analyze()"
        )
    return traces[0]
