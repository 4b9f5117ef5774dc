"""Prefill (#32): a whole unpadded prompt in one forward, attending to its own keys with plain causal
attention; chunks only where they are needed; the same tokens and logits either way. The compiled prefill
(models/prefill.py) generates the tokens the eager one does, for every model family, with one graph for
all prompt lengths, and runs eagerly, saying why, where it cannot."""

import shutil
import warnings

import pytest
import torch
from torch.nn.attention.bias import causal_lower_right

from tracetrain.kernels.apply import compiled_frame_count
from tracetrain.models import prefill as prefill_module
from tracetrain.models.attention import cached_attention, lower_right_causal_mask
from tracetrain.models.families import transformer_class
from tracetrain.models.generate import GenerationRequest, generate_batch, make_cache
from tracetrain.models.llama import ModelArgs
from tracetrain.models.prefill import (
    DEFAULT_PREFILL_CHUNK,
    PREFILL_CHUNK_MULTIPLE,
    PREFILL_FREE_FRACTION,
    PREFILL_RESERVE_BYTES,
    compiled_prefill_refusal,
    fitting_chunk,
    forward_last,
    prefill,
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


def test_a_prompt_hugging_face_prefills_whole_is_one_forward() -> None:
    """One H100 (79.2 GiB), llama2-7b, bf16, batch 1, 81,920 tokens: weights (12.6 GiB) and cache (40.0)
    leave about 26 GiB free; Hugging Face prefilled it in one forward (peak 60.4 GiB) and the eager chunk
    used 119 KB per token. Half of the free memory chunked it (75,776); the rule now takes it whole."""
    per_token = prefill_bytes_per_token(get_preset("llama2-7b"), 2)
    free = int(26.1 * 2**30)
    assert free // 2 // per_token < 81_920  # what the half-of-free rule did
    assert fitting_chunk(81_920, per_token, free) == 81_920
    # Short of memory: the largest multiple of 1,024 whose count fits the usable share, at least 1,024.
    free = 10 * 2**30
    chunk = fitting_chunk(81_920, per_token, free)
    assert chunk % PREFILL_CHUNK_MULTIPLE == 0 and chunk < 81_920
    usable = PREFILL_FREE_FRACTION * (free - PREFILL_RESERVE_BYTES)
    assert chunk * per_token <= usable < (chunk + PREFILL_CHUNK_MULTIPLE) * per_token
    assert fitting_chunk(81_920, per_token, 0) == PREFILL_CHUNK_MULTIPLE


def _prefilled(model, tokens: torch.Tensor, chunk: int, **kw) -> tuple[torch.Tensor, object]:
    """Last logits and the cache after prefilling (batch, s) `tokens` from position 0."""
    cache = make_cache(model, tokens.shape[0], tokens.shape[1] + 1, torch.float32, kv_offload=False, gpu_window=0)
    cache.set_prompt_mask(torch.ones_like(tokens, dtype=torch.bool))
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    with torch.no_grad():
        return prefill(model, tokens, positions, cache, chunk, **kw), cache


def _run_out_of_memory_when(block, too_big) -> object:
    """Make `block` raise CUDA's out-of-memory error (as a forward too large for the GPU does) whenever
    `too_big(x)` holds for its input x; the earlier blocks of that forward have written their K/V."""

    def hook(module, args):
        if too_big(args[0]):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB (injected)")

    return block.register_forward_pre_hook(hook)


# (first chunk, when block 1 runs out of memory, the lengths block 0 sees, the shrunk chunk)
OOM_CASES = {
    # the whole prompt fails: 5,000 -> chunks of 2,048 from position 0
    "whole prompt fails": (5000, lambda x, cache: x.shape[1] > 2500, [5000, 2048, 2048, 904], 2048),
    # the first 2,048-token chunk runs, the second fails: chunks of 1,024 from position 2,048
    "second chunk fails": (
        2048,
        lambda x, cache: cache.length >= 2048 and x.shape[1] > 1024,
        [2048, 2048, 1024, 1024, 904],
        1024,
    ),
}


@pytest.mark.parametrize("case", list(OOM_CASES))
def test_a_forward_out_of_memory_goes_on_in_smaller_chunks(gen_model, case: str) -> None:
    """A chunk sized from free memory that runs out of it all the same: the prompt goes on in chunks half as
    long from the first position not yet written (the failed forward's partial writes overwritten); the
    logits and every written key and value are those of a prefill that never failed."""
    first, too_big, lengths, shrunk = OOM_CASES[case]
    tokens = torch.randint(0, gen_model.args.vocab_size, (1, 5000), generator=torch.Generator().manual_seed(1))
    want_logits, want = _prefilled(gen_model, tokens, 5000)
    caches, seen = [], []
    handles = [
        gen_model.layers[0].register_forward_pre_hook(lambda m, a: seen.append(a[0].shape[1])),
        _run_out_of_memory_when(gen_model.layers[1], lambda x: too_big(x, caches[-1])),
    ]
    positions = torch.arange(5000).expand_as(tokens)
    try:
        results = []
        for shrink in (False, True):
            caches.append(make_cache(gen_model, 1, 5001, torch.float32, kv_offload=False, gpu_window=0))
            caches[-1].set_prompt_mask(torch.ones_like(tokens, dtype=torch.bool))
            seen.clear()
            with warnings.catch_warnings(record=True) as caught, torch.no_grad():
                warnings.simplefilter("always")
                try:
                    results.append(prefill(gen_model, tokens, positions, caches[-1], first, shrink_on_oom=shrink))
                except torch.OutOfMemoryError:
                    results.append(None)
    finally:
        for h in handles:
            h.remove()
    assert results[0] is None  # a chunk the caller asked for (shrink_on_oom off): the error stands
    assert seen == lengths
    (message,) = [str(w.message) for w in caught]
    assert message.endswith(f"ran out of GPU memory; the prompt goes on in chunks of {shrunk} tokens"), message
    cache = caches[-1]
    assert cache.length == 5000
    torch.testing.assert_close(results[1], want_logits)
    for got_layer, want_layer in zip(cache.layers, want.layers):
        torch.testing.assert_close(got_layer.k, want_layer.k)
        torch.testing.assert_close(got_layer.v, want_layer.v)


def test_out_of_memory_at_the_smallest_chunk_is_raised(gen_model) -> None:
    tokens = torch.randint(0, gen_model.args.vocab_size, (1, 3000), generator=torch.Generator().manual_seed(2))
    handle = _run_out_of_memory_when(gen_model.layers[0], lambda x: True)  # nothing fits
    try:
        with pytest.raises(torch.OutOfMemoryError), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _prefilled(gen_model, tokens, 3000, shrink_on_oom=True)
    finally:
        handle.remove()
    # 3,000 -> 1,024 (one warning), and 1,024 is the floor: raised there
    assert [str(w.message).split("chunks of ")[1] for w in caught] == [f"{PREFILL_CHUNK_MULTIPLE} tokens"]


def test_a_compiled_prefill_out_of_memory_goes_on_eagerly_in_chunks(gen_model, monkeypatch) -> None:
    """The compiled prefill writes the cache block by block and moves it only at the end: one that runs
    out of memory part-way leaves partial writes, which the eager chunks overwrite."""
    tokens = torch.randint(0, gen_model.args.vocab_size, (1, 3000), generator=torch.Generator().manual_seed(3))
    want_logits, want = _prefilled(gen_model, tokens, 3000)

    def compiled_that_fails(model, tokens, positions, cache):
        cache.layers[0].k.fill_(7.0)  # block 0 wrote, then block 1 ran out of memory
        raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    monkeypatch.setattr(prefill_module, "_compiled_prefill", compiled_that_fails)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        logits, cache = _prefilled(gen_model, tokens, 3000, mode="compiled", shrink_on_oom=True)
    assert [str(w.message) for w in caught] == [
        "the compiled prefill ran out of GPU memory; the prompt goes on in chunks of 1024 tokens"
    ]
    torch.testing.assert_close(logits, want_logits)
    torch.testing.assert_close(cache.layers[0].k[:, :, :3000], want.layers[0].k[:, :, :3000])
    with pytest.raises(torch.OutOfMemoryError):  # without shrink_on_oom the error stands
        _prefilled(gen_model, tokens, 3000, mode="compiled")


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
    torch.testing.assert_close(cached_attention(q, k, v, None), ref)  # None: the compiled prefill's own keys


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


needs_compiler = pytest.mark.skipif(
    shutil.which("g++") is None and shutil.which("cc") is None, reason="torch.compile on CPU needs a C++ compiler"
)
SAME_LENGTH = [[5, 9, 2, 7, 1, 3, 8, 4, 6, 2, 9, 4, 4], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9]]  # no padding


def _tokens(model, prompts, mode, **options) -> list[list[int]]:
    requests = [GenerationRequest(p, 8) for p in prompts]
    return [r.tokens for r in generate_batch(model, requests, NEVER, 0, prefill_mode=mode, **options)]


def _compiled_tokens(model, prompts) -> list[list[int]]:
    """Greedy tokens through the compiled prefill, which must not fall back to eager (a warning would say so)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="prefill = 'compiled' runs eagerly")
        return _tokens(model, prompts, "compiled")


@needs_compiler
def test_compiled_prefill_generates_the_eager_tokens_with_one_graph_per_batch_shape(gen_model) -> None:
    eager = _tokens(gen_model, SAME_LENGTH, "eager")
    before = compiled_frame_count()
    assert _compiled_tokens(gen_model, SAME_LENGTH) == eager
    assert compiled_frame_count() == before + 1  # every block shares one graph (parameters are inputs)
    shorter = [p[:7] for p in SAME_LENGTH]
    assert _compiled_tokens(gen_model, shorter) == _tokens(gen_model, shorter, "eager")
    assert compiled_frame_count() == before + 1  # another prompt length: the same graph (dynamic length)
    assert _compiled_tokens(gen_model, SAME_LENGTH[:1]) == [eager[0]]  # batch 1: its own graph
    assert compiled_frame_count() == before + 2
    tokens = torch.tensor(SAME_LENGTH)
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    logits = []
    for mode in ("eager", "compiled"):
        cache = make_cache(gen_model, 2, 32, torch.float32, kv_offload=False, gpu_window=0)
        cache.set_prompt_mask(torch.ones_like(tokens, dtype=torch.bool))
        with torch.no_grad():
            logits.append(prefill(gen_model, tokens, positions, cache, tokens.shape[1], mode))
        assert cache.length == tokens.shape[1]
        if mode == "eager":
            written = [(layer.k.clone(), layer.v.clone()) for layer in cache.layers]
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)
    for (k, v), layer in zip(written, cache.layers):  # the compiled prefill wrote the same keys and values
        torch.testing.assert_close(layer.k, k, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(layer.v, v, rtol=1e-5, atol=1e-5)


BASE = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=97, init_std=0.3)
FAMILIES = {
    "qwen3": dict(qk_norm=True, head_dim_override=24),
    "qwen2": dict(qkv_bias=True),
    "mistral": dict(sliding_window=5),  # shorter than the prompts: a dense windowed mask in the graph
    "moe": dict(num_experts=4, experts_top_k=2, dense_layers=(0,)),  # block 1 compiles its attention half
    "gemma2": dict(
        family="gemma2",
        head_dim_override=32,
        query_pre_attn_scalar=24,
        attn_logit_softcap=50.0,
        final_logit_softcap=30.0,
        local_window=6,
        layer_types=("sliding", "full"),
    ),
    "gemma3": dict(
        family="gemma3",
        qk_norm=True,
        local_window=6,
        layer_types=("sliding", "full"),
        rope_local_theta=10000.0,
        rope_theta=1e6,
        rope_linear_factor=8.0,
    ),
    "phi3": dict(
        family="phi3",
        partial_rotary_factor=0.5,
        rope_short_factor=(1.0, 1.5, 2.0, 2.5),
        rope_long_factor=(3.0, 4.0, 5.0, 6.0),
        rope_original_max_len=8,  # the prompts are longer: the long factors
        rope_attention_factor=1.2,
    ),
}


def test_last_position_logits_are_the_models_own_for_every_family() -> None:
    # Generation samples from forward_last's logits: Gemma 2 soft-caps its logits (cap 30 here, which
    # init_std 0.3 exceeds), and a head without the cap would sample from other probabilities.
    for family, extra in FAMILIES.items():
        args = ModelArgs(**BASE, **extra)
        torch.manual_seed(0)
        model = transformer_class(args)(args)
        model.init_weights()
        model.eval()
        tokens = torch.randint(0, args.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            full = model(tokens)[:, -1]
            cache = make_cache(model, 2, 16, torch.float32, kv_offload=False, gpu_window=0)
            last = forward_last(model, tokens, torch.arange(9).expand(2, 9), cache)
        torch.testing.assert_close(last, full, rtol=1e-5, atol=1e-5, msg=family)
        if args.final_logit_softcap:
            assert full.abs().max() < args.final_logit_softcap


@needs_compiler
@pytest.mark.parametrize("family", list(FAMILIES))
def test_compiled_prefill_matches_eager_for_every_family(family: str) -> None:
    args = ModelArgs(**BASE, **FAMILIES[family])
    torch.manual_seed(0)
    model = transformer_class(args)(args)
    model.init_weights()
    model.eval()
    assert _compiled_tokens(model, SAME_LENGTH) == _tokens(model, SAME_LENGTH, "eager")


@needs_compiler
def test_compiled_prefill_of_a_lora_run_with_compiled_blocks() -> None:
    # As `tracetrain generate` loads a run on CUDA: adapters unmerged, blocks compiled (their KV-cache path
    # eager, which the compiled prefill traces).
    from tracetrain.config import load_config
    from tracetrain.kernels.apply import is_compiled
    from tracetrain.train.assemble import build_model

    cfg = load_config(None, ["--train.mode=lora", "--train.compile=on", "--model.n_layers=2"])
    model = build_model(cfg, torch.device("cpu")).eval()
    assert all(is_compiled(block) for block in model.layers)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.5)  # adapters that change the output (B starts at zero)
    prompts = [[t % model.args.vocab_size for t in p] for p in SAME_LENGTH]
    assert _compiled_tokens(model, prompts) == _tokens(model, prompts, "eager")


@needs_compiler
def test_compiled_prefill_is_private_to_each_model() -> None:
    # Dynamo's recompile limit counts per code object: a second model of other widths gets code of its own,
    # so with the limit at 1 it still compiles (a shared function would hit the limit and fail, fullgraph).
    with torch._dynamo.config.patch(recompile_limit=1):
        for dim in (64, 48):
            args = ModelArgs(**{**BASE, "dim": dim})
            torch.manual_seed(0)
            model = transformer_class(args)(args).eval()
            model.init_weights()
            assert len(_compiled_tokens(model, SAME_LENGTH)[0]) == 8


def test_compiled_prefill_runs_eagerly_where_it_cannot_and_says_why(gen_model) -> None:
    padded = [SAME_LENGTH[0], SAME_LENGTH[1][:9]]
    with pytest.warns(UserWarning, match="left-padded rows"):
        assert _tokens(gen_model, padded, "compiled") == _tokens(gen_model, padded, "eager")
    with pytest.warns(UserWarning, match="offloaded cache"):
        assert _tokens(gen_model, SAME_LENGTH, "compiled", kv_offload=True) == _tokens(gen_model, SAME_LENGTH, "eager")
    with pytest.warns(UserWarning, match="chunks of 4 tokens"):
        assert _tokens(gen_model, SAME_LENGTH, "compiled", prefill_chunk=4) == _tokens(gen_model, SAME_LENGTH, "eager")
    cache = make_cache(gen_model, 2, 32, torch.float32, kv_offload=False, gpu_window=0)
    cache.set_prompt_mask(torch.ones(2, 13, dtype=torch.bool))
    assert compiled_prefill_refusal(gen_model, cache, 13, 13) is None
    handle = gen_model.layers[1].register_forward_pre_hook(lambda module, args: None)
    assert "forward hooks" in compiled_prefill_refusal(gen_model, cache, 13, 13)
    handle.remove()
    cache.advance(3)
    assert "already holds positions" in compiled_prefill_refusal(gen_model, cache, 13, 13)
    with pytest.raises(ValueError, match="prefill mode 'jit' is not allowed; must be one of eager, compiled"):
        _tokens(gen_model, SAME_LENGTH, "jit")


def test_tiled_blocks_refuse_the_compiled_prefill() -> None:
    from tracetrain.config import load_config
    from tracetrain.train.assemble import build_model

    model = build_model(load_config(None, ["--memory.tiled_mlp=on", "--model.n_layers=2"]), torch.device("cpu"))
    cache = make_cache(model, 1, 32, torch.float32, kv_offload=False, gpu_window=0)
    cache.set_prompt_mask(torch.ones(1, 13, dtype=torch.bool))
    assert "tiled feed-forward blocks" in compiled_prefill_refusal(model, cache, 13, 13)
