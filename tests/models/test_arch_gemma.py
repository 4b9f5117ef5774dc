"""Gemma 2 and Gemma 3 (text) from Hugging Face folders: logits equal transformers' (fp32), the KV-cache and
packed-document paths equal the plain forward, LoRA and full fine-tuning through the CLI, and `export --hf` /
`--peft` that transformers and PEFT load back with our logits. transformers is the reference (eager attention,
which is what HF runs soft-capped Gemma 2 with)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import cli_here
from helpers import FAMILY_RUN

from tracetrain.errors import CheckpointError, ConfigError
from tracetrain.models.build import build_on_meta, materialize_parts
from tracetrain.models.hf import load_hf_config, open_hf_checkpoint
from tracetrain.models.llama import KVCache

transformers = pytest.importorskip("transformers", reason="Gemma parity is checked against transformers")

pytestmark = pytest.mark.usefixtures("one_thread_torch")

WINDOW = 6  # shorter than the test sequences, so sliding layers differ from full ones
SHAPE = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
TOKENS = dict(vocab_size=259, bos_token_id=256, eos_token_id=257, pad_token_id=258)  # the byte tokenizer's ids


def hf_gemma(family: str, **overrides) -> torch.nn.Module:
    """A random tiny Gemma 2 (4 layers, alternating) or Gemma 3 (6 layers, 5 local : 1 global, linear rope
    scaling, q/k norms), with every weight (norms included) moved off its initial value."""
    torch.manual_seed(0)
    if family == "gemma2":
        cfg = transformers.Gemma2Config(
            **SHAPE, **TOKENS, num_hidden_layers=4, sliding_window=WINDOW, query_pre_attn_scalar=24, **overrides
        )
        model = transformers.Gemma2ForCausalLM(cfg)
    else:
        cfg = transformers.Gemma3TextConfig(
            **SHAPE,
            **TOKENS,
            num_hidden_layers=6,
            sliding_window=WINDOW,
            rope_scaling={"rope_type": "linear", "factor": 8.0},
            rope_local_base_freq=10000.0,
            rope_theta=1e6,
            **overrides,
        )
        model = transformers.Gemma3ForCausalLM(cfg)
    model.config._attn_implementation = "eager"
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


@pytest.fixture(scope="module", params=["gemma2", "gemma3"])
def saved(request, tmp_path_factory) -> tuple[str, Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp(request.param) / "hf"
    model = hf_gemma(request.param)
    model.save_pretrained(path)
    return request.param, path, model


def load_ours(path: Path) -> torch.nn.Module:
    """Through the trainer's path: the family's model on meta, filled from the checkpoint's blocks."""
    args = load_hf_config(path)
    model = build_on_meta(args)
    source = open_hf_checkpoint(path, model)
    materialize_parts([model], args, torch.device("cpu"), seed=0, source=source)
    return model.eval()


def test_config_is_read(saved) -> None:
    family, path, _ = saved
    args = load_hf_config(path)
    assert args.family == family and args.head_dim == 32 and args.dim == 64 and args.local_window == WINDOW
    if family == "gemma2":
        assert args.layer_types == ("sliding", "full") * 2
        assert (args.attn_logit_softcap, args.final_logit_softcap, args.query_pre_attn_scalar) == (50.0, 30.0, 24.0)
    else:
        assert args.layer_types == ("sliding",) * 5 + ("full",)
        assert args.qk_norm and args.rope_linear_factor == 8.0 and args.rope_local_theta == 10000.0


@pytest.mark.parametrize("seq", [5, 24])  # within the window, and four windows long
def test_logits_match_transformers(saved, seq: int) -> None:
    _, path, hf = saved
    ours = load_ours(path)
    ids = torch.randint(0, 259, (2, seq), generator=torch.Generator().manual_seed(seq))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(ids).logits, atol=2e-5, rtol=0)


def test_kv_cache_decode_matches_full_forward(saved) -> None:
    """Prefill 8 tokens, then decode one at a time: the windowed cache masks give the full forward's logits."""
    _, path, _ = saved
    ours = load_ours(path)
    ids = torch.randint(0, 259, (2, 20), generator=torch.Generator().manual_seed(1))
    cache = KVCache(ours.args, batch=2, max_len=20, device=torch.device("cpu"), dtype=torch.float32)
    with torch.no_grad():
        full = ours(ids)
        steps = [ours(ids[:, :8], cache=cache)[:, -1]]
        steps += [ours(ids[:, i : i + 1], cache=cache)[:, -1] for i in range(8, 20)]
    torch.testing.assert_close(torch.stack(steps, 1), full[:, 7:], atol=2e-5, rtol=0)


def test_packed_documents_equal_separate_rows(saved) -> None:
    """Two documents packed in one row (positions restart, document mask) give each document's own logits."""
    _, path, _ = saved
    ours = load_ours(path)
    a, b = torch.randint(0, 259, (1, 14)), torch.randint(0, 259, (1, 10))
    packed = torch.cat([a, b], 1)
    positions = torch.cat([torch.arange(14), torch.arange(10)])[None]
    documents = torch.cat([torch.zeros(14), torch.ones(10)]).long()[None]
    with torch.no_grad():
        together = ours(packed, positions, documents)
        torch.testing.assert_close(together[:, :14], ours(a), atol=2e-5, rtol=0)
        torch.testing.assert_close(together[:, 14:], ours(b), atol=2e-5, rtol=0)




@pytest.mark.parametrize("mode", ["lora", "full"])
def test_finetune_and_export_round_trip(saved, mode: str, tmp_path: Path) -> None:
    """Train a few steps through the CLI, export, and load the export with transformers (and PEFT)."""
    from tracetrain.inference import load_trained

    family, base, _ = saved
    runs = tmp_path / "runs"
    proc = cli_here("train", *FAMILY_RUN, f"--model.init_from={base}", f"--train.mode={mode}", f"--train.output_dir={runs}")
    assert proc.returncode == 0, proc.stderr
    run = next(runs.iterdir())
    assert all(
        json.loads(line)["loss"] > 0 for line in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in line
    )
    flags = ["--hf", str(tmp_path / "hf"), "--dtype", "fp32"] + (
        ["--peft", str(tmp_path / "peft")] if mode == "lora" else []
    )
    proc = cli_here("export", str(run), *flags)
    assert proc.returncode == 0, proc.stderr
    ours = load_trained(run, "cpu").model.eval()
    ids = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(2))
    loaded = [transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager")]
    if mode == "lora":
        peft = pytest.importorskip("peft")
        hf_base = transformers.AutoModelForCausalLM.from_pretrained(base, attn_implementation="eager")
        loaded.append(peft.PeftModel.from_pretrained(hf_base, tmp_path / "peft"))
    with torch.no_grad():
        expected = ours(ids)
        for model in loaded:
            torch.testing.assert_close(model.eval()(ids).logits, expected, atol=2e-5, rtol=0)
    assert load_hf_config(tmp_path / "hf").family == family


def test_unsupported_activation_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "hf"
    hf_gemma("gemma2").save_pretrained(path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["hidden_activation"] = "relu"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"config\.json: hidden_activation 'relu' is not supported"):
        load_hf_config(path)
    cfg["hidden_activation"], cfg["layer_types"] = "gelu_pytorch_tanh", ["full_attention"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"layer_types .* each of the 4 layers"):
        load_hf_config(path)


def test_resolve_and_validate_say_what_gemma_does_not_run(tmp_path: Path) -> None:
    """Fused cross-entropy (no soft-capping), flex attention and the RMSNorm/SwiGLU kernels are turned off with
    one decision line each; pipeline parallelism is refused with one line."""
    from tracetrain.config import load_config
    from tracetrain.spec import resolve
    from tracetrain.validate import validate_run

    path = tmp_path / "hf"
    hf_gemma("gemma2").save_pretrained(path)
    cfg = load_config(None, [f"--model.init_from={path}", "--train.fused_ce=true", "--train.attention=flex"])
    args = load_hf_config(path)
    spec = resolve(cfg, torch.device("cpu"), model_args=args)
    decisions = {d.key: d for d in spec.decisions}  # one line per key: the family's replaces the earlier one
    assert [d.key for d in spec.decisions].count("train.fused_ce") == 1
    assert spec.fused_ce_chunk == 0 and "soft-cap" in decisions["train.fused_ce"].reason
    assert spec.attention == "sdpa" and "Gemma" in decisions["train.attention"].reason
    with pytest.raises(ConfigError, match=r"'parallel.pp' is not supported for a gemma2 model"):
        validate_run(cfg.replace({"parallel.pp": 2}), args)


def test_presets_count_what_transformers_builds() -> None:
    """Each Gemma preset's parameter count equals that of transformers' model of the same config (on meta)."""
    from tracetrain.models.accounting import num_params
    from tracetrain.models.hf import hf_config_dict
    from tracetrain.models.presets import PRESETS

    for name in ("gemma2-27b", "gemma3-4b", "gemma3-27b"):
        cfg = transformers.AutoConfig.for_model(**hf_config_dict(PRESETS[name], torch.bfloat16))
        with torch.device("meta"):
            hf = transformers.AutoModelForCausalLM.from_config(cfg)
        assert num_params(PRESETS[name]) == sum(p.numel() for p in hf.parameters()), name


def test_export_keeps_the_config(saved, tmp_path: Path) -> None:
    """hf_config_dict -> config.json -> load_hf_config gives back the same ModelArgs."""
    from tracetrain.models.export import export_hf

    _, path, _ = saved
    ours = load_ours(path)
    out = tmp_path / "out"
    shutil.rmtree(out, ignore_errors=True)
    export_hf(ours, ours.args, out, dtype=torch.float32)
    assert load_hf_config(out) == ours.args


@pytest.mark.parametrize("options", [{}, {"cuda_graph": True, "prefill_chunk": 4}])  # fixed-shape decode, chunks
def test_generate_matches_greedy_full_forward(saved, options: dict) -> None:
    """`generate` (left-padded batch, KV cache, windowed local layers) gives each prompt's greedy tokens."""
    from tracetrain.models.generate import generate

    _, path, _ = saved
    ours = load_ours(path)
    prompts = [[5, 17, 99, 3, 250, 7, 7, 12, 40], [8, 1, 2]]
    with torch.no_grad():
        expected = []
        for prompt in prompts:
            seq = list(prompt)
            for _ in range(12):  # well past the window of 6
                seq.append(int(ours(torch.tensor([seq]))[0, -1].argmax()))
            expected.append(seq[len(prompt) :])
        got = generate(ours, prompts, 12, eos_id=10**6, pad_id=258, **options)
    assert got == expected
