"""Memory model: exact bytes of weights, gradients and AdamW states against a real model and optimizer,
sharding arithmetic, phases, and the two H200 calibration points."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tracetrain.config import OptimSection
from tracetrain.models.accounting import block_params, num_params
from tracetrain.models.build import materialize
from tracetrain.models.llama import ModelArgs, Transformer
from tracetrain.models.lora import apply_lora
from tracetrain.models.presets import get_preset
from tracetrain.plan import PlanInput, plan
from tracetrain.plan.memory import GIB, plan_memory, stage_model
from tracetrain.plan.params import stage_params
from tracetrain.train.optim import build_optimizer

TINY = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=160, vocab_size=96)


def real_static_bytes(model: torch.nn.Module) -> dict[str, int]:
    """Bytes of parameters, .grad and optimizer state after one real backward and optimizer step."""
    opt = build_optimizer(model, OptimSection(), fused=False)
    tokens = torch.randint(0, TINY.vocab_size, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(tokens)
    F.cross_entropy(logits.float().flatten(0, 1), tokens.flatten()).backward()
    opt.step()
    params = {p.untyped_storage().data_ptr(): p for p in model.parameters()}.values()
    states = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor) and t.ndim > 0]
    return {"weights": sum(p.numel() * p.element_size() for p in params),
            "gradients": sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None),
            "AdamW states": sum(t.numel() * t.element_size() for t in states)}  # the 0-d `step` counters aside


def planned_static_bytes(inp: PlanInput) -> dict[str, float]:
    items = stage_model(inp, 0).items
    return {k: items[k].const for k in ("weights", "gradients", "AdamW states")}


@pytest.mark.parametrize("tied", [False, True])
def test_full_fp32_params_grads_states_are_exact(tied: bool) -> None:
    args = ModelArgs(**{**TINY.__dict__, "tie_embeddings": tied, "rope_scaling": {}})
    real = real_static_bytes(materialize(args, torch.device("cpu"), 0))
    assert planned_static_bytes(PlanInput(model=args, mode="full")) == real
    assert real["weights"] == 4 * num_params(args)


@pytest.mark.parametrize("targets", [("q_proj", "k_proj", "v_proj", "o_proj"), ("all-linear",)])
def test_lora_bf16_base_fp32_adapters_are_exact(targets: tuple[str, ...]) -> None:
    model = materialize(TINY, torch.device("cpu"), 0)
    apply_lora(model, 8, 16.0, 0.0, list(targets), base_dtype=torch.bfloat16)
    real = real_static_bytes(model)
    inp = PlanInput(model=TINY, mode="lora", lora_rank=8, lora_base_dtype="bf16",
                    lora_targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
                    if targets == ("all-linear",) else targets)
    assert planned_static_bytes(inp) == real


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_tensor_parallel_block_params_match_module_shapes(tp: int) -> None:
    """Column-wise (q/k/v/gate/up) and row-wise (o/down) splits hold 1/tp of each weight; norms are
    replicated; embedding and lm_head split by vocabulary."""
    args = get_preset("llama3-8b")
    with torch.device("meta"):
        block = Transformer(ModelArgs(**{**args.__dict__, "n_layers": 1})).layers[0]
    per_rank = sum(m.weight.numel() / tp for m in block.modules() if isinstance(m, torch.nn.Linear))
    per_rank += block.input_layernorm.weight.numel() + block.post_attention_layernorm.weight.numel()
    sp = stage_params(PlanInput(model=args, tp=tp, num_gpus=tp), 0)
    assert sp.block == per_rank
    assert sp.embedding == args.vocab_size * args.dim / tp
    sharded = block_params(args) - 2 * args.dim
    assert sp.block == sharded / tp + 2 * args.dim


@pytest.mark.parametrize("pp", [1, 2, 4])
def test_pipeline_stages_partition_the_model(pp: int) -> None:
    args = get_preset("llama3.2-1b")  # tied: with pp > 1 the last stage holds its own lm_head copy
    inp = PlanInput(model=args, pp=pp, num_gpus=pp, grad_accum=pp)
    total = sum(stage_params(inp, s).total for s in range(pp))
    extra = args.vocab_size * args.dim if pp > 1 else 0
    assert total == num_params(args) + extra


def test_every_zero_stage_shards_the_states_and_stages_1_2_keep_a_gathered_copy() -> None:
    # FSDP2 shards all three over dp_shard whatever the stage (measured by storage on gloo:
    # tests/plan/test_plan_zero_measured.py); ZeRO-1/2 keep every unit's bf16 gathered weights through the
    # forward, ZeRO-3 two blocks at a time.
    args = get_preset("llama3-8b")
    base = PlanInput(model=args, num_gpus=8, dp_shard=8, micro_batch=1, seq_len=1024)
    n = num_params(args)
    for stage in (1, 2, 3):
        items = stage_model(base.replace(zero_stage=stage), 0).items
        full = {"weights": 4 * n, "gradients": 4 * n, "AdamW states": 8 * n}
        for name, whole in full.items():
            assert items[name].const == pytest.approx(whole / 8)
        assert ("FSDP unsharded weights" in items) == (stage < 3)
        if stage < 3:
            assert items["FSDP unsharded weights"].const == pytest.approx(2 * n)


def test_peak_is_the_largest_phase_not_the_sum() -> None:
    p = plan(PlanInput(model=get_preset("llama3.2-1b"), micro_batch=4, seq_len=2048, gpu="h200"))
    assert p.memory.peak_phase == "backward start"
    assert p.memory.peak_bytes == max(p.memory.phases.values())
    every_item = sum(p.memory.breakdown.values()) + 4 * num_params(get_preset("llama3.2-1b"))  # + grads
    assert p.memory.peak_bytes < every_item


def test_grad_accumulation_keeps_grads_through_the_forward() -> None:
    one = plan_memory(PlanInput(model=get_preset("llama3.2-1b"), micro_batch=4, seq_len=2048, gpu="h200"))
    two = plan_memory(PlanInput(model=get_preset("llama3.2-1b"), micro_batch=4, seq_len=2048, gpu="h200",
                                grad_accum=2))
    assert two.peak_bytes - one.peak_bytes == pytest.approx(4 * num_params(get_preset("llama3.2-1b")))


def test_recompute_and_offload_reduce_activations() -> None:
    base = PlanInput(model=get_preset("llama2-7b"), mode="lora", micro_batch=4, seq_len=2048, gpu="h100")
    peaks = [plan_memory(base.replace(recompute=r)).peak_bytes for r in ("none", "selective", "full")]
    assert peaks[0] > peaks[1] > peaks[2]
    off = plan_memory(base.replace(activation_offload="streamed"))
    assert off.peak_bytes < peaks[0] and off.cpu_bytes["offloaded activations"] > 20 * GIB


def test_partial_streamed_offload_keeps_the_unoffloaded_blocks() -> None:
    """`memory.activation_offload_fraction`: the first k blocks go to the host; n - k stay, plus the one
    copied back first. Each further offloaded block moves one block's activations to the CPU."""
    base = PlanInput(model=get_preset("llama2-7b"), mode="lora", micro_batch=4, seq_len=2048, gpu="h100",
                     activation_offload="streamed")
    fractions = (0.25, 0.5, 1.0)
    plans = [plan_memory(base.replace(activation_offload_fraction=f)) for f in fractions]
    peaks = [p.peak_bytes for p in plans]
    assert peaks == sorted(peaks, reverse=True) and len(set(peaks)) == 3
    moved = [p.cpu_bytes["offloaded activations"] for p in plans]
    per_block = (moved[2] - moved[1]) / (31 - 16)  # k = 31 (all but the last) vs k = 16 of 32 blocks
    assert moved[1] - moved[0] == pytest.approx(per_block * (16 - 8), rel=1e-6)
    assert peaks[0] - peaks[1] == pytest.approx(moved[1] - moved[0], rel=0.05)


def test_calibration_7b_lora_partial_offload_h100() -> None:
    """Measured on an H100 with stream-ordered release (commit 078f79a, memory_7b-lora_offload_capped_*):
    26.44 GiB allocated at fraction 0.5, 32.63 GiB at 0.25 (compiled CUDA defaults)."""
    from tracetrain.config import load_config
    from tracetrain.plan import plan_input_from_config
    for fraction, measured in ((0.5, 26.44), (0.25, 32.63)):
        cfg = load_config(None, ["--model.preset=llama2-7b", "--train.mode=lora", "--data.seq_len=2048",
                                 "--data.pack=false", "--train.device=cuda", "--train.micro_batch_size=4",
                                 "--memory.activation_offload=streamed",
                                 f"--memory.activation_offload_fraction={fraction}"])
        inp = plan_input_from_config(cfg, 1, "NVIDIA H100 80GB HBM3")
        assert inp.activation_offload_fraction == fraction
        assert plan(inp).peak_gib == pytest.approx(measured, rel=0.03)


def test_calibration_llama32_1b_full_h200() -> None:
    """Measured on one H200 (benchmarks/results/train_speed_NVIDIA-H200.json): 43.84 GiB allocated."""
    p = plan(PlanInput(model=get_preset("llama3.2-1b"), mode="full", micro_batch=4, seq_len=2048, gpu="h200"))
    assert p.peak_gib == pytest.approx(43.84, rel=0.03)


def test_calibration_llama2_7b_lora_h200() -> None:
    """Measured 55.96 GiB at commit e703ed8, whose LoRALinear cast every adapter input to fp32 first, so
    under autocast each of q/k/v/o kept its own bf16 copy of its input (4 x 2 bytes x d per token and
    block). Since 79cd64d q/k/v share the norm output and o_proj reuses the attention output: 6d bytes
    per token and block less, which this test adds back to compare with that measurement."""
    args = get_preset("llama2-7b")
    p = plan(PlanInput(model=args, mode="lora", micro_batch=4, seq_len=2048, gpu="h200"))
    legacy_copies = 6 * args.dim * 4 * 2048 * args.n_layers
    assert (p.memory.peak_bytes + legacy_copies) / GIB == pytest.approx(55.96, rel=0.03)
    assert p.peak_gib == pytest.approx(49.9, rel=0.01)


def test_fp16_autocast_caches_copies_of_a_bf16_lora_base():
    """Measured on an H100: 7B LoRA fp16 peaks 16 GiB above bf16 (autocast's fp16 copies of the bf16
    base); the plan must carry about the base's size more."""
    from tracetrain.config import load_config
    from tracetrain.plan import plan, plan_input_from_config
    common = ["--model.preset=llama2-7b", "--train.mode=lora", "--data.seq_len=2048", "--train.micro_batch_size=4"]
    peak = {p: plan(plan_input_from_config(load_config(None, [*common, f"--train.precision={p}"]), 1, "h100-sxm"))
            .memory.peak_bytes / 2**30 for p in ("bf16", "fp16")}
    assert 11.0 < peak["fp16"] - peak["bf16"] < 14.0  # ~6.6B frozen linear weights x 2 bytes


def test_fp8_lora_keeps_the_two_e4m3_copies_on_the_gpu_and_the_bf16_base_on_the_host():
    from tracetrain.config import load_config
    from tracetrain.models.accounting import num_matmul_params
    from tracetrain.plan import plan, plan_input_from_config
    common = ["--model.preset=llama2-7b", "--train.mode=lora", "--data.seq_len=2048", "--train.micro_batch_size=4"]
    bf16 = plan_input_from_config(load_config(None, common), 1, "h100-sxm")
    fp8 = plan_input_from_config(load_config(None, [*common, "--train.fp8=rowwise"]), 1, "h100-sxm")
    assert bf16.precision == "bf16" and fp8.precision == "fp8"
    a = bf16.model
    block_weights = num_matmul_params(a) - a.vocab_size * a.dim  # lm_head is not converted
    # kernels/fp8.py: two 1-byte copies of every frozen block weight on the GPU, its bf16 copy on the host
    assert plan(fp8).memory.breakdown["weights"] == plan(bf16).memory.breakdown["weights"]
    assert plan(fp8).memory.cpu_bytes["bf16 copies of the FP8 base weights"] == block_weights * 2
    assert "bf16 copies of the FP8 base weights" not in plan(bf16).memory.cpu_bytes
    assert plan(fp8).step_s < plan(bf16).step_s  # FP8 GEMMs at the FP8 peak
