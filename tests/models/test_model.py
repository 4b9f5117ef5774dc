"""Model numerics against Hugging Face transformers, packing masks, and first-principles accounting."""

import pytest
import torch

from tracetrain.models.accounting import (
    attention_forward_flops,
    lora_params,
    num_matmul_params,
    num_params,
    training_flops_per_token,
)
from tracetrain.models.attention import document_causal_mask
from tracetrain.models.build import materialize
from tracetrain.models.families import transformer_class
from tracetrain.models.generate import generate
from tracetrain.models.llama import ModelArgs, Transformer
from tracetrain.models.presets import PRESETS, PUBLISHED_PARAMS

transformers = pytest.importorskip("transformers")

SCALING = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 32}


def _pair(scaling: dict, tie: bool, kv_heads: int = 2):
    args = ModelArgs(
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=kv_heads,
        ffn_dim=160,
        vocab_size=101,
        rope_theta=500000.0,
        rope_scaling=scaling,
        tie_embeddings=tie,
    )
    extra = {"rope_scaling": {"rope_type": "llama3", **scaling}} if scaling else {}
    hf_cfg = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        vocab_size=101,
        rope_theta=500000.0,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tie,
        **extra,
    )
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    ours = Transformer(args).eval()
    state = {k.removeprefix("model."): v for k, v in hf.state_dict().items()}
    result = ours.load_state_dict(state, strict=False)
    assert not result.missing_keys or (result.missing_keys == ["lm_head.weight"] and tie)
    return ours, hf


@pytest.mark.parametrize("scaling", [{}, SCALING], ids=["rope", "llama3-rope-scaling"])
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_logits_match_hf_llama(scaling, tie):
    ours, hf = _pair(scaling, tie)
    tokens = torch.randint(0, 101, (3, 96))  # longer than original_max_position_embeddings: scaling matters
    with torch.no_grad():
        diff = (ours(tokens) - hf(tokens).logits).abs().max().item()
    assert diff < 1e-4


def test_packed_rows_equal_separate_documents():
    """A packed row with a block-diagonal causal mask gives each document the logits it has alone."""
    torch.manual_seed(0)
    model = Transformer(ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=50)).eval()
    a, b = torch.randint(0, 50, (1, 7)), torch.randint(0, 50, (1, 5))
    packed = torch.cat([a, b], dim=1)
    pos = torch.cat([torch.arange(7), torch.arange(5)]).unsqueeze(0)
    doc = torch.tensor([[0] * 7 + [1] * 5])
    with torch.no_grad():
        together = model(packed, pos, doc)
        alone = torch.cat([model(a), model(b)], dim=1)
        leaky = model(packed)  # plain causal: document b sees a
    assert torch.allclose(together, alone, atol=1e-5)
    assert not torch.allclose(leaky[:, 7:], alone[:, 7:], atol=1e-3)


def test_document_mask_shape_and_blocks():
    m = document_causal_mask(torch.tensor([[0, 0, 1, 1, 1]]))[0, 0]
    assert m.shape == (5, 5)
    assert m[1, 0] and not m[0, 1] and not m[2, 1] and m[4, 2] and m[4, 4]


def test_kv_cache_generation_matches_full_recompute():
    torch.manual_seed(0)
    model = Transformer(ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=50)).eval()
    prompts = [[1, 2, 3, 4, 5], [7, 8]]
    out = generate(model, prompts, max_new_tokens=6, eos_id=49, pad_id=0)
    for prompt, new in zip(prompts, out):
        seq = list(prompt)
        for _ in range(len(new)):  # reference: no cache, no padding, recompute every token
            with torch.no_grad():
                seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
        assert seq[len(prompt) :] == new


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_counts_match_built_model_and_published(name):
    args = PRESETS[name]
    with torch.device("meta"):
        model = transformer_class(args)(args)  # Gemma / Phi presets build their own family's classes
    counted = sum(p.numel() for p in model.parameters())  # parameters() de-duplicates tied weights
    assert counted == num_params(args)
    if name in PUBLISHED_PARAMS:
        assert counted == PUBLISHED_PARAMS[name]


def test_matmul_params_and_flops_conventions():
    args = PRESETS["llama2-7b"]
    n = num_matmul_params(args)
    # Every linear layer's weight (embedding excluded, untied head included).
    with torch.device("meta"):
        model = Transformer(args)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert n == linear
    full = training_flops_per_token(args, 2048)
    assert full.model == pytest.approx(6 * n + 3 * 2 * 32 * 2048 * 4096)
    r = lora_params(args, 16, ["q_proj", "k_proj", "v_proj", "o_proj"])
    assert r == 32 * 4 * 16 * (4096 + 4096)
    lora = training_flops_per_token(args, 2048, mode="lora", num_lora_params=r, recompute="full")
    assert lora.model == pytest.approx(4 * n + 6 * r + 3 * attention_forward_flops(args, 2048))
    assert lora.hardware == pytest.approx(lora.model + 2 * n + 2 * r + attention_forward_flops(args, 2048))


def test_moe_active_matmul_params_match_the_built_experts():
    from tracetrain.models.moe import apply_moe

    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=128)
    model = Transformer(args)
    apply_moe(model, 8, 2)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))  # router included
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    # A token visits top_k of the 8 experts: it uses 2/8 of the expert weights, plus every other matmul.
    assert num_matmul_params(args, num_experts=8, top_k=2) == linear + experts * 2 // 8
    dense = training_flops_per_token(args, 32)
    moe = training_flops_per_token(args, 32, num_experts=8, top_k=2)
    # Per layer one more expert MLP (top_k = 2 instead of the dense MLP's one) and the router.
    assert moe.model - dense.model == pytest.approx(6 * 2 * (3 * 64 * 96 + 64 * 8))
    with pytest.raises(ValueError, match="top_k"):
        num_matmul_params(args, num_experts=2, top_k=3)


def test_materialize_on_target_device_is_seeded_and_tied():
    args = ModelArgs(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64, vocab_size=40, tie_embeddings=True)
    a, b = materialize(args, torch.device("cpu"), 3), materialize(args, torch.device("cpu"), 3)
    assert a.lm_head.weight is a.embed_tokens.weight
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert a.embed_tokens.weight.std().item() == pytest.approx(0.02, rel=0.3)
