"""Helpers of the architecture-family tests (test_arch_*.py): tiny random transformers checkpoints of a
family, tracetrain's model of them, and the comparisons (transformers and PEFT are the references)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers
from conftest import cli_here

from tracetrain.models.hf import load_hf_config, load_hf_weights
from tracetrain.models.llama import Transformer

TINY = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=259,
    bos_token_id=256,
    eos_token_id=257,
)
TRAIN = [
    "--train.steps=3",
    "--train.micro_batch_size=2",
    "--data.synthetic_examples=64",
    "--data.seq_len=64",
    "--train.eval_interval=0",
    "--train.eval_generate=0",
    "--optim.warmup_steps=1",
    "--logging.progress=false",
]


def save_tiny(folder: Path, config_cls: str, **overrides) -> torch.nn.Module:
    """A tiny random transformers model of `config_cls` (e.g. 'Qwen3Config') saved in `folder` (fp32)."""
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**{**TINY, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(folder)
    return model.eval()


def load_tracetrain(folder: Path) -> Transformer:
    model = Transformer(load_hf_config(folder))
    load_hf_weights(model, folder)
    return model.eval()


def tokens(seq: int = 40, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(1))


def assert_same_logits(reference: torch.nn.Module, model: torch.nn.Module, x: torch.Tensor | None = None) -> None:
    """fp32 logits equal within 1e-4 (the models compute the same ops, in places in another order)."""
    x = tokens() if x is None else x
    with torch.no_grad():
        expected = reference(x).logits
        actual = model(x) if isinstance(model, Transformer) else model(x).logits
    assert expected.abs().max() > 1e-3  # a comparison of two near-zero outputs would prove nothing
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=0)


def train_and_export(base: Path, out: Path, mode: str, *extra: str) -> tuple[Path, dict]:
    """A few CPU steps of `mode` from `base` through the CLI, exported with --hf (and --peft for LoRA);
    returns (the run directory, its summary)."""
    cli_here(
        "train",
        *TRAIN,
        f"--model.init_from={base}",
        f"--train.mode={mode}",
        f"--train.output_dir={out}",
        "--train.run_name=r",
        *extra,
    )
    run = out / "r"
    exports = ["--hf", str(out / "hf"), "--dtype", "fp32"] + (["--peft", str(out / "peft")] if mode == "lora" else [])
    cli_here("export", str(run), *exports)
    return run, json.loads((run / "summary.json").read_text())


def hf_from(folder: Path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
