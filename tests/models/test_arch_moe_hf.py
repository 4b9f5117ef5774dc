"""Mixtral and Qwen3-MoE checkpoints on tracetrain's MoE layer, and Mistral's sliding window.

transformers is the reference: logits on load, exports it loads back (one tensor per expert, as its
checkpoints hold them), PEFT adapters; LoRA and full fine-tuning run through the CLI; expert shards read
only their experts' tensors; the window holds in training masks and in KV-cache generation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="architecture tests compare with transformers")

from conftest import cli_here  # noqa: E402
from hf_families import assert_same_logits, hf_from, load_tracetrain, save_tiny, tokens, train_and_export  # noqa: E402

from tracetrain.models.accounting import num_params  # noqa: E402
from tracetrain.models.export import export_hf  # noqa: E402
from tracetrain.models.generate import generate  # noqa: E402
from tracetrain.models.hf import load_hf_config, open_hf_checkpoint  # noqa: E402
from tracetrain.models.moe import MoEFeedForward  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread_torch")

MIXTRAL = ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2})
QWEN3_MOE = (
    "Qwen3MoeConfig",
    {
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "head_dim": 32,
        "norm_topk_prob": True,
        "mlp_only_layers": [1],
    },
)
QWEN3_MOE_RAW = (
    "Qwen3MoeConfig",
    {
        "num_experts": 4,
        "num_experts_per_tok": 3,
        "moe_intermediate_size": 32,
        "norm_topk_prob": False,
        "decoder_sparse_step": 2,
    },
)


def save_family(folder: Path, family: tuple[str, dict]) -> torch.nn.Module:
    return save_tiny(folder, family[0], **family[1])


@pytest.mark.parametrize(
    "family,sparse",
    [(MIXTRAL, [True] * 3), (QWEN3_MOE, [True, False, True]), (QWEN3_MOE_RAW, [False, True, False])],
    ids=["mixtral", "qwen3_moe", "qwen3_moe_raw"],
)
def test_moe_logits_equal_transformers_and_export_round_trips(
    tmp_path: Path, family: tuple[str, dict], sparse: list[bool]
) -> None:
    """Which blocks route (mlp_only_layers, decoder_sparse_step), top-k renormalised or not, as transformers."""
    reference = save_family(tmp_path / "base", family)
    model = load_tracetrain(tmp_path / "base")
    assert [isinstance(layer.mlp, MoEFeedForward) for layer in model.layers] == sparse
    assert num_params(model.args) == sum(p.numel() for p in reference.parameters())
    assert_same_logits(reference, model)
    export_hf(model, model.args, tmp_path / "out", dtype=torch.float32)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == reference.config.architectures
    assert load_hf_config(tmp_path / "out") == model.args
    assert_same_logits(hf_from(tmp_path / "out"), model)


def test_expert_shard_reads_only_its_experts(tmp_path: Path) -> None:
    """An expert-parallel rank's block (experts 2 and 3 of 4) is filled from those experts' tensors only."""
    save_family(tmp_path, MIXTRAL)
    model = load_tracetrain(tmp_path)
    full = model.layers[1].mlp.experts.down_proj.detach()  # (experts, dim, ffn)
    checkpoint = open_hf_checkpoint(tmp_path, model)
    local = torch.zeros(2, *full.shape[1:])
    assert checkpoint.fill(local, "layers.1.mlp.experts.down_proj", tuple(full.shape), (2, 0, 0))
    torch.testing.assert_close(local, full[2:])
    columns = torch.zeros(1, full.shape[1], 8)  # a block of rows and columns, as 2-D sharding cuts it
    assert checkpoint.fill(columns, "layers.1.mlp.experts.down_proj", tuple(full.shape), (3, 0, 8))
    torch.testing.assert_close(columns, full[3:, :, 8:16])
    checkpoint.close()


def test_moe_variant_of_a_preset_exports_as_mixtral(tmp_path: Path) -> None:
    """model.num_experts on a preset: the trained run exports as a Mixtral that transformers runs."""
    from tracetrain.inference import load_trained

    cli_here(
        "train",
        "--model.dim=64",
        "--model.n_layers=2",
        "--model.ffn_dim=96",
        "--model.num_experts=4",
        "--train.steps=2",
        "--train.micro_batch_size=2",
        "--data.synthetic_examples=32",
        "--data.seq_len=32",
        "--train.eval_interval=0",
        "--train.eval_generate=0",
        "--logging.progress=false",
        f"--train.output_dir={tmp_path}",
        "--train.run_name=r",
    )
    cli_here("export", str(tmp_path / "r"), "--hf", str(tmp_path / "hf"), "--dtype", "fp32")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == ["MixtralForCausalLM"]
    assert_same_logits(hf_from(tmp_path / "hf"), load_trained(tmp_path / "r", "cpu").model.eval())


@pytest.mark.slow  # CLI runs and their exports (about 30 s on a busy 2-core machine)
@pytest.mark.parametrize(
    "family,mode",
    [(MIXTRAL, "lora"), (QWEN3_MOE, "lora"), (MIXTRAL, "full")],
    ids=["mixtral-lora", "qwen3_moe-lora", "mixtral-full"],
)
def test_moe_fine_tunes_and_exports(tmp_path: Path, family: tuple[str, dict], mode: str) -> None:
    from tracetrain.inference import load_trained

    save_family(tmp_path / "base", family)
    # all-linear adapts an MoE block's attention only (its experts are not linear layers); Qwen3-MoE's dense
    # block would have MLP adapters, which a PEFT adapter cannot hold for transformers 5 (refused below).
    targets = "['all-linear']" if family == MIXTRAL else "['q_proj', 'k_proj', 'v_proj', 'o_proj']"
    run, summary = train_and_export(tmp_path / "base", tmp_path, mode, f"--lora.targets={targets}")
    assert summary["steps"] == 3 and torch.isfinite(torch.tensor(summary["train_loss"]))
    trained = load_trained(run, "cpu").model.eval()
    x = tokens()
    assert_same_logits(hf_from(tmp_path / "hf"), trained, x)
    if mode == "lora":
        peft = pytest.importorskip("peft")
        adapted = peft.PeftModel.from_pretrained(hf_from(tmp_path / "base"), tmp_path / "peft").eval()
        assert_same_logits(adapted, trained, x)


# ----------------------------------------------------------------------------------------------------
# Mistral's sliding window


def test_sliding_window_logits_equal_transformers(tmp_path: Path) -> None:
    reference = save_tiny(tmp_path, "MistralConfig", sliding_window=8)
    model = load_tracetrain(tmp_path)
    assert model.args.sliding_window == 8
    assert_same_logits(reference, model)  # 40 tokens: the window cuts every row after the eighth
    export_hf(model, model.args, tmp_path / "out", dtype=torch.float32)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["sliding_window"] == 8
    assert_same_logits(hf_from(tmp_path / "out"), model)


def test_sliding_window_generation_equals_transformers(tmp_path: Path) -> None:
    """Greedy decoding with the KV cache, one row and a left-padded batch: transformers' tokens."""
    reference = save_tiny(tmp_path, "MistralConfig", sliding_window=6)
    model = load_tracetrain(tmp_path)
    prompts = [tokens(seq=10, batch=1)[0].tolist(), tokens(seq=4, batch=1)[0].tolist()]
    ours = generate(model, prompts, 16, eos_id=-1, pad_id=0)
    for prompt, new in zip(prompts, ours, strict=True):
        with torch.no_grad():
            out = reference.generate(
                torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0
            )
        assert new == out[0, len(prompt) :].tolist()


def test_flex_attention_is_refused_for_a_window_shorter_than_the_rows(tmp_path: Path) -> None:
    save_tiny(tmp_path / "base", "MistralConfig", sliding_window=16)
    proc = cli_here(
        "train",
        f"--model.init_from={tmp_path / 'base'}",
        "--data.seq_len=128",
        "--train.attention=flex",
        f"--train.output_dir={tmp_path}",
        "--train.steps=1",
        check=False,
    )
    assert proc.returncode != 0 and "sliding window" in proc.stderr and "Traceback" not in proc.stderr


def test_peft_export_of_moe_dense_mlp_adapters_is_refused(tmp_path: Path) -> None:
    from tracetrain.models.export import export_peft_adapter
    from tracetrain.models.lora import apply_lora

    save_family(tmp_path / "base", QWEN3_MOE)
    model = load_tracetrain(tmp_path / "base")
    apply_lora(model, 4, 8.0, 0.0, ["all-linear"])
    with pytest.raises(ValueError, match=r"dense blocks' down_proj, gate_proj, up_proj.*export --hf"):
        export_peft_adapter(model, tmp_path / "peft", 4, 8.0, 0.0, ["all-linear"])
    assert not (tmp_path / "peft").exists()


@pytest.mark.slow  # a 2-rank run
def test_mixtral_on_expert_parallel_ranks_exports_its_experts(tmp_path: Path) -> None:
    """A Mixtral folder trained on 2 expert-parallel ranks (each reads and holds 2 of the 4 experts), saved
    by both ranks (DCP) and streamed to a Hugging Face folder: transformers computes the trained model."""
    from parallel_harness import cli_ranks

    from tracetrain.inference import load_trained

    reference = save_family(tmp_path / "base", MIXTRAL)
    args = [
        "--data.seq_len=32",
        "--data.synthetic_examples=40",
        "--train.steps=1",
        "--optim.warmup_steps=0",
        "--train.micro_batch_size=2",
        "--train.device=cpu",
        "--train.precision=fp32",
        "--train.eval_interval=0",
        "--train.eval_generate=0",
        "--logging.progress=false",
        "--parallel.dp_shard=2",
        "--parallel.ep=2",
        f"--model.init_from={tmp_path / 'base'}",
        f"--train.output_dir={tmp_path}",
        "--train.run_name=r",
    ]
    cli_ranks(2, "train", *args, timeout_s=400)  # launch_local: the CLI's main on each rank
    assert list((tmp_path / "r" / "checkpoints").glob("*/dcp/.metadata"))  # saved by both ranks
    cli_here("export", str(tmp_path / "r"), "--hf", str(tmp_path / "hf"), "--dtype", "fp32")
    exported = hf_from(tmp_path / "hf")
    assert_same_logits(exported, load_trained(tmp_path / "r", "cpu").model.eval())
    with torch.no_grad():  # one step of AdamW moved the experts: the export is the trained model
        x = tokens()
        assert not torch.allclose(exported(x).logits, reference(x).logits, atol=1e-5)


@pytest.mark.parametrize("preset", ["mixtral-8x7b", "qwen3-30b-a3b", "qwen3-0.6b"])
def test_planner_counts_the_experts_and_qk_norms(preset: str) -> None:
    """The planner's parameters are the built model's: experts, routers, q/k norms, LoRA on attention only."""
    from tracetrain.config import load_config
    from tracetrain.models.build import build_on_meta
    from tracetrain.models.lora import apply_lora
    from tracetrain.models.presets import PRESETS
    from tracetrain.plan.mapping import plan_input_from_config
    from tracetrain.plan.params import total_params, trainable_params

    cfg = load_config(None, [f"--model.preset={preset}", "--train.mode=lora", "--lora.targets=['all-linear']"])
    inp = plan_input_from_config(cfg)
    args = PRESETS[preset]
    assert total_params(inp) == num_params(args)
    model = build_on_meta(args)
    assert trainable_params(inp) == apply_lora(model, cfg.lora.rank, cfg.lora.alpha, 0.0, ["all-linear"])


def test_layouts_without_a_window_or_qk_norms_say_so_in_one_line(tmp_path: Path) -> None:
    """resolve picks SDPA for a window shorter than the rows (flex has none); CP (no window) and TP (Qwen3's
    q/k norms would get partial gradients) are refused naming their keys; fused kernels and FP8 say what
    they skip in an MoE model."""
    from tracetrain.config import load_config
    from tracetrain.errors import ConfigError
    from tracetrain.models.presets import PRESETS
    from tracetrain.parallel.mesh import validate_parallel
    from tracetrain.spec import resolve

    save_tiny(tmp_path / "mistral", "MistralConfig", sliding_window=16)
    cfg = load_config(None, [f"--model.init_from={tmp_path / 'mistral'}", "--data.seq_len=128", "--data.pack=true"])
    spec = resolve(cfg, torch.device("cuda"), probe=False)
    [attention] = [d for d in spec.decisions if d.key == "train.attention"]
    assert spec.attention == "sdpa" and "sliding window (16)" in attention.reason
    cp = cfg.replace({"parallel.cp": 2})
    with pytest.raises(ConfigError, match=r"parallel\.cp.*sliding window"):
        validate_parallel(cp, spec.model_args, 2)
    qwen3 = load_config(None, ["--model.preset=qwen3-0.6b", "--parallel.tp=2"])
    with pytest.raises(ConfigError, match=r"parallel\.tp.*q/k norms"):
        validate_parallel(qwen3, PRESETS["qwen3-0.6b"], 2)
    moe = load_config(None, ["--model.preset=mixtral-8x7b", "--train.fused_kernels=on", "--train.fp8=rowwise"])
    notes = {d.key for d in resolve(moe, torch.device("cuda"), probe=False).decisions if "experts" in d.value}
    assert notes == {"train.fused_kernels", "train.fp8"}
