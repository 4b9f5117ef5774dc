"""The managed-memory guard and the model/optimizer swaps, on CPU: the driver allocation is replaced by
a fake that hands out CPU bytes and keeps the same ledger, and `mem_get_info` by fixed numbers. The
real cuMemAllocManaged path needs a GPU and is not exercised here."""

from __future__ import annotations

import gc
import re
import weakref

import pytest
import torch

import tracetrain.memory.unified as unified
from tracetrain.memory.unified import UnifiedMemoryError, apply_unified_memory, check_managed_budget, managed_empty
from tracetrain.models.build import materialize
from tracetrain.models.presets import get_preset

GIB = 2**30


class _FakeBuffer(bytearray):
    """Stands in for _ManagedBuffer: CPU bytes, same ledger bookkeeping and release on collection."""

    allocations: list[int] = []
    refs: list[weakref.ref] = []

    def __init__(self, nbytes: int, device_index: int) -> None:
        super().__init__(max(nbytes, 1))
        self.nbytes = nbytes
        unified.LEDGER.add(device_index, nbytes)
        _FakeBuffer.allocations.append(nbytes)
        _FakeBuffer.refs.append(weakref.ref(self))
        weakref.finalize(self, unified.LEDGER.add, device_index, -nbytes)

    @property
    def ptr(self) -> int:
        return _fake_as_tensor(self, torch.device("cpu")).data_ptr()


class _FakeDriver:
    def __init__(self) -> None:
        self.advice: list[tuple[int, int, int | None]] = []

    def advise(self, ptr: int, nbytes: int, advice: int, device_index: int | None) -> None:
        self.advice.append((nbytes, advice, device_index))


def _fake_as_tensor(buffer: _FakeBuffer, device: torch.device) -> torch.Tensor:
    # Like the real tensor, its storage holds a reference to the owner (and so the ledger entry).
    return torch.frombuffer(buffer, dtype=torch.uint8)[:buffer.nbytes]


@pytest.fixture
def fake_gpu(monkeypatch: pytest.MonkeyPatch):
    """A pretend 80 GiB GPU with `free` GiB free; returns a setter for the free memory."""
    free = {"bytes": 40 * GIB}
    monkeypatch.setattr(unified, "LEDGER", unified._Ledger())
    monkeypatch.setattr(unified, "_ManagedBuffer", _FakeBuffer)
    monkeypatch.setattr(unified, "_as_tensor", _fake_as_tensor)
    driver = _FakeDriver()
    monkeypatch.setattr(unified, "_driver", lambda: driver)
    monkeypatch.setattr(unified, "_cuda_device", lambda device: torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free["bytes"], 80 * GIB))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    _FakeBuffer.allocations, _FakeBuffer.refs = [], []

    def set_free(nbytes: int) -> _FakeDriver:
        free.update(bytes=nbytes)
        return driver
    return set_free


def test_budget_arithmetic():
    # Margin: max(2 GiB, 5% of 80 GiB = 4 GiB) = 4 GiB; limit = 40 - 4 = 36 GiB.
    check_managed_budget(6 * GIB, 30 * GIB, 40 * GIB, 80 * GIB, coherent_memory=False)
    with pytest.raises(UnifiedMemoryError, match=re.escape("memory.coherent_memory")):
        check_managed_budget(6 * GIB + 1, 30 * GIB, 40 * GIB, 80 * GIB, coherent_memory=False)
    # A small GPU gets the 2 GiB floor: 16 GiB free of 16 -> limit 14 GiB.
    check_managed_budget(14 * GIB, 0, 16 * GIB, 16 * GIB, coherent_memory=False)
    with pytest.raises(UnifiedMemoryError):
        check_managed_budget(14 * GIB + 1, 0, 16 * GIB, 16 * GIB, coherent_memory=False)
    # Coherent memory (GH200) may exceed the GPU's memory.
    check_managed_budget(500 * GIB, 100 * GIB, 40 * GIB, 96 * GIB, coherent_memory=True)


def test_guard_counts_earlier_allocations_and_refuses_before_allocating(fake_gpu):
    fake_gpu(4 * GIB + 3000)  # limit = free - 4 GiB margin = 3000 bytes
    a = managed_empty((500,), torch.float32, "cuda:0")              # 2000 bytes
    assert a.shape == (500,) and a.dtype == torch.float32
    with pytest.raises(UnifiedMemoryError, match="already managed"):
        managed_empty((300,), torch.float32, "cuda:0")              # 2000 + 1200 > 3000
    assert _FakeBuffer.allocations == [2000]                        # nothing was allocated
    b = managed_empty((250,), torch.bfloat16, "cuda:0")             # 2000 + 500 fits
    assert b.dtype == torch.bfloat16 and unified.LEDGER.held(0) == 2500
    del a
    gc.collect()
    assert unified.LEDGER.held(0) == 500                            # freed buffers leave the ledger
    c = managed_empty((600,), torch.float32, "cuda:0")  # 500 + 2400 fits again
    assert unified.LEDGER.held(0) == 2900 and b.numel() + c.numel() == 850


def test_advice_reaches_the_driver(fake_gpu):
    driver = fake_gpu(80 * GIB)
    managed_empty((4,), torch.float32, "cuda:0")
    assert driver.advice == []
    managed_empty((4,), torch.float32, "cuda:0", advise="cpu", accessed_by_gpu=True)
    managed_empty((8,), torch.float32, "cuda:0", advise="gpu")
    assert driver.advice == [(16, unified._ADVISE_PREFERRED_LOCATION, None), (16, unified._ADVISE_ACCESSED_BY, 0),
                             (32, unified._ADVISE_PREFERRED_LOCATION, 0)]


def test_coherent_memory_lifts_the_guard(fake_gpu):
    fake_gpu(0)
    with pytest.raises(UnifiedMemoryError):
        managed_empty((10,), torch.float32, "cuda:0")
    assert managed_empty((10,), torch.float32, "cuda:0", coherent_memory=True).numel() == 10


def _tiny_model() -> torch.nn.Module:
    args = get_preset("tiny")
    args.n_layers, args.tie_embeddings = 1, True
    return materialize(args, torch.device("cpu"), seed=0)


def test_model_parameters_move_into_managed_buffers(fake_gpu):
    model = _tiny_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    fake_gpu(4 * GIB + param_bytes)
    moved = apply_unified_memory(model, "model")
    assert moved == param_bytes == sum(_FakeBuffer.allocations)     # the tied weight moved once
    assert model.lm_head.weight is model.embed_tokens.weight
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name])
        assert any(p.untyped_storage().data_ptr() == t.data_ptr() for t in _live_fake_bytes())
    # A model one byte too large for the budget is refused, naming the config key.
    with pytest.raises(UnifiedMemoryError, match="coherent_memory"):
        apply_unified_memory(_tiny_model(), "model")


def _live_fake_bytes() -> list[torch.Tensor]:
    live = [r() for r in _FakeBuffer.refs]
    return [_fake_as_tensor(b, torch.device("cpu")) for b in live if b is not None]


def test_adamw_state_is_created_managed_and_used_by_the_step(fake_gpu):
    fake_gpu(80 * GIB)
    model = _tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    apply_unified_memory(opt, "optimizer")
    state = opt.state[model.embed_tokens.weight]
    ptr = state["exp_avg"].data_ptr()
    assert torch.count_nonzero(state["exp_avg"]) == 0 and float(state["step"]) == 0.0
    model(torch.zeros(1, 4, dtype=torch.long)).sum().backward()
    opt.step()
    assert state["exp_avg"].data_ptr() == ptr and torch.count_nonzero(state["exp_avg"]) > 0
    assert float(state["step"]) == 1.0
    with pytest.raises(ValueError, match="Adam"):
        apply_unified_memory(torch.optim.SGD(model.parameters(), lr=0.1), "optimizer")


def test_cpu_only_machine_gets_a_clear_error(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UnifiedMemoryError, match="needs a CUDA GPU"):
        apply_unified_memory(_tiny_model(), "model")
    with pytest.raises(UnifiedMemoryError, match="needs a CUDA GPU"):
        managed_empty((4,), torch.float32, "cuda")
