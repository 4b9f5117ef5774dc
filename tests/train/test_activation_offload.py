"""Activation offload: identical loss and gradients with each mode (alone, with recomputation, with LoRA),
host buffers reused across steps, device memory released after forward, hooks inert in eval/no_grad;
partial offload (the first blocks), the prefetch schedule spread over backward, and streamed offload with
full recomputation holding less than recomputation alone (issue #4).

On the CPU the streamed mode runs the same code path as on the GPU with plain CPU buffers and no streams;
`min_offload_bytes=0` makes the tiny model's tensors count as large."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from helpers_memory import ARGS, assert_same, held_activation_bytes, packed_batch, tiny_model, with_lora
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from tracetrain.memory.activation_offload import (
    ActivationOffload,
    SaveOnCpuOffload,
    StreamedOffload,
    apply_activation_offload,
    num_offloaded_blocks,
)
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


@pytest.mark.parametrize("lora", [False, True])
def test_a_view_of_a_copied_tensor_is_not_copied_again(lora: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """o_proj's input (`out.transpose(1, 2).reshape(...)`) is a view of the attention output SDPA saved: one
    host copy serves both. Against the same run with the view matching turned off: the same loss and
    gradients, and exactly one attention output fewer copied per offloaded block."""
    model = with_lora(tiny_model(), dropout=0.0) if lora else tiny_model()
    ref = step(model, None)
    wrapped, offload = transformed(model, "streamed")
    assert isinstance(offload, StreamedOffload)
    assert_same(ref, step(wrapped, offload))
    shared = offload.stats
    wrapped_again, naive = transformed(model, "streamed")
    assert isinstance(naive, StreamedOffload)
    monkeypatch.setattr(StreamedOffload, "_covering", staticmethod(lambda group, t: None))
    assert_same(ref, step(wrapped_again, naive))
    batch, seq = BATCH["input_ids"].shape
    attention_out = batch * seq * ARGS.n_heads * ARGS.head_dim * 4  # float32
    offloaded_blocks = ARGS.n_layers - 1
    assert naive.stats.num_views == 0 and shared.num_views == offloaded_blocks
    assert naive.stats.offloaded_bytes - shared.offloaded_bytes == offloaded_blocks * attention_out
    assert shared.num_on_demand == 0 and offload.pool.num_bytes == shared.offloaded_bytes


def test_pool_bytes_as_the_planner_counts_them() -> None:
    """`PinnedBufferPool.allocated_bytes` (what the planner adds for the pinned pool) against the bytes the
    pool really allocates, for buffers carved a block's worth at a time (>= 64 MiB: block sizes are powers
    of two) and taken in any number. (Pages never touched: nothing becomes resident.)"""
    from tracetrain.memory.activation_offload import PinnedBufferPool

    per_shape = 5
    for nbytes in (PinnedBufferPool.CARVE_MIN_BYTES, PinnedBufferPool.CARVE_MIN_BYTES * 3 // 2 + 2):
        like = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="meta")
        pool, taken = PinnedBufferPool(per_shape=per_shape), []  # held, as saved tensors hold theirs
        for count in range(1, 2 * per_shape + 2):
            taken.append(pool.take(like))
            assert pool.num_bytes == PinnedBufferPool.allocated_bytes(count, nbytes, per_shape), (nbytes, count)
    # 1.5x a power of two wastes a quarter in carved blocks (3 per 8 GiB-like block, then the rest rounded)
    assert PinnedBufferPool.allocated_bytes(31, 3 << 30, 31) > 31 * (3 << 30)


def test_pool_counts_the_seconds_it_spends_allocating() -> None:
    """`alloc_s` grows on a miss only (a buffer made), not when a returned buffer is reused, and `clear`
    starts it again: what a one-step benchmark subtracts as the first step's pinning."""
    from tracetrain.memory.activation_offload import PinnedBufferPool

    pool = PinnedBufferPool()
    like = torch.empty(1 << 20, dtype=torch.bfloat16)
    key, buf = pool.take(like)
    first = pool.alloc_s
    assert first > 0
    pool.give(key, buf)
    assert pool.take(like)[1] is buf and pool.alloc_s == first  # reused: no allocation, no time
    pool.take(like)  # a second buffer of the key while the first is held: allocated
    assert pool.alloc_s > first
    pool.clear()
    assert pool.alloc_s == 0.0


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
@pytest.mark.parametrize("recompute,fraction", [("none", 1.0), ("full", 1.0), ("selective", 1.0), ("none", 0.5),
                                               ("full", 0.5)])
def test_streamed_on_cuda(recompute: str, fraction: float) -> None:
    """The real path: pinned buffers, D2H/H2D streams, events, stream-ordered release, prefetch, 1 MiB threshold.
    The math attention backend keeps attention deterministic, so the comparison is exact, except for the
    embedding gradient:
    CUDA's embedding backward accumulates with atomics (it differs by ~1e-9 between two plain runs)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    args = dataclasses.replace(ARGS, dim=256, ffn_dim=768, n_heads=8, n_kv_heads=4)
    model = tiny_model(args).cuda()
    batch = {k: v.cuda() for k, v in packed_batch(args.vocab_size, batch=8, seq=512).items()}
    with sdpa_kernel(SDPBackend.MATH):
        ref = step(model, None, batch)
        wrapped = copy.deepcopy(model)
        apply_recompute(wrapped, recompute, 1)  # type: ignore[arg-type]
        offload = apply_activation_offload(wrapped, "streamed", fraction=fraction)
        for seed in (7, 7):  # the second step runs on reused pinned buffers
            got = step(wrapped, offload, batch, seed=seed)
            assert_same(ref, got, close=("embed_tokens.weight",))
    assert isinstance(offload, StreamedOffload)
    assert offload.stats.num_tensors > 0 and offload.stats.num_on_demand == 0


# -- partial offload, spread prefetch, recomputation ---------------------------------------------------

DEEP = dataclasses.replace(ARGS, n_layers=8)


def test_num_offloaded_blocks() -> None:
    assert [num_offloaded_blocks(8, f) for f in (1.0, 0.5, 0.4, 0.25, 0.01)] == [7, 4, 3, 2, 1]
    assert num_offloaded_blocks(1, 1.0) == 0  # a single block is the last one: never offloaded
    for bad in (0.0, -0.5, 1.5):
        with pytest.raises(ValueError, match="fraction"):
            apply_activation_offload(tiny_model(), "streamed", fraction=bad)


@pytest.mark.parametrize("recompute", ["none", "full"])
@pytest.mark.parametrize("fraction", [0.25, 0.5])
def test_partial_offload_same_loss_and_grads(fraction: float, recompute: str) -> None:
    model = tiny_model(DEEP)
    ref = step(model, None)
    wrapped = copy.deepcopy(model)
    apply_recompute(wrapped, recompute, 1)  # type: ignore[arg-type]
    offload = apply_activation_offload(wrapped, "streamed", min_offload_bytes=0, fraction=fraction)
    assert isinstance(offload, StreamedOffload)
    assert_same(ref, step(wrapped, offload))
    k = num_offloaded_blocks(DEEP.n_layers, fraction)
    stats = offload.stats
    assert stats.num_offloaded_blocks == k and stats.num_on_demand == 0
    if recompute == "full":  # only the input x of each offloaded block
        assert stats.num_tensors == k
    else:  # fewer tensors than offloading all blocks but the last
        wrapped_all, full = transformed(model, "streamed")
        step(wrapped_all, full)
        assert 0 < stats.num_tensors * (DEEP.n_layers - 1) == full.stats.num_tensors * k


@pytest.mark.parametrize("fraction,expected", [
    # Half the blocks: every copy back is requested while blocks 7..4 (resident) run their backward.
    (0.5, [(7, 3), (6, 2), (5, 1), (4, 0)]),
    (0.25, [(7, 1), (6, 0)]),
    # All blocks but the last: one block ahead, as far as memory allows.
    (1.0, [(7, 6), (6, 5), (5, 4), (4, 3), (3, 2), (2, 1), (1, 0)]),
])
def test_prefetch_spreads_over_backward(fraction: float, expected: list[tuple[int, int]]) -> None:
    wrapped = tiny_model(DEEP)
    offload = apply_activation_offload(wrapped, "streamed", min_offload_bytes=0, fraction=fraction)
    assert isinstance(offload, StreamedOffload)
    step(wrapped, offload)
    assert offload.stats.prefetches == expected and offload.stats.num_on_demand == 0


@pytest.mark.parametrize("fraction,expected", [
    # k offloaded blocks, lag n - k: block k - 1 is released when the last block starts (before the peak).
    (0.5, [(4, 0), (5, 1), (6, 2), (7, 3)]),
    (0.25, [(6, 0), (7, 1)]),
    (1.0, [(1, 0), (2, 1), (3, 2), (4, 3), (5, 4), (6, 5), (7, 6)]),
])
def test_release_is_lagged_so_every_offloaded_block_is_freed_before_the_last_block(
        fraction: float, expected: list[tuple[int, int]]) -> None:
    wrapped = tiny_model(DEEP)
    offload = apply_activation_offload(wrapped, "streamed", min_offload_bytes=0, fraction=fraction)
    assert isinstance(offload, StreamedOffload)
    step(wrapped, offload)
    assert offload.stats.release_lag == DEEP.n_layers - num_offloaded_blocks(DEEP.n_layers, fraction)
    assert offload.stats.releases == expected and not offload._in_flight
    other = tiny_model(DEEP)
    lag2 = apply_activation_offload(other, "streamed", min_offload_bytes=0, fraction=0.5, release_lag=2)
    assert isinstance(lag2, StreamedOffload)
    step(other, lag2)
    assert lag2.stats.releases == [(2, 0), (3, 1), (4, 2), (5, 3)]


def test_peak_falls_with_the_offloaded_share() -> None:
    """Over a whole step (forward and backward, prefetches included) the peak drops by at least 40% of
    the bytes offloaded, more the more blocks are offloaded."""
    batch = packed_batch(DEEP.vocab_size, batch=4, seq=128)
    plain = tiny_model(DEEP)
    peaks = [peak_step_bytes(plain, None, batch)]
    for fraction in (0.25, 0.5, 1.0):
        wrapped = copy.deepcopy(plain)
        offload = apply_activation_offload(wrapped, "streamed", min_offload_bytes=0, fraction=fraction)
        assert isinstance(offload, StreamedOffload)
        peaks.append(peak_step_bytes(wrapped, offload, batch))
        assert peaks[-1] <= peaks[0] - 0.4 * offload.stats.offloaded_bytes, (fraction, peaks)
    assert peaks == sorted(peaks, reverse=True), peaks


class _PeakLive(TorchDispatchMode):
    """Peak bytes of op outputs alive at once over forward and backward: activations and their
    gradients. Not counted: gradients of parameters (the same in every run) and a pool's host buffers."""

    def __init__(self, model: Transformer, exclude_ptrs: set[int]) -> None:
        super().__init__()
        self.params, self.exclude_ptrs = list(model.parameters()), exclude_ptrs
        self.refs: dict[int, tuple[StorageWeakRef, int, int]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                self.refs[StorageWeakRef(s).cdata] = (StorageWeakRef(s), s.nbytes(), s.data_ptr())
        skip = self.exclude_ptrs | {p.grad.untyped_storage().data_ptr() for p in self.params if p.grad is not None}
        alive = sum(n for ref, n, ptr in self.refs.values() if not ref.expired() and ptr not in skip)
        self.peak = max(self.peak, alive)
        return out


def peak_step_bytes(model: Transformer, offload: ActivationOffload | None, batch: dict[str, torch.Tensor]) -> int:
    step(model, offload, batch)  # warm-up: the pool's buffers exist before the measured step
    pool_ptrs = offload.pool.storage_ptrs if isinstance(offload, StreamedOffload) else set()
    with _PeakLive(model, pool_ptrs) as mode:
        step(model, offload, batch)
    return mode.peak


def test_streamed_with_full_recompute_holds_no_more_than_full() -> None:
    """Issue #4: streamed + full recompute peaked ~10 GiB above full recompute alone on the 7B (H100).
    On the CPU, over a whole step, it must hold at most what full recomputation holds, and less once
    the offloaded block inputs are large compared with one block's recomputation."""
    args = dataclasses.replace(ARGS, n_layers=8, dim=128, ffn_dim=128)
    batch = packed_batch(args.vocab_size, batch=4, seq=128)
    full = tiny_model(args)
    apply_recompute(full, "full", 1)
    peak_full = peak_step_bytes(full, None, batch)
    wrapped = copy.deepcopy(full)
    offload = apply_activation_offload(wrapped, "streamed", min_offload_bytes=0)
    peak_streamed = peak_step_bytes(wrapped, offload, batch)
    assert offload.stats.num_tensors == args.n_layers - 1
    x_bytes = offload.stats.offloaded_bytes // offload.stats.num_tensors
    # Six of the seven offloaded inputs are off the device at the peak (one is prefetched).
    assert peak_streamed <= peak_full - 4 * x_bytes, (peak_streamed, peak_full, x_bytes)


def test_recomputation_in_backward_does_no_offload_work() -> None:
    """Backward run inside the offload context (as a schedule might): recomputing a block must not pack,
    group or prefetch anything; the only offloaded tensors are the checkpoint inputs of forward."""
    model = tiny_model()
    ref = step(model, None)
    wrapped, offload = transformed(model, "streamed", "full")
    assert isinstance(offload, StreamedOffload)
    torch.manual_seed(7)
    wrapped.zero_grad(set_to_none=True)
    with offload.forward_context():
        logits = wrapped(BATCH["input_ids"], BATCH["position_ids"], BATCH["document_ids"])
        loss = F.cross_entropy(logits.flatten(0, 1), BATCH["labels"].flatten())
        loss.backward()
        assert offload._current is None
    assert_same(ref, (loss.detach(), {n: p.grad for n, p in wrapped.named_parameters() if p.requires_grad}))
    assert offload.stats.num_tensors == ARGS.n_layers - 1 and offload.stats.num_on_demand == 0


def test_model_freed_after_use() -> None:
    """The hooks form a cycle model -> hook -> offload -> model: the garbage collector must free it (a
    benchmark building one model per row must not keep the previous row's weights)."""
    wrapped, offload = transformed(tiny_model(), "streamed", "full")
    step(wrapped, offload)
    ref = weakref.ref(next(wrapped.layers[0].parameters()))
    del wrapped, offload
    gc.collect()
    assert ref() is None


def test_one_block_held_elsewhere_does_not_keep_the_model() -> None:
    """Issue #4's "streamed + full holds ~10 GiB more than full" on the 7B: about the whole model's
    weights (12.6 GiB) stayed allocated after the streamed row of benchmarks/memory.py, and the next rows
    (streamed + full, save_on_cpu) started with them. Something outside (e.g. torch.compile's caches of
    the compiled block) may hold one block; the offload hooks on it must not reach the whole model or the
    pinned pool: the hooks hold the offload weakly and the offload holds the model weakly."""
    wrapped, offload = transformed(tiny_model(), "streamed", "full")
    step(wrapped, offload)
    held_block = wrapped.layers[1]
    embedding, pool = weakref.ref(wrapped.embed_tokens.weight), weakref.ref(offload.pool)
    del wrapped, offload
    gc.collect()
    assert embedding() is None and pool() is None
    cos, sin = tiny_model().rope(BATCH["position_ids"])
    held_block(torch.randn(*BATCH["input_ids"].shape, ARGS.dim), cos, sin, None).sum().backward()  # hooks inert
