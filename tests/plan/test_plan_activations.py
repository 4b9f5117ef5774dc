"""The planner's per-token derivations against the real model on CPU.

Saved activations: every tensor autograd keeps for backward, caught by `saved_tensors_hooks` in a real
forward of a tiny model (unique storages, parameters excluded), must equal the planner's per-block and
outside-block items times the tokens, plus the autocast weight copies. Memory-bound traffic: the bytes
read and written by every aten op of a real forward + backward that is not a matmul or attention must
match traffic.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from tracetrain.models.build import materialize
from tracetrain.models.llama import ModelArgs
from tracetrain.models.lora import apply_lora
from tracetrain.plan import activations as act
from tracetrain.plan import traffic as tr
from tracetrain.plan.inputs import PlanInput
from tracetrain.plan.params import cast_params, stage_params

QKVO = ("q_proj", "k_proj", "v_proj", "o_proj")
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GQA = ModelArgs(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=160, vocab_size=96)
MHA = ModelArgs(dim=48, n_layers=2, n_heads=3, n_kv_heads=3, ffn_dim=128, vocab_size=80, tie_embeddings=True)
B, S = 2, 24
# (mode, precision, LoRA base dtype, targets): tracetrain's full FT keeps fp32 params under bf16 autocast.
SETUPS = [("full", "fp32", "fp32", ()), ("full", "bf16", "fp32", ()), ("lora", "bf16", "bf16", QKVO),
          ("lora", "bf16", "fp32", QKVO), ("lora", "fp32", "fp32", QKVO), ("lora", "bf16", "bf16", ALL),
          ("lora", "fp32", "bf16", ("q_proj", "v_proj", "down_proj")), ("lora", "bf16", "fp32", ALL)]


def build(args: ModelArgs, mode: str, base: str, targets: tuple[str, ...]) -> torch.nn.Module:
    model = materialize(args, torch.device("cpu"), 0)
    if mode == "lora":
        apply_lora(model, 4, 8.0, 0.0, list(targets), base_dtype=torch.bfloat16 if base == "bf16" else None)
    return model


def autocast(precision: str):
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")


def plan_input(args: ModelArgs, mode: str, precision: str, base: str, targets: tuple[str, ...]) -> PlanInput:
    return PlanInput(model=args, mode=mode, precision=precision, lora_base_dtype=base, lora_targets=targets,
                     lora_rank=4, seq_len=S, micro_batch=B)


def measured_saved_bytes(model: torch.nn.Module, precision: str) -> int:
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    tokens = torch.randint(0, model.args.vocab_size, (B, S))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast(precision):
        model(tokens)
    return sum(kept.values())


def predicted_saved_bytes(inp: PlanInput) -> float:
    args, nm = inp.model, act.numerics(inp)
    per_token = sum(i.per_token for i in act.outside_items(args, nm, first_stage=True, last_stage=True))
    for layer in range(args.n_layers):
        first = inp.mode == "lora" and layer == 0
        per_token += sum(i.per_token for i in act.block_items(args, nm, first_lora_block=first))
    sp = stage_params(inp, 0)
    cast_block, cast_outside = cast_params(inp, sp, autocast=nm.autocast, weight_bytes=nm.w)
    return per_token * B * S + 2 * (cast_block * sp.num_blocks + cast_outside)


CASES = [(GQA, s) for s in SETUPS] + [(MHA, SETUPS[i]) for i in (1, 2, 4, 6)]


@pytest.mark.parametrize(("args", "setup"), CASES,
                         ids=lambda c: "-".join([c[0], c[1], c[2], str(len(c[3]))]) if isinstance(c, tuple)
                         else ("gqa" if c is GQA else "mha-tied"))
def test_saved_activations_match_the_real_model(args: ModelArgs, setup: tuple) -> None:
    mode, precision, base, targets = setup
    measured = measured_saved_bytes(build(args, mode, base, targets), precision)
    predicted = predicted_saved_bytes(plan_input(args, mode, precision, base, targets))
    assert predicted == pytest.approx(measured, rel=0.01), (measured, predicted)


def test_tensor_parallelism_and_recomputation_shrink_activations() -> None:
    nm = act.numerics(plan_input(GQA, "full", "bf16", "fp32", ()))
    items = act.block_items(GQA, nm)
    per_token = lambda its, tp, sp: act.shard(its, tp, sp).per_token  # noqa: E731
    assert per_token(items, 2, True) < per_token(items, 2, False) < per_token(items, 1, False)
    assert per_token(act.full_recompute_items(GQA, nm), 1, False) < per_token(
        act.selective_items(GQA, nm), 1, False) < per_token(items, 1, False)


def test_fp32_gqa_takes_the_math_attention_path_on_cuda() -> None:
    """CUDA's flash kernel has no fp32 and memory-efficient attention no GQA: SDPA falls back to the math
    path and keeps the fp32 softmax output, quadratic in the sequence (measured on an H200: 20.6 GiB
    for llama3.2-1b, batch 1 x 1024, fp32; 19.4 predicted without this term)."""
    nm = act.numerics(plan_input(GQA, "full", "fp32", "fp32", ()))
    assert act.attention_backend(GQA, nm) == "math"
    assert act.attention_backend(MHA, nm) == "efficient"
    probs = act.shard(act.block_items(GQA, nm, backend="math"), 1, False).per_token_seq
    assert probs == 4 * GQA.n_heads


VIEWS = {"view", "_unsafe_view", "transpose", "t", "expand", "unsqueeze", "squeeze", "reshape", "slice", "split",
         "chunk", "permute", "alias", "as_strided", "detach", "select", "unbind", "_reshape_alias",
         "split_with_sizes", "arange", "ones_like", "embedding_dense_backward", "clone"}
COMPUTE = {"mm", "addmm", "bmm", "_scaled_dot_product_flash_attention_for_cpu",
           "_scaled_dot_product_flash_attention_for_cpu_backward"}


class _Bytes(TorchDispatchMode):
    """Bytes in + out of every memory-bound aten op (views, matmuls and attention excluded; so are
    casts of whole weights, which traffic.py counts per parameter, and the CPU-only `clone` that
    re-lays out k/v gradients the CUDA flash kernel writes in place)."""

    def __init__(self, weight_shapes: set[tuple[int, ...]]) -> None:
        super().__init__()
        self.weight_shapes, self.total, self.ops = weight_shapes, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        tensors = [x for x in torch.utils._pytree.tree_leaves((args, kwargs, out)) if isinstance(x, torch.Tensor)]
        if name in VIEWS or name in COMPUTE or any(tuple(x.shape) in self.weight_shapes for x in tensors):
            return out
        self.total += sum(x.numel() * x.element_size() for x in tensors)
        self.ops += 1
        return out


@pytest.mark.parametrize("setup", [SETUPS[0], SETUPS[1], SETUPS[2], SETUPS[3]],
                         ids=["full-fp32", "full-bf16", "lora-bf16", "lora-fp32base"])
def test_memory_bound_traffic_matches_the_real_ops(setup: tuple) -> None:
    mode, precision, base, targets = setup
    args = ModelArgs(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=192, vocab_size=96)
    model = build(args, mode, base, targets)
    shapes = {tuple(p.shape) for p in model.parameters() if p.ndim == 2}
    shapes |= {tuple(reversed(s)) for s in shapes}
    tokens = torch.randint(0, args.vocab_size, (B, S))
    mode_ = _Bytes(shapes)
    with mode_:
        with autocast(precision):
            logits = model(tokens)
        F.cross_entropy(logits.float().flatten(0, 1), tokens.flatten(), reduction="sum").backward()
    nm = act.numerics(plan_input(args, mode, precision, base, targets))
    per_token = (tr.block_forward(args, nm) * args.n_layers + tr.outside_forward(args, nm, first=True, last=True)
                 + tr.block_backward(args, nm) * (args.n_layers - 1)
                 + tr.block_backward(args, nm, first_lora_block=mode == "lora")
                 + tr.outside_backward(args, nm, last=True))
    assert per_token.bytes_per_token * B * S == pytest.approx(mode_.total, rel=0.06)
    assert per_token.kernels == pytest.approx(mode_.ops, rel=0.25)


@pytest.mark.parametrize("path", ["eager", "kernels"])
@pytest.mark.parametrize("mode", ["lora", "full"])
def test_item_tensors_sum_to_the_item(path: str, mode: str) -> None:
    """Where an item names its tensors (for the pinned pool's rounding, plan/memory.py), they add up to it."""
    from tracetrain.config import load_config
    from tracetrain.plan.mapping import plan_input_from_config

    cfg = load_config(None, ["--model.preset=llama3.1-8b", f"--train.mode={mode}", "--lora.targets=all-linear"])
    inp = plan_input_from_config(cfg, 1, "h100-sxm")
    nm = act.numerics(inp)
    items = act.block_items(inp.model, nm, path=path)  # type: ignore[arg-type]
    kept, _ = act.tiled_block_items(items, inp.model, nm, 8192)
    named = [i for i in [*items, *kept, *act.full_recompute_items(inp.model, nm)] if i.tensors]
    names = {i.name for i in named}
    assert {"q, k after RoPE", "attention out + logsumexp", "tile inputs (mid residual)", "block input"} <= names
    for item in named:
        assert sum(item.tensors) == item.per_token, item
