"""Hugging Face interop: checkpoints made by transformers load into tracetrain with the same logits, and
tracetrain's exports load back into transformers with the same logits. transformers is the reference."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

transformers = pytest.importorskip("transformers", reason="HF interop tests need transformers")

from tracetrain.errors import CheckpointError  # noqa: E402
from tracetrain.models.export import export_hf  # noqa: E402
from tracetrain.models.hf import load_hf_config, load_hf_weights  # noqa: E402
from tracetrain.models.llama import ModelArgs, Transformer  # noqa: E402

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=100)
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 16}


def save_hf(tmp_path: Path, arch: str, **overrides) -> tuple[Path, torch.nn.Module]:
    """A tiny random transformers model of `arch`, saved with save_pretrained; returns (dir, model)."""
    config_cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
                  "qwen2": transformers.Qwen2Config}[arch]
    # transformers adds keys to a rope_scaling dict passed to it: hand it copies.
    overrides = {k: dict(v) if isinstance(v, dict) else v for k, v in overrides.items()}
    save_kwargs = {"max_shard_size": overrides.pop("max_shard_size")} if "max_shard_size" in overrides else {}
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config_cls(**{**TINY, **overrides}))
    out = tmp_path / arch
    model.save_pretrained(out, **save_kwargs)
    return out, model.eval()


def load_tracetrain(path: Path) -> Transformer:
    model = Transformer(load_hf_config(path))
    load_hf_weights(model, path)
    return model.eval()


def tokens(vocab: int = 100, seq: int = 48) -> torch.Tensor:
    return torch.randint(0, vocab, (2, seq), generator=torch.Generator().manual_seed(1))


def assert_same_logits(hf_model: torch.nn.Module, model: Transformer, atol: float = 1e-4) -> None:
    x = tokens()
    with torch.no_grad():
        expected = hf_model(x).logits
        actual = model(x)
    torch.testing.assert_close(actual, expected, atol=atol, rtol=0)


@pytest.mark.parametrize("arch,overrides", [
    ("llama", {"rms_norm_eps": 1e-5}),
    ("llama", {"rope_theta": 500000.0, "rope_scaling": LLAMA3_SCALING, "max_position_embeddings": 256}),
    ("mistral", {"rope_theta": 1e6}),
    ("qwen2", {"tie_word_embeddings": True}),
], ids=["llama", "llama3-rope-scaling", "mistral", "qwen2-tied"])
def test_hf_to_tracetrain_logits(tmp_path: Path, arch: str, overrides: dict) -> None:
    path, hf_model = save_hf(tmp_path, arch, **overrides)
    model = load_tracetrain(path)
    assert_same_logits(hf_model, model)


def test_config_mapping(tmp_path: Path) -> None:
    path, _ = save_hf(tmp_path, "qwen2", tie_word_embeddings=True, rope_theta=1e6, rms_norm_eps=1e-6)
    args = load_hf_config(path)
    assert (args.dim, args.n_layers, args.n_heads, args.n_kv_heads, args.ffn_dim, args.vocab_size) == \
        (64, 2, 4, 2, 128, 100)
    assert args.qkv_bias and args.tie_embeddings and args.rope_theta == 1e6 and args.norm_eps == 1e-6


def test_rope_scaling_is_read_and_matters(tmp_path: Path) -> None:
    """Guards the scaled-rope test above: dropping the scaling must change the logits."""
    path, hf_model = save_hf(tmp_path, "llama", rope_scaling=LLAMA3_SCALING, max_position_embeddings=256)
    args = load_hf_config(path)
    assert args.rope_scaling == {k: v for k, v in LLAMA3_SCALING.items() if k != "rope_type"}
    args.rope_scaling = {}
    plain = Transformer(args)
    load_hf_weights(plain, path)
    with torch.no_grad():
        assert not torch.allclose(plain.eval()(tokens()), hf_model(tokens()).logits, atol=1e-3)


def test_sharded_checkpoint(tmp_path: Path) -> None:
    path, hf_model = save_hf(tmp_path, "llama", max_shard_size="50KB")
    assert (path / "model.safetensors.index.json").is_file()
    assert_same_logits(hf_model, load_tracetrain(path))


def test_load_into_bf16_and_lora_wrapped_models(tmp_path: Path) -> None:
    """Weights are copied into existing parameters, whatever their dtype, and into LoRA `.base` layers."""
    from tracetrain.models.lora import apply_lora

    path, hf_model = save_hf(tmp_path, "llama")
    reference = hf_model.state_dict()
    model = Transformer(load_hf_config(path)).to(torch.bfloat16)
    apply_lora(model, rank=2, alpha=4.0, dropout=0.0, targets=["q_proj"], base_dtype=None)
    load_hf_weights(model, path)
    q = model.layers[1].self_attn.q_proj.base.weight
    assert q.dtype == torch.bfloat16
    assert torch.equal(q, reference["model.layers.1.self_attn.q_proj.weight"].to(torch.bfloat16))
    assert torch.equal(model.lm_head.weight, reference["lm_head.weight"].to(torch.bfloat16))


def test_rope_parameters_and_legacy_keys_agree(tmp_path: Path) -> None:
    """transformers 5 writes `rope_parameters`; 4.x wrote top-level rope_theta + rope_scaling."""
    path, _ = save_hf(tmp_path, "llama", rope_theta=500000.0, rope_scaling=LLAMA3_SCALING)
    new = load_hf_config(path)
    cfg = json.loads((path / "config.json").read_text())
    params = cfg.pop("rope_parameters", None) or {}
    cfg["rope_theta"] = params.pop("rope_theta", 500000.0)
    cfg["rope_scaling"] = params
    (path / "config.json").write_text(json.dumps(cfg))
    legacy = load_hf_config(path)
    assert legacy == new and new.rope_theta == 500000.0


@pytest.mark.parametrize("qkv_bias,tie", [(False, False), (True, True)], ids=["llama", "qwen2-tied"])
def test_export_loads_in_transformers(tmp_path: Path, qkv_bias: bool, tie: bool) -> None:
    torch.manual_seed(0)
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=100, qkv_bias=qkv_bias,
                     tie_embeddings=tie, rope_theta=500000.0, rope_scaling={
                         k: v for k, v in LLAMA3_SCALING.items() if k != "rope_type"})
    model = Transformer(args)
    model.init_weights()
    if qkv_bias:  # init_weights zeroes biases; make them matter
        for block in model.layers:
            torch.nn.init.normal_(block.self_attn.q_proj.bias, std=0.1)
            torch.nn.init.normal_(block.self_attn.k_proj.bias, std=0.1)
            torch.nn.init.normal_(block.self_attn.v_proj.bias, std=0.1)
    export_hf(model, args, tmp_path / "out", dtype=torch.float32, bos_token_id=1, eos_token_id=2)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(hf_model).__name__ == ("Qwen2ForCausalLM" if qkv_bias else "LlamaForCausalLM")
    assert_same_logits(hf_model, model.eval())


def test_export_sharded_and_overwrite(tmp_path: Path) -> None:
    torch.manual_seed(0)
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=100)
    model = Transformer(args)
    model.init_weights()
    out = tmp_path / "out"
    export_hf(model, args, out, dtype=torch.float32)  # a first, single-file export ...
    export_hf(model, args, out, dtype=torch.float32, max_shard_bytes=64 * 1024)  # ... replaced by shards
    assert not (out / "model.safetensors").exists()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temp dirs left behind
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert_same_logits(hf_model, model.eval())


def test_export_reports_progress_in_bytes_per_shard(tmp_path: Path) -> None:
    """`tracetrain export` shows a bar from these calls: bytes written so far, of the total, per shard."""
    from tracetrain.models.hf import write_hf_weights

    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=100)
    model = Transformer(args)
    calls: list[tuple[str, int, int | None, str]] = []
    write_hf_weights(model, args, tmp_path, torch.float32, 64 * 1024, lambda *c: calls.append(c))
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    done = [c[1] for c in calls]
    assert done == sorted(done) and len(set(done)) == len(done)  # strictly growing, once per tensor
    assert len(calls) == len(index["weight_map"]) and {c[3] for c in calls} == {"bytes"}
    assert done[-1] == calls[-1][2] == index["metadata"]["total_size"]
    assert {c[0] for c in calls} == {f"exporting weights: shard {i + 1} of {len(files)}" for i in range(len(files))}


def test_bf16_export_dtype(tmp_path: Path) -> None:
    args = ModelArgs(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=100)
    export_hf(Transformer(args), args, tmp_path / "out")
    with safe_open(tmp_path / "out" / "model.safetensors", framework="pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    assert json.loads((tmp_path / "out" / "config.json").read_text())["torch_dtype"] == "bfloat16"


# ----------------------------------------------------------------------------------------------------
# Errors: one line naming the file and the tensor

def test_missing_shard_names_file(tmp_path: Path) -> None:
    path, _ = save_hf(tmp_path, "llama", max_shard_size="50KB")
    shard = sorted(path.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=shard.name):
        load_tracetrain(path)


def test_wrong_shape_names_tensor_and_file(tmp_path: Path) -> None:
    path, _ = save_hf(tmp_path, "llama")
    file = path / "model.safetensors"
    with safe_open(file, framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    tensors["model.layers.1.mlp.up_proj.weight"] = torch.zeros(127, 64)
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as err:
        load_tracetrain(path)
    msg = str(err.value)
    assert "model.layers.1.mlp.up_proj.weight" in msg and "model.safetensors" in msg
    assert "(127, 64)" in msg and "(128, 64)" in msg and "\n" not in msg


def test_missing_and_unexpected_tensors(tmp_path: Path) -> None:
    path, _ = save_hf(tmp_path, "llama")
    file = path / "model.safetensors"
    with safe_open(file, framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)  # ignored, as HF does
    tensors["model.layers.0.extra.weight"] = tensors.pop("model.norm.weight")
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"missing.*\bnorm\.weight"):
        load_tracetrain(path)
    tensors["model.norm.weight"] = torch.ones(64)
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"unexpected.*layers\.0\.extra\.weight"):
        load_tracetrain(path)


def test_unknown_architecture_names_config(tmp_path: Path) -> None:
    path, _ = save_hf(tmp_path, "llama")
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["GPTNeoXForCausalLM"], "gpt_neox"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"config\.json.*GPTNeoXForCausalLM.*LlamaForCausalLM"):
        load_hf_config(path)


def test_head_dim_of_its_own(tmp_path: Path) -> None:
    """A head size other than hidden / heads (q_proj 64 -> 128 here) loads with transformers' logits."""
    path, hf_model = save_hf(tmp_path, "llama", head_dim=32)
    model = load_tracetrain(path)
    assert model.args.head_dim == 32 and model.layers[0].self_attn.q_proj.weight.shape == (128, 64)
    assert_same_logits(hf_model, model)
