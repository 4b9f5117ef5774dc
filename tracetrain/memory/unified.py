"""CUDA managed ("unified") memory for chosen tensors — the GH200 experiment, `memory.unified_memory`.

A managed allocation has one address valid on the CPU and the GPU; the driver migrates pages on
demand (or on a prefetch). On a GH200 the CPU and GPU share coherent memory over NVLink-C2C, so
optimizer states or weights can exceed GPU memory at a modest cost. On a PCIe H100 the same
over-subscription thrashes pages across PCIe and can stall the GPU for minutes — on a shared machine
that is everyone's problem. Hence the HARD GUARD: every allocation is refused when the managed bytes
this process holds, plus the request, would exceed the GPU's free memory minus a safety margin,
unless `memory.coherent_memory = true`. The guard counts our managed bytes as if none of them were
resident on the GPU while `mem_get_info` already subtracts those that are: it is conservative by
design (on a PCIe GPU at most about half the free memory can become managed).

Allocation goes through the CUDA driver API (libcuda.so.1, via ctypes) rather than the runtime: there
is exactly one driver per machine, its exported symbols are a stable ABI, whereas libcudart's soname
and the signatures of cudaMemAdvise / cudaMemPrefetchAsync changed in CUDA 13. The buffer is wrapped
as a torch tensor through `__cuda_array_interface__` (zero-copy; the tensor keeps the owner alive
and the owner's finalizer frees the memory).

Seeing page migration: the torch profiler's trace has no unified-memory events on most setups. Use
Nsight Systems:
    nsys profile --trace=cuda,nvtx --cuda-um-cpu-page-faults=true --cuda-um-gpu-page-faults=true \
        --cuda-memory-usage=true -o um python -m tracetrain.cli train ...
    nsys stats --report um_sum,um_total_sum,um_cpu_page_faults_sum um.nsys-rep
The timeline shows each HtoD/DtoH migration and fault group; page faults add overhead, so profile a
few steps only.
"""

from __future__ import annotations

import ctypes
import math
import threading
import weakref
from typing import Literal

import torch
from torch import nn

from tracetrain.errors import TracetrainError

_MARGIN_MIN_BYTES = 2 * 2**30  # CUDA context growth, cuBLAS workspaces, allocator fragmentation
_MARGIN_FRACTION = 0.05
_ATTACH_GLOBAL = 1  # CU_MEM_ATTACH_GLOBAL: accessible from any stream
_ADVISE_PREFERRED_LOCATION = 3  # CU_MEM_ADVISE_SET_PREFERRED_LOCATION
_ADVISE_ACCESSED_BY = 5  # CU_MEM_ADVISE_SET_ACCESSED_BY
_LOCATION_DEVICE, _LOCATION_HOST = 1, 2
_DEVICE_CPU = -1  # CU_DEVICE_CPU, for the pre-12.2 entry points

Advise = Literal["none", "gpu", "cpu"]


class UnifiedMemoryError(TracetrainError):
    """Managed memory was requested where it is unsafe or unavailable."""


class _Ledger:
    """Managed bytes this process holds, per device (allocations and finalizers run on any thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bytes: dict[int, int] = {}

    def held(self, device_index: int) -> int:
        with self._lock:
            return self._bytes.get(device_index, 0)

    def add(self, device_index: int, nbytes: int) -> None:
        with self._lock:
            self._bytes[device_index] = self._bytes.get(device_index, 0) + nbytes


LEDGER = _Ledger()


def check_managed_budget(
    request_bytes: int, held_bytes: int, free_bytes: int, total_bytes: int, coherent_memory: bool
) -> None:
    """Raise unless `held + request <= free - margin` (or the memory is coherent, as on a GH200)."""
    if coherent_memory:
        return
    margin = max(_MARGIN_MIN_BYTES, int(_MARGIN_FRACTION * total_bytes))
    limit = free_bytes - margin
    if held_bytes + request_bytes > limit:
        gib = 2**30
        raise UnifiedMemoryError(
            f"managed allocation of {request_bytes / gib:.2f} GiB refused: with the {held_bytes / gib:.2f} GiB "
            f"already managed it would exceed the GPU's free memory ({free_bytes / gib:.2f} GiB) minus a "
            f"{margin / gib:.2f} GiB margin, and over-subscribed managed memory can stall a PCIe GPU. Set "
            "memory.coherent_memory = true only on a GPU with coherent CPU memory (GH200)."
        )


class _CUmemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _Driver:
    """The handful of CUDA driver entry points this module needs."""

    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        u64, size, p = ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p
        self._sig(lib.cuMemAllocManaged, [ctypes.POINTER(u64), size, ctypes.c_uint])
        self._sig(lib.cuMemFree_v2, [u64])
        self._sig(lib.cuCtxGetCurrent, [ctypes.POINTER(p)])
        self._sig(lib.cuCtxSetCurrent, [p])
        self._sig(lib.cuCtxSynchronize, [])
        self._sig(lib.cuDevicePrimaryCtxRetain, [ctypes.POINTER(p), ctypes.c_int])
        self._sig(lib.cuGetErrorString, [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)])
        # CUDA >= 12.2 drivers take a CUmemLocation (the only form CUDA 13 headers declare); older
        # drivers only have the device-ordinal form, where -1 means the CPU.
        self.v2 = hasattr(lib, "cuMemAdvise_v2") and hasattr(lib, "cuMemPrefetchAsync_v2")
        if self.v2:
            self._sig(lib.cuMemAdvise_v2, [u64, size, ctypes.c_int, _CUmemLocation])
            self._sig(lib.cuMemPrefetchAsync_v2, [u64, size, _CUmemLocation, ctypes.c_uint, p])
        else:
            self._sig(lib.cuMemAdvise, [u64, size, ctypes.c_int, ctypes.c_int])
            self._sig(lib.cuMemPrefetchAsync, [u64, size, ctypes.c_int, p])
        self.lib = lib

    @staticmethod
    def _sig(fn: ctypes._CFuncPtr, argtypes: list) -> None:  # type: ignore[name-defined]  # ctypes._CFuncPtr is private in typeshed
        fn.argtypes, fn.restype = argtypes, ctypes.c_int

    def check(self, result: int, what: str) -> None:
        if result != 0:
            msg = ctypes.c_char_p()
            self.lib.cuGetErrorString(result, ctypes.byref(msg))
            raise RuntimeError(f"{what} failed: {(msg.value or b'').decode()} (CUresult {result})")

    def ensure_context(self, device_index: int) -> None:
        """Finalizers may run on threads where the runtime never made torch's primary context current."""
        ctx = ctypes.c_void_p()
        self.check(self.lib.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
        if not ctx.value:
            self.check(self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), device_index), "cuDevicePrimaryCtxRetain")
            self.check(self.lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")

    def advise(self, ptr: int, nbytes: int, advice: int, device_index: int | None) -> None:
        """`device_index` None = the CPU."""
        if self.v2:
            loc = (
                _CUmemLocation(_LOCATION_HOST, 0)
                if device_index is None
                else _CUmemLocation(_LOCATION_DEVICE, device_index)
            )
            self.check(self.lib.cuMemAdvise_v2(ptr, nbytes, advice, loc), "cuMemAdvise")
        else:
            dev = _DEVICE_CPU if device_index is None else device_index
            self.check(self.lib.cuMemAdvise(ptr, nbytes, advice, dev), "cuMemAdvise")

    def prefetch(self, ptr: int, nbytes: int, device_index: int | None, stream: int) -> None:
        if self.v2:
            loc = (
                _CUmemLocation(_LOCATION_HOST, 0)
                if device_index is None
                else _CUmemLocation(_LOCATION_DEVICE, device_index)
            )
            self.check(self.lib.cuMemPrefetchAsync_v2(ptr, nbytes, loc, 0, stream), "cuMemPrefetchAsync")
        else:
            dev = _DEVICE_CPU if device_index is None else device_index
            self.check(self.lib.cuMemPrefetchAsync(ptr, nbytes, dev, stream), "cuMemPrefetchAsync")


_DRIVER: _Driver | None = None


def _driver() -> _Driver:
    global _DRIVER
    if _DRIVER is None:
        _DRIVER = _Driver()
    return _DRIVER


def _release(ptr: int, nbytes: int, device_index: int) -> None:
    drv = _driver()
    drv.ensure_context(device_index)
    # Kernels queued on any stream may still read the buffer; cuMemFree does not wait for them.
    drv.check(drv.lib.cuCtxSynchronize(), "cuCtxSynchronize")
    drv.check(drv.lib.cuMemFree_v2(ptr), "cuMemFree")
    LEDGER.add(device_index, -nbytes)


class _ManagedBuffer:
    """Owns one managed allocation; exposes it to torch through __cuda_array_interface__ (as bytes,
    since the interface has no bfloat16 type string)."""

    def __init__(self, nbytes: int, device_index: int) -> None:
        drv = _driver()
        drv.ensure_context(device_index)
        ptr = ctypes.c_uint64()
        drv.check(drv.lib.cuMemAllocManaged(ctypes.byref(ptr), max(nbytes, 1), _ATTACH_GLOBAL), "cuMemAllocManaged")
        self.ptr, self.nbytes = ptr.value, nbytes
        LEDGER.add(device_index, nbytes)
        self._finalizer = weakref.finalize(self, _release, self.ptr, nbytes, device_index)
        self._finalizer.atexit = False  # at interpreter exit the driver may already be torn down

    @property
    def __cuda_array_interface__(self) -> dict:
        return {
            "shape": (self.nbytes,),
            "typestr": "|u1",
            "data": (self.ptr, False),
            "version": 3,
            "strides": None,
            "stream": None,
        }


def _as_tensor(buffer: _ManagedBuffer, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(buffer, device=device)  # (nbytes,) uint8, zero-copy, keeps `buffer` alive


def _cuda_device(device: torch.device | str) -> torch.device:
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        raise UnifiedMemoryError(
            f"unified memory needs a CUDA GPU (device {device}, CUDA available: "
            f'{torch.cuda.is_available()}); set memory.unified_memory = "none"'
        )
    return torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())


def managed_empty(
    shape: tuple[int, ...] | torch.Size,
    dtype: torch.dtype,
    device: torch.device | str = "cuda",
    advise: Advise = "none",
    accessed_by_gpu: bool = False,
    *,
    coherent_memory: bool = False,
) -> torch.Tensor:
    """An uninitialised CUDA tensor in managed memory, after the guard (see module docstring).

    advise: preferred location of its pages ("gpu": migrate there and stay; "cpu": stay in host memory
    and be accessed remotely; "none": migrate on each fault). accessed_by_gpu: map the pages into the
    GPU's page table wherever they live, so GPU access does not fault.
    """
    device = _cuda_device(device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    free_bytes, total_bytes = torch.cuda.mem_get_info(device)
    check_managed_budget(nbytes, LEDGER.held(device.index), free_bytes, total_bytes, coherent_memory)
    buffer = _ManagedBuffer(nbytes, device.index)
    if advise != "none":
        _driver().advise(buffer.ptr, nbytes, _ADVISE_PREFERRED_LOCATION, device.index if advise == "gpu" else None)
    if accessed_by_gpu:
        _driver().advise(buffer.ptr, nbytes, _ADVISE_ACCESSED_BY, device.index)
    return _as_tensor(buffer, device).view(dtype).view(shape)


def managed_bytes(device: torch.device | str = "cuda") -> int:
    """Bytes of managed memory this process holds on `device` (what the guard counts)."""
    return LEDGER.held(_cuda_device(device).index)


def prefetch(tensor: torch.Tensor, to: Literal["gpu", "cpu"]) -> None:
    """Migrate a managed tensor's pages ahead of use, ordered on the current stream (no host sync)."""
    stream = torch.cuda.current_stream(tensor.device).cuda_stream
    nbytes = tensor.numel() * tensor.element_size()
    _driver().prefetch(tensor.data_ptr(), nbytes, tensor.device.index if to == "gpu" else None, stream)


def _to_managed(tensor: torch.Tensor, advise: Advise, coherent_memory: bool) -> torch.Tensor:
    managed = managed_empty(
        tensor.shape, tensor.dtype, tensor.device, advise, accessed_by_gpu=True, coherent_memory=coherent_memory
    )
    managed.copy_(tensor)
    return managed


@torch.no_grad()
def apply_unified_memory(
    target: nn.Module | torch.optim.Optimizer,
    which: Literal["model", "optimizer"],
    *,
    coherent_memory: bool = False,
    advise: Advise = "gpu",
) -> int:
    """Move a model's parameters (which="model") or an Adam/AdamW optimizer's moments
    (which="optimizer") into managed memory; returns the bytes moved.

    Apply it after loading a checkpoint: `Optimizer.load_state_dict` replaces state tensors.
    """
    if not torch.cuda.is_available():
        raise UnifiedMemoryError('unified memory needs a CUDA GPU; set memory.unified_memory = "none"')
    if which == "model" and isinstance(target, nn.Module):
        tensors = list(target.parameters())  # unique: a tied weight moves once
        return _swap_params(tensors, advise, coherent_memory)  # type: ignore[arg-type]  # Parameters are Tensors (list is invariant)
    if which == "optimizer" and isinstance(target, torch.optim.Optimizer):
        return _swap_optimizer_states(target, advise, coherent_memory)
    raise ValueError(f"apply_unified_memory: which={which!r} does not fit a {type(target).__name__}")


def _swap_params(params: list[torch.Tensor], advise: Advise, coherent_memory: bool) -> int:
    moved = 0
    for p in params:
        p.data = _to_managed(p.data, advise, coherent_memory)
        moved += p.numel() * p.element_size()
        torch.cuda.empty_cache()  # return the old block, so the next guard check sees it as free
    return moved


def _swap_optimizer_states(opt: torch.optim.Optimizer, advise: Advise, coherent_memory: bool) -> int:
    if not isinstance(opt, torch.optim.Adam | torch.optim.AdamW):
        raise ValueError(f"unified memory for optimizer states supports Adam/AdamW, not {type(opt).__name__}")
    moved = 0
    for group in opt.param_groups:
        for p in group["params"]:
            state = opt.state[p]
            if not state:
                # Adam creates its state lazily at the first step: create it now, directly managed.
                state.update(_adam_initial_state(p, group, advise, coherent_memory))
                moved += sum(_local(v).numel() * v.element_size() for k, v in state.items() if k != "step")
                continue
            for name, value in list(state.items()):
                if name != "step" and value.device.type == "cuda":
                    state[name] = _like(value, _to_managed(_local(value), advise, coherent_memory))
                    moved += _local(value).numel() * value.element_size()
            torch.cuda.empty_cache()  # as in _swap_params
    return moved


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (FSDP / DDP / TP parameters and their Adam moments); `t` otherwise."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _like(ref: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`local` (this rank's managed storage) as a tensor of the same kind as `ref`: a DTensor on ref's
    mesh and placements when ref is one, so the optimizer's update still sees DTensor states."""
    from torch.distributed.tensor import DTensor

    if not isinstance(ref, DTensor):
        return local
    return DTensor.from_local(
        local, ref.device_mesh, ref.placements, run_check=False, shape=ref.shape, stride=ref.stride()
    )


def _adam_initial_state(p: torch.Tensor, group: dict, advise: Advise, coherent_memory: bool) -> dict[str, torch.Tensor]:
    """What torch's Adam/AdamW `_init_group` creates before the first step, moments managed (DTensor
    moments for DTensor parameters: managed storage for this rank's shard)."""
    on_device = group.get("fused") or group.get("capturable")
    names = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if group.get("amsgrad") else [])
    local = _local(p)
    state = {
        name: _like(
            p,
            managed_empty(
                local.shape, local.dtype, local.device, advise, accessed_by_gpu=True, coherent_memory=coherent_memory
            ).zero_(),
        )
        for name in names
    }
    state["step"] = torch.zeros((), dtype=torch.float32, device=local.device) if on_device else torch.tensor(0.0)
    return state
