"""Places a run or a command's output cannot go (issue #29 item 4, the "output paths" and "stdout full"
families): each is one line naming the config key or the output, no traceback. Real commands."""

import shutil
import subprocess
import sys

import pytest
from conftest import cli_here
from helpers import TINY

from tracetrain.config import load_config
from tracetrain.errors import ConfigError


@pytest.mark.parametrize(
    "run_name", ["a" * 300, "a/../../b", "..", "x\x00y", "a\\b"], ids=["300_chars", "dotdot", "parent", "nul", "bslash"]
)
def test_run_names_that_are_not_one_folder_are_refused(run_name):
    with pytest.raises(ConfigError, match=r"config key 'train.run_name': .* is not a folder name"):
        load_config(None, [f"--train.run_name={run_name!r}".replace("\\x00", "\\u0000")])


@pytest.mark.parametrize("where", ["afile", "afile/sub"], ids=["a_file", "under_a_file"])
@pytest.mark.parametrize("kind", ["synthetic", "instruction"])
def test_output_dir_that_is_a_file_or_under_one_is_one_line(tmp_path, where, kind):
    """Refused with the files the config names, before the data is built (an instruction run wrote its data
    cache into train.output_dir first: a NotADirectoryError traceback)."""
    (tmp_path / "afile").write_text("keep")
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"instruction": "a", "response": "b"}\n' * 8)
    data = [f"--data.kind={kind}", f"--data.path={rows}", "--data.template=plain"] if kind == "instruction" else []
    proc = cli_here(
        "train",
        *TINY,
        *data,
        "--train.steps=1",
        "--optim.warmup_steps=0",
        f"--train.output_dir={tmp_path / where}",
        "--train.run_name=r",
        check=False,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    what = "is a file" if where == "afile" else f"is inside {tmp_path / 'afile'}, which is a file"
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: config key 'train.output_dir': {tmp_path / where} {what}; name a folder (runs are made in it)"
    )
    assert (tmp_path / "afile").read_text() == "keep"


def test_output_to_a_full_device_is_one_line():
    # `tracetrain presets > /dev/full`: the write fails at the flush; a fresh process, for its real stdout.
    with open("/dev/full", "w") as full:
        proc = subprocess.run(
            [sys.executable, "-m", "tracetrain.cli", "presets"], stdout=full, stderr=subprocess.PIPE, text=True
        )
    assert proc.returncode == 1 and proc.stderr.strip() == "error: cannot write the output (No space left on device)"


def test_export_into_the_current_empty_folder(tmp_path, monkeypatch):

    cli_here(
        "train",
        *TINY,
        "--train.steps=1",
        "--optim.warmup_steps=0",
        f"--train.output_dir={tmp_path}",
        "--train.run_name=r",
    )
    out = tmp_path / "here"
    out.mkdir()
    monkeypatch.chdir(out)
    cli_here("export", str(tmp_path / "r"), "--hf", ".")  # was: ValueError: PosixPath('.') has an empty name
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()


def test_checkpoints_replaced_by_a_file_is_one_line_on_resume(tmp_path):
    cli_here(
        "train",
        *TINY,
        "--train.steps=1",
        "--optim.warmup_steps=0",
        f"--train.output_dir={tmp_path}",
        "--train.run_name=r",
    )
    run = tmp_path / "r"
    shutil.rmtree(run / "checkpoints")
    (run / "checkpoints").write_text("not a folder")
    proc = cli_here("train", "--resume", str(run), "--train.steps=2", check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert (
        proc.stderr.strip().splitlines()[-1]
        == f"error: {run} has no usable checkpoint (looked in {run / 'checkpoints'})"
    )
