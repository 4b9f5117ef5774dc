"""The seed experiments, captured by `tracetrain profile` on an H100 (torch 2.11, commit a5896a2) and
committed as golden traces; the analyzer's diagnoses of them are asserted here.

- llama2_7b_lora: LoRA r=16 q/k/v/o, batch 4 x 2048 packed, bf16 (benchmarks/gpu_profile.sh step 2)
- loader_workers{0,4}: small preset on GSM8K, tokenised on the fly, batch 64 x 256 (step 3)
"""


import io
import re

import pytest
from helpers import DATA, REPO
from rich.console import Console

from tracetrain.profile.analyze import analyze, compare, render_json, render_terminal

H100 = DATA / "traces" / "h100"


@pytest.fixture(scope="module")
def reports():
    return {name: analyze([str(H100 / f"{name}.json.gz")])
            for name in ("loader_workers0", "loader_workers4", "llama2_7b_lora")}


def _advice(report) -> set[str]:
    return {a["rule"] for a in render_json(report)["advice"]}


def _rank0(report) -> dict:
    return render_json(report)["ranks"][0]


def test_data_loader_blamed_with_no_workers(reports):
    r = _rank0(reports["loader_workers0"])
    util = r["utilisation"]
    assert util["idle_us"]["data_loader"] / util["steps_us"] > 0.2
    assert "data_loader" in _advice(reports["loader_workers0"])


def test_data_loader_not_blamed_with_workers(reports):
    util = _rank0(reports["loader_workers4"])["utilisation"]
    assert util["busy_fraction"] > 0.9
    assert util["idle_us"]["data_loader"] / util["steps_us"] < 0.01
    assert "data_loader" not in _advice(reports["loader_workers4"])


def test_compare_shows_the_workers_win(reports):
    diff = render_json(compare(reports["loader_workers0"], reports["loader_workers4"]))
    text = str(diff)
    assert "data_loader" in text
    a, b = (_rank0(reports[k])["utilisation"]["mean_step_us"] for k in ("loader_workers0", "loader_workers4"))
    assert b < 0.75 * a  # the same GPU work, a quarter or more of the step time gone


def test_lora_7b_breakdown(reports):
    r = _rank0(reports["llama2_7b_lora"])
    assert r["utilisation"]["busy_fraction"] > 0.95
    rows = {row["category"]: row for row in r["bound"]["rows"]}
    assert rows["gemm"]["share"] > 0.35 and rows["gemm"]["verdict"] == "compute-bound"
    assert rows["gemm"]["flop_efficiency"] > 0.6  # bf16 GEMMs near the H100's dense peak
    copies = sum(rows[c]["share"] for c in ("memcpy_h2d", "memcpy_d2h") if c in rows)
    assert copies < 0.01
    assert r["kernels"]["top"][0]["category"] == "gemm"
    assert "data_loader" not in _advice(reports["llama2_7b_lora"])


def test_no_category_exceeds_the_memory_bandwidth(reports):
    """Regression: reductions were charged an output as large as their input (133% of HBM)."""
    for name, report in reports.items():
        for row in _rank0(report)["bound"]["rows"]:
            if row["bandwidth_efficiency"] is not None:
                assert row["bandwidth_efficiency"] <= 1.0, (name, row["category"], row["bandwidth_efficiency"])


def test_analyzing_a_profile_folder_skips_the_report(tmp_path):
    """Regression: `tracetrain analyze RUN/profile/` picked up report.json as a trace."""
    import json
    import shutil
    shutil.copy(H100 / "loader_workers4.json.gz", tmp_path / "rank0.json.gz")
    (tmp_path / "report.json").write_text(json.dumps(render_json(analyze([str(tmp_path / "rank0.json.gz")]))))
    assert len(render_json(analyze([str(tmp_path)]))["ranks"]) == 1


def test_activation_offload_and_unified_memory_seen_in_traces():
    """Seed experiments 3 and 4: llama3.2-1b full FT, 4 x 2048, H100 (benchmarks/gpu_memory.sh, 44c8af2)."""
    base, offload, unified = (_rank0(analyze([str(H100 / f"llama32_1b_full{s}.json.gz")]))
                              for s in ("", "_offload", "_unified"))
    # Offload: the copies dominate (PCIe-bound), the step is >3x longer, the peak much lower.
    assert base["offload"]["copy_fraction"] < 0.01 < 0.5 < offload["offload"]["copy_fraction"]
    assert offload["offload"]["d2h_bytes"] > 30e9 and offload["offload"]["h2d_bytes"] > 30e9
    assert offload["utilisation"]["mean_step_us"] > 3 * base["utilisation"]["mean_step_us"]
    assert offload["memory"]["peak_allocated_bytes"] < 0.7 * base["memory"]["peak_allocated_bytes"]
    # Unified memory for the optimizer states: same speed; the states leave the caching allocator's books.
    assert abs(unified["utilisation"]["mean_step_us"] / base["utilisation"]["mean_step_us"] - 1) < 0.05
    assert base["memory"]["peak_allocated_bytes"] - unified["memory"]["peak_allocated_bytes"] > 8 * 2**30


def test_compare_prints_the_rows_docs_profiling_shows(reports):
    # docs/profiling.md shows an excerpt of `tracetrain analyze loader_workers0.json.gz --compare
    # loader_workers4.json.gz`, borders removed: each row it shows is a row of the terminal output now.
    doc = (REPO / "docs" / "profiling.md").read_text(encoding="utf-8")
    excerpt = doc.split("--compare loader_workers4.json.gz` prints", 1)[1].split("```", 2)[1]
    shown = [re.split(r"\s{2,}", line.strip()) for line in excerpt.splitlines()[1:] if line.strip()]
    out = io.StringIO()
    render_terminal(compare(reports["loader_workers0"], reports["loader_workers4"]), Console(file=out, width=200))
    printed = [
        [cell.strip() for cell in line.strip("│┃").split("│" if "│" in line else "┃") if cell.strip()]
        for line in out.getvalue().splitlines()
    ]
    printed += [[line.strip()] for line in out.getvalue().splitlines()]  # the tables' titles
    missing = [" | ".join(row) for row in shown if row not in printed]
    assert len(shown) >= 10 and not missing, f"docs/profiling.md shows rows the compare no longer prints: {missing}"
