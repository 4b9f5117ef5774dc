"""The planner's model states for every ZeRO stage and for DDP equal what the trainer holds per rank,
measured by storage on gloo (issue #20, planner item 1).

`parallel_harness.model_states_drill` runs the trainer's own `train_step` over 2 ranks (2 micro-batches
per step) for dp_shard=2 with zero_stage 1, 2, 3 and for dp_replicate=2, and counts the distinct live
storages each rank holds: parameters (FSDP's fp32 shards and any gathered copy it has registered on the
modules), gradients, AdamW moments. Measured on this CPU run (fp32, tiny model of 164,416 parameters P,
4 bytes each; N = 2):

| layout   | after the step: params / grads / moments | between micro-batches: params / grads |
|----------|------------------------------------------|---------------------------------------|
| ZeRO-1   | 4P/N / 4P/N / 8P/N                       | 4P/N + 4P / 4P (unsharded)            |
| ZeRO-2   | 4P/N / 4P/N / 8P/N                       | 4P/N + 4P / 4P/N                      |
| ZeRO-3   | 4P/N / 4P/N / 8P/N                       | 4P/N / 4P/N                           |
| DDP      | 4P / 4P / 8P                             | 4P + 4P (a gathered copy) / 4P        |

FSDP2 shards every parameter whatever the ZeRO stage; ZeRO-1/2 and DDP keep the gathered copies from
the forward to the step's last backward, and ZeRO-1 / DDP accumulate unsharded gradients. The plan must
give these bytes exactly. One difference is left out of the plan on purpose: AdamW's 0-d fp32 `step`
counter per parameter tensor (39 tensors here: 156 bytes; 291 for Llama-3-8B: 1,164 bytes).

The CPU run is fp32 (no FSDP mixed precision). With bf16 compute the trainer passes
MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): the shards, the reduced gradients and the
moments stay fp32 (same bytes), the gathered copies are bf16 (half), and ZeRO-1/DDP's accumulated
gradients are fp32 (FSDPParam.to_accumulated_grad_if_needed upcasts them: same bytes). The last test
checks the bf16 plan against the measurement with exactly that derivation.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from parallel_harness import model_states_drill, tiny_config

from tracetrain.parallel.launch import launch_local
from tracetrain.plan import plan_input_from_config
from tracetrain.plan.memory import MemoryModel, stage_model

LAYOUTS = {
    "zero1": ["--parallel.dp_shard=2", "--parallel.zero_stage=1"],
    "zero2": ["--parallel.dp_shard=2", "--parallel.zero_stage=2"],
    "zero3": ["--parallel.dp_shard=2", "--parallel.zero_stage=3"],
    "ddp": ["--parallel.dp_replicate=2"],
}
# Plan items that are parameters or gradients (the rest of a phase: activations, buffers, loss).
STATE_ITEMS = {
    "params": ("weights", "FSDP unsharded weights"),
    "grads": ("gradients", "FSDP unsharded grads (accumulating)"),
    "moments": ("AdamW states",),
}


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    out = tmp_path_factory.mktemp("zero") / "states.json"
    layouts = [{"name": name, "overrides": overrides} for name, overrides in LAYOUTS.items()]
    launch_local(model_states_drill, 2, str(out), layouts, timeout_s=240)
    return json.loads(Path(out).read_text())


def model_of(layout: str, precision: str = "fp32") -> MemoryModel:
    """The plan of the drill's run: its tiny config, 2 micro-batches per step, 2 GPUs."""
    cfg = tiny_config([*LAYOUTS[layout], "--train.grad_accum_steps=2", "--train.micro_batch_size=2"])
    inp = plan_input_from_config(cfg, num_gpus=2, gpu="h100-sxm").replace(precision=precision)
    return stage_model(inp, 0)


def planned(model: MemoryModel, phase: str, kind: str) -> float:
    return sum(model.items[n].const for n in model.phases[phase] if n in STATE_ITEMS[kind])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_states_after_the_step_equal_the_plan(measured, layout):
    model = model_of(layout)
    for rank in measured[layout]:
        got = rank["after_step"]
        for kind in ("params", "grads", "moments"):
            assert got[kind]["bytes"] == planned(model, "optimizer step", kind), (kind, got)
        # The one thing the plan leaves out: a 4-byte step counter per parameter tensor.
        assert got["step_counters"]["bytes"] == 4 * got["params"]["storages"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_states_between_micro_batches_equal_the_plan(measured, layout):
    # What the first micro-batch leaves for the second is what the plan's forward holds besides the
    # micro-batch's own activations (ZeRO-3's two gathered blocks are the forward's own, not carried).
    model = model_of(layout)
    for rank in measured[layout]:
        got = rank["between_micro_batches"]
        assert got["params"]["bytes"] == planned(model, "forward end", "params")
        assert got["grads"]["bytes"] == planned(model, "forward end", "grads")


@pytest.mark.parametrize("layout", ["zero1", "zero2", "ddp"])
def test_gathered_weights_stay_through_the_forward(measured, layout):
    model = model_of(layout)
    for rank in measured[layout]:
        got = rank["forward_end"]
        assert got["params"]["bytes"] == planned(model, "forward end", "params")
        assert got["params"]["bytes"] > rank["after_step"]["params"]["bytes"]  # the gathered copy is there


def test_zero3_keeps_only_the_head_gathered_after_the_forward(measured):
    # parallel/data_parallel.py never reshards norm + lm_head between forward and backward.
    args = tiny_config([]).model
    head_bytes = 4 * (args.vocab_size * args.dim + args.dim)
    for rank in measured["zero3"]:
        assert rank["forward_end"]["params"]["bytes"] == rank["after_step"]["params"]["bytes"] + head_bytes


@pytest.mark.parametrize("layout", LAYOUTS)
def test_bf16_plan_is_the_measurement_with_bf16_gathered_copies(measured, layout):
    """The GPU case from the code path: fp32 shards, gradients and moments; bf16 gathered copies."""
    bf16 = model_of(layout, "bf16")
    rank = measured[layout][0]
    gathered = rank["between_micro_batches"]["params"]["bytes"] - rank["after_step"]["params"]["bytes"]
    assert planned(bf16, "forward end", "params") == rank["after_step"]["params"]["bytes"] + gathered / 2
    assert planned(bf16, "forward end", "grads") == rank["between_micro_batches"]["grads"]["bytes"]
    for kind in ("params", "grads", "moments"):
        assert planned(bf16, "optimizer step", kind) == rank["after_step"][kind]["bytes"]
    assert bf16.items["autocast copies (all)"].const == 0  # bf16 weights gathered: autocast copies none
