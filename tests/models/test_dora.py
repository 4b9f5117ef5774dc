"""DoRA (`lora.dora = true`) against PEFT's `LoraConfig(use_dora=True)` on the same weights: outputs and
gradients, the PEFT adapter export (lora_magnitude_vector) loaded by PEFT with identical logits, merges,
and training through the real assembly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tracetrain.config import load_config
from tracetrain.errors import ConfigError
from tracetrain.models.accounting import lora_params
from tracetrain.models.export import export_hf, export_peft_adapter
from tracetrain.models.hf import load_hf_config, load_hf_weights, load_peft_adapter
from tracetrain.models.llama import Transformer
from tracetrain.models.lora import DoRALinear, apply_lora, merge_lora, trainable_parameters

peft = pytest.importorskip("peft", reason="DoRA is checked against PEFT: pip install peft (in the dev extra)")
transformers = pytest.importorskip("transformers", reason="DoRA is checked against PEFT on a transformers model")

TINY_HF = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=100)  # fmt: skip
TARGETS = ["q_proj", "v_proj", "o_proj", "down_proj"]


@pytest.fixture
def hf_base(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**TINY_HF)).save_pretrained(tmp_path / "b")
    return tmp_path / "b"


def hf_model(path: Path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(path)


def dora_model(path: Path, dropout: float = 0.0) -> Transformer:
    model = Transformer(load_hf_config(path))
    load_hf_weights(model, path)
    apply_lora(model, rank=4, alpha=8.0, dropout=dropout, targets=TARGETS, base_dtype=None, dora=True)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # trained-looking adapters: B non-zero, magnitudes off the base norms
        for m in model.modules():
            if isinstance(m, DoRALinear):
                m.lora_B.weight.copy_(torch.randn(m.lora_B.weight.shape, generator=g) * 0.05)
                m.lora_magnitude_vector.mul_(1 + 0.1 * torch.randn(m.out_features, generator=g))
    return model


def tokens() -> torch.Tensor:
    return torch.randint(0, 100, (2, 24), generator=torch.Generator().manual_seed(2))


def peft_twin(model: Transformer, hf_base: Path, tmp_path: Path, dropout: float = 0.0) -> torch.nn.Module:
    """PEFT's DoRA model holding our adapters: exported by us, loaded by PEFT (trainable, to compare grads)."""
    export_peft_adapter(model, tmp_path / "adapter", 4, 8.0, dropout, TARGETS, base_model_name_or_path=str(hf_base))
    config = (tmp_path / "adapter" / "adapter_config.json").read_text()
    assert '"use_dora": true' in config
    return peft.PeftModel.from_pretrained(hf_model(hf_base), tmp_path / "adapter", is_trainable=True)


def test_fresh_dora_computes_the_base_model(hf_base: Path) -> None:
    model = Transformer(load_hf_config(hf_base))
    load_hf_weights(model, hf_base)
    with torch.no_grad():
        expected = model(tokens())
        apply_lora(model, rank=4, alpha=8.0, dropout=0.0, targets=TARGETS, base_dtype=None, dora=True)
        torch.testing.assert_close(model(tokens()), expected, atol=1e-5, rtol=0)
    q = model.layers[0].self_attn.q_proj
    torch.testing.assert_close(q.lora_magnitude_vector, q.base.weight.norm(dim=1))


def test_count_matches_accounting_and_peft(hf_base: Path) -> None:
    model = dora_model(hf_base)
    count = sum(p.numel() for p in trainable_parameters(model).values())
    assert count == lora_params(model.args, 4, TARGETS, dora=True)
    assert count - lora_params(model.args, 4, TARGETS) == 2 * (64 + 32 + 64 + 64)  # one per output row
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, use_dora=True)
    twin = peft.get_peft_model(hf_model(hf_base), config)
    assert count == sum(p.numel() for p in twin.parameters() if p.requires_grad)


def test_outputs_and_gradients_equal_peft(hf_base: Path, tmp_path: Path) -> None:
    model = dora_model(hf_base).train()
    twin = peft_twin(model, hf_base, tmp_path).train()
    x = tokens()
    ours, theirs = model(x), twin(x).logits
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    (ours.square().mean()).backward()
    (theirs.square().mean()).backward()
    peft_grads = {n.replace(".default", ""): p.grad for n, p in twin.named_parameters() if p.requires_grad}
    compared = 0
    for name, p in trainable_parameters(model).items():
        key = "base_model.model.model." + name.replace(".base.", ".")
        if name.endswith("lora_magnitude_vector"):
            key += ".weight"
        torch.testing.assert_close(p.grad, peft_grads[key], atol=1e-6, rtol=1e-4)
        compared += 1
    assert compared == 3 * 2 * len(TARGETS)  # A, B and the magnitude of every adapter
    assert model.layers[1].self_attn.q_proj.lora_magnitude_vector.grad.abs().sum() > 0


def test_eval_with_dropout_equals_peft(hf_base: Path, tmp_path: Path) -> None:
    model = dora_model(hf_base, dropout=0.1).eval()
    twin = peft_twin(model, hf_base, tmp_path, dropout=0.1).eval()
    with torch.no_grad():
        torch.testing.assert_close(model(tokens()), twin(tokens()).logits, atol=1e-5, rtol=0)


def test_merges_and_hf_export_equal_peft_merge(hf_base: Path, tmp_path: Path) -> None:
    model = dora_model(hf_base).eval()
    twin = peft_twin(model, hf_base, tmp_path).eval()
    x = tokens()
    with torch.no_grad():
        expected = model(x)
        export_hf(model, model.args, tmp_path / "merged", dtype=torch.float32)
        peft_merged = twin.merge_and_unload()
        torch.testing.assert_close(
            hf_model(tmp_path / "merged").eval()(x).logits, peft_merged(x).logits, atol=1e-5, rtol=0
        )
        merge_lora(model)
        assert not any(isinstance(m, DoRALinear) for m in model.modules())
        torch.testing.assert_close(model(x), expected, atol=1e-5, rtol=0)


def test_load_a_dora_adapter_made_by_peft(hf_base: Path, tmp_path: Path) -> None:
    config = peft.LoraConfig(r=4, lora_alpha=16, target_modules=["k_proj", "up_proj"], use_dora=True,
                             init_lora_weights=False)  # fmt: skip
    twin = peft.get_peft_model(hf_model(hf_base), config).eval()
    twin.save_pretrained(tmp_path / "adapter")
    model = Transformer(load_hf_config(hf_base))
    load_hf_weights(model, hf_base)
    count = load_peft_adapter(model, tmp_path / "adapter")
    assert count == sum(p.numel() for p in twin.parameters() if p.requires_grad)
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(tokens()), twin(tokens()).logits, atol=1e-5, rtol=0)


def test_trains_through_the_real_assembly_with_a_qlora_base() -> None:
    from tracetrain.models.qlora import NF4Linear
    from tracetrain.spec import resolve
    from tracetrain.train.assemble import assemble, run_step_context
    from tracetrain.train.step import train_step

    cfg = load_config(None, ["--model.n_layers=2", "--train.mode=lora", "--lora.dora=true", "--lora.base_quant=nf4",
                             "--optim.lr=3e-3", "--train.device=cpu"])  # fmt: skip
    a = assemble(resolve(cfg, torch.device("cpu")))
    dora = [m for m in a.module.modules() if isinstance(m, DoRALinear)]
    assert dora and all(isinstance(m.base, NF4Linear) for m in dora)
    # materialise set each magnitude to its (dequantised) base's row norms
    torch.testing.assert_close(dora[0].lora_magnitude_vector, dora[0].base.weight.float().norm(dim=1))
    ids = torch.randint(0, 259, (4, 32), generator=torch.Generator().manual_seed(0))
    b = {"input_ids": ids, "labels": torch.roll(ids, -1, 1), "position_ids": torch.arange(32).expand(4, 32),
         "document_ids": torch.zeros_like(ids)}  # fmt: skip
    ctx = run_step_context(a)
    losses = [train_step(a.module, a.optimizer, [b], ctx).loss.item() for _ in range(6)]
    assert losses[-1] < losses[0] - 0.05


@pytest.mark.parametrize(
    "overrides", [["--lora.dora=true"], ["--train.mode=lora", "--lora.dora=true", "--train.fp8=rowwise"]]
)
def test_bad_combinations_are_one_line(overrides: list[str]) -> None:
    with pytest.raises(ConfigError, match=r"lora\.dora") as e:
        load_config(None, overrides)
    assert "\n" not in str(e.value)
