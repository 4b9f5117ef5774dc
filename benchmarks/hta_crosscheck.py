"""Cross-check tracetrain's trace analyzer against HolisticTraceAnalysis (HTA) on the golden traces.

For each golden trace both tools measure the same quantities, side by side:
GPU busy and idle %, the "computation" share, memcpy/memset share, communication share, the top-5
kernels and their shares, idle time by cause, and (2-rank trace) communication/computation overlap.

HTA is run twice: as shipped (`HTA`), and `HTA aligned`, with the two HTA defaults that change the
numbers most switched off (`include_last_profiler_step=True`, `HTA_DISABLE_NS_ROUNDING=1`). The
GPU-busy difference is then split into its causes by applying HTA's rules one at a time to the same
events (`busy_decomposition`): HTA's time span (first GPU event to last, where ours is the whole
profiled window), its last-step cut, and its rounding of timestamps to whole microseconds. When the
last column equals HTA's own number, the difference is fully explained. docs/profiling.md discusses
the results.

HTA is in the dev extra (pip install -e '.[dev]'), or alone:

    pip install HolisticTraceAnalysis
    python benchmarks/hta_crosscheck.py      # writes benchmarks/results/analyze_hta_crosscheck.json
"""

from __future__ import annotations

import gzip
import json
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, write_result  # noqa: E402

from tracetrain.profile.analyze import analyze  # noqa: E402
from tracetrain.profile.analyze.categories import CATEGORIES, MEMCPY_CATEGORIES, short_kernel_name  # noqa: E402
from tracetrain.profile.analyze.intervals import intersect, union  # noqa: E402
from tracetrain.profile.analyze.reader import parse_trace  # noqa: E402
from tracetrain.profile.analyze.select import gpu_categories, gpu_spans  # noqa: E402

TRACES_DIR = Path(__file__).resolve().parent.parent / "tests" / "data" / "traces"
CASES: dict[str, list[Path]] = {
    "h100/llama2_7b_lora": [TRACES_DIR / "h100" / "llama2_7b_lora.json.gz"],
    "h100/loader_workers0": [TRACES_DIR / "h100" / "loader_workers0.json.gz"],
    "h100/loader_workers4": [TRACES_DIR / "h100" / "loader_workers4.json.gz"],
    "h200/real_h200": [TRACES_DIR / "real_h200.json.gz"],
    "h200/real_ddp_2rank": [TRACES_DIR / "real_rank0.json.gz", TRACES_DIR / "real_rank1.json.gz"],
}
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
TOP_N = 5


# ------------------------------------------------------------------------------------------------
# tracetrain's side


def tracetrain_side(paths: list[Path]) -> dict[int, dict[str, Any]]:
    """Per rank: the numbers of `tracetrain analyze`, in percent of the same denominators HTA uses
    where one exists (kernel shares: of summed GPU event time)."""
    out = {}
    for rank in analyze([str(p) for p in paths]).ranks:
        util, kernels = rank.utilisation, rank.kernels
        share = {row.category: 100 * row.share for row in kernels.categories}
        memcpy = sum(share.get(c, 0.0) for c in MEMCPY_CATEGORIES)
        out[rank.rank] = {
            "source": rank.source, "busy_pct": 100 * util.busy_fraction,
            "idle_pct": 100 * (1 - util.busy_fraction),
            "window_us": util.window_us, "busy_us": util.busy_us,
            "gemm_attention_pct": share.get("gemm", 0.0) + share.get("attention", 0.0),
            "non_memory_pct": 100 - memcpy - share.get("memset", 0.0) - share.get("communication", 0.0),
            "memcpy_pct": memcpy, "memset_pct": share.get("memset", 0.0),
            "memcpy_memset_pct": memcpy + share.get("memset", 0.0),
            "comm_pct": share.get("communication", 0.0),
            "overlap_pct": 100 * rank.communication.overlap_fraction if rank.communication.comm_us else None,
            "top": [{"name": row.name, "pct": 100 * row.share} for row in kernels.top[:TOP_N]],
            "idle_us": {cause: round(us, 1) for cause, us in util.idle_us.items()},
        }
    return out


# ------------------------------------------------------------------------------------------------
# HTA's side


def _hta_dir(paths: list[Path], workdir: Path) -> Path:
    """HTA reads a directory, one file per rank (rank from `distributedInfo`, else 0): symlinks."""
    workdir.mkdir(parents=True, exist_ok=True)
    for path in paths:
        (workdir / path.name).symlink_to(path.resolve())
    return workdir


def _hta_kernels(analysis: Any, rank: int) -> dict[str, Any]:
    """Kernel-type shares and top kernels of one rank (of the summed time of every GPU event)."""
    _, kernels = analysis.get_gpu_kernel_breakdown(visualize=False, num_kernels=10**9, duration_ratio=1.0,
                                                   include_memory_kernels=True)
    kernels = kernels[kernels["rank"] == rank]
    total = float(kernels["sum (us)"].sum())
    by_type = kernels.groupby("kernel_type")["sum (us)"].sum()
    top = kernels.sort_values("sum (us)", ascending=False).head(TOP_N)
    return {"computation_pct": 100 * float(by_type.get("COMPUTATION", 0.0)) / total,
            "memory_pct": 100 * float(by_type.get("MEMORY", 0.0)) / total,
            "comm_pct": 100 * float(by_type.get("COMMUNICATION", 0.0)) / total,
            "top": [{"name": short_kernel_name(name), "pct": 100 * float(us) / total}
                    for name, us in zip(top["name"], top["sum (us)"])]}


def _hta_idle(analysis: Any, rank: int) -> dict[str, Any]:
    """HTA's idle time by category, summed over streams and per stream (µs)."""
    idle, _ = analysis.get_idle_time_breakdown(ranks=[rank], visualize=False)
    per_stream = {f"{int(s)}/{c}": float(t) for s, c, t in zip(idle["stream"], idle["idle_category"],
                                                               idle["idle_time"])}
    summed = idle.groupby("idle_category")["idle_time"].sum()
    return {"idle_us": {c: float(t) for c, t in summed.items()}, "idle_us_per_stream": per_stream}


def hta_side(paths: list[Path], aligned: bool) -> dict[int, dict[str, Any]] | dict[str, str]:
    """Per rank: HTA's numbers; `aligned` keeps the last step and nanosecond timestamps.
    Returns {"error": ...} when HTA fails on the trace (recorded, not hidden)."""
    from hta.trace_analysis import TraceAnalysis

    os.environ["HTA_DISABLE_NS_ROUNDING"] = "1" if aligned else "0"
    with tempfile.TemporaryDirectory() as tmp:
        try:
            analysis = TraceAnalysis(trace_dir=str(_hta_dir(paths, Path(tmp) / "traces")),
                                     include_last_profiler_step=aligned)
            temporal = analysis.get_temporal_breakdown(visualize=False).set_index("rank")
            overlap = (analysis.get_comm_comp_overlap(visualize=False).set_index("rank")
                       if len(paths) > 1 else None)
            out = {}
            for rank in analysis.t.get_ranks():
                row = temporal.loc[rank]
                out[int(rank)] = {
                    "busy_pct": 100 - float(row["idle_time_pctg"]), "idle_pct": float(row["idle_time_pctg"]),
                    "span_us": float(row["kernel_time(us)"]), "compute_time_pct": float(row["compute_time_pctg"]),
                    "non_compute_time_pct": float(row["non_compute_time_pctg"]),
                    "overlap_pct": (float(overlap.loc[rank, "comp_comm_overlap_pctg"])
                                    if overlap is not None else None),
                    **_hta_kernels(analysis, rank), **_hta_idle(analysis, rank)}
            return out
        except Exception as error:  # noqa: BLE001 - any HTA failure is a result to record
            return {"error": f"{type(error).__name__}: {error}"}


# ------------------------------------------------------------------------------------------------
# The GPU-busy difference, rule by rule


def _events(path: Path) -> list[dict[str, Any]]:
    with gzip.open(path, "rt") as f:
        return json.load(f)["traceEvents"]


def busy_decomposition(path: Path, tracetrain_busy_pct: float) -> dict[str, float]:
    """GPU busy % of one rank's trace as HTA's rules are applied one at a time to its GPU events:

    1. `tracetrain`: union of kernels/copies/memsets over the profiled window (first to last event,
       host or GPU);
    2. `hta_span`: the same union over HTA's span, first GPU event start to last GPU event end;
    3. `hta_launched_in_trace`: only GPU events whose launch (runtime event with the same
       correlation id) is in the trace. This drops kernels of the profiler's warm-up step that the
       GPU was still running when the recorded window opened (HTA joins on the launch; we keep them:
       they ran inside the window). `HTA aligned` stops here;
    4. `hta_last_step_cut`: only events launched before the last `ProfilerStep#` event starts. HTA
       takes the latest start among every event named ProfilerStep, and the GPU-side copy
       (`gpu_user_annotation`) starts later than the host range, so the cut lands there;
    5. `hta_rounded`: timestamps rounded inward to whole µs (start up, end down), as HTA's parser
       does. This reproduces HTA as shipped.
    """
    events = [e for e in _events(path) if e.get("ph") == "X"]
    launch = {e["args"]["correlation"]: float(e["ts"]) for e in events
              if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    gpu = [e for e in events if e.get("cat") in GPU_CATS]
    ts = np.array([float(e["ts"]) for e in gpu])
    end = ts + np.array([float(e["dur"]) for e in gpu])
    launched = np.array([launch.get(e["args"].get("correlation"), math.inf) for e in gpu])
    cut = max(float(e["ts"]) for e in events if str(e.get("name", "")).startswith("ProfilerStep"))

    def busy_pct(keep: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> float:
        spans = union(starts[keep], ends[keep])
        return 100 * spans.total() / (ends[keep].max() - starts[keep].min())

    keep_cut = launched < cut
    return {"tracetrain": tracetrain_busy_pct, "hta_span": busy_pct(np.ones(len(gpu), dtype=bool), ts, end),
            "hta_launched_in_trace": busy_pct(np.isfinite(launched), ts, end),
            "hta_last_step_cut": busy_pct(keep_cut, ts, end),
            "hta_rounded": busy_pct(keep_cut, np.ceil(ts), np.floor(end))}


def unlaunched_gpu_us(path: Path) -> float:
    """GPU time (µs) of events whose launch is not in the trace (warm-up-step leftovers)."""
    trace = parse_trace(path)
    return float(trace.gpu.dur[np.isnan(trace.gpu.launch_ts)].sum())


def overlap_with_computation_pct(path: Path) -> float | None:
    """tracetrain's overlap, but against HTA's COMPUTATION set (copies and memsets do not count)."""
    trace = parse_trace(path)
    codes = np.array(CATEGORIES)[gpu_categories(trace)]
    comm = codes == "communication"
    computation = ~comm & ~np.isin(codes, (*MEMCPY_CATEGORIES, "memset"))
    comm_spans = gpu_spans(trace, comm)
    if not comm_spans.total():
        return None
    return 100 * intersect(comm_spans, gpu_spans(trace, computation)).total() / comm_spans.total()


# ------------------------------------------------------------------------------------------------
# Report


def _fmt(value: float | None) -> str:
    return "—" if value is None else f"{value:6.2f}"


def _rows(tt: dict[str, Any], hta: dict[str, Any], aligned: dict[str, Any]) -> list[tuple[str, Any, Any, Any]]:
    return [("GPU busy %", tt["busy_pct"], hta.get("busy_pct"), aligned.get("busy_pct")),
            ("GPU idle %", tt["idle_pct"], hta.get("idle_pct"), aligned.get("idle_pct")),
            ("GEMM+attention % (tt) / COMPUTATION % (HTA)", tt["gemm_attention_pct"],
             hta.get("computation_pct"), aligned.get("computation_pct")),
            ("all but copies/memset/NCCL % (tt) / COMPUTATION %", tt["non_memory_pct"],
             hta.get("computation_pct"), aligned.get("computation_pct")),
            ("memcpy+memset % (tt) / MEMORY % (HTA)", tt["memcpy_memset_pct"], hta.get("memory_pct"),
             aligned.get("memory_pct")),
            ("memcpy only % (tt)", tt["memcpy_pct"], None, None),
            ("communication %", tt["comm_pct"], hta.get("comm_pct"), aligned.get("comm_pct")),
            ("comm overlapped %", tt["overlap_pct"], hta.get("overlap_pct"), aligned.get("overlap_pct"))]


def print_case(name: str, result: dict[str, Any]) -> None:
    for rank, tt in result["tracetrain"].items():
        hta = result["hta"].get(rank, {}) if "error" not in result["hta"] else {}
        aligned = result["hta_aligned"].get(rank, {}) if "error" not in result["hta_aligned"] else {}
        reconcile = result["reconcile"][rank]
        print(f"\n== {name} rank {rank}")
        for key in ("hta", "hta_aligned"):
            if "error" in result[key]:
                print(f"   {key} FAILED: {result[key]['error']}")
        print(f"   {'metric':<52} {'tt':>7} {'HTA':>7} {'aligned':>7}")
        for label, a, b, c in _rows(tt, hta, aligned):
            print(f"   {label:<52} {_fmt(a):>7} {_fmt(b):>7} {_fmt(c):>7}")
        for side, top in (("tt", tt["top"]), ("HTA", hta.get("top", [])), ("aligned", aligned.get("top", []))):
            print(f"   top-5 {side:<7}: " + "; ".join(f"{k['name'][:34]} {k['pct']:.1f}%" for k in top))
        print(f"   idle µs tt: {tt['idle_us']}")
        print(f"   idle µs HTA / aligned (summed over streams): {hta.get('idle_us')} / {aligned.get('idle_us')}")
        print("   busy % rule by rule: " + ", ".join(f"{k} {v:.2f}" for k, v in reconcile["busy_pct"].items()))
        print(f"   GPU µs launched before the window (warm-up step): {reconcile['unlaunched_gpu_us']:.0f}; "
              f"tt overlap against HTA's COMPUTATION set: {_fmt(reconcile['overlap_with_computation_pct'])}")


def run_case(name: str, paths: list[Path]) -> dict[str, Any]:
    tt = tracetrain_side(paths)
    reconcile = {rank: {"busy_pct": busy_decomposition(Path(row["source"]), row["busy_pct"]),
                        "unlaunched_gpu_us": unlaunched_gpu_us(Path(row["source"])),
                        "overlap_with_computation_pct": overlap_with_computation_pct(Path(row["source"]))}
                 for rank, row in tt.items()}
    return {"files": [str(p.relative_to(TRACES_DIR.parent.parent.parent)) for p in paths], "tracetrain": tt,
            "hta": hta_side(paths, aligned=False), "hta_aligned": hta_side(paths, aligned=True),
            "reconcile": reconcile}


def main() -> None:
    from importlib.metadata import version

    results = {}
    for name, paths in CASES.items():
        results[name] = run_case(name, paths)
        print_case(name, results[name])
    payload = {"environment": {**environment(), "hta": version("HolisticTraceAnalysis")},
               "definitions": __doc__.split("HTA is a benchmark")[0].strip(), "traces": results}
    path = write_result("analyze_hta_crosscheck.json", json.loads(json.dumps(payload, default=float)))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
