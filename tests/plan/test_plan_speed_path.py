"""The planner's speed-path inputs (compile, fused kernels, FlexAttention, fused lm_head + CE) and its
pipeline / expert-parallel accounting, checked against the real code where a CPU can run it."""

from __future__ import annotations

import shutil

import pytest
import torch

from tracetrain.config import load_config
from tracetrain.models.build import materialize, model_args_from_config
from tracetrain.models.presets import get_preset
from tracetrain.plan import PlanInput, plan, plan_input_from_config
from tracetrain.plan import activations as act

SHAPE = ["--model.dim=256", "--model.n_layers=1", "--model.n_heads=4", "--model.n_kv_heads=1",
         "--model.ffn_dim=640", "--model.vocab_size=256"]


def _saved_block_bytes_per_token(model: torch.nn.Module, batch: int, seq: int) -> float:
    """Bytes of the distinct storages block 0's autograd graph saves, per token, under bf16 autocast
    (rotary tables excluded: the planner counts them outside the blocks)."""
    sizes: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.dim() and t.shape[0] in (batch, batch * seq):  # activations (weights have other leading dims)
            sizes[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    ids = torch.randint(0, 256, (batch, seq))
    pos = torch.arange(seq).expand(batch, seq)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cos, sin = model.rope(pos)
        x = model.embed_tokens(ids).detach().requires_grad_()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model.layers[0](x, cos, sin, None)
    rope_tables = {t.untyped_storage().data_ptr() for t in (cos, sin)}
    return sum(v for k, v in sizes.items() if k not in rope_tables) / (batch * seq)


QKVO = ("q_proj", "k_proj", "v_proj", "o_proj")
ALL = (*QKVO, "gate_proj", "up_proj", "down_proj")


@pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                    reason="torch.compile on CPU needs a C++ compiler")
@pytest.mark.parametrize(("mode", "targets", "quant", "pointwise"), [
    ("full", (), "none", False), ("lora", QKVO, "none", False), ("lora", QKVO, "none", True),
    ("lora", ALL, "nf4", False), ("lora", ALL, "nf4", True)])
def test_compiled_block_saves_what_the_planner_counts(mode: str, targets: tuple[str, ...], quant: str,
                                                      pointwise: bool) -> None:
    """`pointwise`: memory.recompute_pointwise (off by default: the adapters' pointwise inputs are saved)."""
    from tracetrain.kernels.apply import apply_compile
    cfg = load_config(None, SHAPE + [f"--train.mode={mode}"])
    args = model_args_from_config(cfg)
    torch.manual_seed(0)
    model = materialize(args, torch.device("cpu"), 0)
    if mode == "lora":
        from tracetrain.models.lora import apply_lora
        apply_lora(model, rank=8, alpha=16, dropout=0.0, targets=list(targets), base_dtype=torch.bfloat16,
                   adapter_dtype=torch.float32, base_quant=quant)
    inp = PlanInput(model=args, mode=mode, lora_rank=8, lora_targets=targets, lora_base_quant=quant,  # type: ignore[arg-type]
                    compile=True, recompute_pointwise=pointwise)
    nm = act.numerics(inp)
    eager_planned = act.shard(act.block_items(args, nm), 1, True).per_token
    assert _saved_block_bytes_per_token(model, 3, 96) == pytest.approx(eager_planned, rel=0.01)
    apply_compile(model, pointwise)
    compiled_planned = act.shard(act.block_items(args, nm, path="compile"), 1, True).per_token
    saving_planned = act.shard(act.block_items(args, act.numerics(inp.replace(recompute_pointwise=True)),
                                               path="compile"), 1, True).per_token
    assert compiled_planned < eager_planned
    assert (saving_planned < compiled_planned) == (mode == "lora" and not pointwise)  # o_proj is adapted
    assert _saved_block_bytes_per_token(model, 3, 96) == pytest.approx(compiled_planned, rel=0.01)


def _backward_peak_bytes_per_token(block: torch.nn.Module, model: torch.nn.Module, batch: int, seq: int) -> float:
    """The largest total of CPU bytes allocated during the block's backward over what was allocated when it
    started (the allocator's own running count, from the profiler), per token. The incoming gradient, the
    block input and its output exist before."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    ids = torch.randint(0, 256, (batch, seq))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cos, sin = model.rope(torch.arange(seq).expand(batch, seq))
        x = model.embed_tokens(ids).detach().to(torch.bfloat16).requires_grad_()
        out = block(x, cos, sin, None)
    grad = torch.randn_like(out)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out.backward(grad)

    def walk(nodes):  # type: ignore[no-untyped-def]
        for n in nodes:
            yield n
            yield from walk(n.children)

    events = prof.profiler.kineto_results.experimental_event_tree()  # type: ignore[union-attr]
    allocations = sorted((n for n in walk(events) if n.tag == _EventType.Allocation), key=lambda n: n.start_time_ns)
    total = peak = 0
    for n in allocations:
        total += n.extra_fields.alloc_size
        peak = max(peak, total)
    return peak / (batch * seq)


@pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                    reason="torch.compile on CPU needs a C++ compiler")
@pytest.mark.parametrize("targets", [ALL, QKVO, ()], ids=["lora-all", "lora-qkvo", "full"])
def test_compiled_recomputed_block_backward_holds_what_the_planner_counts(targets: tuple[str, ...]) -> None:
    """A compiled block under full recomputation (recompute wraps it first, as the trainer orders them):
    its backward reruns the forward in the compiled graph and holds, at its SwiGLU backward, what
    `compiled_recomputed_mlp_backward_items` adds to the rematerialised saved tensors (11 ffn-wide tensors
    with every MLP projection adapted, the planner's long-context rows). Where down_proj has no adapter,
    Inductor writes one gradient over a dead input of that kernel, which the planner does not count: it
    may be one ffn-wide tensor high there. ffn = 8 dim, so the MLP's tensors decide."""
    from tracetrain.kernels.apply import apply_compile
    from tracetrain.memory.recompute import apply_recompute
    from tracetrain.plan.memory import memory_model

    mode = "lora" if targets else "full"
    cfg = load_config(None, ["--model.dim=64", "--model.n_layers=1", "--model.n_heads=4", "--model.n_kv_heads=1",
                             "--model.ffn_dim=512", "--model.vocab_size=256", f"--train.mode={mode}"])
    args = model_args_from_config(cfg)
    torch.manual_seed(0)
    model = materialize(args, torch.device("cpu"), 0)
    if targets:
        from tracetrain.models.lora import apply_lora
        apply_lora(model, rank=8, alpha=8, dropout=0.0, targets=list(targets), base_dtype=torch.bfloat16,
                   adapter_dtype=torch.float32)
    torch._dynamo.reset()  # the blocks' code is cached per process
    apply_recompute(model, "full")
    apply_compile(model)
    batch, seq = 2, 1024
    _backward_peak_bytes_per_token(model.layers[0], model, batch, seq)  # compiles forward and backward
    measured = _backward_peak_bytes_per_token(model.layers[0], model, batch, seq)
    inp = PlanInput(model=args, mode=mode, lora_rank=8, lora_targets=targets, lora_base_dtype="bf16",  # type: ignore[arg-type]
                    compile=True, recompute="full", micro_batch=batch, seq_len=seq)
    nm = act.numerics(inp)
    working = memory_model(inp, batch * seq, seq).items["block backward (MLP)"].per_token
    planned = working - act.residual_gradient(args, nm).per_token  # the incoming gradient was there before
    in_place = 0 if "down_proj" in targets else nm.c * args.ffn_dim
    assert 0.95 * measured <= planned <= 1.05 * measured + in_place, (measured, planned)


def test_fused_ce_replaces_the_logits_buffers_and_follows_the_trainer() -> None:
    base = PlanInput(model=get_preset("llama3.2-1b"), micro_batch=4, seq_len=2048, gpu="h100-sxm")
    eager, fused = plan(base), plan(base.replace(fused_ce_chunk=4096))
    # 12 x tokens x vocab bytes of loss buffers become one (chunk, vocab) bf16 buffer + weight-sized ones
    assert eager.memory.breakdown["logits / loss"] > 10 * 2**30
    assert fused.memory.breakdown["logits / loss"] < 4 * 2**30
    assert fused.peak_gib < eager.peak_gib - 6
    assert fused.step_s < eager.step_s
    # the trainer leaves the loss to loss parallelism (tp) and the pipeline (pp): so does the plan
    tp = base.replace(num_gpus=2, tp=2)
    assert plan(tp.replace(fused_ce_chunk=4096)).peak_gib == plan(tp).peak_gib


def test_compile_and_kernels_cut_activation_memory_and_time() -> None:
    base = PlanInput(model=get_preset("llama3.2-1b"), micro_batch=4, seq_len=2048, gpu="h100-sxm", fused_ce_chunk=4096)
    eager, kernels, compiled = plan(base), plan(base.replace(fused_kernels=True)), plan(base.replace(compile=True))
    act_gib = [p.memory.breakdown["activations"] / 2**30 for p in (eager, kernels, compiled)]
    assert act_gib[0] > act_gib[1] > act_gib[2]
    assert eager.step_s > kernels.step_s and eager.step_s > compiled.step_s
    flex = plan(base.replace(compile=True, attention="flex"))
    assert flex.time.breakdown["attention"] > compiled.time.breakdown["attention"]  # causal, no documents


def test_config_defaults_resolve_as_on_cuda() -> None:
    inp = plan_input_from_config(load_config(None, ["--model.preset=llama3.2-1b"]), 1, "h200")
    assert (inp.compile, inp.fused_kernels, inp.attention, inp.fused_ce_chunk) == (True, False, "flex", 4096)
    off = plan_input_from_config(load_config(None, ["--model.preset=llama3.2-1b", "--train.compile=off",
                                                    "--train.fused_ce=false", "--data.pack=false"]), 1, "h200")
    assert (off.compile, off.fused_kernels, off.attention, off.fused_ce_chunk) == (False, True, "sdpa", 0)


def test_pipeline_micro_batches_are_the_step_rows_cut_in_pp_microbatches() -> None:
    cfg = load_config(None, ["--model.preset=llama3-8b", "--parallel.pp=4", "--parallel.pp_microbatches=8",
                             "--train.micro_batch_size=8"])
    inp = plan_input_from_config(cfg, 4, "h200")
    assert (inp.micro_batch, inp.num_microbatches, inp.global_batch) == (1, 8, 8)
    bad = load_config(None, ["--model.preset=llama3-8b", "--parallel.pp=4", "--parallel.pp_microbatches=8",
                             "--train.micro_batch_size=4"])
    with pytest.raises(ValueError, match="pp_microbatches"):
        plan_input_from_config(bad, 4, "h200")


def test_pipeline_with_fsdp_keeps_the_stage_gathered_with_fp32_grads() -> None:
    base = PlanInput(model=get_preset("llama3-8b"), micro_batch=1, seq_len=2048, gpu="h200", num_gpus=4,
                     pp=2, dp_shard=2, pp_microbatches=4)
    p = plan(base)
    assert "pipeline backward end" in p.memory.phases
    stage_params = 8.03e9 / 2
    held = p.memory.phases["pipeline backward end"] - p.memory.phases["optimizer step"]
    assert held > 5 * stage_params  # 2 bytes gathered + 4 bytes unsharded grad per stage parameter, roughly
    assert "pipeline backward end" not in plan(base.replace(dp_shard=1, num_gpus=2)).memory.phases


def test_expert_parallel_shards_experts_over_dp_shard_not_twice() -> None:
    args = get_preset("llama3.2-1b")
    moe = PlanInput(model=args, micro_batch=4, seq_len=2048, gpu="h200", num_gpus=4, dp_shard=4,
                    num_experts=8, top_k=2)
    no_ep, ep = plan(moe), plan(moe.replace(ep=4))
    # the same expert bytes per rank either way: 1/4 of every expert's weights, grads and AdamW states
    assert ep.memory.breakdown["AdamW states"] == pytest.approx(no_ep.memory.breakdown["AdamW states"], rel=1e-6)
