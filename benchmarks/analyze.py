"""Analyzer speed and memory on large traces: tracetrain `analyze` next to HolisticTraceAnalysis (HTA).

Large traces are made from a real golden trace (tests/data/traces/h100/loader_workers0.json.gz, 4
profiled steps, ~24 MB of JSON) by writing it out again N times, each copy shifted in time by the
trace's length and given fresh ids: correlation ids (kernel <-> launch and their `ac2g` flows),
`External id`, `fwdbwd` flow ids and `ProfilerStep#N` numbers, so every copy is four more well-formed
steps of the same run. The result is one event per line, gzipped, like the profiler writes, with a
`distributedInfo` block (rank 0) so HTA finds the rank without scanning the file.

Each analysis runs in a fresh Python process. Measured: wall seconds around the process and the
analysis call; CPU seconds from `os.wait4` (they hardly move when other work shares the machine, and
the 1-minute load average is recorded next to them); peak RSS as the child's own high-water mark
(`VmHWM` of /proc/self/status, read as it ends; not `ru_maxrss`, which on Linux carries the parent's
high-water mark over fork+exec, and this parent has just built a large trace). HTA is stopped when its
RSS passes 16 GiB or it runs longer than 10 minutes, and that is recorded with the highest RSS seen.
Traces are written to /tmp and deleted afterwards. The installed orjson (tracetrain's optional faster
reader, `pip install tracetrain[analyze-fast]`) and HTA versions are recorded with the machine.

    python benchmarks/analyze.py            # ~100 MB, ~300 MB, ~1 GB; HTA on the first two
    python benchmarks/analyze.py --sizes-mb 100 --no-hta
"""

from __future__ import annotations

import argparse
import gzip
import importlib.metadata
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, write_result  # noqa: E402

SOURCE = Path(__file__).resolve().parent.parent / "tests" / "data" / "traces" / "h100" / "loader_workers0.json.gz"
STEP_NAME = re.compile(r"^ProfilerStep#(\d+)$")
HTA_MAX_RSS_BYTES = 16 * 2**30
HTA_TIMEOUT_S = 600


# ------------------------------------------------------------------------------------------------
# Making a large trace


def _max_ids(events: list[dict[str, Any]]) -> dict[str, int]:
    """The largest id of each kind in the source, so copy k can add k * (max + 1)."""
    ids = {"correlation": 0, "external": 0, "fwdbwd": 0, "step": 0, "num_steps": 0}
    for event in events:
        args = event.get("args") or {}
        ids["correlation"] = max(ids["correlation"], int(args.get("correlation", 0)))
        ids["external"] = max(ids["external"], int(args.get("External id", 0)))
        if event.get("cat") == "ac2g":
            ids["correlation"] = max(ids["correlation"], int(event.get("id", 0)))
        if event.get("cat") == "fwdbwd":
            ids["fwdbwd"] = max(ids["fwdbwd"], int(event.get("id", 0)))
        if event.get("cat") == "user_annotation" and (match := STEP_NAME.match(event.get("name", ""))):
            ids["step"] = max(ids["step"], int(match.group(1)))
            ids["num_steps"] += 1
    return ids


def _shifted(event: dict[str, Any], copy: int, shift_us: float, ids: dict[str, int]) -> dict[str, Any]:
    """One event of copy `copy`: later by `copy * shift_us`, with ids that no other copy uses."""
    out = dict(event)
    if "ts" in out:
        out["ts"] = round(float(out["ts"]) + copy * shift_us, 3)
    if out.get("cat") == "ac2g":
        out["id"] = int(out["id"]) + copy * (ids["correlation"] + 1)
    elif out.get("cat") == "fwdbwd":
        out["id"] = int(out["id"]) + copy * (ids["fwdbwd"] + 1)
    if match := STEP_NAME.match(str(out.get("name", ""))):
        out["name"] = f"ProfilerStep#{int(match.group(1)) + copy * ids['num_steps']}"
    args = out.get("args")
    if isinstance(args, dict) and ("correlation" in args or "External id" in args):
        args = out["args"] = dict(args)
        if "correlation" in args:
            args["correlation"] = int(args["correlation"]) + copy * (ids["correlation"] + 1)
        if "External id" in args:
            args["External id"] = int(args["External id"]) + copy * (ids["external"] + 1)
    return out


def make_trace(source: Path, target_bytes: int, out: Path) -> dict[str, Any]:
    """Write `source` replicated to about `target_bytes` of JSON into gzipped `out`; returns facts."""
    with gzip.open(source, "rt") as f:
        doc = json.load(f)
    events = doc.pop("traceEvents")
    unit_bytes = sum(len(json.dumps(e)) + 2 for e in events)
    copies = max(1, round(target_bytes / unit_bytes))
    ids = _max_ids(events)
    timed = [e for e in events if "ts" in e and e.get("ph") == "X"]
    start = min(float(e["ts"]) for e in timed)
    shift_us = max(float(e["ts"]) + float(e.get("dur", 0)) for e in timed) - start + 1000.0
    header = {**doc, "distributedInfo": {"rank": 0, "world_size": 1}}
    num_events = 0
    with gzip.open(out, "wt", compresslevel=3) as f:
        written = f.write(json.dumps(header, indent=2)[:-2] + ',\n  "traceEvents": [\n')
        for copy in range(copies):
            for event in events:
                if copy and (event.get("ph") == "M" or event.get("cat") == "Trace"):
                    continue  # process/thread names and the profiler's own span: once
                separator = ",\n  " if num_events else "  "
                written += f.write(separator + json.dumps(_shifted(event, copy, shift_us, ids)))
                num_events += 1
        written += f.write("\n  ]\n}\n")
    return {"copies": copies, "num_steps": copies * ids["num_steps"], "num_events": num_events,
            "json_bytes": written, "gz_bytes": out.stat().st_size}


# ------------------------------------------------------------------------------------------------
# Measuring one analysis in a fresh process


PEAK_RSS = """
def peak_rss_bytes():
    import re
    return int(re.search(r"VmHWM:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) * 1024
"""

TRACETRAIN_CHILD = PEAK_RSS + """
import json, sys, time
t0 = time.perf_counter()
from tracetrain.profile.analyze import analyze
t1 = time.perf_counter()
report = analyze([sys.argv[1]])
t2 = time.perf_counter()
rank = report.ranks[0]
print(json.dumps({"import_s": t1 - t0, "analyze_s": t2 - t1, "busy_fraction": rank.utilisation.busy_fraction,
                  "num_steps": len(rank.utilisation.steps), "num_gpu_events": rank.kernels.num_gpu_events,
                  "peak_rss_bytes": peak_rss_bytes()}))
"""

HTA_CHILD = PEAK_RSS + """
import json, os, sys, tempfile, time
t0 = time.perf_counter()
from hta.trace_analysis import TraceAnalysis
t1 = time.perf_counter()
with tempfile.TemporaryDirectory() as tmp:
    os.symlink(sys.argv[1], os.path.join(tmp, os.path.basename(sys.argv[1])))
    analysis = TraceAnalysis(trace_dir=tmp)
    t2 = time.perf_counter()
    temporal = analysis.get_temporal_breakdown(visualize=False)
    analysis.get_gpu_kernel_breakdown(visualize=False)
    analysis.get_idle_time_breakdown(visualize=False)
    t3 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "load_s": t2 - t1, "analyze_s": t3 - t1,
                  "busy_fraction": 1 - float(temporal["idle_time_pctg"][0]) / 100,
                  "peak_rss_bytes": peak_rss_bytes()}))
"""


def _watch_rss(pid: int, limit_bytes: int, state: dict[str, Any]) -> None:
    """Kill `pid` when its RSS passes `limit_bytes` (polled every 0.2 s)."""
    while state["running"]:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except (FileNotFoundError, ProcessLookupError):
            return
        match = re.search(r"VmRSS:\s+(\d+) kB", status)
        rss = int(match.group(1)) * 1024 if match else 0
        state["max_rss_bytes"] = max(state["max_rss_bytes"], rss)
        if rss > limit_bytes:
            state["killed"] = f"RSS above {limit_bytes / 2**30:.0f} GiB"
            os.kill(pid, 9)
            return
        time.sleep(0.2)


def measure(script: str, trace: Path, timeout_s: float, max_rss_bytes: int | None) -> dict[str, Any]:
    """Run `script trace` in a fresh interpreter: wall seconds, peak RSS and what the script printed."""
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", script, str(trace)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    state: dict[str, Any] = {"running": True, "killed": None, "max_rss_bytes": 0}
    watcher = threading.Thread(target=_watch_rss, args=(proc.pid, max_rss_bytes or 2**62, state), daemon=True)
    watcher.start()
    timer = threading.Timer(timeout_s, lambda: (state.update(killed=f"over {timeout_s:.0f} s"), proc.kill()))
    timer.start()
    stdout = proc.stdout.read()  # type: ignore[union-attr]
    stderr = proc.stderr.read()  # type: ignore[union-attr]
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    state["running"] = False
    timer.cancel()
    # CPU seconds barely change when other work shares the machine; wall seconds do (load average
    # recorded). Peak RSS: overwritten by the child's own VmHWM when it finishes, else the sampled maximum.
    result: dict[str, Any] = {"wall_s": time.perf_counter() - start, "cpu_s": usage.ru_utime + usage.ru_stime,
                              "load_avg_1min": os.getloadavg()[0], "peak_rss_bytes": state["max_rss_bytes"]}
    if state["killed"]:
        result["stopped"] = state["killed"]
    elif proc.returncode != 0:
        result["error"] = stderr.strip().splitlines()[-1] if stderr.strip() else f"exit status {status}"
    else:
        result.update(json.loads(stdout.strip().splitlines()[-1]))
    return result


# ------------------------------------------------------------------------------------------------


def _machine() -> dict[str, Any]:
    meminfo, cpuinfo = Path("/proc/meminfo").read_text(), Path("/proc/cpuinfo").read_text()
    mem_kb = int(re.search(r"MemTotal:\s+(\d+)", meminfo).group(1))  # type: ignore[union-attr]
    cpu = re.search(r"model name\s*:\s*(.+)", cpuinfo)
    env = environment()
    return {"cores": os.cpu_count(), "ram_gib": round(mem_kb / 2**20, 1),
            "cpu": cpu.group(1).strip() if cpu else platform.machine(), "python": platform.python_version(),
            "torch": env["torch"], "tracetrain_commit": env["commit"], "date": env["date"],
            "orjson": _version("orjson"), "hta": _version("HolisticTraceAnalysis")}


def _version(package: str) -> str | None:
    """The installed version (orjson speeds up tracetrain's reader; HTA is the peer), None if absent."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _row(size: dict[str, Any], tool: str, run: dict[str, Any]) -> str:
    rss = run["peak_rss_bytes"] / 2**20
    outcome = run.get("stopped") or run.get("error") or f"busy {100 * run['busy_fraction']:.1f}%"
    analyze_s = f"{run['analyze_s']:8.1f}" if "analyze_s" in run else "       —"
    ratio = run["peak_rss_bytes"] / size["json_bytes"]
    return (f"{size['json_bytes'] / 1e6:8.0f} {size['gz_bytes'] / 1e6:6.1f} {size['num_events'] / 1e6:6.2f} "
            f"{tool:<10} {run['wall_s']:8.1f} {analyze_s} {run['cpu_s']:7.1f} {rss:9.0f} {ratio:7.2f} "
            f"{run['load_avg_1min']:5.1f}  {outcome}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[100, 300, 1000])
    parser.add_argument("--hta-max-mb", type=int, default=300, help="run HTA on traces up to this size")
    parser.add_argument("--no-hta", action="store_true")
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    baseline = measure(PEAK_RSS + "import json, tracetrain.profile.analyze\n"
                       "print(json.dumps({'peak_rss_bytes': peak_rss_bytes()}))", SOURCE, 60, None)
    print(f"{'JSON MB':>8} {'gz MB':>6} {'Mevents':>7} {'tool':<10} {'wall s':>8} {'call s':>8} {'CPU s':>7} "
          f"{'peak MiB':>9} {'RSS/JSON':>7} {'load':>5}")
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        for size_mb in args.sizes_mb:
            trace = Path(tmp) / f"replicated_{size_mb}mb.json.gz"
            size = make_trace(SOURCE, size_mb * 10**6, trace)
            runs = {"tracetrain": measure(TRACETRAIN_CHILD, trace, 1800, None)}
            if not args.no_hta and size_mb <= args.hta_max_mb:
                runs["hta"] = measure(HTA_CHILD, trace, HTA_TIMEOUT_S, HTA_MAX_RSS_BYTES)
            for tool, run in runs.items():
                print(_row(size, tool, run), flush=True)
            rows.append({"target_mb": size_mb, **size, **runs})
            trace.unlink()
    payload = {"machine": _machine(), "source": str(SOURCE.relative_to(SOURCE.parents[4])),
               "baseline_import_peak_rss_bytes": baseline["peak_rss_bytes"], "results": rows}
    print(f"\nfresh interpreter importing the analyzer: peak RSS {baseline['peak_rss_bytes'] / 2**20:.0f} MiB")
    print(f"wrote {write_result('analyze_perf.json', payload)}")


if __name__ == "__main__":
    main()
