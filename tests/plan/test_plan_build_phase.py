"""The build and load phases of the memory plan: each rank materialises its shard of the weights in
their final dtype plus one fp32 chunk of initial values, and the verdict is the largest of the build and
the step."""

from __future__ import annotations

import pytest
import torch

from tracetrain.config import load_config
from tracetrain.models.accounting import num_params
from tracetrain.models.build import materialize
from tracetrain.models.llama import ModelArgs
from tracetrain.models.presets import get_preset
from tracetrain.plan import PlanInput, plan, plan_input_from_config
from tracetrain.plan.build_phase import (
    BUILD_PHASE,
    CHECKPOINT_READ_BYTES,
    INIT_CHUNK_ELEMENTS,
    INIT_ITEM,
    LOAD_PHASE,
    SHARD_ITEM,
    STAGING_ITEM,
)
from tracetrain.plan.memory import GIB, stage_model

LORA_70B = [
    "--model.preset=llama3-70b",
    "--train.mode=lora",
    "--train.micro_batch_size=1",
    "--data.seq_len=2048",
    "--memory.recompute=full",
]


def test_sharded_70b_lora_builds_below_its_step_with_half_the_weights() -> None:
    p = plan(plan_input_from_config(load_config(None, [*LORA_70B, "--parallel.dp_shard=2"]), 2, "h200"))
    a = get_preset("llama3-70b")
    m = p.memory
    adapters = 80 * 16 * (6 * a.dim + 2 * a.n_kv_heads * a.head_dim)  # r16 A and B on q, k, v, o
    shard = (num_params(a) * 2 + adapters * 4) / 2  # bf16 base + fp32 adapters, halved
    assert m.phases[BUILD_PHASE] == pytest.approx(shard + 2**24 * 4, rel=1e-6)  # + one 64 MiB fp32 chunk
    assert 60 * GIB < shard < 70 * GIB  # ~66 GiB a rank, not the whole 131 GiB
    assert m.build_peak_bytes < m.step_peak_bytes == m.peak_bytes
    assert p.fits and m.peak_phase != BUILD_PHASE


def test_70b_lora_on_one_gpu_does_not_fit_and_names_the_build() -> None:
    p = plan(plan_input_from_config(load_config(None, LORA_70B), 1, "h200"))
    assert not p.fits
    assert p.memory.build_peak_bytes > 130 * GIB  # the whole bf16 base on the one GPU
    assert any("build" in line for line in p.advice), p.advice


def test_70b_full_on_one_gpu_names_the_build_that_alone_does_not_fit() -> None:
    cfg = load_config(None, ["--model.preset=llama3-70b", "--memory.recompute=full"])
    p = plan(plan_input_from_config(cfg, 1, "h200"))
    assert not p.fits
    assert p.memory.build_required_bytes > p.memory.capacity_bytes  # 70B fp32 weights: 263 GiB
    assert any(line.startswith("the build alone does not fit") for line in p.advice), p.advice


def test_a_build_larger_than_the_step_is_the_verdict() -> None:
    """fsdp_cpu_offload keeps the step's shards on the host, but each rank still materialises its
    shard on the GPU first: with a GPU too small for that shard, the build is the peak and the verdict."""
    inp = plan_input_from_config(
        load_config(
            None,
            [
                "--model.preset=llama3-8b",
                "--parallel.dp_shard=2",
                "--parallel.fsdp_cpu_offload=true",
                "--train.micro_batch_size=1",
            ],
        ),
        2,
        "h200",
    )
    small = plan(inp.replace(gpu_memory_gib=12.0))
    assert small.memory.peak_phase == BUILD_PHASE
    assert small.memory.build_peak_bytes > small.memory.step_peak_bytes
    assert not small.fits
    assert plan(inp).fits


def test_load_phase_holds_the_shard_and_stages_one_tensor_on_the_host() -> None:
    inp = PlanInput(model=get_preset("llama3-8b"), num_gpus=4, dp_shard=4, load_checkpoint=True, gpu="h200")
    p = plan(inp)
    a = inp.model
    shard = p.memory.phases[BUILD_PHASE] - INIT_CHUNK_ELEMENTS * 4
    assert p.memory.cpu_bytes[STAGING_ITEM] == CHECKPOINT_READ_BYTES < a.vocab_size * a.dim * 2  # one read
    assert p.memory.phases[LOAD_PHASE] == shard + CHECKPOINT_READ_BYTES
    assert LOAD_PHASE not in plan(inp.replace(load_checkpoint=False)).memory.phases


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_shard_item_is_the_bytes_one_rank_materialises(mode: str) -> None:
    """On one rank the shard is the whole model: the planned bytes equal materialize's parameters."""
    tiny = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=160, vocab_size=96)
    dtype = torch.bfloat16 if mode == "lora" else torch.float32
    model = materialize(tiny, torch.device("cpu"), seed=0, dtype=dtype)
    real = sum(p.numel() * p.element_size() for p in model.parameters())  # (tied weights counted once)
    inp = PlanInput(model=tiny, mode=mode, lora_targets=(), lora_base_dtype="bf16", precision="bf16", gpu="h200")
    items = stage_model(inp, 0).items
    assert items[SHARD_ITEM].const == real
    largest = max(p.numel() for p in model.parameters())
    assert items[INIT_ITEM].const == min(largest, INIT_CHUNK_ELEMENTS) * 4  # the largest, in fp32


def test_advice_does_not_say_fits_when_the_host_cannot_hold_the_offloaded_shards() -> None:
    cfg = load_config(
        None,
        [
            "--model.preset=llama3-70b",
            "--parallel.dp_shard=4",
            "--parallel.fsdp_cpu_offload=true",
            "--memory.recompute=full",
            "--train.micro_batch_size=1",
        ],
    )
    p = plan(plan_input_from_config(cfg, 4, "h200").replace(host_memory_gib=512.0))
    assert not p.fits  # 70B x 16 bytes of fp32 weights, grads and AdamW states: ~1,050 GiB on the host
    assert p.advice[0].startswith("host memory")
    assert not any(line.startswith("fits") for line in p.advice), p.advice


def test_fp8_materialises_the_whole_model_before_sharding() -> None:
    """kernels/fp8.py quantises real values, so the trainer materialises before the FP8 row, before FSDP."""
    overrides = ["--model.preset=llama3-8b", "--train.mode=lora", "--parallel.dp_shard=2"]
    bf16 = plan(plan_input_from_config(load_config(None, overrides), 2, "h200")).memory.phases[BUILD_PHASE]
    fp8 = plan(plan_input_from_config(load_config(None, [*overrides, "--train.fp8=rowwise"]), 2, "h200"))
    chunk = INIT_CHUNK_ELEMENTS * 4
    assert fp8.memory.phases[BUILD_PHASE] - chunk == pytest.approx(2 * (bf16 - chunk))
