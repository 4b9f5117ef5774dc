"""Recomputation transform: identical loss and gradients with and without it (full, selective, every k-th
block, with LoRA and LoRA dropout), unchanged state-dict keys, and less activation memory held."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers_memory import ARGS, assert_same, held_activation_bytes, packed_batch, tiny_model, with_lora

from tracetrain.memory.recompute import apply_recompute, is_recomputed
from tracetrain.models.llama import ModelArgs, Transformer

CASES = [("full", 1), ("selective", 1), ("full", 2), ("selective", 3)]


def loss_and_grads(model: Transformer, batch: dict[str, torch.Tensor],
                   seed: int = 7) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    torch.manual_seed(seed)  # the same dropout masks in every run
    model.zero_grad(set_to_none=True)
    logits = model(batch["input_ids"], batch["position_ids"], batch["document_ids"])
    loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("mode,every", CASES)
def test_same_loss_and_grads(mode: str, every: int) -> None:
    # Recomputation reruns the same kernels on the same inputs: results are bit-identical (torch.equal).
    model, batch = tiny_model(), packed_batch(ARGS.vocab_size)
    ref = loss_and_grads(model, batch)
    wrapped = copy.deepcopy(model)
    num = apply_recompute(wrapped, mode, every)
    assert num == len(range(0, ARGS.n_layers, every))
    assert [is_recomputed(b) for b in wrapped.layers] == [i % every == 0 for i in range(ARGS.n_layers)]
    assert_same(ref, loss_and_grads(wrapped, batch))


@pytest.mark.parametrize("mode,every", CASES)
@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_same_with_lora(mode: str, every: int, dropout: float) -> None:
    model, batch = with_lora(tiny_model(), dropout), packed_batch(ARGS.vocab_size)
    ref = loss_and_grads(model, batch)
    if dropout:  # the dropout really draws masks: another seed gives another loss
        assert not torch.equal(ref[0], loss_and_grads(model, batch, seed=8)[0])
    wrapped = copy.deepcopy(model)
    apply_recompute(wrapped, mode, every)
    # The recomputation restores the RNG state, so the dropout masks match: still bit-identical.
    assert_same(ref, loss_and_grads(wrapped, batch))


def test_state_dict_and_names_unchanged() -> None:
    model = tiny_model()
    keys, names = list(model.state_dict()), [n for n, _ in model.named_modules()]
    apply_recompute(model, "selective", 1)
    assert list(model.state_dict()) == keys
    assert [n for n, _ in model.named_modules()] == names
    model.load_state_dict(tiny_model(seed=1).state_dict())  # loads into the wrapped model by the same keys
    assert torch.equal(model.layers[0].self_attn.q_proj.weight, tiny_model(seed=1).layers[0].self_attn.q_proj.weight)


def test_eval_and_no_grad_skip_checkpointing() -> None:
    model, batch = tiny_model(), packed_batch(ARGS.vocab_size)
    apply_recompute(model, "full", 1)
    calls: list[int] = []
    model.layers[0].register_forward_hook(lambda *a: calls.append(1))
    with torch.no_grad():
        out_no_grad = model(batch["input_ids"], batch["position_ids"], batch["document_ids"])
    model.eval()
    out_eval = model(batch["input_ids"], batch["position_ids"], batch["document_ids"])
    assert torch.equal(out_no_grad, out_eval) and len(calls) == 2


def test_rejects_bad_arguments() -> None:
    model = tiny_model()
    with pytest.raises(ValueError, match="recompute mode"):
        apply_recompute(model, "everything", 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="recompute_every"):
        apply_recompute(model, "full", 0)
    assert apply_recompute(model, "none", 1) == 0 and not any(map(is_recomputed, model.layers))
    apply_recompute(model, "full", 1)
    with pytest.raises(ValueError, match="already wrapped"):
        apply_recompute(model, "selective", 1)


def test_memory_full_lt_selective_lt_none() -> None:
    args = ModelArgs(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=384, vocab_size=64)
    batch = packed_batch(args.vocab_size, batch=2, seq=256)
    held = {}
    for mode in ("none", "selective", "full"):
        model = tiny_model(args)
        apply_recompute(model, mode, 1)  # type: ignore[arg-type]
        held[mode] = held_activation_bytes(model, batch)
    assert held["full"] < held["selective"] < held["none"], held
    # Full keeps about one residual stream per block (plus the logits and the shared mask/rotary tables).
    assert held["none"] - held["full"] > 0.5 * held["none"], held
