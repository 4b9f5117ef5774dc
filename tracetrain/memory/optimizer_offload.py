"""AdamW with its fp32 master weights, gradients and moments in CPU memory (ZeRO-Offload idea).

Full fine-tuning of a 7B model on one 80 GB GPU: the GPU holds only the bf16 weights, each bf16
gradient for the moment between its accumulation and its copy out, and the activations. The host holds,
per trainable parameter (18 bytes each, 121 GB = 113 GiB for llama2-7b's 6.74B, plus ~2 GiB process):

  staging     param dtype (bf16), pinned   2 B   landing zone of the gradient copies (D2H)
  master      fp32, pinned                 4 B   source of the weight uploads (H2D)
  grad        fp32, pageable               4 B   gradient accumulated over the step's micro-batches
  exp_avg, exp_avg_sq  fp32, pageable      8 B

Only what DMA touches is pinned (40 GB of 121). Each pinned kind is one flat buffer registered with
cudaHostRegister: the caching pinned allocator rounds every block up to a power of two (+5 GB for 7B).

Data flow of one optimizer step:
1. backward: a post-accumulate-grad hook on each parameter copies its gradient into the staging buffer
   on a side stream (after waiting on the stream that produced it), frees `param.grad`, and hands the
   buffer to one worker thread that waits for the copy's event and accumulates in fp32 (first
   micro-batch: cast-copy, later ones: add). Accumulating on the CPU in fp32 costs host memory traffic
   but is exact where bf16 accumulation on the GPU would round each micro-batch's sum to 8 bits of
   mantissa, and it keeps the GPU free of any full set of gradients.
2. `step_with_clip`: takes each gradient's squared norm as soon as the worker has finished it (the
   norms of early gradients overlap the worker's tail; a host sync, since the CPU update needs every
   gradient), skips the update if the total is non-finite, else runs the fused CPU AdamW kernel chunk
   by chunk (the clip factor is folded into the kernel's `grad_scale`: no extra pass). After each
   chunk its fp32 masters are copied to the GPU asynchronously on the side stream and cast there, so
   the upload of chunk i overlaps the CPU update of chunk i+1. The compute stream then waits on the
   side stream: the next forward sees the new weights, without a host sync.
Not done (SuperOffload's speculative update): starting chunk updates during the last backward would
need the global norm before it is known, i.e. an update that is rolled back when clipping applies.

On CPU-only machines the same code runs with CPU "device" parameters; copies become plain copies.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim.adamw import adamw

_SLICE_NUMEL = 1 << 22  # 16 MB of fp32 scratch: stays in the last-level cache between cast and add
_ALIGN_BYTES = 64


@dataclass
class _Slot:
    """The host-side buffers of one trainable parameter (all shaped like the parameter)."""

    param: torch.Tensor
    staging: torch.Tensor  # param dtype, pinned when the param is on CUDA
    grad: torch.Tensor  # fp32
    master: torch.Tensor  # fp32
    exp_avg: torch.Tensor  # fp32
    exp_avg_sq: torch.Tensor  # fp32
    step: torch.Tensor  # () fp32, as torch.optim.AdamW keeps it
    num_accumulated: int = 0  # micro-batch gradients added into `grad` since the last zero_grad
    pending: Future | None = None


def _flat_host(
    params: list[torch.Tensor], dtype: torch.dtype | None, pin: bool
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One host buffer with a view per parameter (in `dtype`, or the parameter's own), page-locked
    with cudaHostRegister when `pin` (exact size, unlike the caching pinned allocator)."""
    sizes = [p.numel() * (torch.empty((), dtype=dtype or p.dtype).element_size()) for p in params]
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += -(-size // _ALIGN_BYTES) * _ALIGN_BYTES
    flat = torch.empty(max(total, 1), dtype=torch.uint8)
    if pin:
        err = int(torch.cuda.cudart().cudaHostRegister(flat.data_ptr(), flat.numel(), 0))
        if err != 0:
            raise RuntimeError(f"cudaHostRegister of {flat.numel() / 2**30:.1f} GiB failed (cudaError {err})")
    views = [flat[o : o + size].view(dtype or p.dtype).view(p.shape) for o, size, p in zip(offsets, sizes, params)]
    return flat, views


def _accumulate(slot: _Slot, event: torch.cuda.Event | None, first: bool, scratch: torch.Tensor) -> None:
    """Worker thread: copy (first micro-batch) or add the staged gradient into the fp32 buffer."""
    if event is not None:
        event.synchronize()  # worker-thread wait for the D2H copy; the training thread does not block
    grad, staged = slot.grad.view(-1), slot.staging.view(-1)
    if first or staged.dtype == grad.dtype:
        grad.copy_(staged) if first else grad.add_(staged)
        return
    for acc, part in zip(grad.split(_SLICE_NUMEL), staged.split(_SLICE_NUMEL)):
        # A mixed-dtype add_ runs at half the speed of a cast into cache-sized fp32 scratch + fp32 add
        # (16 H200-host cores: 0.30 s vs 0.14 s unsliced per 1G elements).
        tmp = scratch[: acc.numel()]
        tmp.copy_(part)
        acc.add_(tmp)


def _squared_norm(grad: torch.Tensor) -> torch.Tensor:
    flat = grad.view(-1)
    # BLAS sdot: 8x faster than linalg.vector_norm on the CPU (0.036 s vs 0.30 s per 1G elements).
    return torch.dot(flat, flat)


@contextlib.contextmanager
def cpu_threads(threads: int) -> Iterator[None]:
    """Run the enclosed CPU ops on `threads` intra-op threads (0 = leave torch's setting)."""
    if threads <= 0:
        yield
        return
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


class CPUOffloadAdamW(torch.optim.Optimizer):
    """AdamW whose state lives on the CPU; gradients stream out during backward (see module docstring).

    `param_groups` are the real (device) parameters, so lr schedulers work unchanged. Call
    `step_with_clip(max_norm)` instead of clip_grad_norm_ + step; `param.grad` is always None after
    backward. `chunk_numel` sets the granularity of the CPU-update / upload overlap.
    """

    # What a checkpoint's state holds for each parameter, and for every one (train/state_checks.py).
    STATE_KEYS = ("step", "exp_avg", "exp_avg_sq", "master")
    STATE_FOR_EVERY_PARAMETER = True

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        threads: int = 0,
        chunk_numel: int = 1 << 26,
    ) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.threads = threads
        self.chunk_numel = chunk_numel
        all_params = [p for g in self.param_groups for p in g["params"]]
        if any(not p.requires_grad for p in all_params):
            raise ValueError("CPUOffloadAdamW: every parameter must require grad (pass trainable ones only)")
        self._on_cuda = all_params[0].is_cuda if all_params else False
        self._staging_flat, stagings = _flat_host(all_params, None, pin=self._on_cuda)
        self._master_flat, masters = _flat_host(all_params, torch.float32, pin=self._on_cuda)
        self._slots: dict[torch.Tensor, _Slot] = {}
        with torch.no_grad():
            for p, staging, master in zip(all_params, stagings, masters):
                master.copy_(p.detach())
                self._slots[p] = _Slot(
                    p,
                    staging,
                    torch.zeros_like(master),
                    master,
                    torch.zeros_like(master),
                    torch.zeros_like(master),
                    torch.zeros((), dtype=torch.float32),
                )
                self.state[p] = self._state_view(self._slots[p])
        self._scratch = torch.empty(min(_SLICE_NUMEL, max((p.numel() for p in all_params), default=1)))
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="offload-grad")
        self._copy_stream = torch.cuda.Stream(all_params[0].device) if self._on_cuda else None
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in all_params]
        self._arrived: list[_Slot] = []  # slots with a gradient since zero_grad, in arrival order
        self.last_timings: dict[str, float] = {}

    @staticmethod
    def _state_view(slot: _Slot) -> dict[str, torch.Tensor]:
        # The very tensors the update writes: state_dict() hands them out without copying 81 GB.
        return {"step": slot.step, "exp_avg": slot.exp_avg, "exp_avg_sq": slot.exp_avg_sq, "master": slot.master}

    # ------------------------------------------------------------------------------------------------
    # Backward: stream each gradient out as soon as it is accumulated

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        slot = self._slots[param]
        if slot.pending is not None:
            # The staging buffer is reused: the previous micro-batch's add must be done. It usually is,
            # a whole forward later; if the worker falls behind, this back-pressure stalls backward.
            slot.pending.result()
        grad, event = param.grad, None
        assert grad is not None
        if grad.is_cuda:
            self._copy_stream.wait_stream(torch.cuda.current_stream(grad.device))  # type: ignore[union-attr]  # the copy stream exists whenever gradients are on CUDA (grad.is_cuda above)
            with torch.cuda.stream(self._copy_stream):
                slot.staging.copy_(grad, non_blocking=True)
                event = torch.cuda.Event()
                event.record()
            grad.record_stream(self._copy_stream)  # type: ignore[arg-type]  # the copy stream exists on CUDA, the only path with CUDA grads; the allocator must not reuse it before the copy ran
        else:
            slot.staging.copy_(grad)
        param.grad = None  # gradients never all live on the GPU at once
        first = slot.num_accumulated == 0
        if first:
            self._arrived.append(slot)
        slot.num_accumulated += 1
        slot.pending = self._worker.submit(_accumulate, slot, event, first, self._scratch)

    def _wait_for_grads(self) -> None:
        for slot in self._slots.values():
            if slot.pending is not None:
                slot.pending.result()
                slot.pending = None

    @torch.no_grad()
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Start a new accumulation: the next gradient of each parameter overwrites its fp32 buffer."""
        self._wait_for_grads()
        self._arrived = []
        for slot in self._slots.values():
            slot.num_accumulated = 0
            slot.param.grad = None

    # ------------------------------------------------------------------------------------------------
    # The update

    def step_with_clip(self, max_norm: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Clip to `max_norm` (inf = measure only) and update; returns (grad_norm, finite), () CPU tensors.

        A non-finite norm skips the update and leaves every state and weight unchanged.
        """
        return self.step(max_norm=max_norm)

    @torch.no_grad()
    def step(  # type: ignore[override]  # step also takes max_norm (step_with_clip); no closure
        self,
        closure: None = None,
        max_norm: float = math.inf,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`step_with_clip` under the name lr schedulers and optimizer hooks track."""
        assert closure is None, "CPUOffloadAdamW does not take a closure"
        start = time.perf_counter()
        with cpu_threads(self.threads):
            grad_norm = self._grad_norm()
            finite = torch.isfinite(grad_norm)
            measured = time.perf_counter()
            if bool(finite):  # a CPU tensor: no device sync
                # Same factor as clip_grad_norm_; the kernel divides by grad_scale, so pass its inverse.
                clip_coef = torch.clamp(max_norm / (grad_norm + 1e-6), max=1.0)
                self._update_and_upload(None if bool(clip_coef == 1.0) else 1.0 / clip_coef)
        self.last_timings = {"grad_norm_s": measured - start, "update_s": time.perf_counter() - measured}
        return grad_norm, finite

    def _grad_norm(self) -> torch.Tensor:
        """Global L2 norm of the accumulated gradients, () fp32 on the CPU."""
        squares = []
        for slot in self._arrived:
            # Host sync, needed: the CPU update reads every accumulated gradient. The wait is on the
            # worker, which waits on the D2H events; the GPU keeps running whatever is queued.
            slot.pending.result()  # type: ignore[union-attr]  # every arrived slot has its accumulate future
            slot.pending = None
            squares.append(_squared_norm(slot.grad))
        if not squares:
            return torch.zeros(())
        # fp32 squares overflow for gradients above ~1e19, as in clip_grad_norm_: such a step is skipped.
        return torch.stack(squares).sum().sqrt()

    def _chunks(self) -> Iterator[tuple[dict[str, Any], list[_Slot]]]:
        """Slots that received a gradient, grouped by param group, in chunks of about chunk_numel."""
        for group in self.param_groups:
            chunk: list[_Slot] = []
            chunk_numel = 0
            for p in group["params"]:
                slot = self._slots[p]
                if slot.num_accumulated > 0:
                    chunk.append(slot)
                    chunk_numel += p.numel()
                if chunk_numel >= self.chunk_numel:
                    yield group, chunk
                    chunk, chunk_numel = [], 0
            if chunk:
                yield group, chunk

    def _update_and_upload(self, grad_scale: torch.Tensor | None) -> None:
        self._order_uploads(before=True)
        for group, chunk in self._chunks():
            beta1, beta2 = group["betas"]
            adamw(
                [s.master for s in chunk],
                [s.grad for s in chunk],
                [s.exp_avg for s in chunk],
                [s.exp_avg_sq for s in chunk],
                [],
                [s.step for s in chunk],
                fused=True,
                grad_scale=grad_scale,
                amsgrad=False,
                beta1=beta1,
                beta2=beta2,
                lr=group["lr"],
                weight_decay=group["weight_decay"],
                eps=group["eps"],
                maximize=False,
            )
            self._upload(chunk)
        self._order_uploads(before=False)

    def _order_uploads(self, before: bool) -> None:
        """Stream dependencies around the uploads (GPU-side waits, no host sync)."""
        if self._copy_stream is None:
            return
        compute = torch.cuda.current_stream(self._copy_stream.device)
        if before:
            self._copy_stream.wait_stream(compute)  # the tail of backward may still read the weights
        else:
            compute.wait_stream(self._copy_stream)  # the next forward must read the new weights

    def _upload(self, chunk: list[_Slot]) -> None:
        """Copy the chunk's fp32 masters into the device weights, cast to their dtype."""
        if self._copy_stream is None:
            for slot in chunk:
                slot.param.detach().copy_(slot.master)
            return
        with torch.cuda.stream(self._copy_stream):
            for slot in chunk:
                # fp32 over PCIe from pinned memory, cast on the GPU: asynchronous, so it overlaps the
                # next chunk's update. Casting into bf16 on the CPU halves the PCIe bytes but cost 0.47 s
                # per 7B step of CPU time on the critical path, while the link (55 GB/s) has slack.
                master = slot.master.to(slot.param.device, non_blocking=True)  # on the copy stream
                slot.param.detach().copy_(master)

    def host_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The host buffers by kind, in parameter order (for measurements and debugging)."""
        slots = list(self._slots.values())
        return {
            name: [getattr(s, name) for s in slots]
            for name in ("staging", "grad", "master", "exp_avg", "exp_avg_sq", "step")
        }

    # ------------------------------------------------------------------------------------------------
    # Checkpoints

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Copy a saved state into the existing host buffers (load it with map_location="cpu", and
        mmap=True for a 7B model, so that no second copy of 81 GB is ever resident), then upload
        the masters into the device weights."""
        saved_groups = state_dict["param_groups"]
        if [len(g["params"]) for g in saved_groups] != [len(g["params"]) for g in self.param_groups]:
            raise ValueError(
                "optimizer state does not match the model's parameter groups "
                f"({[len(g['params']) for g in saved_groups]} saved vs "
                f"{[len(g['params']) for g in self.param_groups]} now)"
            )
        self._wait_for_grads()
        if self._copy_stream is not None:
            self._copy_stream.synchronize()  # an upload may still be reading the masters we overwrite
        for saved, group in zip(saved_groups, self.param_groups):
            group.update({k: v for k, v in saved.items() if k != "params"})
            for index, p in zip(saved["params"], group["params"]):
                slot, entry = self._slots[p], state_dict["state"][index]
                if entry["master"].shape != slot.master.shape:
                    raise ValueError(
                        f"optimizer state {index}: shape {tuple(entry['master'].shape)}, "
                        f"the parameter has {tuple(slot.master.shape)}"
                    )
                for name, target in self._state_view(slot).items():
                    target.copy_(entry[name])
        self.zero_grad()
        self._upload_all()

    def _upload_all(self) -> None:
        self._order_uploads(before=True)
        self._upload(list(self._slots.values()))
        self._order_uploads(before=False)

    def close(self) -> None:
        """Remove the gradient hooks, stop the worker and unpin the host buffers."""
        for handle in self._hooks:
            handle.remove()
        self._worker.shutdown(wait=True)
        if self._on_cuda:
            torch.cuda.synchronize()  # no copy may still use the buffer once it is unpinned
            for flat in (self._staging_flat, self._master_flat):
                torch.cuda.cudart().cudaHostUnregister(flat.data_ptr())
            self._on_cuda = False
