"""A run trained with `train.fp8` exports and evaluates where FP8 cannot run (the CPU): FP8 is only how the
frozen matmuls ran, the checkpoint holds the same weights (tracetrain/inference.py `load_trained`).

Found on the GPU machine: `tracetrain export` of an FP8 LoRA run stopped with "'train.fp8' needs a CUDA GPU",
because export loads on the CPU. Training with FP8 needs a GPU, so here a CPU run's checkpoint gets
`train.fp8 = "rowwise"` in its config.toml, as an FP8 run's has."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tracetrain.cli import main
from tracetrain.inference import load_trained
from tracetrain.kernels.fp8 import Float8FrozenLinear

pytestmark = pytest.mark.usefixtures("one_thread_torch")

TINY = ["--train.steps=2", "--train.micro_batch_size=2", "--data.synthetic_examples=60", "--data.seq_len=32",
        "--train.eval_interval=0", "--train.eval_batches=1", "--train.eval_generate=0", "--optim.warmup_steps=1",
        "--logging.progress=false", "--model.dim=64", "--model.n_layers=2", "--model.ffn_dim=128",
        "--train.mode=lora"]


def _as_fp8_run(run: Path) -> None:
    from tracetrain.train.manifest import step_of, write_manifest

    for config in [run / "config.toml", *run.glob("checkpoints/*/config.toml")]:
        text = config.read_text()
        assert 'fp8 = "none"' in text, config
        config.write_text(text.replace('fp8 = "none"', 'fp8 = "rowwise"'))
    for ckpt in run.glob("checkpoints/*"):  # as the trainer would have recorded the edited config
        write_manifest(ckpt, step_of(ckpt))


def test_an_fp8_runs_checkpoint_exports_and_loads_on_the_cpu(tmp_path, capsys):
    assert main(["train", *TINY, f"--train.output_dir={tmp_path}", "--train.run_name=r"]) == 0
    run = tmp_path / "r"
    _as_fp8_run(run)
    loaded = load_trained(run, "cpu")
    assert loaded.cfg.train.fp8 == "none" and loaded.spec.fp8 == "none"
    assert "weights run unquantised here" in capsys.readouterr().err  # said, not silent
    assert not any(isinstance(m, Float8FrozenLinear) for m in loaded.model.modules())
    capsys.readouterr()
    assert main(["export", str(run), "--hf", str(tmp_path / "hf")]) == 0, capsys.readouterr()
    assert (tmp_path / "hf" / "config.json").is_file()
    # And the check can fail: the same load with FP8 kept would have refused, as before the fix.
    from tracetrain.config import load_config
    from tracetrain.errors import ConfigError
    from tracetrain.spec import resolve

    ckpt = next(run.glob("checkpoints/*/config.toml"))
    with pytest.raises(ConfigError, match=r"train\.fp8"):
        resolve(load_config(ckpt), torch.device("cpu"))
