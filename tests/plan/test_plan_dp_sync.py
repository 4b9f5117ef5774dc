"""Per-step data-parallel work in the time model against what the trainer runs (issue #20, planner
leftovers): where gradients accumulate under a pipeline, what HSDP all-reduces for each ZeRO stage, when
ZeRO-1/2 gather their weights, and agreement with the memory model's buffers.

The trainer's behaviour these tests encode (parallel/data_parallel.py on torch's FSDP2):
- `GradSync.set` turns gradient sync off until the last micro-batch for ZeRO-1 and replication, and
  torch.distributed.pipelining turns it off for every micro-batch of an FSDP stage and reduces once after
  the schedule (`perform_reduce_grad`): the unsharded gradients accumulate, upcast to fp32 under bf16
  mixed precision (`FSDPParam.to_accumulated_grad_if_needed`, then `+=` per micro-batch);
- FSDP2 shards the gradients over dp_shard * cp at every ZeRO stage, and HSDP all-reduces the
  reduce-scatter's output (`foreach_reduce`), so the all-reduce carries 1 / (dp_shard * cp) of them.
"""

from __future__ import annotations

import pytest

from tracetrain.models.presets import get_preset
from tracetrain.plan import PlanInput, plan
from tracetrain.plan import collective_time as comm
from tracetrain.plan.memory import stage_model
from tracetrain.plan.params import stage_params
from tracetrain.plan.step import accumulation_bytes

EIGHT_B = get_preset("llama3-8b")
BASE = PlanInput(model=EIGHT_B, seq_len=2048, micro_batch=1, gpu="h100-sxm", precision="bf16")


def _train(inp: PlanInput, stage: int = 0) -> float:
    return stage_params(inp, stage).total


def test_pipeline_accumulates_unsharded_fp32_gradients() -> None:
    """Under pp every FSDP stage accumulates unsharded gradients: first micro-batch upcast (6 bytes per
    element), each later one added (10). The old model charged a sharded 12 (m - 1) / fsdp."""
    inp = BASE.replace(num_gpus=4, pp=2, dp_shard=2, grad_accum=4)
    assert accumulation_bytes(inp, _train(inp)) == pytest.approx((6 + 10 * 3) * _train(inp))
    # The same buffer the memory model holds until the step's single reduce-scatter: 4 bytes per element.
    held = stage_model(inp, 0).items["FSDP unsharded grads (pipeline)"].const
    assert held == pytest.approx(4 * _train(inp))


def test_pipeline_accumulation_does_not_shrink_with_more_shards() -> None:
    small = plan(BASE.replace(num_gpus=4, pp=2, dp_shard=2, grad_accum=4))
    large = plan(BASE.replace(num_gpus=8, pp=2, dp_shard=4, grad_accum=4))
    key = "grad accumulation"
    assert small.time.breakdown[key] == pytest.approx(large.time.breakdown[key])
    # Without a pipeline, ZeRO-2/3 add reduce-scattered shards: half the shard, half the bytes.
    z2 = [plan(BASE.replace(num_gpus=n, dp_shard=n, zero_stage=2, grad_accum=4)).time.breakdown[key] for n in (2, 4)]
    assert z2[1] < 0.6 * z2[0]


@pytest.mark.parametrize("zero_stage", [1, 2])
def test_zero_accumulation_matches_the_flavour(zero_stage: int) -> None:
    inp = BASE.replace(num_gpus=4, dp_shard=4, zero_stage=zero_stage, grad_accum=3)
    train = _train(inp)
    expected = (6 + 10 * 2) * train if zero_stage == 1 else 2 * 12 * train / 4
    assert accumulation_bytes(inp, train) == pytest.approx(expected)
    assert accumulation_bytes(inp.replace(grad_accum=1), train) == 0.0


def test_zero1_and_zero2_are_the_same_step_under_a_pipeline() -> None:
    """Pipelining reduces once after the schedule whatever the stage (search.py skips ZeRO-1 there)."""
    z1 = plan(BASE.replace(num_gpus=4, pp=2, dp_shard=2, zero_stage=1, grad_accum=4))
    z2 = plan(BASE.replace(num_gpus=4, pp=2, dp_shard=2, zero_stage=2, grad_accum=4))
    assert z1.step_s == pytest.approx(z2.step_s)


@pytest.mark.parametrize("zero_stage", [1, 2, 3])
def test_hsdp_all_reduces_the_sharded_fp32_gradients(zero_stage: int) -> None:
    inp = BASE.replace(num_gpus=16, dp_replicate=2, dp_shard=8, zero_stage=zero_stage, grad_accum=2)
    p = plan(inp)
    bw = comm.bandwidth(inp, inp.hardware(), ("dp_replicate",))
    expected = comm.all_reduce_s(_train(inp) * 4 / 8, 2, bw)
    assert p.time.comm_total["DP all-reduce"] == pytest.approx(expected)


def test_reductions_after_a_pipeline_schedule_are_exposed() -> None:
    piped = plan(BASE.replace(num_gpus=8, pp=2, dp_replicate=2, dp_shard=2, grad_accum=4))
    flat = plan(BASE.replace(num_gpus=4, dp_replicate=2, dp_shard=2, grad_accum=4))
    t = piped.time
    assert t.breakdown["DP comm (exposed)"] == pytest.approx(t.comm_total["DP all-reduce"])
    assert flat.time.breakdown["DP comm (exposed)"] < 0.5 * flat.time.comm_total["DP all-reduce"]
    # ZeRO-3 under pp: the reduce-scatter alone (fp32, once) is charged whole.
    inp = piped.input
    rs = comm.all_gather_s(_train(inp) * 4, 2, comm.bandwidth(inp, inp.hardware(), ("dp_shard", "cp")))
    assert t.breakdown["FSDP comm (exposed)"] >= rs


def test_zero2_gathers_behind_the_first_forward() -> None:
    """FSDP2 gathers ZeRO-1/2 weights unit by unit in the step's first forward, prefetching the next unit
    behind the current one's compute: with enough compute little of the gather is exposed (the old model
    charged all of it). LoRA: the gathered base is large, the reduce-scattered adapters tiny."""
    inp = BASE.replace(num_gpus=8, dp_shard=8, zero_stage=2, micro_batch=8, grad_accum=1, mode="lora")
    p = plan(inp)
    bw = comm.bandwidth(inp, inp.hardware(), ("dp_shard", "cp"))
    gather = comm.all_gather_s(_train(inp) * 2, 8, bw)
    assert gather < p.time.comm_total["ZeRO reduce-scatter + all-gather"]
    assert p.time.breakdown["ZeRO comm (exposed)"] < 0.5 * gather
