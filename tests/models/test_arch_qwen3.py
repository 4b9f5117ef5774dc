"""Qwen3 checkpoints (per-head q/k RMSNorm, a head size of their own): transformers' logits on load, and
exports (merged weights and PEFT adapters) that transformers and PEFT load back with the same logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="architecture tests compare with transformers")

from hf_families import assert_same_logits, hf_from, load_tracetrain, save_tiny, tokens, train_and_export  # noqa: E402

from tracetrain.models.accounting import num_params  # noqa: E402
from tracetrain.models.export import export_hf, export_peft_adapter  # noqa: E402
from tracetrain.models.hf import load_hf_config  # noqa: E402
from tracetrain.models.lora import apply_lora  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread_torch")


@pytest.mark.parametrize("overrides", [{"head_dim": 32}, {"head_dim": 16, "tie_word_embeddings": True}])
def test_qwen3_logits_equal_transformers(tmp_path: Path, overrides: dict) -> None:
    reference = save_tiny(tmp_path, "Qwen3Config", **overrides)
    with torch.no_grad():  # norms start at one: make q_norm / k_norm matter
        for name, p in reference.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.uniform_(0.5, 1.5)
    reference.save_pretrained(tmp_path)
    model = load_tracetrain(tmp_path)
    assert model.args.qk_norm and model.args.head_dim == overrides["head_dim"]
    assert num_params(model.args) == sum(p.numel() for p in reference.parameters())  # the accounting counts q/k norms
    assert_same_logits(reference, model)


def test_qwen3_export_is_qwen3_for_transformers(tmp_path: Path) -> None:
    save_tiny(tmp_path / "base", "Qwen3Config", head_dim=32)
    model = load_tracetrain(tmp_path / "base")
    with torch.no_grad():
        for layer in model.layers:
            layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    export_hf(model, model.args, tmp_path / "out", dtype=torch.float32)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["head_dim"] == 32
    assert load_hf_config(tmp_path / "out") == model.args
    assert_same_logits(hf_from(tmp_path / "out"), model)


def test_qwen3_peft_adapter_loads_in_peft(tmp_path: Path) -> None:
    peft = pytest.importorskip("peft")
    save_tiny(tmp_path / "base", "Qwen3Config", head_dim=32)
    model = load_tracetrain(tmp_path / "base")
    targets = ["q_proj", "o_proj", "down_proj"]
    apply_lora(model, rank=4, alpha=8.0, dropout=0.0, targets=targets)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.05)
    export_peft_adapter(model.eval(), tmp_path / "adapter", 4, 8.0, 0.0, targets)
    adapted = peft.PeftModel.from_pretrained(hf_from(tmp_path / "base"), tmp_path / "adapter").eval()
    assert_same_logits(adapted, model)


@pytest.mark.slow  # two CLI runs and their exports (about 20 s on a busy 2-core machine)
@pytest.mark.parametrize("mode", ["lora", "full"])
def test_qwen3_fine_tunes_and_exports(tmp_path: Path, mode: str) -> None:
    """LoRA and full fine-tuning from a Qwen3 folder: the run trains (finite loss, changed weights) and its
    exports are what the trained model computes, in transformers (merged) and PEFT (adapter)."""
    from tracetrain.inference import load_trained

    save_tiny(tmp_path / "base", "Qwen3Config", head_dim=32)
    run, summary = train_and_export(tmp_path / "base", tmp_path, mode)
    assert summary["steps"] == 3 and torch.isfinite(torch.tensor(summary["train_loss"]))
    trained = load_trained(run, "cpu").model.eval()
    merged = hf_from(tmp_path / "hf")
    x = tokens()
    assert_same_logits(merged, trained, x)
    with torch.no_grad():
        assert not torch.allclose(merged(x).logits, hf_from(tmp_path / "base")(x).logits, atol=1e-5)  # it trained
    if mode == "lora":
        peft = pytest.importorskip("peft")
        adapted = peft.PeftModel.from_pretrained(hf_from(tmp_path / "base"), tmp_path / "peft").eval()
        assert_same_logits(adapted, trained, x)


def test_qwen3_greedy_generation_equals_transformers(tmp_path: Path) -> None:
    """The KV cache holds keys after their norm and rotation: greedy tokens are transformers'."""
    from tracetrain.models.generate import generate

    reference = save_tiny(tmp_path, "Qwen3Config", head_dim=32)
    model = load_tracetrain(tmp_path)
    prompt = tokens(seq=8, batch=1)[0].tolist()
    [ours] = generate(model, [prompt], 12, eos_id=-1, pad_id=0)
    with torch.no_grad():
        out = reference.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None)
    assert ours == out[0, len(prompt) :].tolist()
