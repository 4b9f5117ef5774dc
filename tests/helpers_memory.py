"""The memory transforms' shared pieces (tests/train/test_recompute.py, test_activation_offload.py): a tiny
model, a packed batch, bit-identical comparison of loss and gradients, LoRA with live adapters, and the bytes
of activations a forward leaves alive."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from tracetrain.models.llama import ModelArgs, Transformer
from tracetrain.models.lora import LoRALinear, apply_lora

ARGS = ModelArgs(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=100)


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


def assert_same(ref: tuple[torch.Tensor, dict], got: tuple[torch.Tensor, dict], close: tuple[str, ...] = ()) -> None:
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
