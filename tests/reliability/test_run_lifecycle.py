"""A run's life on disk: one process per run directory, resume only onto the same data, no NaN/inf
weights in checkpoints, signals that save and say so in the exit status, no half-made run directories."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import cli_here, model_and_optimizer
from helpers import read_metrics

from tracetrain.config import load_config
from tracetrain.train.checkpoint import list_checkpoints, load_checkpoint, save_checkpoint
from tracetrain.train.resume import check_data_unchanged, data_fingerprint

pytestmark = pytest.mark.usefixtures("one_thread_torch")

# A tiny, fast run; log_interval=1 so that metrics.jsonl shows progress step by step.
RUN = [
    "--train.micro_batch_size=4",
    "--data.synthetic_examples=200",
    "--data.seq_len=64",
    "--model.n_layers=1",
    "--model.dim=64",
    "--model.ffn_dim=128",
    "--logging.log_interval=1",
    "--train.eval_interval=0",
    "--train.eval_generate=0",
    "--train.eval_batches=1",
    "--optim.warmup_steps=1",
]
CLI = [sys.executable, "-m", "tracetrain.cli"]


def _start(*args: str) -> subprocess.Popen:
    # One torch thread per process: the machine running the tests may have few cores.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([*CLI, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _wait_for_steps(run_dir: Path, num_steps: int, proc: subprocess.Popen) -> None:
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= num_steps:
            return
        time.sleep(0.05)
    raise AssertionError(f"no {num_steps} steps in {metrics}: {proc.communicate()}")


def _step_lines(run_dir: Path) -> list[int]:
    return [r["step"] for r in read_metrics(run_dir)[0]]


@pytest.fixture(scope="module")
def finished_once(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 3-step run with its final checkpoint, trained once for the module."""
    out = tmp_path_factory.mktemp("finished")
    cli_here("train", *RUN, "--train.steps=3", f"--train.output_dir={out}", "--train.run_name=r")
    return out / "r"


@pytest.fixture()
def finished(finished_once: Path, tmp_path: Path) -> Path:
    """A copy of that run for one test to resume, damage or extend (a resume takes the directory it is
    given: nothing in a run names its own path)."""
    return Path(shutil.copytree(finished_once, tmp_path / "r"))


# ---- 6: one process per run directory ----------------------------------------------------------------


def test_resume_of_a_run_before_its_first_checkpoint_names_the_process_that_has_it(finished: Path):
    """A run in its first steps has no checkpoint yet: `--resume` of it says who holds it (the lock), not that
    it has no usable checkpoint; once nobody holds it, the missing checkpoint is the refusal."""
    from tracetrain.errors import CheckpointError, TracetrainError
    from tracetrain.train.resume import resolve_resume
    from tracetrain.train.rundir import claim_new_run_dir

    young = finished.parent / "young"
    lock = claim_new_run_dir(young)  # held by this process, as a starting run holds it
    assert lock is not None
    shutil.copy(finished / "config.toml", young / "config.toml")
    try:
        with pytest.raises(TracetrainError) as refused:
            resolve_resume(str(young), None, [])
        assert str(refused.value) == (
            f"run directory {young} is in use by PID {os.getpid()} on host {socket.gethostname()} "
            f"(lock file {young / '.lock'}); wait for that run to end or stop it, then try again"
        )
    finally:
        lock.release()
    with pytest.raises(CheckpointError, match="has no usable checkpoint"):
        resolve_resume(str(young), None, [])


def test_second_resume_is_refused_while_the_first_runs_and_signals_exit_128_plus(finished: Path):
    first = _start("train", "--resume", str(finished), "--train.steps=2000")
    _wait_for_steps(finished, 6, first)  # resumed, and holding the lock
    second = _start("train", "--resume", str(finished), "--train.steps=2000")
    out, err = second.communicate(timeout=120)
    assert second.returncode == 2, out + err
    assert err.strip() == (
        f"error: run directory {finished} is in use by PID {first.pid} on host "
        f"{socket.gethostname()} (lock file {finished / '.lock'}); wait for that run to end "
        "or stop it, then try again"
    )
    # SIGINT: a checkpoint, the resume command, and 128 + 2 (not 0: it did not finish).
    first.send_signal(signal.SIGINT)
    out, err = first.communicate(timeout=120)
    assert first.returncode == 130, out + err
    assert "SIGINT received: saved checkpoint" in out + err
    assert f"continue with: tracetrain train --resume {finished}" in out + err
    steps = _step_lines(finished)
    assert steps == list(range(1, len(steps) + 1)), "every metric line once, in order"
    assert list_checkpoints(finished)[-1].name == f"step_{steps[-1]:08d}"


def test_two_fresh_runs_with_one_name_started_together_exactly_one_wins(tmp_path: Path):
    args = ["train", *RUN, "--train.steps=4", f"--train.output_dir={tmp_path}", "--train.run_name=same"]
    procs = [_start(*args), _start(*args)]
    results = [(p.wait(timeout=300), *p.communicate()) for p in procs]
    codes = sorted(code for code, _, _ in results)
    assert codes == [0, 2], results
    loser_err = next(err for code, _, err in results if code == 2)
    assert loser_err.strip() == (
        f"error: run directory {tmp_path / 'same'} already exists; choose another "
        f"train.run_name or continue it with --resume {tmp_path / 'same'}"
    )
    assert _step_lines(tmp_path / "same") == [1, 2, 3, 4]  # one run's lines, not two interleaved


# ---- 7: resume only onto the same data and the same or a longer run ---------------------------------


def _write_instructions(path: Path, answer_of_first: str) -> None:
    rows = [{"instruction": f"add {i} and {i + 1}", "response": str(2 * i + 1)} for i in range(64)]
    rows[0]["response"] = answer_of_first
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_resume_is_refused_when_the_data_changed_with_the_same_row_count(tmp_path: Path):
    data = tmp_path / "qa.jsonl"
    _write_instructions(data, "1")
    # The byte tokenizer's prompt template alone needs more than RUN's 64 tokens.
    args = [*RUN, "--data.kind=instruction", f"--data.path={data}", "--data.eval_fraction=0.1", "--data.seq_len=256"]
    cli_here("train", *args, "--train.steps=2", f"--train.output_dir={tmp_path}", "--train.run_name=q")
    _write_instructions(data, "one")  # one answer edited: same number of examples and rows
    proc = cli_here("train", "--resume", str(tmp_path / "q"), "--train.steps=4", check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    err = proc.stderr.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert err.startswith(
        f"error: cannot resume from {tmp_path / 'q' / 'checkpoints' / 'step_00000002'}: "
        f"the training data changed since it was saved (data.path {str(data)!r}: "
    )
    assert "other token ids or labels" in err
    _write_instructions(data, "1")  # the original data again: resumes
    cli_here("train", "--resume", str(tmp_path / "q"), "--train.steps=4")
    assert _step_lines(tmp_path / "q") == [1, 2, 3, 4]


def test_fingerprint_covers_tokens_and_labels_and_old_checkpoints_get_a_note(tmp_path: Path):
    from tracetrain.data.packing import PackedDataset

    rows = {k: torch.arange(12).reshape(3, 4) for k in ("input_ids", "labels", "position_ids", "document_ids")}
    base = data_fingerprint(PackedDataset(rows))
    other_label = {**rows, "labels": rows["labels"].clone()}
    other_label["labels"][2, 3] = -100
    assert data_fingerprint(PackedDataset(other_label)) != base
    assert data_fingerprint(PackedDataset({k: v.clone() for k, v in rows.items()})) == base
    cfg = load_config(None, [])
    note = check_data_unchanged("", base, cfg, tmp_path / "step_00000001", 3)
    assert note == (
        f"{tmp_path / 'step_00000001'} has no data fingerprint (saved by an older tracetrain): "
        "cannot check that the training data is unchanged"
    )


def test_resume_with_fewer_steps_than_the_checkpoint_is_refused(finished: Path):
    proc = cli_here("train", "--resume", str(finished), "--train.steps=2", check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "error: config key 'train.steps': 2 is below the step of the checkpoint to "
        "resume (step_00000003, step 3); use train.steps >= 3"
    )
    assert [p.name for p in list_checkpoints(finished)] == ["step_00000003"]  # nothing saved or deleted


# ---- 8: no NaN/inf weights in checkpoints; a run ending on skipped steps fails -----------------------


def _rewrite_checkpoint(run_dir: Path, edit) -> Path:
    """Load the run's checkpoint, apply `edit(model, optimizer)`, save it again (same step, through the
    real save path, so that the manifest matches). Returns the checkpoint folder."""
    cfg = load_config(run_dir / "config.toml")
    ckpt = list_checkpoints(run_dir)[-1]
    model, opt = model_and_optimizer(cfg)
    state = load_checkpoint(ckpt, model, opt, lora=False)
    with torch.no_grad():
        edit(model, opt)
    return save_checkpoint(run_dir, model, opt, state, (ckpt / "config.toml").read_text(), lora=False, keep_last=1)


def _first_moment_at_float32_limit(model, opt) -> None:
    next(iter(opt.state.values()))["exp_avg"].fill_(3e38)


def test_non_finite_weights_are_never_saved_and_keep_last_keeps_the_good_checkpoint(finished: Path):
    """From a checkpoint whose AdamW first moment is at float32's limit, the next step's loss and
    gradient are finite and its update overflows the weights. With keep_last = 1, saving that step
    would delete the only good checkpoint."""
    good = _rewrite_checkpoint(finished, _first_moment_at_float32_limit)
    proc = cli_here(
        "train",
        "--resume",
        str(finished),
        "--train.steps=6",
        "--checkpoint.interval=1",
        "--checkpoint.keep_last=1",
        "--train.max_bad_steps=100",
        check=False,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip() == (
        f"error: weights are NaN/inf after step 4: checkpoint not saved (the last "
        f"good checkpoint {good} is kept). Try a lower optim.lr, train.grad_clip > 0, "
        "or bf16 instead of fp16"
    )
    assert list_checkpoints(finished) == [good]
    cfg = load_config(finished / "config.toml")
    model, opt = model_and_optimizer(cfg)
    load_checkpoint(good, model, opt, lora=False)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_run_whose_final_steps_were_skipped_fails(finished: Path):
    # A finite lm_head at float32's limit: every logit overflows, every later loss is NaN and its step
    # skipped (the weights stay finite, so the final checkpoint is saved).
    _rewrite_checkpoint(finished, lambda model, opt: model.lm_head.weight.fill_(3e38))
    proc = cli_here("train", "--resume", str(finished), "--train.steps=5", "--train.max_bad_steps=100", check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    err = proc.stderr.strip()
    assert err.startswith(
        "error: the last 2 step(s) of the run (to step 5) had a NaN/inf loss or gradient and "
        "were not applied: the weights are those after step 3; checkpoint "
    )
    summary = json.loads((finished / "summary.json").read_text())
    assert summary["final_steps_skipped"] == 2 and summary["skipped_steps"] == 2


# ---- 9: signals --------------------------------------------------------------------------------------


def test_sigterm_saves_exits_143_and_a_second_signal_does_not_cut_the_save(tmp_path: Path):
    # A model large enough that its save takes a while: the later signals land in the step or the save.
    run_dir, log = tmp_path / "s", tmp_path / "log.txt"
    args = [
        *CLI,
        "train",
        *RUN,
        "--model.dim=512",
        "--model.ffn_dim=1024",
        "--model.n_layers=4",
        "--train.steps=2000",
        f"--train.output_dir={tmp_path}",
        "--train.run_name=s",
    ]
    with open(log, "w") as out:  # a file, not a pipe: nothing blocks on an unread pipe
        proc = subprocess.Popen(
            args, stdout=out, stderr=subprocess.STDOUT, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}
        )
        _wait_for_steps(run_dir, 2, proc)
        proc.send_signal(signal.SIGTERM)
        deadline = time.time() + 60
        while "SIGTERM received: finishing this step" not in log.read_text() and time.time() < deadline:
            time.sleep(0.01)
        proc.send_signal(signal.SIGINT)  # an impatient Ctrl-C ...
        proc.send_signal(signal.SIGTERM)  # ... and one more
        proc.wait(timeout=120)
    text = log.read_text()
    assert proc.returncode == 143, text
    assert text.count(f"to stop now without it: kill -9 {proc.pid}") == 1, text
    assert "SIGTERM received: saved checkpoint" in text
    ckpts = list_checkpoints(run_dir)
    assert len(ckpts) == 1
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["interrupted"] and summary["signal"] == "SIGTERM"
    assert ckpts[0].name == f"step_{summary['step']:08d}"


# ---- 10: a torn last metrics line ---------------------------------------------------------------------


def test_torn_last_metrics_line_is_dropped_on_resume(finished: Path):
    metrics = finished / "metrics.jsonl"
    with open(metrics, "a") as f:
        f.write('{"step": 4, "loss": 5.1, "grad_')  # a killed process's partial write
    config_inode = (finished / "config.toml").stat().st_ino
    proc = cli_here("train", "--resume", str(finished), "--train.steps=5")
    assert "dropped a torn last line" in proc.stdout + proc.stderr
    assert _step_lines(finished) == [1, 2, 3, 4, 5]
    # config.toml was replaced by a rename (atomic), not rewritten in place; no temporary file is left.
    assert (finished / "config.toml").stat().st_ino != config_inode
    assert not [p.name for p in finished.iterdir() if ".tmp-" in p.name]


# ---- 12: no half-made run directory --------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad",
    [["--train.micro_batch_size=64", "--data.synthetic_examples=40"], ["--model.vocab_size=100"]],
    ids=["batch-larger-than-data", "vocab"],
)
def test_failed_setup_leaves_no_run_directory(tmp_path: Path, bad: list[str]):
    proc = cli_here(
        "train",
        *RUN,
        "--train.steps=2",
        *bad,
        f"--train.output_dir={tmp_path / 'out'}",
        "--train.run_name=x",
        check=False,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out" / "x").exists()
