"""Attention backends (tracetrain/models/attention.py): the document-causal BlockMask builder against
FlexAttention's own `create_block_mask`, FlexAttention against SDPA with the dense mask, and the
`apply_attention` transform on the model (packed, unpacked and KV-cache paths).

On CPU, torch 2.13 runs FlexAttention's forward only (eagerly); its backward and speed are checked on
the GPU by benchmarks/speed.py --attention and by the flex training variants there.
"""

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

from tracetrain.models.attention import (
    FlexCore,
    apply_attention,
    document_causal_block_mask,
    document_causal_mask,
    resolve_attention,
    sdpa_attention,
)
from tracetrain.models.llama import KVCache, ModelArgs, Transformer


def _packed_ids(batch: int, seq: int, seed: int = 0) -> torch.Tensor:
    """Increasing document ids per row, as packing makes them, with a padding (-1) tail on row 0."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.rand(batch, seq, generator=g) < 4 / seq
    starts[:, 0] = True
    doc = starts.long().cumsum(1) - 1
    doc[0, -seq // 5:] = -1
    return doc


def _reference_block_mask(doc: torch.Tensor):
    batch, seq = doc.shape
    return create_block_mask(lambda b, h, q, kv: (doc[b, q] == doc[b, kv]) & (q >= kv),
                             batch, None, seq, seq, device="cpu")


@pytest.mark.parametrize("ids", ["packed", "unordered"])
def test_block_mask_equals_create_block_mask(ids):
    doc = _packed_ids(3, 512) if ids == "packed" else torch.randint(0, 3, (2, 512))
    fast, ref = document_causal_block_mask(doc), _reference_block_mask(doc)
    assert torch.equal(fast.to_dense(), ref.to_dense())  # which tiles run at all
    # which tiles run without the mask function, and the transposed (backward) indices
    for name in ("kv_num_blocks", "full_kv_num_blocks", "q_num_blocks", "full_q_num_blocks"):
        assert torch.equal(getattr(fast, name), getattr(ref, name)), name
    if ids == "packed":
        assert fast.sparsity() > 50  # several documents per row: most tiles are skipped


def test_block_mask_needs_whole_tiles():
    with pytest.raises(ValueError, match="multiple of the attention block size"):
        document_causal_block_mask(torch.zeros(1, 200, dtype=torch.long))


def test_flex_forward_matches_sdpa_with_the_dense_mask():
    torch.manual_seed(0)
    doc = _packed_ids(2, 256)
    q = torch.randn(2, 4, 256, 16)
    k, v = torch.randn(2, 2, 256, 16), torch.randn(2, 2, 256, 16)  # grouped-query attention
    with torch.no_grad():
        out = FlexCore()(q, k, v, document_causal_block_mask(doc))
    ref = sdpa_attention(q, k, v, document_causal_mask(doc))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_flex_backward_on_cpu_or_skip():
    q, k, v = (torch.randn(1, 2, 128, 16, requires_grad=True) for _ in range(3))
    doc = _packed_ids(1, 128)
    try:
        FlexCore()(q, k, v, document_causal_block_mask(doc)).sum().backward()
    except NotImplementedError as e:  # torch 2.13 on CPU; the GPU script checks the backward
        pytest.skip(f"FlexAttention backward is not available on CPU in this torch: {e}")
    flex_grad = q.grad.clone()
    q.grad = None
    sdpa_attention(q, k, v, document_causal_mask(doc)).sum().backward()
    torch.testing.assert_close(flex_grad, q.grad, rtol=1e-4, atol=1e-5)


def _model() -> Transformer:
    torch.manual_seed(0)
    model = Transformer(ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=50))
    model.init_weights()
    return model.eval()


def test_apply_attention_on_the_model():
    model, doc = _model(), _packed_ids(2, 128)
    tokens = torch.randint(0, 50, (2, 128))
    keys = list(model.state_dict())
    with torch.no_grad():
        packed_ref, unpacked_ref = model(tokens, document_ids=doc), model(tokens)
        apply_attention(model, "flex")
        assert list(model.state_dict()) == keys  # no parameters added or renamed
        assert all(isinstance(b.self_attn.attn_core, FlexCore) for b in model.layers)
        torch.testing.assert_close(model(tokens, document_ids=doc), packed_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(model(tokens), unpacked_ref, rtol=0, atol=0)  # no docs: SDPA causal
        # Generation: the KV cache builds a dense mask, which the flex core hands to SDPA.
        cache = KVCache(model.args, 2, 128, torch.device("cpu"), torch.float32)
        prefix = model(tokens[:, :100], cache=cache)
        step = model(tokens[:, 100:101], cache=cache)
        torch.testing.assert_close(prefix, unpacked_ref[:, :100], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(step[:, 0], unpacked_ref[:, 100], rtol=1e-5, atol=1e-5)
        apply_attention(model, "sdpa")
        torch.testing.assert_close(model(tokens, document_ids=doc), packed_ref, rtol=0, atol=0)
    with pytest.raises(ValueError, match="resolve 'auto' first"):
        apply_attention(model, "auto")


def test_resolve_attention():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert resolve_attention("auto", cuda, packed=True) == "flex"
    assert resolve_attention("auto", cuda, packed=False) == "sdpa"
    assert resolve_attention("auto", cpu, packed=True) == "sdpa"
    assert resolve_attention("flex", cpu, packed=False) == "flex"
    with pytest.raises(ValueError, match="not one of"):
        resolve_attention("flash", cuda, packed=True)


def test_flex_needs_whole_tiles():
    """Packed rows of a length FlexAttention cannot tile (e.g. data.seq_len = 32 on a GPU) fall back to SDPA
    under 'auto'; an explicit 'flex' is a one-line config error, not a ValueError from inside the step."""
    from tracetrain.errors import ConfigError
    cuda = torch.device("cuda")
    assert resolve_attention("auto", cuda, packed=True, seq_len=256) == "flex"
    assert resolve_attention("auto", cuda, packed=True, seq_len=32) == "sdpa"
    with pytest.raises(ConfigError, match=r"'train.attention': 'flex' needs data.seq_len to be a multiple of 128 "
                                          r"\(got 200\)"):
        resolve_attention("flex", cuda, packed=True, seq_len=200)
