"""KV-cache offload (same tokens as the in-GPU cache, window positions really served from the GPU copy)
and the generation accounting of the planner checked against real cache tensors."""

import pytest
import torch
from conftest import GEN_ARGS_KW

from tracetrain.models.accounting import kv_cache_bytes, kv_cache_bytes_per_token, num_matmul_params, num_params
from tracetrain.models.generate import GenerationRequest, forward_last, generate_batch, left_pad
from tracetrain.models.kv_cache import OffloadedKVCache, StaticKVCache, _ring_runs, carve_blocks
from tracetrain.models.llama import KVCache, ModelArgs
from tracetrain.models.presets import get_preset
from tracetrain.plan import plan_generation

CPU = torch.device("cpu")
ARGS = ModelArgs(**GEN_ARGS_KW)
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [15, 16, 17, 18, 19, 20], [21]]


pytestmark = pytest.mark.usefixtures("one_thread_torch")  # conftest: one torch thread for the module


@pytest.fixture(scope="module")
def model(gen_model):
    return gen_model


def reference_tokens(model, prompts, steps):
    """Greedy decoding on the model's own `llama.KVCache` (the in-GPU cache), written out by hand."""
    tokens, valid, positions = left_pad(prompts, 0, CPU)
    cache = KVCache(ARGS, len(prompts), tokens.shape[1] + steps, CPU, torch.float32)
    cache.valid[:, :tokens.shape[1]] = valid
    out = []
    with torch.no_grad():
        logits, pos = model(tokens, positions, cache=cache)[:, -1], positions[:, -1:] + 1
        for _ in range(steps):
            out.append(logits.argmax(-1))
            logits, pos = model(out[-1][:, None], pos, cache=cache)[:, -1], pos + 1
    return torch.stack(out, 1).tolist()


@pytest.mark.parametrize("window", [0, 1, 4, 11, 64], ids=lambda w: f"window{w}")
@pytest.mark.parametrize("chunk", [2048, 4], ids=["one-prefill", "chunked-prefill"])
def test_offloaded_greedy_tokens_equal_in_gpu_cache(model, window, chunk):
    expected = reference_tokens(model, PROMPTS, 12)
    requests = [GenerationRequest(p, 12) for p in PROMPTS]
    static = generate_batch(model, requests, -1, 0, prefill_chunk=chunk)
    offloaded = generate_batch(model, requests, -1, 0, kv_offload=True, gpu_window=window, prefill_chunk=chunk)
    assert [r.tokens for r in static] == expected
    assert [r.tokens for r in offloaded] == expected


def _prefilled(model, window):
    tokens, valid, positions = left_pad(PROMPTS, 0, CPU)
    cache = OffloadedKVCache(ARGS, len(PROMPTS), tokens.shape[1] + 4, CPU, torch.float32, gpu_window=window)
    cache.valid[:, :tokens.shape[1]] = valid
    with torch.no_grad():
        forward_last(model, tokens, positions, cache)
    return cache, positions[:, -1:] + 1


def _next_logits(model, cache, pos):
    with torch.no_grad():
        return forward_last(model, torch.full((len(PROMPTS), 1), 5), pos, cache)


def test_window_positions_come_from_the_gpu_and_older_ones_from_the_cpu_store(model):
    """Poison the CPU store: the window's positions must not be read from it, older ones must be."""
    clean = _next_logits(model, *_prefilled(model, window=4))
    cache, pos = _prefilled(model, window=4)
    for k, v in cache.store:
        k[-8:].fill_(float("nan"))  # positions 7..10 (the window) and the unwritten tail
        v[-8:].fill_(float("nan"))
    cache.fetch(0)  # layer 0 was fetched at the end of the prefill, before the poisoning
    assert torch.equal(_next_logits(model, cache, pos), clean)
    cache, pos = _prefilled(model, window=4)
    for k, _ in cache.store:
        k[6].fill_(float("nan"))  # the newest position outside the window
    cache.fetch(0)
    assert _next_logits(model, cache, pos).isnan().any()


def test_cpu_store_holds_every_position(model):
    """New K/V are written back, so the store equals the in-GPU cache (position-major) at every real token
    (padded positions differ: there a padded query attends to itself, see `causal_valid_mask`)."""
    cache, _ = _prefilled(model, window=4)
    tokens, valid, positions = left_pad(PROMPTS, 0, CPU)
    ref = KVCache(ARGS, len(PROMPTS), tokens.shape[1], CPU, torch.float32)
    ref.valid[:] = valid
    with torch.no_grad():
        model(tokens, positions, cache=ref)
    real = valid.T  # (positions, batch), the store's layout
    for (k, v), layer in zip(cache.store, ref.layers):
        assert torch.allclose(k[:real.shape[0]][real], layer.k.permute(2, 0, 1, 3)[real], atol=1e-6)
        assert torch.allclose(v[:real.shape[0]][real], layer.v.permute(2, 0, 1, 3)[real], atol=1e-6)


def test_ring_runs():
    assert _ring_runs(5, 9, 4) == [(5, 8, 1), (8, 9, 0)]
    assert _ring_runs(8, 12, 4) == [(8, 12, 0)]
    assert _ring_runs(3, 3, 4) == []


def _bytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_kv_accounting_matches_cache_tensors(dtype):
    dtype_bytes = torch.tensor([], dtype=dtype).element_size()
    batch, max_len, window = 3, 40, 8
    assert kv_cache_bytes_per_token(ARGS, dtype_bytes) == 2 * 3 * 2 * 16 * dtype_bytes
    expected = kv_cache_bytes(ARGS, batch, max_len, dtype_bytes)
    gpu = KVCache(ARGS, batch, max_len, CPU, dtype)
    static = StaticKVCache(ARGS, batch, max_len, CPU, dtype)
    assert _bytes(t for layer in gpu.layers for t in (layer.k, layer.v)) == expected
    assert _bytes(t for layer in static.layers for t in (layer.k, layer.v)) == expected
    off = OffloadedKVCache(ARGS, batch, max_len, CPU, dtype, gpu_window=window)
    p = plan_generation(ARGS, batch, max_len, dtype_bytes, "h100-sxm", offload=True, gpu_window=window)
    assert _bytes(t for pair in off.store for t in pair) == p.cpu_cache_bytes == expected
    assert _bytes(t for pair in off.staging + off.window for t in pair) == p.gpu_cache_bytes
    assert plan_generation(ARGS, batch, max_len, dtype_bytes).gpu_cache_bytes == expected


def test_plan_generation_decode_estimate():
    args = get_preset("llama3-8b")
    kv = kv_cache_bytes_per_token(args, 2)
    assert kv == 2 * 32 * 8 * 128 * 2  # 128 KiB per token
    gpu = plan_generation(args, 16, 4096, 2, "h100-sxm")
    assert gpu.weight_bytes == 2 * num_params(args) and gpu.cpu_cache_bytes == 0 and gpu.bound == "hbm"
    hbm = 2 * num_matmul_params(args) + 16 * 4096 * kv
    assert gpu.hbm_bytes_per_step == hbm
    assert gpu.decode_tokens_per_s == pytest.approx(16 / (hbm / 3.35e12))
    off = plan_generation(args, 16, 4096, 2, "h100-sxm", offload=True, gpu_window=1024)
    assert off.pcie_bytes_per_step == 16 * 3072 * kv and off.bound == "pcie"
    assert off.decode_tokens_per_s == pytest.approx(16 / (16 * 3072 * kv / 55e9))
    assert off.gpu_cache_bytes == 16 * 1024 * kv + 2 * 16 * 4096 * kv // 32
    big = plan_generation(get_preset("llama2-7b"), 16, 32768, 2, "h100-sxm")
    assert not big.fits and plan_generation(get_preset("llama2-7b"), 16, 32768, 2, "h100-sxm", offload=True).fits


@pytest.mark.parametrize("count,shape", [(64, (3000, 1, 8, 16)), (64, (4096, 1, 8, 16)), (6, (37, 3)), (1, (5,))])
def test_carve_blocks_are_powers_of_two_without_overlap(count, shape):
    blocks = []

    def alloc(nbytes):
        blocks.append(torch.empty(nbytes, dtype=torch.uint8))
        return blocks[-1]

    tensors = carve_blocks(count, shape, torch.bfloat16, alloc)
    assert len(tensors) == count and all(t.shape == shape and t.dtype == torch.bfloat16 for t in tensors)
    assert all(b.numel() & (b.numel() - 1) == 0 for b in blocks)  # what the pinned allocator would round to
    nbytes = tensors[0].numel() * 2
    assert sum(b.numel() for b in blocks) - count * nbytes < len(blocks) * nbytes  # < one tensor per block
    starts = sorted(t.data_ptr() for t in tensors)
    assert all(b - a >= nbytes for a, b in zip(starts, starts[1:]))
