"""Every parallel layout against a single process on the same global batches (CPU, gloo).

One job per world size runs all its layouts (process start-up dominates on a 2-core CI machine);
each layout is then its own test. For each layout, 3 AdamW steps (4-layer, dim-64 model, fp32,
2 packed documents per row, 30% ignored labels so data-parallel ranks hold different target counts):
the step losses, the gradient norms, every gradient (gathered to a full tensor, after clipping) and
every parameter after the last step must match the single-process run.

Tolerances (fp32): losses, gradient norms and gradients within 1e-5 absolute (gradients are ~0.05;
observed differences are ~1e-8, from summation order); parameters within 1e-6. The tiny config uses
AdamW with eps = 1 so that an update is ~lr * gradient: with the usual eps, Adam turns round-off in
near-zero gradients into O(lr) parameter differences, which would hide nothing but blur the check.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from parallel_harness import check_layouts

from tracetrain.parallel.launch import launch_local

TOL_LOSS, TOL_GRAD, TOL_PARAM = 1e-5, 1e-5, 1e-6
MOE = ["--model.num_experts=4", "--model.experts_top_k=2", "--model.moe_aux_loss_coef=0.01"]

# "probe": the layouts whose collectives per micro-batch test_gradient_accumulation_reduces_once reads.
LAYOUTS_2 = [
    {"name": "dp_replicate", "overrides": ["--parallel.dp_replicate=2"], "accum": 2, "probe": True},
    {"name": "zero1", "overrides": ["--parallel.dp_shard=2", "--parallel.zero_stage=1"], "accum": 2, "probe": True},
    {"name": "zero2", "overrides": ["--parallel.dp_shard=2", "--parallel.zero_stage=2"], "accum": 2, "probe": True},
    {"name": "zero3", "overrides": ["--parallel.dp_shard=2", "--parallel.zero_stage=3"], "accum": 2, "probe": True},
    {
        "name": "tp",
        "overrides": ["--parallel.tp=2", "--parallel.sequence_parallel=false", "--parallel.loss_parallel=false"],
    },
    {"name": "tp_sp", "overrides": ["--parallel.tp=2"]},  # + loss parallel (default)
    {"name": "tp_sp_recompute", "overrides": ["--parallel.tp=2", "--memory.recompute=full"]},  # TP -> recompute
    {
        "name": "pp_gpipe",
        "overrides": ["--parallel.pp=2", "--parallel.pp_schedule=gpipe", "--parallel.pp_microbatches=2"],
    },
    {
        "name": "pp_1f1b",
        "overrides": ["--parallel.pp=2", "--parallel.pp_schedule=1f1b", "--parallel.pp_microbatches=4"],
        "accum": 2,
    },
    {
        "name": "pp_interleaved",
        "overrides": ["--parallel.pp=2", "--parallel.pp_schedule=interleaved_1f1b", "--parallel.pp_microbatches=4"],
    },
    {"name": "cp_packed", "overrides": ["--parallel.cp=2"]},
    {"name": "cp_unpacked", "overrides": ["--parallel.cp=2", "--data.pack=false"]},
    {"name": "ep", "overrides": ["--parallel.dp_shard=2", "--parallel.ep=2", *MOE], "split_reference": True},
]
LAYOUTS_4 = [
    {
        "name": "hsdp_2x2",
        "overrides": ["--parallel.dp_replicate=2", "--parallel.dp_shard=2"],
        "accum": 2,
        "probe": True,
    },
    {"name": "fsdp2_tp2", "overrides": ["--parallel.dp_shard=2", "--parallel.tp=2"], "accum": 2},
    {"name": "pp2_fsdp2", "overrides": ["--parallel.pp=2", "--parallel.dp_shard=2", "--parallel.pp_microbatches=2"]},
    {
        "name": "pp2_tp2",
        "overrides": [
            "--parallel.pp=2",
            "--parallel.tp=2",
            "--parallel.pp_schedule=interleaved_1f1b",
            "--parallel.pp_microbatches=2",
        ],
    },
    {"name": "cp2_tp2", "overrides": ["--parallel.cp=2", "--parallel.tp=2"]},
    {"name": "ep2_efsdp2", "overrides": ["--parallel.dp_shard=4", "--parallel.ep=2", *MOE], "split_reference": True},
]


def _run(world: int, layouts: list[dict], tmp: Path) -> dict:
    out = tmp / f"layouts_{world}.json"
    launch_local(check_layouts, world, layouts, str(out), timeout_s=400)
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def results_2(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return _run(2, LAYOUTS_2, tmp_path_factory.mktemp("w2"))


@pytest.fixture(scope="module")
def results_4(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return _run(4, LAYOUTS_4, tmp_path_factory.mktemp("w4"))


def _assert_matches(r: dict) -> None:
    assert r["loss"] <= TOL_LOSS and r["norm"] <= TOL_LOSS, (r["losses"], r["ref_losses"])
    assert r["grad"] <= TOL_GRAD
    assert r["param"] <= TOL_PARAM
    assert r["num_grads_all_ranks"] >= r["num_params"]  # every parameter's gradient was compared somewhere


@pytest.mark.parametrize("name", [layout["name"] for layout in LAYOUTS_2])
def test_layout_world2_matches_single_process(results_2: dict, name: str) -> None:
    _assert_matches(results_2[name])


@pytest.mark.parametrize("name", [layout["name"] for layout in LAYOUTS_4])
def test_layout_world4_matches_single_process(results_4: dict, name: str) -> None:
    _assert_matches(results_4[name])


def test_layouts_are_really_applied(results_2: dict, results_4: dict) -> None:
    q = "self_attn.q_proj.weight"
    assert results_2["zero3"]["facts"][q] == {"placements": ["S(0)"], "local_shape": [32, 64]}
    assert results_2["dp_replicate"]["facts"][q] == {"placements": ["R", "S(0)"], "local_shape": [64, 64]}
    assert results_2["tp"]["facts"][q]["local_shape"] == [32, 64]
    assert results_2["tp"]["facts"]["input_layernorm.weight"]["placements"] == []  # no SP: plain, replicated
    assert results_2["tp_sp"]["facts"]["input_layernorm.weight"]["placements"] == ["R"]  # SP: a DTensor
    assert results_2["pp_1f1b"]["facts"]["num_layers_here"] == 2
    assert results_2["pp_interleaved"]["facts"]["num_layers_here"] == 2  # 2 stages of 1 layer
    assert results_2["ep"]["facts"]["mlp.experts.gate_proj"]["local_shape"] == [2, 128, 64]  # 4 experts / ep 2
    assert results_4["fsdp2_tp2"]["facts"][q]["local_shape"] == [16, 64]  # FSDP 2 x TP 2
    assert results_4["hsdp_2x2"]["facts"][q]["placements"] == ["R", "S(0)"]
    assert results_4["ep2_efsdp2"]["facts"]["mlp.experts.gate_proj"]["local_shape"] == [1, 128, 64]


def test_gradient_accumulation_reduces_once(results_2: dict, results_4: dict) -> None:
    """Collectives of a non-final ("first") and the final micro-batch's forward + backward."""

    def probe(r: dict, which: str) -> dict:
        return r["accumulation_probe"][which]

    # DDP-like: nothing until the last micro-batch, then one all-reduce per unit.
    assert probe(results_2["dp_replicate"], "first") == {}
    assert set(probe(results_2["dp_replicate"], "last")) == {"allreduce"}
    # ZeRO-1: gradients stay local until the last micro-batch; parameters are not gathered again.
    assert "reduce_scatter_base" not in probe(results_2["zero1"], "first")
    assert set(probe(results_2["zero1"], "last")) == {"reduce_scatter_base"}
    # ZeRO-2: reduce-scatter every micro-batch, parameters kept gathered between micro-batches.
    assert probe(results_2["zero2"], "first")["reduce_scatter_base"] > 0
    assert "allgather_base" not in probe(results_2["zero2"], "last")
    # ZeRO-3: parameters re-gathered every micro-batch (resharded after forward).
    assert probe(results_2["zero3"], "last")["allgather_base"] > probe(results_2["zero2"], "first")["allgather_base"]
    # HSDP: reduce-scatter every micro-batch, the all-reduce across replicas only on the last one.
    assert "allreduce" not in probe(results_4["hsdp_2x2"], "first")
    assert probe(results_4["hsdp_2x2"], "last")["allreduce"] > 0


LAYOUTS_8 = [
    {
        "name": "pp2_fsdp2_tp2",
        "overrides": ["--parallel.pp=2", "--parallel.dp_shard=2", "--parallel.tp=2", "--parallel.pp_microbatches=2"],
    },
    {
        "name": "hsdp2_cp2_tp2",
        "overrides": ["--parallel.dp_replicate=2", "--parallel.cp=2", "--parallel.tp=2"],
        "accum": 2,
    },
]


@pytest.mark.slow  # 8 processes on the CI's 2 cores: ~55 s
def test_3d_layouts_world8_match_single_process(tmp_path: Path) -> None:
    results = _run(8, LAYOUTS_8, tmp_path)
    for layout in LAYOUTS_8:
        _assert_matches(results[layout["name"]])
    # 3-D: FSDP shards the TP shard of q_proj again (strided), each pipeline rank holds half the layers.
    facts = results["pp2_fsdp2_tp2"]["facts"]
    assert facts["num_layers_here"] == 2 and facts["self_attn.q_proj.weight"]["local_shape"] == [16, 64]
