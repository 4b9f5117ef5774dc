"""Recomputation transform: identical loss and gradients with and without it (full, selective, every k-th
block, with LoRA and LoRA dropout), unchanged state-dict keys, and less activation memory held."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from tracetrain.models.llama import ModelArgs, Transformer
from tracetrain.models.lora import LoRALinear, apply_lora
from tracetrain.memory.recompute import apply_recompute, is_recomputed

ARGS = ModelArgs(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=100)
CASES = [("full", 1), ("selective", 1), ("full", 2), ("selective", 3)]


def tiny_model(args: ModelArgs = ARGS, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(args)
    model.init_weights()
    return model


def packed_batch(vocab: int, batch: int = 2, seq: int = 32) -> dict[str, torch.Tensor]:
    """Random tokens packed as three documents per row (positions restart, attention is masked)."""
    g = torch.Generator().manual_seed(3)
    lengths = [seq // 3, seq // 3, seq - 2 * (seq // 3)]
    doc = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]).expand(batch, seq)
    pos = torch.cat([torch.arange(n) for n in lengths]).expand(batch, seq)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    return {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:], "position_ids": pos, "document_ids": doc}


def loss_and_grads(model: Transformer, batch: dict[str, torch.Tensor],
                   seed: int = 7) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    torch.manual_seed(seed)  # the same dropout masks in every run
    model.zero_grad(set_to_none=True)
    logits = model(batch["input_ids"], batch["position_ids"], batch["document_ids"])
    loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def assert_same(ref: tuple[torch.Tensor, dict], got: tuple[torch.Tensor, dict],
                close: tuple[str, ...] = ()) -> None:
    """Bit-identical loss and gradients; the `close` ones only within 1e-7 (non-deterministic kernels)."""
    assert torch.equal(ref[0], got[0]), (ref[0], got[0])
    assert ref[1].keys() == got[1].keys()
    differ = {n: float((g - got[1][n]).abs().max()) for n, g in ref[1].items() if not torch.equal(g, got[1][n])}
    assert all(n in close and d <= 1e-7 for n, d in differ.items()), differ


def with_lora(model: Transformer, dropout: float) -> Transformer:
    apply_lora(model, rank=4, alpha=8.0, dropout=dropout, targets=["all-linear"])
    g = torch.Generator().manual_seed(1)  # B starts at zero; random B makes the adapters matter
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LoRALinear):
                m.lora_B.weight.copy_(torch.randn(m.lora_B.weight.shape, generator=g) * 0.05)
    return model


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


class _LiveStorages(TorchDispatchMode):
    """Records (weakly) the storage of every op output during forward.

    After forward, the still-alive storages are what the autograd graph keeps for backward (saved
    tensors, checkpoint inputs and the selective-checkpoint cache alike). `saved_tensors_hooks` would
    miss that cache: it is held by the checkpoint's dispatch mode, not by autograd.
    """

    def __init__(self) -> None:
        super().__init__()
        self.refs: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                ref = StorageWeakRef(t.untyped_storage())
                self.refs[ref.cdata] = (ref, t.untyped_storage().nbytes())
        return out

    def alive_bytes(self, exclude: set[int]) -> int:
        return sum(n for key, (ref, n) in self.refs.items() if not ref.expired() and key not in exclude)


def held_activation_bytes(model: Transformer, batch: dict[str, torch.Tensor]) -> int:
    """Bytes of op outputs that are still alive once forward has run and only the loss is kept."""
    params = {StorageWeakRef(t.untyped_storage()).cdata for t in [*model.parameters(), *model.buffers()]}
    with _LiveStorages() as mode:
        logits = model(batch["input_ids"], batch["position_ids"], batch["document_ids"])
        loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
    del logits
    held = mode.alive_bytes(params)
    loss.backward()
    return held


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
