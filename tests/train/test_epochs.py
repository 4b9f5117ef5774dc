"""`train.epochs`: the step count sized from the built data, recorded in the run, kept on resume."""

import json
import shutil
import tomllib

import pytest
from conftest import cli_here
from helpers import read_metrics

from tracetrain.config import load_config, resolve_warmup
from tracetrain.data import build_datasets, load_tokenizer
from tracetrain.errors import ConfigError
from tracetrain.train.optim import lr_factor, steps_for_epochs

EPOCH_RUN = [
    "--train.epochs=2",
    "--train.micro_batch_size=8",
    "--train.grad_accum_steps=2",
    "--data.synthetic_examples=300",
    "--data.seq_len=64",
    "--train.eval_interval=0",
    "--train.eval_batches=2",
    "--train.eval_generate=0",  # optim.warmup_steps unset: 10% of the steps the data sizes
    "--logging.log_interval=1",
    "--checkpoint.interval=4",
    "--checkpoint.keep_last=10",
]


def test_steps_for_epochs_rounds_up_and_ignores_float_noise():
    assert steps_for_epochs(2, 15, 2) == 15  # ceil(30 / 2)
    assert steps_for_epochs(1, 15, 2) == 8  # ceil(7.5): the last, partial accumulation counts
    assert steps_for_epochs(0.1, 30, 1) == 3  # not 4: 0.1 * 30 = 3.0000000000000004
    assert steps_for_epochs(0.01, 5, 1) == 1  # at least one step


def test_steps_and_epochs_together_is_one_line_error():
    with pytest.raises(
        ConfigError,
        match=r"^config keys 'train.steps' \(100\) and 'train.epochs' \(2.0\) are both "
        r"set; set one",
    ):
        load_config(None, ["--train.steps=100", "--train.epochs=2"])
    assert load_config(None, ["--train.epochs=2"]).train.steps == 600  # default steps: epochs decides
    proc = cli_here("train", "--train.steps=100", "--train.epochs=2", check=False)
    assert proc.returncode == 2 and proc.stderr.startswith("error: config keys 'train.steps'")
    assert len(proc.stderr.strip().splitlines()) == 1


@pytest.fixture(scope="module")
def epoch_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs")
    proc = cli_here("train", *EPOCH_RUN, f"--train.output_dir={out}", "--train.run_name=e")
    (out / "stdout.txt").write_text(proc.stdout)
    return out / "e"


def _expected_steps() -> tuple[int, int]:
    cfg = load_config(None, EPOCH_RUN)
    train_ds, _, _ = build_datasets(cfg.data, load_tokenizer(cfg.data.tokenizer))
    batches = len(train_ds) // cfg.train.micro_batch_size  # the loader drops the last partial batch
    return batches, -(-2 * batches // cfg.train.grad_accum_steps)


def test_epochs_size_the_run_schedule_and_records(epoch_run):
    batches, steps = _expected_steps()
    summary = json.loads((epoch_run / "summary.json").read_text())
    assert (summary["steps"], summary["epochs"], summary["batches_per_epoch"]) == (steps, 2.0, batches)
    # config.toml: the resolved count as a comment; the file loads back with epochs deciding again.
    text = (epoch_run / "config.toml").read_text()
    assert f"# steps = {steps}  (resolved from epochs = 2.0: {batches} micro-batches" in text
    cfg = load_config(epoch_run / "config.toml")
    assert cfg.train.epochs == 2.0 and tomllib.loads(text)["train"].get("steps") is None
    # The lr schedule decays over the resolved steps, not the default 600.
    train_rows, _ = read_metrics(epoch_run)
    assert [r["step"] for r in train_rows] == list(range(1, steps + 1))
    for r in train_rows:
        assert r["lr"] == pytest.approx(cfg.optim.lr * lr_factor(r["step"] - 1, cfg.optim, steps), rel=1e-6)
    assert train_rows[-1]["lr"] < 0.2 * cfg.optim.lr  # cosine to min_lr_ratio 0.1 at the end
    ckpts = sorted(p.name for p in (epoch_run / "checkpoints").iterdir())
    assert ckpts[-1] == f"step_{steps:08d}" and f"step_{4:08d}" in ckpts
    # The unset warm-up is a share of the resolved steps (not of the default 600), said once.
    warmup = steps // 10
    assert cfg.optim.warmup_steps is None and resolve_warmup(cfg.optim, steps) == warmup > 0
    said = f"warm-up: {warmup} step{'s' if warmup != 1 else ''} (10% of {steps}; optim.warmup_steps not set)"
    assert (epoch_run.parent / "stdout.txt").read_text().count(said) == 1
    # The run's page counts steps against the resolved total.
    assert f"steps<b>{steps} / {steps}</b>" in (epoch_run / "report.html").read_text()


def test_epoch_run_resumes_exactly(epoch_run, tmp_path):
    _, steps = _expected_steps()
    resumed = tmp_path / "r"
    shutil.copytree(epoch_run, resumed)
    last = max(p for p in (resumed / "checkpoints").iterdir())
    shutil.rmtree(last)  # as if it had stopped after the step-12 checkpoint
    (resumed / "summary.json").unlink()
    proc = cli_here("train", "--resume", str(resumed))
    assert "resumed from" in proc.stdout + proc.stderr
    a = json.loads((epoch_run / "summary.json").read_text())
    b = json.loads((resumed / "summary.json").read_text())
    assert b["steps"] == steps and b["train_loss"] == pytest.approx(a["train_loss"], abs=1e-6)
    assert b["eval_loss"] == pytest.approx(a["eval_loss"], abs=1e-6)


def test_warmup_longer_than_the_epoch_run_is_refused(tmp_path):
    proc = cli_here(
        "train",
        *[a for a in EPOCH_RUN if not a.startswith("--optim.warmup_steps")],
        "--optim.warmup_steps=50",
        f"--train.output_dir={tmp_path}",
        "--train.run_name=w",
        check=False,
    )
    batches, steps = _expected_steps()
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        f"error: config key 'optim.warmup_steps': 50 is not shorter than the run ({steps} "
        f"steps from train.epochs = 2.0 over {batches} batches); set it below {steps} "
        f"(e.g. --optim.warmup_steps={steps // 10})"
    )
