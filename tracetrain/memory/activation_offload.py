"""Activation offload: keep the tensors saved for backward in (pinned) CPU memory instead of the GPU.

`apply_activation_offload(model, mode)` returns an `ActivationOffload` whose `forward_context()` the
training step wraps around the forward pass; backward runs outside it (the hooks were bound to each
saved tensor when it was saved). Two modes:

- "save_on_cpu": `torch.autograd.graph.save_on_cpu(pin_memory=True)`. Every saved tensor (parameters
  included) is copied to a fresh pinned buffer during forward and copied back when backward needs it;
  the copies are not overlapped with compute and pinned memory is allocated anew every step.
- "streamed": our own `saved_tensors_hooks`, organised by transformer block.
  * Forward: a saved tensor of block i (>= `min_offload_bytes`, not a parameter/buffer or a view of
    one, not one of the inputs shared by every block: rotary tables, mask) is copied to a pinned host
    buffer on a side CUDA stream, right when autograd saves it (the side stream first waits for the
    compute stream, so the tensor is complete). The same view saved by several ops (the normed input of
    q/k/v_proj) is copied once.
  * Release: the block keeps a reference to each copied GPU tensor. When block i+1 finishes its
    forward, the compute stream waits on the event recorded after block i's last copy and the
    references are dropped, so the caching allocator may reuse that memory only after the copy has
    read it. The host never blocks; block i's copies had all of block i+1's compute to run behind.
  * Backward: the first time a saved tensor of block i is unpacked (block i's backward starts), every
    offloaded tensor of block i-1 is copied back on the side stream ("prefetch one block ahead"); the
    unpack of each tensor makes the compute stream wait on its copy's event. A tensor not prefetched
    (unexpected order) is loaded on demand, so correctness never depends on the prefetch order.
  * The last block is not offloaded: its backward comes first, nothing could hide its copy-back.
  * Host buffers come from a `PinnedBufferPool` keyed by (shape, stride, dtype) and go back to it when
    autograd frees the saved tensor, so pinning is paid in the first step only. Pool size: the
    offloaded activations of one micro-batch (blocks 0..n-2), held for the run.

On the CPU (the unit tests) the same code path runs: the "pinned" buffer is a plain CPU tensor, copies
are synchronous and streams/events are skipped (every CUDA-only call is guarded by `is_cuda`).

Composition: a recomputed block saves only its inputs (checkpoint saves them through these hooks), so
with `recompute = "full"` only each block's input residual stream is offloaded; with "selective" the
matmul/attention outputs that selective checkpointing keeps are held by checkpoint itself, not by
autograd, and stay on the GPU. LoRA needs nothing special (frozen weights are parameters, skipped).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

OffloadMode = Literal["none", "save_on_cpu", "streamed"]
OFFLOAD_MODES: tuple[str, ...] = ("none", "save_on_cpu", "streamed")
DEFAULT_MIN_OFFLOAD_BYTES = 1 << 20  # smaller tensors are not worth a copy (latency-bound)


class ActivationOffload:
    """What the training step needs: a context manager around the forward pass."""

    mode: str = "none"

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def enabled(self) -> bool:
        """Only a training forward that records a graph saves tensors for backward."""
        return self.model.training and torch.is_grad_enabled()

    def forward_context(self) -> contextlib.AbstractContextManager:
        raise NotImplementedError

    def remove(self) -> None:
        """Undo the transform (remove module hooks)."""


class SaveOnCpuOffload(ActivationOffload):
    """PyTorch's own `save_on_cpu`: simple, synchronous, pins fresh memory for every saved tensor."""

    mode = "save_on_cpu"

    def forward_context(self) -> contextlib.AbstractContextManager:
        if not self.enabled():
            return contextlib.nullcontext()
        return torch.autograd.graph.save_on_cpu(pin_memory=True)  # pins only where CUDA is available


def _storage_ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _is_dense(t: torch.Tensor) -> bool:
    """True when `t` covers its memory without gaps or overlaps (contiguous up to a permutation)."""
    expected = 1
    for size, stride in sorted(zip(t.shape, t.stride()), key=lambda p: p[1]):
        if size != 1:
            if stride != expected:
                return False
            expected *= size
    return True


class PinnedBufferPool:
    """Host buffers for offloaded tensors, reused across steps (keyed by shape, stride, dtype, pinned).

    It grows to the largest set of offloaded tensors alive at once (one micro-batch's offloaded
    activations) and keeps that memory, pinned, until `clear()`: cudaHostAlloc is slow (it maps pages
    for the GPU), so it is paid in the first step only. `num_bytes` is the pool's total host memory as
    requested; torch's pinned allocator rounds each buffer up to a power of two, so the locked memory
    can be up to 2x that (Llama activation shapes are mostly powers of two already).
    """

    def __init__(self) -> None:
        self._free: dict[tuple, list[torch.Tensor]] = defaultdict(list)
        self._lock = threading.Lock()  # buffers come back from the autograd engine's thread
        self.num_buffers = 0
        self.num_bytes = 0

    @staticmethod
    def key(like: torch.Tensor) -> tuple:
        stride = like.stride() if _is_dense(like) else None  # None: contiguous (gappy/expanded views)
        return tuple(like.shape), stride, like.dtype, like.is_cuda

    def take(self, like: torch.Tensor) -> tuple[tuple, torch.Tensor]:
        """A host buffer shaped like `like` (same strides when dense), pinned when `like` is on CUDA."""
        key = self.key(like)
        with self._lock:
            if self._free[key]:
                return key, self._free[key].pop()
        shape, stride, dtype, pinned = key
        if stride is None:
            buf = torch.empty(shape, dtype=dtype, pin_memory=pinned)
        else:
            buf = torch.empty_strided(shape, stride, dtype=dtype, pin_memory=pinned)
        self.num_buffers += 1
        self.num_bytes += buf.untyped_storage().nbytes()
        return key, buf

    def give(self, key: tuple, buf: torch.Tensor) -> None:
        with self._lock:
            self._free[key].append(buf)

    def clear(self) -> None:
        """Free the idle buffers (those of tensors still saved come back to an empty pool)."""
        with self._lock:
            self._free.clear()
        self.num_buffers = self.num_bytes = 0


class _Slot:
    """One saved tensor of a block: its host copy and, once loaded back, its device copy.

    Autograd holds the slot in place of the tensor; when it drops it (after the backward node that
    used it), `__del__` returns the host buffer to the pool. Stream order makes the reuse safe: the
    next step's copy into the buffer is queued on the same side stream as this one's copy back.
    """

    __slots__ = ("block", "device", "host", "device_copy", "ready", "_pool", "_key", "__weakref__")

    def __init__(self, block: int, device: torch.device, host: torch.Tensor | None = None,
                 device_copy: torch.Tensor | None = None, pool: PinnedBufferPool | None = None,
                 key: tuple = ()) -> None:
        self.block, self.device = block, device
        self.host, self.device_copy = host, device_copy
        self.ready: torch.cuda.Event | None = None  # copy back queued, compute stream not yet waiting
        self._pool, self._key = pool, key

    def __del__(self) -> None:
        if self.ready is not None:  # loaded back but never unpacked: its copy may still be writing
            torch.cuda.current_stream(self.device).wait_event(self.ready)
        if self._pool is not None and self.host is not None:
            self._pool.give(self._key, self.host)


@dataclass
class _Group:
    """The saved tensors of one block during its forward and the next block's."""

    index: int
    keep_alive: list[torch.Tensor] = field(default_factory=list)  # device tensors being copied out
    slots: dict[tuple, _Slot] = field(default_factory=dict)  # one copy per (storage, view) saved
    copied: torch.cuda.Event | None = None  # recorded on the side stream after the block's copies


@dataclass
class OffloadStats:
    """What the last forward offloaded."""

    num_tensors: int = 0       # distinct saved tensors copied to the host
    offloaded_bytes: int = 0
    num_on_demand: int = 0     # loaded back when needed instead of prefetched (0 in normal order)


class StreamedOffload(ActivationOffload):
    """Block-by-block offload with copies on a side stream and one-block-ahead prefetch (module doc)."""

    mode = "streamed"

    def __init__(self, model: nn.Module, min_offload_bytes: int = DEFAULT_MIN_OFFLOAD_BYTES) -> None:
        super().__init__(model)
        self.min_offload_bytes = min_offload_bytes
        self.pool = PinnedBufferPool()
        self.stats = OffloadStats()
        self._last_block = len(model.layers) - 1
        self._stream: torch.cuda.Stream | None = None
        self._active = False
        self._groups: dict[int, _Group] = {}
        self._current: _Group | None = None
        self._skip_ptrs: set[int] = set()
        self._by_block: dict[int, list[weakref.ref[_Slot]]] = defaultdict(list)
        self._backward_block: int | None = None
        self._handles = []
        for index, block in enumerate(model.layers):
            self._handles.append(block.register_forward_pre_hook(
                functools.partial(self._enter_block, index), with_kwargs=True))
            self._handles.append(block.register_forward_hook(functools.partial(self._exit_block, index)))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def forward_context(self) -> contextlib.AbstractContextManager:
        return self._streaming() if self.enabled() else contextlib.nullcontext()

    @contextlib.contextmanager
    def _streaming(self) -> Iterator[None]:
        # Per micro-batch state: its backward runs before the next forward starts.
        self._by_block, self._backward_block, self.stats = defaultdict(list), None, OffloadStats()
        self._active = True
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            self._active, self._current = False, None
            for group in list(self._groups.values()):
                self._release(group)

    # -- forward: block scope -------------------------------------------------------------------------

    def _enter_block(self, index: int, block: nn.Module, args: tuple, kwargs: dict) -> None:
        if not self._active:
            return
        # Not offloaded: weights (they stay on the GPU anyway; FSDP's unsharded ones included, as the
        # pointers are read now) and the inputs after `x` (rotary tables, mask): every block gets the
        # same ones, so copying them would move the same bytes once per block for no memory gain.
        shared = [a for a in (*args[1:], *kwargs.values()) if isinstance(a, torch.Tensor)]
        self._skip_ptrs = {_storage_ptr(t) for t in (*block.parameters(), *block.buffers(), *shared)}
        self._current = self._groups[index] = _Group(index)

    def _exit_block(self, index: int, block: nn.Module, args: tuple, output: Any) -> None:
        if not self._active:
            return
        group = self._groups[index]
        if group.keep_alive and group.keep_alive[0].is_cuda:
            group.copied = self._side_stream(group.keep_alive[0].device).record_event()
        for other in [g for i, g in self._groups.items() if i != index]:
            self._release(other)  # the previous block's copies ran behind this block's compute
        self._current = None

    def _release(self, group: _Group) -> None:
        """Let the allocator reuse the group's device memory once its copies have read it."""
        if group.keep_alive and group.keep_alive[0].is_cuda:
            device = group.keep_alive[0].device
            event = group.copied or self._side_stream(device).record_event()
            torch.cuda.current_stream(device).wait_event(event)  # GPU-side wait: the host never blocks
        del self._groups[group.index]

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=device)
        return self._stream

    # -- saved tensor hooks ---------------------------------------------------------------------------

    def _pack(self, t: torch.Tensor) -> torch.Tensor | _Slot:
        group = self._current
        if (group is None or t.numel() * t.element_size() < max(self.min_offload_bytes, 1)
                or _storage_ptr(t) in self._skip_ptrs):
            # Detached: a saved output returned with its grad_fn would form a cycle that is never freed.
            return t.detach()
        key = (_storage_ptr(t), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t._version)
        slot = group.slots.get(key)
        if slot is None:
            slot = group.slots[key] = self._new_slot(t.detach(), group)
        return slot

    def _new_slot(self, t: torch.Tensor, group: _Group) -> _Slot:
        if group.index == self._last_block:
            return _Slot(group.index, t.device, device_copy=t)  # resident: only marks block order
        key, host = self.pool.take(t)
        if t.is_cuda:
            stream = self._side_stream(t.device)
            stream.wait_stream(torch.cuda.current_stream(t.device))  # t is complete before the copy
            with torch.cuda.stream(stream):
                host.copy_(t, non_blocking=True)
        else:
            host.copy_(t)
        # Held until `_release` (after the copy's event): the copy reads it, and while it is alive no
        # other tensor can take its memory, which keeps the (pointer, view) de-duplication key unique.
        group.keep_alive.append(t)
        slot = _Slot(group.index, t.device, host=host, pool=self.pool, key=key)
        self._by_block[group.index].append(weakref.ref(slot))
        self.stats.num_tensors += 1
        self.stats.offloaded_bytes += t.numel() * t.element_size()
        return slot

    def _unpack(self, packed: torch.Tensor | _Slot) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        slot = packed
        if slot.block != self._backward_block:
            # First tensor of a block's backward: bring back the previous block's tensors now, so their
            # copies run while this block's backward computes.
            self._backward_block = slot.block
            self._load([s for r in self._by_block.get(slot.block - 1, []) if (s := r()) is not None])
        if slot.device_copy is None:
            self.stats.num_on_demand += 1  # not prefetched: load now (the compute stream will wait)
            self._load([slot])
        if slot.ready is not None:
            torch.cuda.current_stream(slot.device).wait_event(slot.ready)
            slot.ready = None  # later uses of this tensor are queued behind this wait
        return slot.device_copy

    def _load(self, slots: list[_Slot]) -> None:
        """Queue the copy back to the device of every slot not loaded yet."""
        slots = [s for s in slots if s.device_copy is None]
        if not slots:
            return
        device = slots[0].device
        if device.type != "cuda":
            for s in slots:  # a copy, as on the GPU: the host buffer goes back to the pool later
                s.device_copy = s.host.clone()
            return
        main, stream = torch.cuda.current_stream(device), self._side_stream(device)
        # Allocated on the compute stream (so the allocator orders its reuse there); the side stream
        # waits for the compute stream because this memory may have been freed by queued kernels.
        copies = [torch.empty_strided(s.host.shape, s.host.stride(), dtype=s.host.dtype, device=device)
                  for s in slots]
        stream.wait_stream(main)
        with torch.cuda.stream(stream):
            for s, dst in zip(slots, copies):
                dst.copy_(s.host, non_blocking=True)
            ready = stream.record_event()
        for s, dst in zip(slots, copies):
            s.device_copy, s.ready = dst, ready


def apply_activation_offload(model: nn.Module, mode: OffloadMode,
                             min_offload_bytes: int = DEFAULT_MIN_OFFLOAD_BYTES) -> ActivationOffload | None:
    """Offload saved activations to CPU memory (see module doc); None for mode "none".

    The returned object's `forward_context()` must wrap the forward pass of each training micro-batch;
    it does nothing in eval mode or under no_grad. `min_offload_bytes` applies to "streamed" only.
    """
    if mode not in OFFLOAD_MODES:
        raise ValueError(f"activation offload mode {mode!r} is not one of {', '.join(OFFLOAD_MODES)}")
    if mode == "none":
        return None
    if mode == "save_on_cpu":
        return SaveOnCpuOffload(model)
    return StreamedOffload(model, min_offload_bytes)
