"""Phi-3 / Phi-4-mini (Phi3ForCausalLM) from Hugging Face folders: the fused qkv_proj / gate_up_proj are split
on load (block by block, any shard) and fused on export, longrope (short and long factors, attention factor)
and partial rotary give transformers' logits (fp32), and LoRA / full runs export to HF and to a PEFT adapter
on the checkpoint's own module names (qkv_proj, gate_up_proj) that transformers and PEFT load back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import cli_here
from helpers import FAMILY_RUN

from tracetrain.errors import CheckpointError
from tracetrain.models.build import build_on_meta, materialize_parts
from tracetrain.models.export import export_hf
from tracetrain.models.hf import load_hf_config, open_hf_checkpoint

transformers = pytest.importorskip("transformers", reason="Phi-3 parity is checked against transformers")

pytestmark = pytest.mark.usefixtures("one_thread_torch")

ORIGINAL = 16  # original_max_position_embeddings: sequences beyond it take the long factors
SHAPE = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2)
TOKENS = dict(vocab_size=259, bos_token_id=256, eos_token_id=257, pad_token_id=258)  # the byte tokenizer's ids


def hf_phi3(longrope: bool, partial: float = 1.0) -> torch.nn.Module:
    """A random tiny Phi-3; with `longrope`, distinct short and long factors (head_dim 16 x `partial` / 2 each)."""
    torch.manual_seed(0)
    extra: dict = {"partial_rotary_factor": partial}
    if longrope:
        half = int(16 * partial) // 2
        extra |= dict(
            max_position_embeddings=256,
            original_max_position_embeddings=ORIGINAL,
            rope_scaling={
                "type": "longrope",
                "short_factor": [1.0 + 0.1 * i for i in range(half)],
                "long_factor": [2.0 + 0.3 * i for i in range(half)],
            },
        )
    model = transformers.Phi3ForCausalLM(transformers.Phi3Config(**SHAPE, **TOKENS, **extra))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


VARIANTS = {"phi4-mini-like": (True, 0.75), "phi3-mini-4k-like": (False, 1.0)}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def saved(request, tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("phi3") / "hf"
    model = hf_phi3(*VARIANTS[request.param])
    model.save_pretrained(path)
    return path, model


def load_ours(path: Path) -> torch.nn.Module:
    """Through the trainer's path: the model on meta, filled from the checkpoint's blocks."""
    args = load_hf_config(path)
    model = build_on_meta(args)
    materialize_parts([model], args, torch.device("cpu"), seed=0, source=open_hf_checkpoint(path, model))
    return model.eval()


@pytest.mark.parametrize("seq", [ORIGINAL - 4, 3 * ORIGINAL])  # short factors, then long ones
def test_logits_match_transformers(saved, seq: int) -> None:
    path, hf = saved
    ours = load_ours(path)
    ids = torch.randint(0, 259, (2, seq), generator=torch.Generator().manual_seed(seq))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(ids).logits, atol=2e-5, rtol=0)


def test_longrope_config_is_read(tmp_path: Path) -> None:
    hf_phi3(True, 0.75).save_pretrained(tmp_path)
    args = load_hf_config(tmp_path)
    assert args.family == "phi3" and args.rotary_dim == 12 and args.rope_original_max_len == ORIGINAL
    assert args.rope_short_factor[1] == pytest.approx(1.1) and args.rope_long_factor[1] == pytest.approx(2.3)
    # HF's default: sqrt(1 + ln(max / original) / ln(original)); here max / original = 256 / 16 = original.
    assert args.rope_attention_factor == pytest.approx(2**0.5)


def test_fused_tensors_are_read_by_row_blocks(saved) -> None:
    """A shard of k_proj / up_proj (any dim-0 block, as FSDP or TP cut it) is its rows of the fused tensor."""
    path, hf = saved
    ours = load_ours(path)
    checkpoint = open_hf_checkpoint(path, ours)
    layer = hf.model.layers[1]
    q_dim, kv = 64, 32
    block = torch.empty(5, 64)
    assert checkpoint.fill(block, "layers.1.self_attn.k_proj.weight", (kv, 64), (3, 0))
    torch.testing.assert_close(block, layer.self_attn.qkv_proj.weight[q_dim + 3 : q_dim + 8].detach())
    block = torch.empty(6, 32)
    assert checkpoint.fill(block, "layers.1.mlp.up_proj.weight", (96, 64), (90, 32))
    torch.testing.assert_close(block, layer.mlp.gate_up_proj.weight[96 + 90 : 96 + 96, 32:].detach())


def test_missing_fused_tensor_is_one_line(saved, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    path, _ = saved
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.0.self_attn.qkv_proj.weight"]
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    model = build_on_meta(load_hf_config(tmp_path))
    with pytest.raises(CheckpointError, match=r"missing from the checkpoint: layers\.0\.self_attn\.qkv_proj\.weight"):
        open_hf_checkpoint(tmp_path, model)


def test_wrong_factor_count_is_one_line(tmp_path: Path) -> None:
    hf_phi3(True, 0.75).save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    key = "rope_parameters" if "rope_parameters" in cfg else "rope_scaling"
    cfg[key]["short_factor"] = [1.0, 1.0]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"config\.json: rope_scaling\.short_factor must list 6 numbers"):
        load_hf_config(tmp_path)


def test_export_fuses_and_keeps_the_config(saved, tmp_path: Path) -> None:
    path, hf = saved
    ours = load_ours(path)
    export_hf(ours, ours.args, tmp_path / "out", dtype=torch.float32)
    assert load_hf_config(tmp_path / "out") == ours.args
    from safetensors import safe_open

    with safe_open(tmp_path / "out" / "model.safetensors", "pt") as f:
        assert "model.layers.0.self_attn.qkv_proj.weight" in f.keys()  # noqa: SIM118 (safe_open has keys() only)
        fused = f.get_tensor("model.layers.0.mlp.gate_up_proj.weight")
    torch.testing.assert_close(fused, hf.model.layers[0].mlp.gate_up_proj.weight.detach())




@pytest.mark.parametrize(("mode", "targets"), [("lora", "q_proj,v_proj,o_proj,up_proj"), ("full", "")])
def test_finetune_and_export_round_trip(saved, mode: str, targets: str, tmp_path: Path) -> None:
    """Train through the CLI, export; transformers (merged) and PEFT (adapter on qkv_proj / gate_up_proj, some
    parts not adapted) give our logits."""
    from tracetrain.inference import load_trained

    base, _ = saved
    runs = tmp_path / "runs"
    extra = [f"--lora.targets={targets}"] if targets else []
    args = ("train", *FAMILY_RUN, f"--model.init_from={base}", f"--train.mode={mode}", f"--train.output_dir={runs}", *extra)
    proc = cli_here(*args)
    assert proc.returncode == 0, proc.stderr
    run = next(runs.iterdir())
    flags = ["--hf", str(tmp_path / "hf"), "--dtype", "fp32"] + (
        ["--peft", str(tmp_path / "peft")] if mode == "lora" else []
    )
    proc = cli_here("export", str(run), *flags)
    assert proc.returncode == 0, proc.stderr
    ours = load_trained(run, "cpu").model.eval()
    ids = torch.randint(0, 256, (2, 2 * ORIGINAL), generator=torch.Generator().manual_seed(3))
    loaded = [transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")]
    if mode == "lora":
        peft = pytest.importorskip("peft")
        adapter = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
        assert adapter["target_modules"] == ["qkv_proj", "o_proj", "gate_up_proj"]
        assert adapter["rank_pattern"] == {"qkv_proj": 2 * adapter["r"]}  # q and v adapted: twice the rank
        loaded.append(
            peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(base), tmp_path / "peft")
        )
    with torch.no_grad():
        expected = ours(ids)
        for model in loaded:
            torch.testing.assert_close(model.eval()(ids).logits, expected, atol=2e-5, rtol=0)


def test_streamed_export_of_a_sharded_checkpoint_fuses_too(saved, tmp_path: Path) -> None:
    """The export of a multi-rank (DCP) checkpoint, streamed tensor by tensor, writes the same fused files as
    the one-process export (the DCP folder is written here by one process, as the ranks would lay it out)."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    from tracetrain.train.sharded_export import write_hf_from_dcp

    path, _ = saved
    ours = load_ours(path)
    dcp.save({f"model.{k}": v for k, v in ours.state_dict().items()}, checkpoint_id=str(tmp_path / "ckpt" / "dcp"))
    (tmp_path / "streamed").mkdir()
    write_hf_from_dcp(tmp_path / "ckpt", ours.args, None, tmp_path / "streamed", torch.float32, 10**9)
    export_hf(ours, ours.args, tmp_path / "gathered", dtype=torch.float32)
    streamed, gathered = (load_file(tmp_path / d / "model.safetensors") for d in ("streamed", "gathered"))
    assert streamed.keys() == gathered.keys() and "model.layers.1.mlp.gate_up_proj.weight" in streamed
    for key, value in gathered.items():
        assert torch.equal(streamed[key], value), key


def test_peft_adapter_on_fused_projections_loads_exactly(saved, tmp_path: Path) -> None:
    """An adapter PEFT trained on qkv_proj / gate_up_proj loads as adapters of the split parts, same logits."""
    peft = pytest.importorskip("peft")
    from tracetrain.models.hf import load_peft_adapter

    path, _ = saved
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["qkv_proj", "gate_up_proj", "o_proj"], init_lora_weights=False
    )
    torch.manual_seed(1)
    adapted = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(path), config).eval()
    adapted.save_pretrained(tmp_path / "adapter")
    ours = load_ours(path)
    load_peft_adapter(ours, tmp_path / "adapter")
    ids = torch.randint(0, 259, (2, 24), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(ours.eval()(ids), adapted(ids).logits, atol=2e-5, rtol=0)
