"""Search, advice, config round trips and overrides."""

from __future__ import annotations

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
    assert speeds == sorted(speeds, reverse=True) or max(speeds) / min(speeds) < 1.006
    for r in rows:
        i = r.input
        assert i.dp_replicate * i.dp_shard * i.tp * i.pp * i.cp == 8
        assert r.reason.startswith("fits with")


def test_search_drops_layouts_that_cannot_fit() -> None:
    """Full fine-tuning of a 70B model: 16 bytes/param x 70.6B = 1.1 TB never fits on 8 x 80 GB."""
    base = PlanInput(model=get_preset("llama3-70b"), micro_batch=1, grad_accum=8, seq_len=4096, gpu="h100-sxm")
    rows = search(base.replace(), gpus=8, top=5)
    assert all(r.input.optimizer_offload for r in rows)  # only offloading the optimizer can help
    single = plan(base)
    assert not single.fits and single.advice[0].startswith("does not fit")


def test_layouts_respect_heads_and_layers() -> None:
    args = get_preset("llama3.2-3b")  # 24 heads, 8 kv heads, 28 layers
    for lay in layouts(PlanInput(model=args), 8):
        assert args.n_kv_heads % lay["tp"] == 0 and args.n_layers % lay["pp"] == 0
        assert lay["dp_replicate"] * lay["dp_shard"] * lay["tp"] * lay["pp"] * lay["cp"] == 8


def test_validation_names_the_field() -> None:
    with pytest.raises(ValueError, match="tp = 3"):
        plan(PlanInput(model=get_preset("llama2-7b"), tp=3, num_gpus=3))
    with pytest.raises(ValueError, match="num_gpus"):
        plan(PlanInput(model=get_preset("llama2-7b"), num_gpus=4, dp_shard=2))


def test_plan_input_from_config_and_overrides_round_trip() -> None:
    cfg = load_config(None, ["--model.preset=llama2-7b", "--train.mode=lora", "--train.micro_batch_size=4",
                             "--data.seq_len=2048", "--memory.recompute=selective", '--lora.targets=["all-linear"]'])
    inp = plan_input_from_config(cfg, num_gpus=1, gpu="h200")
    assert (inp.mode, inp.micro_batch, inp.seq_len, inp.recompute, inp.lora_base_dtype, inp.precision) == (
        "lora", 4, 2048, "selective", "bf16", "bf16")
    assert len(inp.lora_targets) == 7
    p = plan(inp)
    overrides = plan_to_config_overrides(p)
    real = [o for o in overrides if not o.startswith("#")]
    back = load_config(None, ["--model.preset=llama2-7b", *real])  # every emitted override is a valid key
    assert plan_input_from_config(back, 1, "h200") == inp
    assert "--parallel.tp=1" in overrides or "# --parallel.tp=1  (no such config key or value yet)" in overrides
    assert any(o.startswith("# --train.precision=fp8") for o in plan_to_config_overrides(plan(inp.replace(
        precision="fp8"))))  # a value the config does not allow comes back as a comment


def test_advice_mentions_the_loss_buffers_for_large_vocabularies() -> None:
    p = plan(PlanInput(model=get_preset("llama3.2-1b"), micro_batch=4, seq_len=2048, gpu="h200"))
    assert any("cross-entropy" in a for a in p.advice)
    assert p.memory.breakdown["logits / loss"] == pytest.approx(12 * 128256 * 4 * 2048)
    assert p.memory.spare_bytes > 80 * GIB
