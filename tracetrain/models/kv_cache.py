"""KV caches for generation with the interface of `llama.KVCache` (duck-typed, so the model needs no change):
`layers[i].update(k, v) -> (k_all, v_all)`, `attention_mask(s)`, `advance(s)`, `length`, `max_len` and a
`valid` (batch, max_len) bool mask that marks left padding.

The mask a cache hands the attention (`attention_mask(s)`, read by `attention.cached_attention`) is what
decides the kernel: when no row is left-padded (`set_prompt_mask` notes that on the host, once per
batch) and the attention reads exactly the positions written so far, it is a lower-right `CausalBias`
and no mask tensor exists (flash kernels, GQA included); otherwise a dense bool mask (batch, 1, s, keys).

- `StaticKVCache`: the whole cache on the compute device, like `llama.KVCache`. With `fixed_shape`
  (what a CUDA graph needs) a decode step (s == 1) reads all `max_len` positions (unwritten ones are
  zeros and masked out) and finds its write position in a device tensor (`pos`), so the step needs no
  host value that changes from token to token and can be captured. Without it, and for every prefill
  chunk (s > 1), new K/V are written with a plain slice copy at the host's `length`, and the attention
  reads only the `length + s` positions written so far, or, for a prompt from position 0, the new K/V
  themselves (nothing to read back).

- `OffloadedKVCache`: every layer's K/V live in (pinned) CPU memory; a forward streams them through two
  GPU staging buffers. Timeline of one forward, layer i using staging buffer i % 2:

      compute stream:  ... proj(i) | wait ready(i) | write new k/v | attn(i) mlp(i) | proj(i+1) | wait ready(i+1) ...
      copy stream:              fetch(i+1) -> ready(i+1) | write-back(i) | ...

  `update` of layer i starts fetch(i+1) (the copy stream first waits for all compute enqueued so far,
  which includes attn(i-1), the last reader of that staging buffer), so the PCIe copy of layer i+1
  overlaps layer i's attention and MLP. Layer 0's fetch for the next forward starts in `advance`, at
  the end of the current forward. New K/V are written into the staging buffer (the attention reads
  them from there) and copied back to the CPU store on the copy stream, so the store always holds every
  position. With `gpu_window = W`, the W most recent positions of every layer also stay resident on the
  GPU (a ring buffer per layer); fetch then copies only the older positions over PCIe and the resident
  ones device-to-device. On CPU the same code runs: copies are plain, streams and events are None.

  Both the store and the staging buffers are position-major, (max_len, batch, kv_heads, head_dim), so
  the positions [0, n) that a fetch copies are one contiguous block: a strided host-to-device copy would
  go through an unpinned temporary and block the host. The attention gets a permuted view.
  PyTorch's pinned-memory allocator rounds every allocation up to a power of two; the store is carved
  out of power-of-two blocks (`carve_blocks`) so that a cache of any length does not pin up to twice
  its size.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator

import torch
from torch.nn.attention.bias import CausalBias, causal_lower_right

from tracetrain.models.llama import ModelArgs


def causal_valid_mask(valid: torch.Tensor, q_pos: torch.Tensor, num_keys: int) -> torch.Tensor:
    """(batch, 1, s, num_keys) bool: key j is visible from query position q if j <= q and j holds a real
    token. A padded query also sees itself, so no mask row is empty (some SDPA kernels return NaN for an
    empty row); padded queries never feed a real token, whose mask hides them."""
    k_pos = torch.arange(num_keys, device=valid.device)
    causal = k_pos[None, :] <= q_pos[:, None]  # (s, num_keys)
    own = k_pos[None, :] == q_pos[:, None]
    return ((causal[None] & valid[:, None, :num_keys]) | own[None]).unsqueeze(1)


class CacheMask:
    """What both caches share: the valid mask of left padding and the attention mask of a forward.

    Subclasses set `valid` (batch, max_len) bool, `length` and `max_len`, and may override `num_keys`
    and `query_positions`."""

    valid: torch.Tensor
    length: int
    max_len: int
    padded: bool = True  # host flag; until `set_prompt_mask` says otherwise, assume padding
    sliding_window: int = 0  # the model's sliding window (Mistral): keys fewer than `window` positions back; 0 = all

    def set_prompt_mask(self, valid: torch.Tensor) -> None:
        """(batch, prompt_len) bool, False at left padding. Notes on the host whether any row is padded
        (one device sync, before the prefill): unpadded batches attend without a mask tensor."""
        self.valid[:, : valid.shape[1]] = valid
        self.padded = not bool(valid.all())

    def num_keys(self, s: int) -> int:
        """Keys the attention of an s-token forward reads: the positions written so far."""
        return self.length + s

    def query_positions(self, s: int) -> torch.Tensor:
        return torch.arange(self.length, self.length + s, device=self.valid.device)

    def attention_mask(self, s: int) -> torch.Tensor | CausalBias:
        """A lower-right `CausalBias` (s, keys) when no row is padded and the keys are exactly the written
        positions; else a dense (batch, 1, s, keys) bool mask (`causal_valid_mask`)."""
        end = self.length + s
        if end > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} tokens; {end} requested")
        num_keys = self.num_keys(s)
        windowed = 0 < self.sliding_window < num_keys
        if not self.padded and num_keys == end and not windowed:
            return causal_lower_right(s, num_keys)
        q_pos = self.query_positions(s)
        mask = causal_valid_mask(self.valid, q_pos, num_keys)
        if windowed:  # slot distances are position distances: left padding shifts a whole row
            k_pos = torch.arange(num_keys, device=self.valid.device)
            mask = mask & (k_pos[None, :] > q_pos[:, None] - self.sliding_window)[None, None]
        return mask


class StaticKVLayer:
    """One layer's keys and values, (batch, kv_heads, max_len, head_dim), zero-initialised."""

    def __init__(self, owner: StaticKVCache, k: torch.Tensor, v: torch.Tensor) -> None:
        self.owner, self.k, self.v = owner, k, v

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = k.shape[2]
        if s == 1 and self.owner.fixed_shape:  # a step that may be graph-captured: device positions only
            index = self.owner.pos + torch.arange(s, device=k.device)
            self.k.index_copy_(2, index, k.to(self.k.dtype))
            self.v.index_copy_(2, index, v.to(self.v.dtype))
        else:  # the host knows where: a plain slice copy (no index tensor)
            start = self.owner.length
            self.k[:, :, start : start + s].copy_(k)
            self.v[:, :, start : start + s].copy_(v)
            if start == 0:  # a prompt from the start attends to its own keys: no read back of the cache
                return k, v
        n = self.owner.num_keys(s)
        return self.k[:, :, :n], self.v[:, :, :n]


class StaticKVCache(CacheMask):
    """Whole cache on the compute device; with `fixed_shape`, decode steps have static shapes (module
    docstring)."""

    def __init__(
        self,
        args: ModelArgs,
        batch: int,
        max_len: int,
        device: torch.device,
        dtype: torch.dtype,
        fixed_shape: bool = False,
    ) -> None:
        shape = (batch, args.n_kv_heads, max_len, args.head_dim)
        # Zeros, not empty: a decode step reads unwritten positions too (masked, but 0 * NaN = NaN).
        self.layers = [
            StaticKVLayer(
                self, torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=dtype)
            )
            for _ in range(args.n_layers)
        ]
        self.max_len = max_len
        self.length = 0  # host copy of the write position: bounds checks and prefill slicing
        self.pos = torch.zeros((), dtype=torch.long, device=device)  # what a captured step reads
        self.valid = torch.ones(batch, max_len, dtype=torch.bool, device=device)
        self.fixed_shape = fixed_shape
        self.sliding_window = args.sliding_window

    def num_keys(self, s: int) -> int:
        """Keys the attention sees: all of them for a fixed-shape decode step, else those written."""
        return self.max_len if s == 1 and self.fixed_shape else self.length + s

    def query_positions(self, s: int) -> torch.Tensor:
        return self.pos + torch.arange(s, device=self.valid.device)  # device value: right on graph replay

    def advance(self, s: int) -> None:
        self.length += s
        self.pos += s  # in place: a captured graph advances it on replay


def _ring_runs(start: int, end: int, size: int) -> list[tuple[int, int, int]]:
    """Positions [start, end) in a ring of `size` slots -> contiguous (first, last + 1, first slot) runs."""
    runs, p = [], start
    while p < end:
        slot = p % size
        n = min(end - p, size - slot)
        runs.append((p, p + n, slot))
        p += n
    return runs


def carve_blocks(
    count: int, shape: tuple[int, ...], dtype: torch.dtype, alloc: Callable[[int], torch.Tensor]
) -> list[torch.Tensor]:
    """`count` tensors of `shape`, cut from byte blocks `alloc(nbytes)` whose sizes are powers of two (each
    block: the largest power of two that the remaining tensors fill, or one tensor's rounded size).
    Each block wastes less than one tensor, and there are about log2(count) + 1 blocks."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    out: list[torch.Tensor] = []
    for block_bytes in carve_sizes(count, nbytes):
        block = alloc(block_bytes)
        for offset in range(0, min(block_bytes // nbytes, count - len(out)) * nbytes, nbytes):
            out.append(block[offset : offset + nbytes].view(dtype).view(shape))
    return out


def carve_sizes(count: int, nbytes: int) -> list[int]:
    """The byte blocks `carve_blocks` allocates for `count` tensors of `nbytes` each (the planner counts
    pinned host memory with it: plan/memory.py)."""
    sizes: list[int] = []
    placed = 0
    while placed < count:
        remaining_bytes = (count - placed) * nbytes
        block_bytes = max(1 << (remaining_bytes.bit_length() - 1), 1 << (nbytes - 1).bit_length())
        sizes.append(block_bytes)
        placed += min(block_bytes // nbytes, count - placed)
    return sizes


def _pinned_bytes(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


class OffloadedKVLayer:
    """Layer `index` of an `OffloadedKVCache`: `update` is where the copy pipeline advances."""

    def __init__(self, owner: OffloadedKVCache, index: int) -> None:
        self.owner, self.index = owner, index

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        o, i = self.owner, self.index
        if i + 1 < len(o.layers):
            o.fetch(i + 1)  # overlaps this layer's attention and MLP
        o.wait_ready(i)
        start, end = o.length, o.length + k.shape[2]
        stage = o.staging[i % 2]
        for buf, new in zip(stage, (k, v)):
            buf[start:end].copy_(new.permute(2, 0, 1, 3))  # (s, batch, kv_heads, head_dim)
        o.write_back(i, start, end)
        return tuple(buf[:end].permute(1, 2, 0, 3) for buf in stage)  # type: ignore[return-value]  # stage holds the two buffers, keys and values; (batch, kv_heads, end, head_dim)


class OffloadedKVCache(CacheMask):
    """K/V in (pinned) CPU memory, streamed through two staging buffers; see the module docstring."""

    def __init__(
        self, args: ModelArgs, batch: int, max_len: int, device: torch.device, dtype: torch.dtype, gpu_window: int = 0
    ) -> None:
        if gpu_window < 0:
            raise ValueError(f"gpu_window must be >= 0, got {gpu_window}")
        row = (batch, args.n_kv_heads, args.head_dim)
        # Empty, not zeros: only written positions are ever read (attention sees [0, length + s)).
        if device.type == "cuda":
            flat = carve_blocks(2 * args.n_layers, (max_len, *row), dtype, _pinned_bytes)
        else:
            flat = [torch.empty((max_len, *row), dtype=dtype) for _ in range(2 * args.n_layers)]
        self.store = list(zip(flat[0::2], flat[1::2]))  # (k, v) per layer
        self.staging = [tuple(torch.empty((max_len, *row), dtype=dtype, device=device) for _ in "kv") for _ in range(2)]
        self.gpu_window = min(gpu_window, max_len)
        self.window = [
            tuple(torch.empty((self.gpu_window, *row), dtype=dtype, device=device) for _ in "kv")
            for _ in range(args.n_layers if self.gpu_window else 0)
        ]
        self.layers = [OffloadedKVLayer(self, i) for i in range(args.n_layers)]
        self.max_len, self.length, self.device = max_len, 0, device
        self.sliding_window = args.sliding_window
        self.valid = torch.ones(batch, max_len, dtype=torch.bool, device=device)
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.ready = [torch.cuda.Event() if self.copy_stream else None for _ in range(2)]
        self.fetch(0)

    @contextlib.contextmanager
    def _on_copy_stream(self) -> Iterator[None]:
        """Run copies on the side stream, after all compute enqueued so far (no-op on CPU)."""
        if self.copy_stream is None:
            yield
            return
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.copy_stream):
            yield

    def fetch(self, i: int) -> None:
        """Start copying layer i's cached positions into staging buffer i % 2."""
        num_old = max(0, self.length - self.gpu_window)  # positions that live only on the CPU
        with self._on_copy_stream():
            for buf, src in zip(self.staging[i % 2], self.store[i]):
                buf[:num_old].copy_(src[:num_old], non_blocking=True)
            for first, last, slot in _ring_runs(num_old, self.length, self.gpu_window or 1):
                for buf, ring in zip(self.staging[i % 2], self.window[i]):
                    buf[first:last].copy_(ring[slot : slot + last - first], non_blocking=True)
            if self.ready[i % 2] is not None:
                self.ready[i % 2].record()  # type: ignore[union-attr]  # checked on the line above (list items are not narrowed)

    def wait_ready(self, i: int) -> None:
        if self.ready[i % 2] is not None:
            torch.cuda.current_stream(self.device).wait_event(self.ready[i % 2])  # type: ignore[arg-type]  # an event exists on the CUDA path, the only one that waits

    def write_back(self, i: int, start: int, end: int) -> None:
        """New positions [start, end) of layer i: into its GPU window (the most recent W), and to the CPU."""
        stage = self.staging[i % 2]
        if self.gpu_window:
            for first, last, slot in _ring_runs(max(start, end - self.gpu_window), end, self.gpu_window):
                for ring, buf in zip(self.window[i], stage):
                    ring[slot : slot + last - first].copy_(buf[first:last])
        # On the copy stream, after the write into staging; fetch(i + 2) into the same buffer is
        # enqueued later on this stream, so the buffer is not overwritten before it is read here.
        with self._on_copy_stream():
            for dst, buf in zip(self.store[i], stage):
                dst[start:end].copy_(buf[start:end], non_blocking=True)

    def advance(self, s: int) -> None:
        self.length += s
        self.fetch(0)  # the next forward's first layer: overlaps sampling and the host's bookkeeping

    def synchronize(self) -> None:
        """Wait for pending copies (before freeing the cache or reading the CPU store)."""
        if self.copy_stream is not None:
            self.copy_stream.synchronize()
