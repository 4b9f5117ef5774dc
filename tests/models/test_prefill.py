"""Prefill (#32): a whole unpadded prompt in one forward, attending to its own keys with plain causal
attention; chunks only where they are needed; the same tokens and logits either way."""

import pytest
import torch
from torch.nn.attention.bias import causal_lower_right

from tracetrain.models.attention import cached_attention, lower_right_causal_mask
from tracetrain.models.generate import (
    DEFAULT_PREFILL_CHUNK,
    GenerationRequest,
    forward_last,
    generate_batch,
    make_cache,
    prefill_bytes_per_token,
    prefill_chunk_tokens,
)
from tracetrain.models.presets import get_preset

pytestmark = pytest.mark.usefixtures("one_thread_torch")  # conftest: one torch thread for the module
NEVER = -1


def test_chunk_rules(gen_model) -> None:
    cache = make_cache(gen_model, 2, 64, torch.float32, kv_offload=False, gpu_window=0)
    cache.set_prompt_mask(torch.ones(2, 40, dtype=torch.bool))
    assert prefill_chunk_tokens(gen_model, 2, 40, cache, torch.float32, None) == 40  # whole prompt
    assert prefill_chunk_tokens(gen_model, 2, 40, cache, torch.float32, 8) == 8  # as asked
    cache.set_prompt_mask(torch.tensor([[True] * 40, [False] * 3 + [True] * 37]))
    assert prefill_chunk_tokens(gen_model, 2, 40, cache, torch.float32, None) == DEFAULT_PREFILL_CHUNK  # padded
    offloaded = make_cache(gen_model, 1, 64, torch.float32, kv_offload=True, gpu_window=0)
    offloaded.set_prompt_mask(torch.ones(1, 40, dtype=torch.bool))
    assert prefill_chunk_tokens(gen_model, 1, 40, offloaded, torch.float32, None) == DEFAULT_PREFILL_CHUNK
    # Llama 3 8B in bf16: the MLP's three (f,) tensors dominate, ~135 KiB per token.
    assert 120_000 < prefill_bytes_per_token(get_preset("llama3-8b"), 2) < 160_000


def test_prompt_from_start_attends_to_its_own_keys(gen_model) -> None:
    cache = make_cache(gen_model, 1, 32, torch.float32, kv_offload=False, gpu_window=0)
    layer = cache.layers[0]
    kv_heads, head_dim = layer.k.shape[1], layer.k.shape[3]
    k, v = torch.randn(2, 1, kv_heads, 10, head_dim).unbind(0)
    got_k, got_v = layer.update(k, v)
    assert got_k is k and got_v is v  # nothing read back
    assert torch.equal(layer.k[:, :, :10], k) and torch.equal(layer.v[:, :, :10], v)  # but written
    cache.advance(10)
    k2, v2 = torch.randn(2, 1, kv_heads, 3, head_dim).unbind(0)
    all_k, _ = layer.update(k2, v2)
    assert torch.equal(all_k, torch.cat([k, k2], dim=2))


@pytest.mark.parametrize("gqa", [False, True])
def test_square_causal_bias_is_plain_causal(gqa: bool) -> None:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 12, 8, generator=g)
    k, v = torch.randn(2, 1, 2 if gqa else 4, 12, 8, generator=g).unbind(0)
    got = cached_attention(q, k, v, causal_lower_right(12, 12))
    ref = cached_attention(q, k, v, lower_right_causal_mask(12, 12, q.device).expand(1, 1, 12, 12).clone())
    torch.testing.assert_close(got, ref)


def test_whole_prompt_equals_chunked(gen_model) -> None:
    """Default (one forward) against 3-token chunks: the same greedy tokens and last logits."""
    prompts = [[5, 9, 2, 7, 1, 3, 8, 4, 6, 2, 9], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]]  # equal lengths: no padding
    whole = generate_batch(gen_model, [GenerationRequest(p, 8) for p in prompts], NEVER, 0)
    chunked = generate_batch(gen_model, [GenerationRequest(p, 8) for p in prompts], NEVER, 0, prefill_chunk=3)
    assert [r.tokens for r in whole] == [r.tokens for r in chunked]
    tokens = torch.tensor(prompts)
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    logits = []
    for chunk in (tokens.shape[1], 3):
        cache = make_cache(gen_model, 2, 32, torch.float32, kv_offload=False, gpu_window=0)
        cache.set_prompt_mask(torch.ones_like(tokens, dtype=torch.bool))
        with torch.no_grad():
            for a in range(0, tokens.shape[1], chunk):
                out = forward_last(gen_model, tokens[:, a : a + chunk], positions[:, a : a + chunk], cache)
        logits.append(out)
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        full = gen_model(tokens)[:, -1]
    torch.testing.assert_close(logits[0], full, rtol=1e-5, atol=1e-5)
