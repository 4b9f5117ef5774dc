"""Activation offload: identical loss and gradients with each mode (alone, with recomputation, with LoRA),
host buffers reused across steps, device memory released after forward, hooks inert in eval/no_grad.

On the CPU the streamed mode runs the same code path as on the GPU with plain CPU buffers and no streams;
`min_offload_bytes=0` makes the tiny model's tensors count as large."""

from __future__ import annotations

import contextlib
import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from test_recompute import ARGS, assert_same, held_activation_bytes, packed_batch, tiny_model, with_lora
from tracetrain.memory.activation_offload import (ActivationOffload, SaveOnCpuOffload, StreamedOffload,
                                                  apply_activation_offload)
from tracetrain.memory.recompute import apply_recompute
from tracetrain.models.llama import Transformer

BATCH = packed_batch(ARGS.vocab_size)


def step(model: Transformer, offload: ActivationOffload | None, batch: dict[str, torch.Tensor] = BATCH,
         seed: int = 7) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One forward (inside the offload context, as the training step does) and backward."""
    torch.manual_seed(seed)
    model.zero_grad(set_to_none=True)
    with offload.forward_context() if offload else contextlib.nullcontext():
        logits = model(batch["input_ids"], batch["position_ids"], batch["document_ids"])
    loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def transformed(model: Transformer, mode: str, recompute: str = "none") -> tuple[Transformer, ActivationOffload]:
    model = copy.deepcopy(model)
    apply_recompute(model, recompute, 1)  # type: ignore[arg-type]
    offload = apply_activation_offload(model, mode, min_offload_bytes=0)  # type: ignore[arg-type]
    assert offload is not None
    return model, offload


@pytest.mark.parametrize("recompute", ["none", "full", "selective"])
@pytest.mark.parametrize("mode", ["save_on_cpu", "streamed"])
def test_same_loss_and_grads(mode: str, recompute: str) -> None:
    model = tiny_model()
    ref = step(model, None)
    wrapped, offload = transformed(model, mode, recompute)
    # Offloaded tensors come back with the same values (and strides): bit-identical (torch.equal).
    assert_same(ref, step(wrapped, offload))
    if isinstance(offload, StreamedOffload):
        stats = offload.stats
        assert stats.num_on_demand == 0, "every offloaded tensor was prefetched one block ahead"
        if recompute == "none":
            assert stats.num_tensors > 10 * (ARGS.n_layers - 1)
        else:  # a recomputed block saves only its input x; the last block is never offloaded
            assert stats.num_tensors == ARGS.n_layers - 1


@pytest.mark.parametrize("recompute", ["none", "full", "selective"])
def test_streamed_with_lora_dropout(recompute: str) -> None:
    model = with_lora(tiny_model(), dropout=0.2)
    ref = step(model, None)
    wrapped, offload = transformed(model, "streamed", recompute)
    assert_same(ref, step(wrapped, offload))
    assert offload.stats.num_tensors > 0


def test_pool_reuses_buffers_across_steps() -> None:
    wrapped, offload = transformed(tiny_model(), "streamed")
    assert isinstance(offload, StreamedOffload)
    step(wrapped, offload)
    num_buffers, num_bytes = offload.pool.num_buffers, offload.pool.num_bytes
    assert num_buffers == offload.stats.num_tensors > 0
    for seed in (8, 9):  # later steps (and micro-batches) take every buffer from the pool
        step(wrapped, offload, seed=seed)
        assert (offload.pool.num_buffers, offload.pool.num_bytes) == (num_buffers, num_bytes)
    offload.pool.clear()
    assert offload.pool.num_bytes == 0


def test_streamed_releases_activation_memory() -> None:
    """After forward, blocks 0..n-2 hold host copies only: their device (here: CPU) tensors were freed."""
    model = tiny_model()
    batch = packed_batch(ARGS.vocab_size, seq=128)
    held_plain = held_activation_bytes(model, batch)
    wrapped, offload = transformed(model, "streamed")
    with offload.forward_context():
        held_streamed = held_activation_bytes(wrapped, batch)
    # The host copies are op outputs too (made inside the pack hook): take them out.
    held_device = held_streamed - offload.pool.num_bytes
    assert offload.pool.num_bytes > 0.5 * held_plain and held_device < 0.5 * held_plain, (held_device, held_plain)


def test_inert_in_eval_no_grad_and_after_remove() -> None:
    wrapped, offload = transformed(tiny_model(), "streamed")
    assert isinstance(offload, StreamedOffload)
    with torch.no_grad(), offload.forward_context():
        wrapped(BATCH["input_ids"], BATCH["position_ids"], BATCH["document_ids"])
    wrapped.eval()
    with offload.forward_context():
        wrapped(BATCH["input_ids"], BATCH["position_ids"], BATCH["document_ids"]).sum().backward()
    assert offload.pool.num_buffers == 0 and offload.stats.num_tensors == 0
    wrapped.train()
    offload.remove()  # no block hooks: nothing is in a block scope, nothing is offloaded
    step(wrapped, offload)
    assert offload.pool.num_buffers == 0 and offload.stats.num_tensors == 0
    save_on_cpu = apply_activation_offload(wrapped, "save_on_cpu")
    assert isinstance(save_on_cpu, SaveOnCpuOffload)
    assert isinstance(save_on_cpu.forward_context(), torch.autograd.graph.save_on_cpu)
    wrapped.eval()
    assert isinstance(save_on_cpu.forward_context(), contextlib.nullcontext)


def test_rejects_unknown_mode() -> None:
    assert apply_activation_offload(tiny_model(), "none") is None
    with pytest.raises(ValueError, match="activation offload mode"):
        apply_activation_offload(tiny_model(), "disk")  # type: ignore[arg-type]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the device machine)")
@pytest.mark.parametrize("recompute", ["none", "full", "selective"])
def test_streamed_on_cuda(recompute: str) -> None:
    """The real path: pinned buffers, side stream, events, prefetch, 1 MiB threshold. The math attention
    backend keeps attention deterministic, so the comparison is exact, except for the embedding gradient:
    CUDA's embedding backward accumulates with atomics (it differs by ~1e-9 between two plain runs)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    args = dataclasses.replace(ARGS, dim=256, ffn_dim=768, n_heads=8, n_kv_heads=4)
    model = tiny_model(args).cuda()
    batch = {k: v.cuda() for k, v in packed_batch(args.vocab_size, batch=8, seq=512).items()}
    with sdpa_kernel(SDPBackend.MATH):
        ref = step(model, None, batch)
        wrapped = copy.deepcopy(model)
        apply_recompute(wrapped, recompute, 1)  # type: ignore[arg-type]
        offload = apply_activation_offload(wrapped, "streamed")
        for seed in (7, 7):  # the second step runs on reused pinned buffers
            got = step(wrapped, offload, batch, seed=seed)
            assert_same(ref, got, close=("embed_tokens.weight",))
    assert isinstance(offload, StreamedOffload)
    assert offload.stats.num_tensors > 0 and offload.stats.num_on_demand == 0
