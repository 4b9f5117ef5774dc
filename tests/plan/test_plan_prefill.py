"""Prefill speed (plan/inference.py `plan_prefill`): the time model of one no-grad forward of a prompt, against
the eager prefill measured on an H200 (benchmarks/results/generate_NVIDIA-H200.json) and every variant (eager,
compiled, fused) measured on an H100 (generate_NVIDIA-H100-80GB-HBM3_variants.json and _hf-longest.json: the
rows whose prefill took the variant's own path, not chunks)."""

from __future__ import annotations

import dataclasses
import json

import pytest
from helpers import REPO

from tracetrain.models.accounting import num_matmul_params
from tracetrain.models.presets import get_preset
from tracetrain.plan import plan_prefill
from tracetrain.plan import time as T

MEASURED = REPO / "benchmarks" / "results" / "generate_NVIDIA-H200.json"
H100 = [
    REPO / "benchmarks" / "results" / f"generate_NVIDIA-H100-80GB-HBM3_{part}.json"
    for part in ("variants", "hf-longest")
]


def _eager_rows() -> list[dict]:
    rows = json.loads(MEASURED.read_text())["cases"]
    return [
        r
        for r in rows
        if r["method"] in ("gpu", "gpu+graph") and r["status"] == "ok" and r.get("variant", "eager") == "eager"
    ]


@pytest.mark.parametrize("row", _eager_rows(), ids=lambda r: f"{r['model']}-b{r['batch']}-{r['context']}-{r['method']}")
def test_eager_prefill_plan_is_within_ten_percent_of_the_h200_measurement(row: dict) -> None:
    planned = plan_prefill(
        get_preset(row["model"]), row["batch"], row["context"], gpu="h200", last_block=_last_block_alone(row)
    ).tokens_per_s
    assert abs(planned / row["prefill_tok_s"] - 1) <= 0.10, (planned, row)


def _last_block_alone(row: dict) -> bool:
    """Whether the measured prefill ran its last block for the last position alone: rows since that change
    say so (`prefill_last_block`); those before it ran the whole block, and are planned that way."""
    return row.get("prefill_last_block") == "last position"


def _h100_rows() -> list[dict]:
    """(model, batch, prompt, variant, measured tok/s, planned tok/s as the benchmark recorded it) of every
    H100 prefill that ran its variant's own path (a chunked prompt runs the eager path: not its variant's)."""
    out = []
    for path in H100:
        data = json.loads(path.read_text())
        for r in data["cases"]:
            if r["method"] == "gpu+graph" and r["status"] == "ok" and r.get("prefill_path") in ("eager", "compiled"):
                out.append(
                    (
                        r["model"],
                        r["batch"],
                        r["context"],
                        r["variant"],
                        r["prefill_tok_s"],
                        r["plan_prefill_tok_s"],
                        _last_block_alone(r),
                    )
                )
        for r in data["hf_longest"]:
            for variant, ours in r["ours"].items():
                if ours.get("status") == "ok" and ours.get("prefill_path") in ("eager", "compiled"):
                    out.append(
                        (
                            r["model"],
                            r["batch"],
                            r["context"],
                            variant,
                            ours["prefill_tok_s"],
                            None,
                            _last_block_alone(ours),
                        )
                    )
    return out


@pytest.mark.parametrize("row", _h100_rows(), ids=lambda r: f"{r[0]}-b{r[1]}-{r[2]}-{r[3]}")
def test_every_prefill_variant_plan_is_within_ten_percent_of_the_h100_measurement(row: tuple) -> None:
    model, batch, context, variant, measured, recorded, last_block = row
    # The benchmark times a prompt of `context` tokens (cases) or `context - 1` (HF's longest, which leaves
    # room for one decoded token); the difference is below the tolerance's resolution.
    h100 = "NVIDIA H100 80GB HBM3"
    planned = plan_prefill(
        get_preset(model), batch, context, gpu=h100, mode=variant, last_block=last_block
    ).tokens_per_s
    assert abs(planned / measured - 1) <= 0.10, (planned, measured, row)
    if recorded is not None:  # the benchmark's own column is this planner's figure
        assert planned == pytest.approx(recorded, rel=0.01)


def test_gemm_time_is_the_forward_flops_at_the_gemm_efficiency() -> None:
    # What one more block adds: exactly its projections' forward FLOPs over the peak times the GEMM
    # efficiency of these shapes (all within 1% of the square one's at 4096 rows).
    a = get_preset("llama3-8b")
    tokens = 4096
    one, two = (
        plan_prefill(dataclasses.replace(a, n_layers=n), 1, tokens, gpu="h200", last_block=False) for n in (1, 2)
    )
    block = num_matmul_params(dataclasses.replace(a, n_layers=1)) - a.vocab_size * a.dim
    seconds = 2 * block * tokens / (989.4e12 * T.gemm_efficiency(tokens, a.dim, a.dim))
    assert two.seconds["GEMM"] - one.seconds["GEMM"] == pytest.approx(seconds, rel=0.02)
    # The head runs on the last position only: a read of its weight, memory-bound.
    head = one.seconds["GEMM"] - seconds
    assert head == pytest.approx(2 * a.vocab_size * a.dim / (4.8e12 * T.HBM_EFFICIENCY), rel=0.05)


def test_compiled_and_fused_paths_cut_the_memory_bound_work_not_the_matmuls() -> None:
    a = get_preset("llama2-7b")
    eager, compiled, fused = (plan_prefill(a, 1, 4096, gpu="h200", mode=m) for m in ("eager", "compiled", "fused"))
    assert compiled.seconds["GEMM"] == eager.seconds["GEMM"] == fused.seconds["GEMM"]
    assert compiled.seconds["attention"] == eager.seconds["attention"]
    assert compiled.seconds["memory-bound"] < 0.3 * eager.seconds["memory-bound"]
    assert fused.seconds["memory-bound"] < 0.5 * eager.seconds["memory-bound"]
    assert compiled.tokens_per_s > 1.2 * eager.tokens_per_s


def test_attention_share_grows_with_the_prompt_and_moe_counts_top_k_experts() -> None:
    a = get_preset("llama3-8b")
    short, long = plan_prefill(a, 1, 4096, gpu="h200"), plan_prefill(a, 1, 32768, gpu="h200")
    assert short.seconds["attention"] / short.total_s < 0.1 < 0.3 < long.seconds["attention"] / long.total_s
    moe = dataclasses.replace(a, num_experts=8, experts_top_k=2, moe_ffn_dim=a.ffn_dim)
    dense, routed = plan_prefill(a, 1, 4096, gpu="h200"), plan_prefill(moe, 1, 4096, gpu="h200")
    # two experts per token: the MLP's three GEMMs twice (plus the router's small one)
    attn, mlp = 2 * a.dim * a.q_dim + 2 * a.dim * a.n_kv_heads * a.head_dim, 3 * a.dim * a.ffn_dim
    assert routed.seconds["GEMM"] / dense.seconds["GEMM"] == pytest.approx((attn + 2 * mlp) / (attn + mlp), rel=0.03)


@pytest.mark.parametrize("model", ["llama3-8b", "mixtral-8x7b"])
def test_the_last_block_at_one_position_saves_its_attention_and_its_projections_after_q_k_v(model: str) -> None:
    """models/prefill.py `last_position_block`: the last block's attention, output projection and MLP run
    for one position per row; what the plan saves is exactly those GEMMs' rows and one block's attention."""
    a = get_preset(model)
    batch, prompt = 2, 32768
    alone, whole = (plan_prefill(a, batch, prompt, gpu="h200", last_block=b) for b in (True, False))
    tokens, d, f = batch * prompt, a.dim, a.expert_ffn_dim if a.num_experts else a.ffn_dim
    rows = a.experts_top_k if a.num_experts else 1
    gemms = [T.Gemm("o", tokens, d, a.q_dim, False, False)] + [
        T.Gemm(n, tokens * rows, *shape, False, False)
        for n, shape in (("gate", (f, d)), ("up", (f, d)), ("down", (d, f)))
    ]
    if a.num_experts:
        gemms.append(T.Gemm("router", tokens, a.num_experts, d, False, False))
    saved_rows = sum(
        T.gemm_time(g, T.Hardware("h200", 0, 989.4e12, 989.4e12, 4.8e12, 0, 0, 0, 0, 0), 2)[0] for g in gemms
    )
    assert whole.seconds["GEMM"] - alone.seconds["GEMM"] == pytest.approx(saved_rows, rel=0.01)
    assert alone.seconds["attention"] < whole.seconds["attention"] * (1 - 0.9 / a.n_layers)
    assert alone.seconds["memory-bound"] == whole.seconds["memory-bound"]  # counted as a whole block: a bound
    assert 1.02 < alone.tokens_per_s / whole.tokens_per_s < 1.04  # one block in 32: about 3% of the prefill
    one = plan_prefill(a, batch, 1, gpu="h200", last_block=True)  # a one-token forward has nothing to save
    assert one.seconds == plan_prefill(a, batch, 1, gpu="h200", last_block=False).seconds
