"""The advice-truth table of docs/profiling.md: per corpus case, the cause, the gain realized by fixing
it (unprofiled medians, truth.json), the analyzer's first rule and predicted gain, whether the rule is
the expected one and within 10 points, and HolisticTraceAnalysis's view of the same trace files.

    pip install HolisticTraceAnalysis      # in the dev extra; without it the HTA columns read "not installed"
    python3 benchmarks/advice_truth_table.py [CORPUS_DIR]     # default tests/data/advice_truth

HTA's view (`hta_view`): its GPU idle % of the recorded window (temporal breakdown), the share of that
idle it classes as waiting on the host (idle-time breakdown, summed over streams), and for two-rank
traces its communication/computation overlap. HTA runs "aligned" (benchmarks/hta_crosscheck.py): it reads
both recorded steps, as the analyzer does (`include_last_profiler_step=True`; as shipped it drops the last
of the 2), with nanosecond timestamps (`HTA_DISABLE_NS_ROUNDING=1`; its µs rounding costs a point of busy
on small kernels). Its idle is over its own span, first GPU event to last. Idle is an upper bound on what
fixing any cause gives back, not a prediction: HTA names no cause.

`EXPECTED` (which rule should come first for each problem case) is shared with
tests/analyze/test_advice_truth.py, which asserts what this table shows.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import traceback
import warnings
from pathlib import Path
from typing import Any

from tracetrain.profile.analyze import analyze

CORPUS = Path(__file__).resolve().parent.parent / "tests" / "data" / "advice_truth"
# case -> the rules that name its cause (the first rule of the analysis must be one of them)
EXPECTED: dict[str, tuple[str, ...]] = {
    "loader_workers": ("data_loader",),
    "pageable_copies": ("pageable_copies",),
    "item_per_param": ("sync_stalls",),
    "cpu_optimizer": ("cpu_optimizer",),
    "activation_offload": ("pageable_copies",),
    "fp32_matmul": ("fp32_gemm",),
    "launch_bound": ("launch_bound",),
    "recompile": ("recompilation",),
    "ddp_no_sync": ("grad_sync_per_microbatch",),
    "ddp_buckets": ("exposed_comm",),
    "fsdp_prefetch": ("exposed_comm",),
    "pipeline_unbalanced": ("load_imbalance",),
    "straggler": ("straggler",),
}
TOLERANCE = 0.10


def hta_view(paths: list[Path]) -> list[dict[str, Any]] | str:
    """Per rank: HTA's GPU idle %, host-wait share of idle, and (several ranks) comm/comp overlap %.
    A string says why there is none (HTA not installed, or its error on this trace)."""
    try:
        from hta.trace_analysis import TraceAnalysis
    except ImportError:
        return "not installed"
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from hta_crosscheck import _hta_dir

    os.environ["HTA_DISABLE_NS_ROUNDING"] = "1"
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # pandas deprecations inside HTA, one per call
        try:
            analysis = TraceAnalysis(trace_dir=str(_hta_dir(paths, Path(tmp))), include_last_profiler_step=True)
            temporal = analysis.get_temporal_breakdown(visualize=False).set_index("rank")
            overlap = analysis.get_comm_comp_overlap(visualize=False).set_index("rank") if len(paths) > 1 else None
            out = []
            for rank in sorted(analysis.t.get_ranks()):
                idle, _ = analysis.get_idle_time_breakdown(ranks=[rank], visualize=False)
                by_cause = idle.groupby("idle_category")["idle_time"].sum()
                out.append(
                    {
                        "rank": int(rank),
                        "idle": float(temporal.loc[rank, "idle_time_pctg"]) / 100,
                        "host_wait": float(by_cause.get("host_wait", 0.0)) / max(float(by_cause.sum()), 1e-9),
                        "overlap": float(overlap.loc[rank, "comp_comm_overlap_pctg"]) / 100
                        if overlap is not None
                        else None,
                    }
                )
            return out
        except Exception as error:  # HTA failing on a trace is a result to show, not a crash
            where = traceback.extract_tb(error.__traceback__)[-1]
            return f"HTA fails: {type(error).__name__} `{where.line}` ({Path(where.filename).name})"[:90]


def evaluate(corpus: Path = CORPUS) -> list[dict]:
    """One row per case of the corpus: realized and predicted gains, first rule, verdict."""
    truth = json.loads((corpus / "truth.json").read_text())
    rows = []
    for name, case in truth["cases"].items():
        if case.get("error") or not (corpus / name).is_dir():
            rows.append({"case": name, "error": (case.get("error") or "no traces").splitlines()[0]})
            continue
        paths = sorted((corpus / name).glob("rank*.json.gz"))
        report = analyze(paths)
        first = report.advice[0] if report.advice else None
        realized = case.get("realized_gain")
        wanted = EXPECTED.get(name, ())
        # The gain of the rule that names the cause (as the test reads it), else the first rule's.
        named = next((a for a in report.advice if a.rule in wanted), first)
        predicted = named.gain if named is not None else None
        rows.append(
            {
                "case": name,
                "cause": case["cause"],
                "realized": realized,
                "first_rule": first.rule if first else None,
                "predicted": predicted,
                "range": named.gain_range if named else None,
                "expected": wanted,
                "rule_right": (first.rule in wanted) if first and wanted else None,
                "within": (abs(predicted - realized) <= TOLERANCE)
                if predicted is not None and realized is not None
                else None,
                "advice": [(a.rule, a.gain) for a in report.advice],
                "hta": hta_view(paths),
            }
        )
    return rows


def hta_cells(view: list[dict[str, Any]] | str) -> str:
    """HTA's columns: idle % (host-wait share of it) and overlap, ranks separated by " / "."""
    if isinstance(view, str):
        return f"{view} | "
    idle = " / ".join(f"{r['idle']:.0%} ({r['host_wait']:.0%})" for r in view)
    overlap = " / ".join(f"{r['overlap']:.0%}" for r in view if r["overlap"] is not None)
    return f"{idle} | {overlap or '-'}"


def markdown(rows: list[dict]) -> str:
    lines = [
        "| case | realized | first rule | predicted by the cause's rule (range) | right rule first | within 10 pts "
        "| HTA: GPU idle (host wait) | HTA: comm overlapped |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['case']} | not run: {r['error'][:60]} | | | | | | |")
            continue
        pct = lambda x: "-" if x is None else f"{x:.0%}"  # noqa: E731
        span = f" ({pct(r['range'][0])}-{pct(r['range'][1])})" if r["range"] else ""
        yes = lambda x: "-" if x is None else ("yes" if x else "**no**")  # noqa: E731
        lines.append(
            f"| {r['case']} | {pct(r['realized'])} | {r['first_rule'] or 'none'} | {pct(r['predicted'])}{span} "
            f"| {yes(r['rule_right'])} | {yes(r['within'])} | {hta_cells(r['hta'])} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    found = evaluate(Path(sys.argv[1]) if len(sys.argv) > 1 else CORPUS)
    print(markdown(found))
    for r in found:
        print(r["case"], r.get("advice"))
