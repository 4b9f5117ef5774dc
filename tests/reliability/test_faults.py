"""Fault injection (issue #29 items 1-2): no failure after the first step loses the run, and the files a run
writes are written safely. Real processes, real signals, a pipe closed by its reader, a real EFBIG from
RLIMIT_FSIZE, a callback that raises, symbolic links planted in a run directory; no mocks."""

import json
import multiprocessing
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
import torch
from conftest import cli_here
from helpers import TINY, _steps_logged, _wait_for

import tracetrain
from tracetrain.data import token_cache
from tracetrain.data.loader import StatefulLoader
from tracetrain.data.packing import PackedDataset
from tracetrain.train.checkpoint import list_checkpoints
from tracetrain.train.faults import RunStopped

pytestmark = pytest.mark.usefixtures("one_thread_torch")

CLI = [sys.executable, "-m", "tracetrain.cli"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _start(tmp_path: Path, *args: str, **popen: object) -> subprocess.Popen:
    cmd = [*CLI, "train", *TINY, f"--train.output_dir={tmp_path}", "--train.run_name=r", *args]
    return subprocess.Popen(cmd, text=True, env=ENV, **popen)  # type: ignore[call-overload]


def _saved_step(run_dir: Path) -> int:
    """The one checkpoint of the run, which the interruption record names."""
    ckpts = list_checkpoints(run_dir)
    assert len(ckpts) == 1, ckpts
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["interrupted"] and summary["checkpoint"] == str(ckpts[0])
    return int(summary["step"])


# ---- point 1: every way a run can be stopped saves it first -------------------------------------------


def test_closed_stdout_saves_then_one_line_exit_1_and_the_run_resumes(tmp_path: Path):
    # `tracetrain train ... | head -3`: the reader quits while the run goes on.
    proc = _start(tmp_path, "--train.steps=100000", stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    line = "setup"
    while line and not line.startswith("step"):  # past the setup lines (decisions, data) to the first step's
        line = proc.stdout.readline()
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: the output was closed"), err
    run_dir = tmp_path / "r"
    step = _saved_step(run_dir)
    assert f"saved checkpoint {run_dir / 'checkpoints'}" in lines[0] and step >= 1
    # The checkpoint is a real one: the run continues from it.
    resumed = cli_here("train", "--resume", str(run_dir), f"--train.steps={step + 2}", "--logging.report=false")
    assert resumed.returncode == 0, resumed.stderr
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "train"][-2:] == [step + 1, step + 2]


@pytest.mark.parametrize("first", [signal.SIGHUP, signal.SIGTERM])
def test_first_signal_saves_and_decides_the_exit_status_whatever_follows(tmp_path: Path, first: signal.Signals):
    # SIGHUP: a closed terminal. SIGTERM then an impatient Ctrl-C that lands after the save, while the
    # process exits: the status is still 128 + the first signal. The first signal goes to the whole process
    # group, as a terminal's hangup or Ctrl-C does, so the data workers get it too: they inherited the handler
    # and must stay silent (it printed "received: finishing this step" as if it were the run).
    log = tmp_path / "log.txt"
    with open(log, "w") as out:  # a file, not a pipe: nothing blocks on an unread pipe
        proc = _start(
            tmp_path,
            "--train.steps=100000",
            "--data.num_workers=2",
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, as a shell job's
        )
        _wait_for(lambda: _steps_logged(tmp_path / "r") >= 2, proc, "two steps")
        os.killpg(proc.pid, first)
        _wait_for(lambda: "received: saved checkpoint" in log.read_text(), proc, "the save")
        while proc.poll() is None:  # SIGINT after SIGINT until the process is gone
            try:
                proc.send_signal(signal.SIGINT)
            except ProcessLookupError:
                break
            time.sleep(0.005)
        proc.wait(timeout=60)
    assert proc.returncode == 128 + first, log.read_text()
    assert log.read_text().count("received: finishing this step") == 1, log.read_text()
    assert _saved_step(tmp_path / "r") >= 2


def test_full_disk_while_logging_saves_then_one_line_exit_1(tmp_path: Path):
    # A real EFBIG: every file of the child may grow to 128 KiB. metrics.jsonl reaches that after ~360
    # steps, while the checkpoint's largest file (the optimizer state, ~110 KiB) still fits.
    limit = 128 << 10

    def small_files() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    proc = _start(
        tmp_path,
        "--train.steps=100000",
        "--logging.report=false",
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        preexec_fn=small_files,
    )
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: the disk is full writing "), err
    assert "metrics.jsonl" in lines[0] and "saved checkpoint" in lines[0]
    assert _saved_step(tmp_path / "r") > 100


def test_report_that_cannot_be_written_warns_once_and_training_goes_on(tmp_path: Path):
    # report.html (~20 KiB) cannot be written under a 16 KiB file size limit; everything else fits.
    limit = 16 << 10

    def small_files() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    proc = _start(
        tmp_path,
        "--train.steps=4",
        "--checkpoint.save_final=false",
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        preexec_fn=small_files,
    )
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 0, err
    assert err.count("warning: could not write") == 1 and "training goes on" in err, err
    run_dir = tmp_path / "r"
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 4
    assert not [p.name for p in run_dir.iterdir() if ".tmp-" in p.name]  # no temporary file left behind


class _Boom:
    def on_step(self, step: int, metrics: dict) -> None:
        if step == 3:
            raise ValueError("the user's hook failed")


def test_callback_that_raises_saves_the_steps_done_then_stops(tmp_path: Path):
    config = {"train": {"steps": 50, "output_dir": str(tmp_path), "run_name": "r"}}
    with pytest.raises(RunStopped) as caught:
        tracetrain.train(config, overrides=TINY, callbacks=[_Boom()])
    message = str(caught.value)
    assert "callback _Boom.on_step raised ValueError: the user's hook failed at step 3" in message
    assert f"continue with: tracetrain train --resume {tmp_path / 'r'}" in message
    assert _saved_step(tmp_path / "r") == 3
    # The previous handlers are back (the API restores them): the test process can still be interrupted.
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_data_worker_outlives_the_stop_signals_that_reach_it():
    # A scheduler's stop (Slurm, systemd, `kill -- -PGID`) and a terminal's Ctrl-C reach every process of the
    # job, the data workers too. Torch's workers die of SIGTERM (their own handler), and the run then ended on
    # "DataLoader worker ... is killed by signal" instead of saving at the step boundary (under torchrun,
    # without any save). The real loader, its real worker process, real signals.
    rows = {key: torch.arange(64).reshape(16, 4) for key in token_cache.ROW_KEYS}
    loader = StatefulLoader(PackedDataset(rows), 2, shuffle=False, seed=0, drop_last=True, num_workers=1)
    before = set(multiprocessing.active_children())
    first = next(loader)
    (worker,) = set(multiprocessing.active_children()) - before
    for stop in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        os.kill(worker.pid, stop)
    time.sleep(0.5)  # a worker killed by the signal is gone by now
    assert worker.is_alive()
    assert next(loader)["input_ids"].tolist() == (first["input_ids"] + 8).tolist()  # it still serves rows
    del loader  # ends the worker


class _SignalInTheLastStep:
    """A real SIGTERM to this process from the callback of the step before the last: it lands in the last."""

    def __init__(self, last: int) -> None:
        self.last = last

    def on_step(self, step: int, metrics: dict) -> None:
        if step == self.last - 1:
            os.kill(os.getpid(), signal.SIGTERM)


def test_a_signal_in_the_last_step_saves_once_and_the_resume_only_ends_the_run(tmp_path: Path):
    config = {"train": {"steps": 4, "output_dir": str(tmp_path), "run_name": "r"}}
    result = tracetrain.train(config, overrides=TINY, callbacks=[_SignalInTheLastStep(4)])
    run_dir = tmp_path / "r"
    assert result.signum == signal.SIGTERM and _saved_step(run_dir) == 4  # one save, at the last step
    (saved,) = list_checkpoints(run_dir)
    inode = saved.stat().st_ino
    # Resumed at its last step, the run trains nothing: the final evaluation and the summary, with the
    # checkpoint of the signal as the final one; saving it again replaced it with a copy (a moment with
    # no checkpoint of the run on disk).
    resumed = cli_here("train", "--resume", str(run_dir), "--logging.report=false")
    assert resumed.returncode == 0, resumed.stderr
    assert list_checkpoints(run_dir) == [saved] and saved.stat().st_ino == inode
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["checkpoint"] == str(saved) and "eval_loss" in summary
    assert "interrupted" not in summary


# ---- point 2: files written safely -------------------------------------------------------------------


@pytest.fixture(scope="module")
def finished_once(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 2-step run, trained once for the module; a string with a control character in its config."""
    out = tmp_path_factory.mktemp("finished")
    cli_here(
        "train",
        *TINY,
        "--train.steps=2",
        "--logging.report=false",
        "--logging.mlflow_experiment=bell\x07tab\there",
        f"--train.output_dir={out}",
        "--train.run_name=r",
    )
    return out / "r"


@pytest.fixture()
def finished(finished_once: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(finished_once, tmp_path / "r", symlinks=True))


@pytest.mark.parametrize("name", [".lock", "metrics.jsonl", "config.toml"])
def test_a_symlink_in_the_run_directory_is_refused_and_its_target_untouched(finished: Path, name: str):
    # The target holds what the run expects to read there (a valid config, lock, metrics), so the run gets
    # as far as writing it.
    victim = finished.parent / "victim.txt"
    shutil.copyfile(finished / name, victim)
    before = victim.read_bytes()
    (finished / name).unlink()
    (finished / name).symlink_to(victim)
    proc = cli_here("train", "--resume", str(finished), "--train.steps=3", check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"error: {finished / name} is a symbolic link; tracetrain writes only real " + (
        "files inside a run directory (remove the link and try again)"
    )
    assert victim.read_bytes() == before


def test_config_with_a_control_character_is_written_as_valid_toml_and_resumes(finished: Path):
    text = (finished / "config.toml").read_text()
    assert tomllib.loads(text)["logging"]["mlflow_experiment"] == "bell\x07tab\there"
    proc = cli_here("train", "--resume", str(finished), "--train.steps=3", "--logging.report=false", check=False)
    assert proc.returncode == 0, proc.stderr
    assert list_checkpoints(finished)[-1].name == "step_00000003"


@pytest.mark.parametrize("inside", ["checkpoints/step_00000002/hf", "exports/hf", "."])
def test_export_anywhere_inside_a_run_directory_is_refused(finished: Path, inside: str):
    out = finished / inside
    proc = cli_here("export", str(finished), "--hf", str(out), check=False)
    assert proc.returncode == 2, proc.stdout
    line = proc.stderr.strip()
    assert "\n" not in line and line.startswith("error: export folder"), line
    assert str(finished) in line
    assert not (finished / "exports").exists() and not (finished / "checkpoints/step_00000002/hf").exists()


def _rows(folder: Path) -> dict:
    with token_cache.row_writers(folder, "train") as out:
        token_cache.write_rows(out, {k: torch.arange(8).reshape(2, 4) for k in token_cache.ROW_KEYS})
    with token_cache.row_writers(folder, "eval") as out:
        token_cache.write_rows(out, {k: torch.arange(4).reshape(1, 4) for k in token_cache.ROW_KEYS})
    return {"rows": {"train": 2, "eval": 1}, "seq_len": 4, "stats": {}}


def test_token_cache_entry_damaged_at_its_right_size_is_rebuilt(tmp_path: Path):
    splits, _, reused = token_cache.open_or_build(tmp_path, "k", _rows)
    assert not reused
    array = token_cache.row_file(tmp_path / "text-k", "train", "input_ids")
    data = bytearray(array.read_bytes())
    data[5] ^= 0xFF  # a flipped byte: the size is unchanged
    array.write_bytes(bytes(data))
    splits, _, reused = token_cache.open_or_build(tmp_path, "k", _rows)
    assert not reused  # the damage was seen and the entry rebuilt
    assert splits["train"]["input_ids"].tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    _, _, reused = token_cache.open_or_build(tmp_path, "k", _rows)
    assert reused  # a sound entry is used as before
