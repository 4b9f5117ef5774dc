"""LoRA transform: merged == unmerged, only adapters train, the count matches the accounting formula, and
adapters round-trip through PEFT (peft and transformers are the reference)."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest
import torch

from tracetrain.errors import CheckpointError
from tracetrain.models.accounting import lora_params
from tracetrain.models.export import export_hf, export_peft_adapter
from tracetrain.models.hf import load_hf_config, load_hf_weights, load_peft_adapter
from tracetrain.models.llama import ModelArgs, Transformer
from tracetrain.models.lora import (
    LoRALinear,
    apply_lora,
    load_lora_state_dict,
    lora_state_dict,
    merge_lora,
    trainable_parameters,
)

try:  # the PEFT tests compare against the reference libraries (the `dev` extra)
    import peft
    import transformers
except ImportError:
    peft = transformers = None
needs_peft = pytest.mark.skipif(peft is None, reason="PEFT interop tests need peft and transformers")

ARGS = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=100, qkv_bias=True)
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]


def tiny_model(args: ModelArgs = ARGS, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(args)
    model.init_weights()
    return model


def randomize_adapters(model: torch.nn.Module, seed: int = 1) -> None:
    """B starts at zero (the update is 0); random B makes the adapters change the output."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LoRALinear):
                m.lora_B.weight.copy_(torch.randn(m.lora_B.weight.shape, generator=g) * 0.05)


def tokens(seq: int = 24) -> torch.Tensor:
    return torch.randint(0, 100, (2, seq), generator=torch.Generator().manual_seed(2))


@pytest.mark.parametrize("targets", [ATTN, ["all-linear"], ["v_proj", "down_proj"]])
def test_trainable_count_matches_accounting(targets: list[str]) -> None:
    model = tiny_model()
    count = apply_lora(model, rank=4, alpha=8.0, dropout=0.0, targets=targets, base_dtype=None)
    assert count == lora_params(ARGS, 4, targets)
    assert count == sum(p.numel() for p in trainable_parameters(model).values())
    assert all(".lora_A." in n or ".lora_B." in n for n in trainable_parameters(model))


def test_state_dict_names() -> None:
    model = tiny_model()
    apply_lora(model, rank=4, alpha=8.0, dropout=0.0, targets=["q_proj"], base_dtype=None)
    keys = set(model.state_dict())
    for suffix in ("base.weight", "base.bias", "lora_A.weight", "lora_B.weight"):
        assert f"layers.1.self_attn.q_proj.{suffix}" in keys
    assert "layers.1.self_attn.k_proj.weight" in keys and "lm_head.weight" in keys


def test_fresh_adapters_do_not_change_output() -> None:
    model = tiny_model()
    with torch.no_grad():
        before = model(tokens())
    apply_lora(model, rank=4, alpha=8.0, dropout=0.0, targets=["all-linear"], base_dtype=None)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens()), before, atol=0, rtol=0)


def test_merge_equals_unmerged() -> None:
    model = tiny_model()
    apply_lora(model, rank=4, alpha=16.0, dropout=0.0, targets=["all-linear"], base_dtype=None)
    randomize_adapters(model)
    with torch.no_grad():
        unmerged = model(tokens())
        base_only = tiny_model()(tokens())
    merge_lora(model)
    assert not any(isinstance(m, LoRALinear) for m in model.modules())
    assert set(model.state_dict()) == set(tiny_model().state_dict())  # original names are back
    with torch.no_grad():
        merged = model(tokens())
    torch.testing.assert_close(merged, unmerged, atol=1e-5, rtol=0)
    assert not torch.allclose(merged, base_only, atol=1e-3)  # the adapters really did something


def test_backward_reaches_only_adapters() -> None:
    model = tiny_model()
    apply_lora(model, rank=4, alpha=8.0, dropout=0.1, targets=ATTN, base_dtype=None)
    randomize_adapters(model)
    model.train()
    model(tokens()).float().logsumexp(-1).mean().backward()
    with_grad = {n for n, p in model.named_parameters() if p.grad is not None}
    assert with_grad == set(trainable_parameters(model))
    assert len(with_grad) == 2 * len(ATTN) * ARGS.n_layers
    assert all(model.get_parameter(n).grad.abs().sum() > 0 for n in with_grad)


def test_dropout_only_on_adapter_input_and_only_in_training() -> None:
    model = tiny_model()
    with torch.no_grad():
        base_out = model(tokens())
    apply_lora(model, rank=4, alpha=8.0, dropout=0.5, targets=ATTN, base_dtype=None)
    model.train()
    with torch.no_grad():
        # B = 0: whatever dropout does to the adapter input, the base path is untouched.
        torch.testing.assert_close(model(tokens()), base_out, atol=0, rtol=0)
        randomize_adapters(model)
        assert not torch.allclose(model(tokens()), model(tokens()))  # fresh dropout masks
        model.eval()
        torch.testing.assert_close(model(tokens()), model(tokens()), atol=0, rtol=0)


def test_bf16_base_keeps_fp32_adapters() -> None:
    tied = dataclasses.replace(ARGS, tie_embeddings=True)
    model = tiny_model(tied)
    count = apply_lora(model, rank=4, alpha=8.0, dropout=0.0, targets=ATTN, base_dtype=torch.bfloat16)
    assert count == lora_params(tied, 4, ATTN)
    trainable = trainable_parameters(model)
    for name, p in model.named_parameters():
        assert p.dtype == (torch.float32 if name in trainable else torch.bfloat16), name
    assert model.lm_head.weight is model.embed_tokens.weight  # the tie survives the cast
    out = model(tokens())
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()


def test_unknown_target_lists_allowed() -> None:
    with pytest.raises(ValueError, match=r"qkv_proj.*q_proj.*all-linear"):
        apply_lora(tiny_model(), rank=4, alpha=8.0, dropout=0.0, targets=["qkv_proj"], base_dtype=None)


def test_lora_state_dict_round_trip() -> None:
    source = tiny_model()
    apply_lora(source, rank=4, alpha=8.0, dropout=0.0, targets=ATTN, base_dtype=None)
    randomize_adapters(source)
    sd = lora_state_dict(source)
    assert len(sd) == 2 * len(ATTN) * ARGS.n_layers
    target = tiny_model()
    apply_lora(target, rank=4, alpha=8.0, dropout=0.0, targets=ATTN, base_dtype=None)
    load_lora_state_dict(target, sd)
    with torch.no_grad():
        torch.testing.assert_close(target(tokens()), source(tokens()), atol=0, rtol=0)
    wrong_rank = tiny_model()
    apply_lora(wrong_rank, rank=8, alpha=8.0, dropout=0.0, targets=ATTN, base_dtype=None)
    with pytest.raises(CheckpointError, match=r"layers\.0\.self_attn\.\w_proj\.lora_\w\.weight.*shape"):
        load_lora_state_dict(wrong_rank, sd)


# ----------------------------------------------------------------------------------------------------
# PEFT interop

TINY_HF = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=100)


@pytest.fixture
def hf_base(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**TINY_HF))
    model.save_pretrained(tmp_path / "base")
    return tmp_path / "base"


def load_base(path: Path) -> Transformer:
    model = Transformer(load_hf_config(path))
    load_hf_weights(model, path)
    return model.eval()


def hf_model(path: Path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(path).eval()  # saved in fp32


@needs_peft
def test_peft_adapter_export_matches_peft(hf_base: Path, tmp_path: Path) -> None:
    targets = ["q_proj", "v_proj", "down_proj"]
    model = load_base(hf_base)
    apply_lora(model, rank=4, alpha=8.0, dropout=0.1, targets=targets, base_dtype=None)
    randomize_adapters(model)
    model.eval()
    export_peft_adapter(model, tmp_path / "adapter", 4, 8.0, 0.1, targets, base_model_name_or_path=str(hf_base))
    peft_model = peft.PeftModel.from_pretrained(hf_model(hf_base), tmp_path / "adapter").eval()
    x = tokens()
    with torch.no_grad():
        expected = peft_model(x).logits
        torch.testing.assert_close(model(x), expected, atol=1e-4, rtol=0)
        # Exporting merged weights must not touch the LoRA model; the export equals PEFT's merge.
        export_hf(model, model.args, tmp_path / "merged", dtype=torch.float32)
        assert any(isinstance(m, LoRALinear) for m in model.modules())
        peft_merged = peft_model.merge_and_unload()
        torch.testing.assert_close(hf_model(tmp_path / "merged")(x).logits, peft_merged(x).logits, atol=1e-4, rtol=0)
        merge_lora(model)
        torch.testing.assert_close(model(x), expected, atol=1e-4, rtol=0)
        assert not torch.allclose(hf_model(hf_base)(x).logits, expected, atol=1e-3)  # adapters matter


@needs_peft
def test_load_peft_adapter_made_by_peft(hf_base: Path, tmp_path: Path) -> None:
    config = peft.LoraConfig(r=4, lora_alpha=16, lora_dropout=0.0, target_modules=["k_proj", "o_proj", "up_proj"],
                             task_type="CAUSAL_LM", init_lora_weights=False)  # random A and B
    peft_model = peft.get_peft_model(hf_model(hf_base), config).eval()
    peft_model.save_pretrained(tmp_path / "adapter")
    model = load_base(hf_base)
    count = load_peft_adapter(model, tmp_path / "adapter")
    assert count == sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(x), peft_model(x).logits, atol=1e-4, rtol=0)


def test_export_peft_adapter_checks_its_arguments(tmp_path: Path) -> None:
    model = tiny_model()
    apply_lora(model, rank=4, alpha=8.0, dropout=0.0, targets=ATTN, base_dtype=None)
    with pytest.raises(ValueError, match="targets"):
        export_peft_adapter(model, tmp_path / "a", 4, 8.0, 0.0, ["q_proj"])
    with pytest.raises(ValueError, match="rank"):
        export_peft_adapter(copy.deepcopy(model), tmp_path / "a", 8, 8.0, 0.0, ATTN)
    assert not (tmp_path / "a").exists()
