"""The advice-truth table of docs/profiling.md: per corpus case, the cause, the gain realized by fixing
it (unprofiled medians, truth.json), the analyzer's first rule and predicted gain, and whether the
rule is the expected one and within 10 points.

    python3 benchmarks/advice_truth_table.py [CORPUS_DIR]     # default tests/data/advice_truth

`EXPECTED` (which rule should come first for each problem case) is shared with
tests/test_advice_truth.py, which asserts what this table shows.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

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


def evaluate(corpus: Path = CORPUS) -> list[dict]:
    """One row per case of the corpus: realized and predicted gains, first rule, verdict."""
    truth = json.loads((corpus / "truth.json").read_text())
    rows = []
    for name, case in truth["cases"].items():
        if case.get("error") or not (corpus / name).is_dir():
            rows.append({"case": name, "error": (case.get("error") or "no traces").splitlines()[0]})
            continue
        report = analyze(sorted((corpus / name).glob("rank*.json.gz")))
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
            }
        )
    return rows


def markdown(rows: list[dict]) -> str:
    lines = [
        "| case | realized | first rule | predicted by the cause's rule (range) | right rule first | within 10 pts |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['case']} | not run: {r['error'][:60]} | | | | |")
            continue
        pct = lambda x: "-" if x is None else f"{x:.0%}"  # noqa: E731
        span = f" ({pct(r['range'][0])}-{pct(r['range'][1])})" if r["range"] else ""
        yes = lambda x: "-" if x is None else ("yes" if x else "**no**")  # noqa: E731
        lines.append(
            f"| {r['case']} | {pct(r['realized'])} | {r['first_rule'] or 'none'} | {pct(r['predicted'])}{span} "
            f"| {yes(r['rule_right'])} | {yes(r['within'])} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    found = evaluate(Path(sys.argv[1]) if len(sys.argv) > 1 else CORPUS)
    print(markdown(found))
    for r in found:
        print(r["case"], r.get("advice"))
