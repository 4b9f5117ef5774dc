"""Activation offload: keep the tensors saved for backward in (pinned) CPU memory instead of the GPU.

`apply_activation_offload(model, mode)` returns an `ActivationOffload` whose `forward_context()` the
training step wraps around the forward pass; backward runs outside it (the hooks were bound to each
saved tensor when it was saved). Two modes:

- "save_on_cpu": `torch.autograd.graph.save_on_cpu(pin_memory=True)`. Every saved tensor (parameters
  included) is copied to a fresh pinned buffer during forward and copied back when backward needs it;
  the copies are not overlapped with compute and pinned memory is allocated anew every step.
- "streamed": our own `saved_tensors_hooks`, organised by transformer block.
  * Which blocks: the first k = round(`fraction` * n_layers) blocks (at most n_layers - 1). The first
    blocks are the right ones: their forward copies start earliest and their tensors are needed last in
    backward, so both copies have the most compute to hide behind. The last block is never offloaded:
    its backward comes first, nothing could hide its copy-back.
  * Forward: a saved tensor of an offloaded block (>= `min_offload_bytes`, not a parameter/buffer or a
    view of one, not one of the inputs shared by every block: rotary tables, mask) is copied to a pinned
    host buffer on the device-to-host (D2H) stream right when autograd saves it (the stream first waits
    for the compute stream, so the tensor is complete). The same view saved by several ops (the normed
    input of q/k/v_proj) is copied once, and a view that lies inside a dense tensor already copied
    from the same memory, unmodified since (o_proj's input, `out.transpose(1, 2).reshape(...)`, is a view
    of the attention output SDPA saved), is served from that copy: without that, each offloaded block
    moved its attention output twice (measured on an H100 at 64k tokens, Llama 3.1 8B LoRA: 102.7 GiB
    of host memory where one copy each is 87).
  * Release, stream-ordered: when block j's forward starts, the compute stream waits for the D2H
    copies of block j - L (an event) and only then are that block's device tensors dropped, so their
    memory goes back to the compute stream's pool at once and is reused by block j's own activations,
    in stream order (no `record_stream`, no host sync). The lag L = n_layers - k is the longest that
    still frees every offloaded block before the forward ends (block k - 1 at block n - 1), where the
    peak is: copies get the whole forward to drain, and the forward waits only for what PCIe could not
    carry by then (back-pressure: it never runs more than L blocks ahead of the copies). Releasing
    through `record_stream` instead (an earlier version) let the memory be reused only once the host
    saw the copy finished; the host runs ahead of the GPU, so the allocator grew the heap instead, and
    under a memory cap it synchronised and emptied its cache every step (0.67x throughput at fraction
    0.5 on the 7B LoRA, against 0.86x now).
  * Backward: one offloaded block is requested back per block whose backward starts, highest first
    (when block b's backward starts, blocks >= k - (n_layers - b) are requested). The copies back run
    on their own host-to-device (H2D) stream, so they overlap the D2H copies still in flight (PCIe is
    full duplex), and each takes the place of the memory that a finished block's backward freed: the
    destination is allocated from the compute stream's pool (where that freed memory is; a pool of its
    own would grow the heap by the whole offloaded set) and the H2D stream first waits for the compute
    stream to reach the point where the request was made. The unpack of each tensor makes the compute
    stream wait on its copy's event; a tensor not prefetched (unexpected order) is loaded on demand, so
    correctness never depends on the order.
  * Stream safety: the H2D copy of a tensor waits for its D2H copy (event) and for the compute stream
    (its destination may be memory that queued compute kernels still use); every use of a loaded tensor
    is queued behind the compute stream's wait for its copy (a tensor dropped unused waits too, in
    `_Slot.__del__`); a host buffer goes back to the pool only after the compute stream waited for the
    copy reading it, and the next D2H copy into it waits for the compute stream.
  * Host buffers come from a `PinnedBufferPool` keyed by (shape, stride, dtype) and go back to it when
    autograd frees the saved tensor, so pinning is paid in the first step only. Pool size: the
    offloaded activations of one micro-batch, held for the run.

On the CPU (the unit tests) the same code path runs: the "pinned" buffer is a plain CPU tensor, copies
are synchronous and streams/events are skipped (every CUDA-only call is guarded by `is_cuda`).

Composition: a recomputed block saves only its inputs (checkpoint saves them through these hooks, its
own hooks take over inside the block), so with `recompute = "full"` only each offloaded block's input
residual stream is offloaded; with "selective" the matmul/attention outputs that selective checkpointing
keeps are held by checkpoint itself, not by autograd, and stay on the GPU. Recomputation in backward
reruns the block's forward: the hooks do nothing then (they act only inside `forward_context()` and
never inside a backward pass). Under `torch.compile` the compiled block saves its tensors through the
same hooks. LoRA needs nothing special (frozen weights are parameters, skipped).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
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
        # Weak: the model's blocks hold our hooks, and a block kept by someone else (torch.compile's
        # caches) must not keep the whole model alive through them (issue #4: 12.6 GiB left behind).
        self._model = weakref.ref(model)

    def enabled(self) -> bool:
        """Only a training forward that records a graph saves tensors for backward."""
        model = self._model()
        return model is not None and model.training and torch.is_grad_enabled()

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
    for the GPU), so it is paid in the first step only. `num_bytes` is the pool's total host memory,
    `alloc_s` the host seconds spent allocating it (a long context's first step pins tens of GiB: a
    benchmark that times one step reports this apart).

    torch's pinned allocator rounds every allocation up to a power of two: a long context's block input
    (300k tokens x 4096 x 2 bytes = 2.3 GiB) would lock 4 GiB. So a buffer of at least
    `CARVE_MIN_BYTES` is not allocated alone: on a miss, `per_shape` buffers of its key (the offloaded
    blocks: each saves its tensors once per shape) are carved out of power-of-two blocks
    (`kv_cache.carve_blocks`: less than one buffer of waste per block) and the rest wait in the pool.
    """

    CARVE_MIN_BYTES = 64 << 20

    def __init__(self, per_shape: int = 1) -> None:
        self.per_shape = max(1, per_shape)
        self._free: dict[tuple, list[torch.Tensor]] = defaultdict(list)
        self._lock = threading.Lock()  # buffers come back from the autograd engine's thread
        self.num_buffers = 0
        self.num_bytes = 0
        self.alloc_s = 0.0
        self.storage_ptrs: set[int] = set()  # every buffer made (tests tell host from device memory)

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
        nbytes = like.numel() * like.element_size()
        start = time.perf_counter()
        if nbytes >= self.CARVE_MIN_BYTES and self.per_shape > 1:
            bufs = self._carve(key, like.numel())
        elif stride is None:
            bufs = [torch.empty(shape, dtype=dtype, pin_memory=pinned)]
        else:
            bufs = [torch.empty_strided(shape, stride, dtype=dtype, pin_memory=pinned)]
        self.alloc_s += time.perf_counter() - start
        self.num_buffers += len(bufs)
        for buf in bufs:
            if _storage_ptr(buf) not in self.storage_ptrs:
                self.num_bytes += buf.untyped_storage().nbytes()
                self.storage_ptrs.add(_storage_ptr(buf))
        with self._lock:
            self._free[key].extend(bufs[1:])
        return key, bufs[0]

    def _carve(self, key: tuple, numel: int) -> list[torch.Tensor]:
        """`per_shape` buffers of `key` cut from power-of-two blocks (class docstring)."""
        from tracetrain.models.kv_cache import carve_blocks

        shape, stride, dtype, pinned = key
        flat = carve_blocks(
            self.per_shape, (numel,), dtype, lambda n: torch.empty(n, dtype=torch.uint8, pin_memory=pinned)
        )
        # A dense strided layout covers exactly numel elements: the flat view takes its strides.
        return [f.view(shape) if stride is None else f.as_strided(shape, stride) for f in flat]

    @classmethod
    def allocated_bytes(cls, count: int, nbytes: int, per_shape: int) -> int:
        """Host bytes `take` allocates for `count` buffers of `nbytes` with one key, pinned (torch's pinned
        allocator rounds each allocation up to a power of two): carved `per_shape` at a time from
        `CARVE_MIN_BYTES` on, one each below."""
        from tracetrain.models.kv_cache import carve_sizes

        if nbytes <= 0 or count <= 0:
            return 0
        if nbytes >= cls.CARVE_MIN_BYTES and per_shape > 1:
            carves = -(-count // per_shape)  # a miss carves all `per_shape`, however few are taken
            return carves * sum(carve_sizes(per_shape, nbytes))
        return count * (1 << (nbytes - 1).bit_length())

    def give(self, key: tuple, buf: torch.Tensor) -> None:
        with self._lock:
            self._free[key].append(buf)

    def clear(self) -> None:
        """Free the idle buffers (those of tensors still saved come back to an empty pool)."""
        with self._lock:
            self._free.clear()
        self.num_buffers = self.num_bytes = 0
        self.alloc_s = 0.0
        self.storage_ptrs.clear()


class _Slot:
    """One saved tensor of a block: its host copy and, once loaded back, its device copy.

    Autograd holds the slot in place of the tensor; when it drops it (after the backward node that
    used it), `__del__` returns the host buffer to the pool. A resident slot (a block that is not
    offloaded) holds the device tensor only: it tells `_unpack` which block's backward is running.
    """

    __slots__ = (
        "__weakref__",
        "_key",
        "_pool",
        "block",
        "device",
        "device_copy",
        "host",
        "parent",
        "ready",
        "source",
        "stored",
        "view",
    )

    def __init__(
        self,
        block: int,
        device: torch.device,
        host: torch.Tensor | None = None,
        device_copy: torch.Tensor | None = None,
        pool: PinnedBufferPool | None = None,
        key: tuple = (),
    ) -> None:
        self.block, self.device = block, device
        self.host, self.device_copy = host, device_copy
        self.stored: torch.cuda.Event | None = None  # the D2H copy into `host` is done (D2H stream)
        self.ready: torch.cuda.Event | None = None  # copy back queued, compute stream not yet waiting
        self._pool, self._key = pool, key
        # A view served from another slot's copy (`StreamedOffload._covering`): that slot, and this view's
        # (shape, stride, element offset from the start of that slot's tensor). It holds no copy itself.
        self.parent: _Slot | None = None
        self.view: tuple[tuple[int, ...], tuple[int, ...], int] = ((), (), 0)
        # While the block's forward runs (offloaded copies only): (storage offset, version) of the device
        # tensor copied, for `_covering`; cleared when the forward ends.
        self.source: tuple[int, int] | None = None

    @classmethod
    def view_of(cls, parent: _Slot, t: torch.Tensor) -> _Slot:
        assert parent.source is not None
        slot = cls(parent.block, t.device)
        slot.parent = parent
        slot.view = (tuple(t.shape), t.stride(), int(t.storage_offset()) - parent.source[0])
        return slot

    def __del__(self) -> None:
        if self.ready is not None:  # loaded back but never unpacked: its copy may still read `host`
            torch.cuda.current_stream(self.device).wait_event(self.ready)
        if self._pool is not None and self.host is not None:
            self._pool.give(self._key, self.host)


@dataclass
class _Group:
    """The saved tensors of one block while its forward runs."""

    index: int
    offloaded: bool
    keep_alive: list[torch.Tensor] = field(default_factory=list)  # device tensors being copied out
    slots: dict[tuple, _Slot] = field(default_factory=dict)  # one copy per (storage, view) saved
    dense: dict[int, list[_Slot]] = field(default_factory=dict)  # storage pointer -> dense tensors copied


@dataclass
class _InFlight:
    """An offloaded block whose forward ended: its device tensors stay alive until the compute stream
    has waited for `stored` (the D2H copies), then they are dropped (`StreamedOffload._release`)."""

    index: int
    stored: torch.cuda.Event | None
    tensors: list[torch.Tensor]


@dataclass
class _Streams:
    d2h: torch.cuda.Stream
    h2d: torch.cuda.Stream


@dataclass
class OffloadStats:
    """What the last forward offloaded and how its backward brought it back."""

    num_offloaded_blocks: int = 0  # blocks 0..k-1 offload, k..n-1 stay on the device
    num_tensors: int = 0  # distinct saved tensors copied to the host
    num_views: int = 0  # saved views served from the copy of a dense tensor they lie in (not copied again)
    offloaded_bytes: int = 0
    num_on_demand: int = 0  # loaded back when needed instead of prefetched (0 in normal order)
    release_lag: int = 0  # block j's forward releases block j - release_lag's device tensors
    releases: list[tuple[int, int]] = field(default_factory=list)  # (forward block, block released)
    prefetches: list[tuple[int, int]] = field(default_factory=list)  # (backward block, block requested)


def _weak_hook(owner: weakref.ref[StreamedOffload], method: str, index: int, *args: Any) -> None:
    """A block hook that calls `owner.method(index, ...)` while the offload exists (inert after)."""
    offload = owner()
    if offload is not None:
        getattr(offload, method)(index, *args)


def num_offloaded_blocks(num_blocks: int, fraction: float) -> int:
    """k = round(fraction * num_blocks) first blocks, at least 1 and at most num_blocks - 1."""
    if not 0 < fraction <= 1:
        raise ValueError(f"activation offload fraction must be in (0, 1], got {fraction}")
    return min(num_blocks - 1, max(1, round(fraction * num_blocks)))


class StreamedOffload(ActivationOffload):
    """Offload of the first blocks with copies on D2H/H2D side streams and spread prefetch (module doc)."""

    mode = "streamed"

    def __init__(
        self,
        model: nn.Module,
        min_offload_bytes: int = DEFAULT_MIN_OFFLOAD_BYTES,
        fraction: float = 1.0,
        release_lag: int | None = None,
    ) -> None:
        super().__init__(model)
        self.min_offload_bytes = min_offload_bytes
        self.num_blocks = len(model.layers)  # type: ignore[arg-type]  # nn.Module attributes are typed Tensor | Module in torch's stubs
        self.num_offloaded = num_offloaded_blocks(self.num_blocks, fraction)
        # Default: the longest lag that frees every offloaded block before the forward ends (module doc).
        self.release_lag = max(1, self.num_blocks - self.num_offloaded if release_lag is None else release_lag)
        self._in_flight: list[_InFlight] = []
        self.pool = PinnedBufferPool(per_shape=self.num_offloaded)
        self.stats = OffloadStats()
        self._streams: _Streams | None = None
        self._active = False
        self._current: _Group | None = None
        self._skip_ptrs: set[int] = set()
        self._by_block: dict[int, list[weakref.ref[_Slot]]] = defaultdict(list)
        self._backward_block = self._next_prefetch = self.num_blocks
        self._handles = []
        owner = weakref.ref(self)  # the hooks hold us weakly too: nor the pinned pool through a block
        for index, block in enumerate(model.layers):  # type: ignore[arg-type]  # nn.Module attributes are typed Tensor | Module in torch's stubs
            self._handles.append(
                block.register_forward_pre_hook(
                    functools.partial(_weak_hook, owner, "_enter_block", index), with_kwargs=True
                )
            )
            self._handles.append(
                block.register_forward_hook(functools.partial(_weak_hook, owner, "_exit_block", index))
            )

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def forward_context(self) -> contextlib.AbstractContextManager:
        return self._streaming() if self.enabled() else contextlib.nullcontext()

    @contextlib.contextmanager
    def _streaming(self) -> Iterator[None]:
        # Per micro-batch state: its backward runs before the next forward starts.
        self._by_block = defaultdict(list)
        self.stats = OffloadStats(num_offloaded_blocks=self.num_offloaded, release_lag=self.release_lag)
        self._backward_block = self._next_prefetch = self.num_blocks
        self._active = True
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            self._active = False
            if self._current is not None:  # an exception inside a block
                self._finish(self._current)
            self._release(self.num_blocks + self.release_lag)  # whatever is still in flight

    # -- forward: block scope -------------------------------------------------------------------------

    def _enter_block(self, index: int, block: nn.Module, args: tuple, kwargs: dict) -> None:
        # Inside a backward pass (a recomputation rerunning the block) there is nothing to do.
        if not self._active or torch._C._current_graph_task_id() != -1:
            return
        # Not offloaded: weights (they stay on the GPU anyway; FSDP's unsharded ones included, as the
        # pointers are read now) and the inputs after `x` (rotary tables, mask): every block gets the
        # same ones, so copying them would move the same bytes once per block for no memory gain.
        shared = [a for a in (*args[1:], *kwargs.values()) if isinstance(a, torch.Tensor)]
        self._skip_ptrs = {_storage_ptr(t) for t in (*block.parameters(), *block.buffers(), *shared)}
        self._release(index)
        self._current = _Group(index, offloaded=index < self.num_offloaded)

    def _exit_block(self, index: int, block: nn.Module, args: tuple, output: Any) -> None:
        if self._current is not None and self._current.index == index:
            self._finish(self._current)

    def _finish(self, group: _Group) -> None:
        """End of a block's forward: mark when its copies are done; its tensors wait in `_in_flight`."""
        stored = None
        if group.keep_alive and group.keep_alive[0].is_cuda:
            stored = self._side_streams(group.keep_alive[0].device).d2h.record_event()
            for slot in group.slots.values():
                slot.stored = stored
        for slot in group.slots.values():
            slot.source = None  # the device tensors may be reused once released: no later match
        group.dense.clear()
        if group.keep_alive:
            self._in_flight.append(_InFlight(group.index, stored, group.keep_alive))
        self._current = None

    def _release(self, index: int) -> None:
        """Block `index` starts: drop the device tensors of offloaded blocks <= index - lag, in stream order.

        The compute stream waits for their D2H copies first, so the memory they free can go straight back
        to the compute stream's pool: every later kernel that reuses it is queued behind the wait.
        """
        while self._in_flight and self._in_flight[0].index <= index - self.release_lag:
            done = self._in_flight.pop(0)
            if done.stored is not None:
                torch.cuda.current_stream(done.tensors[0].device).wait_event(done.stored)
            self.stats.releases.append((min(index, self.num_blocks), done.index))
            done.tensors.clear()

    def _side_streams(self, device: torch.device) -> _Streams:
        if self._streams is None:
            self._streams = _Streams(torch.cuda.Stream(device=device), torch.cuda.Stream(device=device))
        return self._streams

    # -- saved tensor hooks ---------------------------------------------------------------------------

    def _pack(self, t: torch.Tensor) -> torch.Tensor | _Slot:
        group = self._current
        if (
            group is None
            or t.numel() * t.element_size() < max(self.min_offload_bytes, 1)
            or _storage_ptr(t) in self._skip_ptrs
        ):
            # Detached: a saved output returned with its grad_fn would form a cycle that is never freed.
            return t.detach()
        key = (_storage_ptr(t), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t._version)
        slot = group.slots.get(key)
        if slot is None:
            parent = self._covering(group, t) if group.offloaded else None
            if parent is not None:
                slot = _Slot.view_of(parent, t)
                self.stats.num_views += 1
            else:
                slot = self._new_slot(t.detach(), group)
            group.slots[key] = slot
        return slot

    @staticmethod
    def _covering(group: _Group, t: torch.Tensor) -> _Slot | None:
        """A dense tensor of this block already copied whose memory holds all of `t`, unmodified since."""
        candidates = group.dense.get(_storage_ptr(t))
        if not candidates or any(st < 0 for st in t.stride()):
            return None
        low = t.storage_offset()
        high = low + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))  # t's last element
        for slot in candidates:
            assert slot.source is not None and slot.host is not None
            start, version = slot.source
            if (
                version == t._version
                and slot.host.dtype == t.dtype
                and start <= low
                and high < start + slot.host.numel()
            ):
                return slot
        return None

    def _new_slot(self, t: torch.Tensor, group: _Group) -> _Slot:
        if not group.offloaded:
            return _Slot(group.index, t.device, device_copy=t)  # resident: only marks block order
        key, host = self.pool.take(t)
        if t.is_cuda:
            d2h = self._side_streams(t.device).d2h
            d2h.wait_stream(torch.cuda.current_stream(t.device))  # t is complete before the copy
            with torch.cuda.stream(d2h):
                host.copy_(t, non_blocking=True)
        else:
            host.copy_(t)
        # Held until `_release` (the compute stream then waits for the copy): no record_stream needed,
        # and while it is alive no other tensor can take its memory, which keeps the (pointer, view)
        # de-duplication key unique.
        group.keep_alive.append(t)
        slot = _Slot(group.index, t.device, host=host, pool=self.pool, key=key)
        if _is_dense(t) and all(st >= 0 for st in t.stride()):  # its host copy has its strides: views map
            slot.source = (int(t.storage_offset()), t._version)
            group.dense.setdefault(_storage_ptr(t), []).append(slot)
        self._by_block[group.index].append(weakref.ref(slot))
        self.stats.num_tensors += 1
        self.stats.offloaded_bytes += t.numel() * t.element_size()
        return slot

    def _unpack(self, packed: torch.Tensor | _Slot) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        if packed.parent is not None:  # a view of another saved tensor's copy: that copy, viewed
            base = self._unpack(packed.parent)
            shape, stride, offset = packed.view
            return base.as_strided(shape, stride, base.storage_offset() + offset)
        slot = packed
        if slot.block < self._backward_block:  # the first tensor of a block's backward
            self._backward_block = slot.block
            self._prefetch(slot.block)
        if slot.device_copy is None:
            self.stats.num_on_demand += 1  # not prefetched: load now (the compute stream will wait)
            self._load([slot])
        if slot.ready is not None:
            torch.cuda.current_stream(slot.device).wait_event(slot.ready)
            slot.ready = None  # later uses of this tensor are queued behind this wait
        return slot.device_copy  # type: ignore[return-value]  # _load above filled it when it was None

    def _prefetch(self, block: int) -> None:
        """Backward of `block` starts: request offloaded blocks down to k - (n_layers - block)."""
        # One offloaded block per started block: each copy back takes the memory a finished block freed.
        lowest = max(0, self.num_offloaded - (self.num_blocks - block))
        for index in range(min(self._next_prefetch, self.num_offloaded) - 1, lowest - 1, -1):
            self.stats.prefetches.append((block, index))
            self._load([s for r in self._by_block.get(index, []) if (s := r()) is not None])
        self._next_prefetch = min(self._next_prefetch, lowest)

    def _load(self, slots: list[_Slot]) -> None:
        """Queue the copy back to the device of every slot not loaded yet."""
        slots = [s for s in slots if s.device_copy is None]
        if not slots:
            return
        device = slots[0].device
        if device.type != "cuda":
            for s in slots:  # a copy, as on the GPU: the host buffer goes back to the pool later
                s.device_copy = s.host.clone()  # type: ignore[union-attr]  # an offloaded slot has its host copy
            return
        streams = self._side_streams(device)
        # Allocated on the compute stream, from the memory finished backward kernels freed (module doc);
        # the H2D stream waits for the compute stream, whose queued kernels may still use that memory.
        copies = [torch.empty_strided(s.host.shape, s.host.stride(), dtype=s.host.dtype, device=device) for s in slots]  # type: ignore[union-attr]  # an offloaded slot has its host copy
        streams.h2d.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(streams.h2d):
            for event in {id(s.stored): s.stored for s in slots}.values():
                if event is None:  # its block's forward has not ended (not expected): wait for all copies
                    streams.h2d.wait_stream(streams.d2h)
                else:
                    streams.h2d.wait_event(event)
            for s, dst in zip(slots, copies):
                dst.copy_(s.host, non_blocking=True)  # type: ignore[arg-type]  # an offloaded slot has its host copy
            ready = streams.h2d.record_event()
        for s, dst in zip(slots, copies):
            s.device_copy, s.ready = dst, ready


def apply_activation_offload(
    model: nn.Module,
    mode: OffloadMode,
    min_offload_bytes: int = DEFAULT_MIN_OFFLOAD_BYTES,
    fraction: float = 1.0,
    release_lag: int | None = None,
) -> ActivationOffload | None:
    """Offload saved activations to CPU memory (see module doc); None for mode "none".

    The returned object's `forward_context()` must wrap the forward pass of each training micro-batch;
    it does nothing in eval mode or under no_grad. `min_offload_bytes`, `fraction` (the share of
    blocks offloaded, counted from the first) and `release_lag` (None: n_layers - k, see the module doc)
    apply to "streamed" only. Raises ValueError for an unknown mode or a fraction outside (0, 1].
    """
    if mode not in OFFLOAD_MODES:
        raise ValueError(f"activation offload mode {mode!r} is not one of {', '.join(OFFLOAD_MODES)}")
    if mode == "none":
        return None
    if mode == "save_on_cpu":
        return SaveOnCpuOffload(model)
    return StreamedOffload(model, min_offload_bytes, fraction, release_lag)
