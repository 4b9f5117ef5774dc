"""A prefill forward's last block runs its attention, output projection and MLP for the last position only
(models/prefill.py `last_position_block`), while every position's keys and values still reach the cache:
for every model family, padded rows, windowed masks, a prompt in chunks, the offloaded cache and the
compiled prefill, the logits, the cache and the next decode step's logits are those of the whole block."""

from __future__ import annotations

import pytest
import torch
from test_prefill import BASE, FAMILIES, needs_compiler

from tracetrain.models import prefill as prefill_module
from tracetrain.models.families import transformer_class
from tracetrain.models.generate import make_cache
from tracetrain.models.llama import ModelArgs
from tracetrain.models.prefill import forward_last, last_position_refusal, prefill

pytestmark = pytest.mark.usefixtures("one_thread_torch")  # conftest: one torch thread for the module

PROMPT = 13
FAMILY_ARGS = {"llama": {}, **FAMILIES}


def _model(family: str) -> torch.nn.Module:
    args = ModelArgs(**BASE, **FAMILY_ARGS[family])
    torch.manual_seed(0)
    model = transformer_class(args)(args)
    model.init_weights()
    return model.eval()


def _run(
    model,
    tokens: torch.Tensor,
    valid: torch.Tensor,
    chunk: int,
    *,
    whole: bool,
    offload: bool = False,
    mode: str = "eager",
):
    """Prefill then one decode step; (prefill logits, decode logits, cache, tokens the last block's MLP saw)."""
    seen: list[int] = []
    last = model.layers[-1]
    mlp = last.mlp
    handle = mlp.register_forward_pre_hook(lambda m, a: seen.append(a[0].shape[1]))
    cache = make_cache(model, tokens.shape[0], 32, torch.float32, kv_offload=offload, gpu_window=0)
    cache.set_prompt_mask(valid)
    positions = (valid.long().cumsum(1) - 1).clamp(min=0)  # left padding: real tokens from position 0
    refusal = prefill_module.last_position_refusal
    try:
        if whole:  # the whole block at every position, as before last_position_block
            prefill_module.last_position_refusal = lambda model: "off for the comparison"
        with torch.no_grad():
            logits = prefill(model, tokens, positions, cache, chunk, mode)  # type: ignore[arg-type]
            step = forward_last(model, logits.argmax(-1, keepdim=True), positions[:, -1:] + 1, cache)
    finally:
        prefill_module.last_position_refusal = refusal
        handle.remove()
    return logits, step, cache, seen


def _assert_same(model, tokens, valid, chunk, **kw) -> list[int]:
    got_logits, got_step, got, seen = _run(model, tokens, valid, chunk, whole=False, **kw)
    want_logits, want_step, want, whole_seen = _run(model, tokens, valid, chunk, whole=True, **kw)
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_step, want_step, rtol=1e-5, atol=1e-5)
    assert got.length == want.length == tokens.shape[1] + 1
    if hasattr(got.layers[0], "k"):  # the in-GPU cache: every written key and value
        for g, w in zip(got.layers, want.layers):
            if kw.get("mode", "eager") == "eager":  # the same ops on the same input: bit for bit
                assert torch.equal(g.k, w.k) and torch.equal(g.v, w.v)
            else:  # the last block's keys eager here, compiled there (Inductor's fused RoPE)
                torch.testing.assert_close(g.k, w.k, rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(g.v, w.v, rtol=1e-5, atol=1e-5)
    if kw.get("mode", "eager") == "eager":  # (a compiled block's module hooks fire while it is traced)
        assert sum(whole_seen) > sum(seen)  # the whole block's MLP saw every position
    return seen


@pytest.mark.parametrize("family", list(FAMILY_ARGS))
def test_the_last_block_runs_one_position_for_every_family(family: str) -> None:
    model = _model(family)
    assert last_position_refusal(model) is None
    tokens = torch.randint(0, model.args.vocab_size, (2, PROMPT), generator=torch.Generator().manual_seed(1))
    valid = torch.ones_like(tokens, dtype=torch.bool)
    seen = _assert_same(model, tokens, valid, PROMPT)
    # The MLP of the last block: one position at the prefill, one at the decode step (an MoE block's
    # experts take their tokens through the same module).
    assert seen == [1, 1], seen


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma2"])
def test_padded_rows_and_chunks(family: str) -> None:
    """Left-padded rows (a dense mask, its last row taken), a sliding window shorter than the prompt, and a
    prompt in chunks (the second attends to the first's keys through a lower-right CausalBias)."""
    model = _model(family)
    tokens = torch.randint(0, model.args.vocab_size, (2, PROMPT), generator=torch.Generator().manual_seed(2))
    padded = torch.ones_like(tokens, dtype=torch.bool)
    padded[1, :4] = False
    assert _assert_same(model, tokens, padded, PROMPT) == [1, 1]
    unpadded = torch.ones_like(tokens, dtype=torch.bool)
    assert _assert_same(model, tokens, unpadded, 5) == [1, 1, 1, 1]  # chunks of 5, 5, 3, then the decode step


def test_offloaded_cache() -> None:
    model = _model("llama")
    tokens = torch.randint(0, model.args.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(3))
    assert _assert_same(model, tokens, torch.ones_like(tokens, dtype=torch.bool), 6, offload=True) == [1, 1, 1, 1]


def test_a_block_with_hooks_runs_whole() -> None:
    """Forward hooks on the last block (FP8's re-quantisation) would be skipped by its halves: it runs whole."""
    model = _model("llama")
    handle = model.layers[-1].register_forward_pre_hook(lambda m, a: None)
    try:
        assert "hooks" in (last_position_refusal(model) or "")
        tokens = torch.randint(0, model.args.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(4))
        _, _, _, seen = _run(model, tokens, torch.ones_like(tokens, dtype=torch.bool), PROMPT, whole=False)
        assert seen == [PROMPT, 1]
    finally:
        handle.remove()


@needs_compiler
@pytest.mark.parametrize("family", ["llama", "moe"])
def test_compiled_prefill_runs_the_last_block_at_one_position(family: str) -> None:
    """The compiled prefill runs the blocks before the last compiled and the last one eagerly, as above."""
    model = _model(family)
    tokens = torch.randint(0, model.args.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(5))
    assert _assert_same(model, tokens, torch.ones_like(tokens, dtype=torch.bool), PROMPT, mode="compiled") == [1, 1]
