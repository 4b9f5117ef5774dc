"""Search, advice, config round trips and overrides."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from tracetrain.config import load_config
from tracetrain.models.presets import get_preset
from tracetrain.plan import PlanInput, plan, plan_input_from_config, plan_to_config_overrides, search
from tracetrain.plan.memory import GIB
from tracetrain.plan.search import layouts


def test_search_returns_only_fitting_rows_fastest_first() -> None:
    base = PlanInput(model=get_preset("llama3-8b"), micro_batch=1, grad_accum=8, seq_len=4096, gpu="h100-sxm")
    rows = search(base, gpus=8, top=6)
    assert 0 < len(rows) <= 6
    assert all(r.fits and r.memory.required_bytes <= r.memory.capacity_bytes for r in rows)
    speeds = [r.tokens_per_s for r in rows]
    # fastest first, but rows within ~0.5% of each other may swap (the simpler one first)
    assert all(later < earlier * 1.006 for earlier, later in itertools.pairwise(speeds))
    for r in rows:
        i = r.input
        assert i.dp_replicate * i.dp_shard * i.tp * i.pp * i.cp == 8
        assert r.reason.startswith("fits with")


def test_search_drops_layouts_that_cannot_fit() -> None:
    """Full fine-tuning of a 70B model: 16 bytes/param x 70.6B = 1.1 TB never fits on 8 x 80 GB, nor in
    one node's 1 TiB of host memory (FSDP CPU offload); the trainer refuses optimizer offload with
    several ranks, so the search offers nothing."""
    base = PlanInput(model=get_preset("llama3-70b"), micro_batch=1, grad_accum=8, seq_len=4096, gpu="h100-sxm")
    assert search(base.replace(), gpus=8, top=5) == []
    roomy = search(base.replace(host_memory_gib=2048.0), gpus=8, top=5)
    assert roomy and all(r.input.fsdp_cpu_offload for r in roomy)  # only the sharded CPU offload can help
    single = plan(base)
    assert not single.fits and single.advice[0].startswith("does not fit")


def test_layouts_respect_heads_and_layers() -> None:
    args = get_preset("llama3.2-3b")  # 24 heads, 8 kv heads, 28 layers
    for lay in layouts(PlanInput(model=args), 8):
        assert args.n_kv_heads % lay["tp"] == 0 and lay["pp"] <= args.n_layers  # uneven splits allowed
        assert lay["dp_replicate"] * lay["dp_shard"] * lay["tp"] * lay["pp"] * lay["cp"] == 8


def test_validation_names_the_field() -> None:
    with pytest.raises(ValueError, match="tp = 3"):
        plan(PlanInput(model=get_preset("llama2-7b"), tp=3, num_gpus=3))
    with pytest.raises(ValueError, match="num_gpus"):
        plan(PlanInput(model=get_preset("llama2-7b"), num_gpus=4, dp_shard=2))


def test_plan_input_from_config_and_overrides_round_trip() -> None:
    cfg = load_config(
        None,
        [
            "--model.preset=llama2-7b",
            "--train.mode=lora",
            "--train.micro_batch_size=4",
            "--data.seq_len=2048",
            "--memory.recompute=selective",
            '--lora.targets=["all-linear"]',
        ],
    )
    inp = plan_input_from_config(cfg, num_gpus=1, gpu="h200")
    assert (inp.mode, inp.micro_batch, inp.seq_len, inp.recompute, inp.lora_base_dtype, inp.precision) == (
        "lora",
        4,
        2048,
        "selective",
        "bf16",
        "bf16",
    )
    assert len(inp.lora_targets) == 7
    p = plan(inp)
    overrides = plan_to_config_overrides(p)
    real = [o for o in overrides if not o.startswith("#")]
    back = load_config(None, ["--model.preset=llama2-7b", *real])  # every emitted override is a valid key
    assert plan_input_from_config(back, 1, "h200") == inp
    assert "--parallel.tp=1" in overrides
    odd = plan_to_config_overrides(dataclasses.replace(p, input=inp.replace(recompute="everything")))
    assert "# --memory.recompute=everything  (not a value the config allows)" in odd  # a comment, not a flag


def test_advice_mentions_the_loss_buffers_for_large_vocabularies() -> None:
    p = plan(PlanInput(model=get_preset("llama3.2-1b"), micro_batch=4, seq_len=2048, gpu="h200"))
    assert any("cross-entropy" in a for a in p.advice)
    assert p.memory.breakdown["logits / loss"] == pytest.approx(12 * 128256 * 4 * 2048)
    assert p.memory.spare_bytes > 80 * GIB


def test_search_tries_every_data_parallel_flavour_and_pipeline_schedule() -> None:
    from tracetrain.plan.search import candidates

    base = PlanInput(model=get_preset("llama3-8b"), micro_batch=1, grad_accum=32, seq_len=4096, gpu="h100-sxm")
    tried = candidates(base, 8)  # 32 rows per step: accumulation over 8 ranks, where ZeRO-1 differs from 2
    flavours = {(i.zero_stage, i.dp_shard * i.cp > 1) for i in tried if i.dp_shard * i.dp_replicate == 8}
    assert {(1, True), (2, True), (3, True)} <= flavours  # ZeRO-1, ZeRO-2, ZeRO-3 over 8
    assert any(i.dp_replicate == 8 and i.dp_shard == 1 for i in tried)  # plain DDP
    assert {i.pp_schedule for i in tried if i.pp > 1} == {"gpipe", "1f1b", "interleaved_1f1b"}
    assert not any(i.optimizer_offload for i in tried)  # the trainer refuses it with several ranks
    assert any(i.fsdp_cpu_offload for i in tried)
    tied = PlanInput(model=get_preset("llama3.2-1b"))  # the trainer refuses pipelines of tied embeddings
    assert all(i.pp == 1 for i in candidates(tied, 8))


def test_search_ranks_zero2_first_where_it_is_fastest() -> None:
    # 13B over 16 GPUs: ZeRO-2 keeps bf16 weights gathered through the step (no second all-gather in
    # backward) and fits, so it outruns ZeRO-3; the reason names the flavour.
    base = PlanInput(model=get_preset("llama2-13b"), micro_batch=1, grad_accum=32, seq_len=4096, gpu="h100-sxm")
    rows = search(base, gpus=16, top=3)
    best = rows[0].input
    assert best.zero_stage == 2 and not best.zero3
    assert f"ZeRO-2 over {best.dp_shard}" in rows[0].reason
    same_layout = plan(best.replace(zero_stage=3))
    assert rows[0].tokens_per_s > same_layout.tokens_per_s


def test_cp_reason_names_the_all_gather_the_plan_charges() -> None:
    """parallel/context_parallel.py all-gathers K/V (not a ring), and the time model charges all of it
    exposed: the search's explanation says so, with the share the breakdown holds."""
    from tracetrain.plan.search import reason

    inp = PlanInput(
        model=get_preset("llama3-8b"), micro_batch=1, seq_len=32768, num_gpus=4, cp=4, recompute="full", gpu="h100-sxm"
    )
    p = plan(inp)
    text = reason(p, inp)
    share = p.time.breakdown["CP comm (exposed)"] / p.step_s
    assert p.time.breakdown["CP comm (exposed)"] == pytest.approx(p.time.comm_total["CP"])
    assert f"all-gathers the whole sequence's keys and values ({share:.0%} exposed" in text
    assert "ring" not in text
