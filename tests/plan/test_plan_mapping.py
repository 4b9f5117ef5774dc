"""The planner reads the resolved spec through one mapping, both ways: every PlanInput field is mapped
or named as not from the config, and plan -> overrides -> resolve gives the same spec and input back."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tracetrain.config import load_config
from tracetrain.plan import PlanInput, plan, plan_input_from_config, plan_input_from_spec, plan_to_config_overrides
from tracetrain.plan.mapping import BATCH_FIELDS, FIELDS, LAYOUT_FIELDS, NOT_FROM_CONFIG
from tracetrain.spec import resolve

CASES = {
    "lora fp8 rowwise fsdp2": (
        ["--model.preset=llama2-7b", "--train.mode=lora", "--train.fp8=rowwise", "--parallel.dp_shard=2"],
        2,
    ),
    "full fp8 tensorwise": (["--model.preset=llama3.2-1b", "--train.fp8=tensorwise", "--train.compile=off"], 1),
    "full tp2 unpacked": (["--model.preset=llama3-8b", "--parallel.tp=2", "--data.pack=false"], 2),
    "lora fp32 base, all-linear, recompute": (
        [
            "--model.preset=llama2-7b",
            "--train.mode=lora",
            "--lora.base_dtype=fp32",
            '--lora.targets=["all-linear"]',
            "--memory.recompute=selective",
            "--optim.fused=off",
        ],
        1,
    ),
    "interleaved pipeline": (
        [
            "--model.preset=llama3-8b",
            "--parallel.pp=2",
            "--parallel.dp_shard=2",
            "--parallel.pp_schedule=interleaved_1f1b",
            "--train.micro_batch_size=2",
            "--train.grad_accum_steps=4",
        ],
        4,
    ),
    "moe ep2 zero2": (
        [
            "--model.preset=llama3.2-1b",
            "--model.num_experts=4",
            "--parallel.dp_shard=2",
            "--parallel.ep=2",
            "--parallel.zero_stage=2",
        ],
        2,
    ),
}


def _decided(spec: object) -> dict[str, object]:
    """A spec's decided values (its config and the reasons for 'auto' aside: the overrides say
    'on' where the first config said 'auto')."""
    return {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec) if f.name not in ("cfg", "decisions")}  # type: ignore[arg-type]


def test_every_plan_input_field_is_mapped_once_or_named() -> None:
    mapped = {f.name for f in FIELDS}
    outside = set(NOT_FROM_CONFIG) | set(LAYOUT_FIELDS) | set(BATCH_FIELDS)
    fields = {f.name for f in dataclasses.fields(PlanInput)}
    assert mapped | outside == fields, (fields - mapped - outside, (mapped | outside) - fields)
    assert not mapped & outside


@pytest.mark.parametrize("name", list(CASES))
def test_plan_overrides_resolve_round_trip(name: str) -> None:
    overrides, gpus = CASES[name]
    cfg = load_config(None, overrides)
    inp = plan_input_from_config(cfg, gpus, "h200")
    emitted = plan_to_config_overrides(plan(inp))
    assert not [o for o in emitted if o.startswith("#")], emitted  # every planned value has a config key
    back = load_config(None, [overrides[0], *emitted])  # the preset, then the plan's own overrides
    assert plan_input_from_config(back, gpus, "h200") == inp
    cuda = torch.device("cuda")
    first = resolve(cfg, cuda, world_size=gpus, probe=False)
    again = resolve(back, cuda, world_size=gpus, probe=False)
    assert _decided(again) == _decided(first)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "none"])
def test_the_fp8_recipe_written_back_is_the_one_planned(recipe: str) -> None:
    cfg = load_config(None, ["--model.preset=llama3.2-1b", f"--train.fp8={recipe}"])
    inp = plan_input_from_config(cfg, 1, "h200")
    assert inp.precision == ("bf16" if recipe == "none" else "fp8")
    emitted = plan_to_config_overrides(plan(inp))
    assert f"--train.fp8={recipe}" in emitted
    assert "--train.precision=bf16" in emitted  # FP8 GEMMs run inside bf16 autocast
    spec = resolve(load_config(None, emitted), torch.device("cuda"), probe=False)
    assert spec.fp8 == recipe


def test_the_planner_reads_the_trainers_spec_not_the_config() -> None:
    """A spec changed after resolve (as a benchmark variant is) is what the planner plans."""
    cfg = load_config(None, ["--model.preset=llama3.2-1b", "--parallel.dp_shard=2"])
    spec = resolve(cfg, torch.device("cuda"), world_size=2, probe=False)
    inp = plan_input_from_spec(spec.replace(compile=False, optimizer_fused=False, fused_ce_chunk=0), "h200")
    assert (inp.compile, inp.fused_adamw, inp.fused_ce_chunk, inp.num_gpus, inp.dp_shard) == (False, False, 0, 2, 2)
    assert plan_input_from_spec(spec, "h200").compile is True  # on CUDA, compile 'auto' is on


def test_search_layouts_follow_the_specs_fused_ce_rule() -> None:
    cfg = load_config(None, ["--model.preset=llama3-8b", "--parallel.dp_shard=2"])
    inp = plan_input_from_config(cfg, 2, "h200")
    assert inp.fused_ce and inp.fsdp_mixed_precision
    assert not inp.replace(tp=2, dp_shard=1).fused_ce  # spec.fused_ce_applies: no fused CE under tp
    assert not inp.replace(precision="fp32").fsdp_mixed_precision  # spec.fsdp_param_dtype_for
