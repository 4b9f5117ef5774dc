"""Experiment tracking (train/tracking.py) against the real packages: an MLflow file store read back with
MlflowClient, and W&B offline run files; a missing package is a one-line error naming the extra."""

import json

import pytest
from conftest import cli_here
from helpers import SMALL, read_metrics, run_cli

ARGS = [*SMALL, "--train.steps=12", "--train.eval_interval=6", "--train.eval_generate=0", "--logging.progress=false"]


def test_mlflow_file_store_gets_metrics_config_and_summary(tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow", reason="mlflow is an optional extra: pip install 'tracetrain[mlflow]'")
    # Through the CLI's main in this process (test_tracking_mlflow.py runs MLflow runs in real ones).
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "")  # the default: a file store under the output directory
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "")  # put back after the test, and
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")  # unset during it: the tracker sets it (a file store opts in)
    cli_here(
        "train",
        *ARGS,
        "--logging.mlflow=true",
        "--logging.mlflow_experiment=exp1",
        f"--train.output_dir={tmp_path}",
        "--train.run_name=ml",
    )
    client = mlflow.tracking.MlflowClient((tmp_path / "mlruns").as_uri())
    exp = client.get_experiment_by_name("exp1")
    runs = client.search_runs([exp.experiment_id])
    assert [r.info.run_name for r in runs] == ["ml"] and runs[0].info.status == "FINISHED"
    run = runs[0]
    steps, _ = read_metrics(tmp_path / "ml")
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert [(m.step, m.value) for m in history] == [(r["step"], pytest.approx(r["loss"])) for r in steps]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "eval/eval_loss")] == [6, 12]  # + final
    from tracetrain.config import load_config

    assert float(run.data.params["optim.lr"]) == load_config(tmp_path / "ml" / "config.toml").optim.lr
    assert run.data.params["train.steps"] == "12"
    summary = json.loads((tmp_path / "ml" / "summary.json").read_text())
    assert run.data.metrics["summary/tokens_per_s"] == pytest.approx(summary["tokens_per_s"])
    assert run.data.tags["tracetrain.run_dir"] == str(tmp_path / "ml")


def test_wandb_offline_run_files(tmp_path):
    pytest.importorskip("wandb", reason="wandb is an optional extra: pip install 'tracetrain[wandb]'")
    run_cli(
        "train",
        *ARGS,
        "--logging.wandb=true",
        "--logging.wandb_project=proj",
        f"--train.output_dir={tmp_path}",
        "--train.run_name=wb",
        env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"},
    )
    files = list((tmp_path / "wb" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1, list((tmp_path / "wb").rglob("*"))
    data = files[0].read_bytes()
    # The records are protobuf; their keys and JSON-encoded values are plain bytes in the file.
    for key in (b"train/loss", b"train/tokens_per_s", b"eval/eval_loss", b"summary/tokens_per_s", b"optim.lr", b"proj"):
        assert key in data, key
    steps, _ = read_metrics(tmp_path / "wb")
    assert repr(steps[-1]["loss"]).encode() in data  # the last logged loss, as logged


@pytest.mark.parametrize(("key", "extra"), [("mlflow", "mlflow"), ("wandb", "wandb")])
def test_a_missing_tracking_package_is_one_line_naming_the_extra(tmp_path, monkeypatch, key, extra):
    # The package cannot be imported (None in sys.modules: `import` raises ImportError, as for a package that
    # is not installed), in this process through the CLI's main; test_tracking_mlflow.py's SQLAlchemy case
    # and this file's W&B runs start real processes.
    import sys

    monkeypatch.setitem(sys.modules, key, None)
    proc = cli_here("train", *ARGS, f"--logging.{key}=true", f"--train.output_dir={tmp_path}", check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"error: logging.{key} = true needs the {key} package: pip install 'tracetrain[{extra}]'"
    ]


KILL_WANDB_MID_RUN = """
import os, signal, sys
import tracetrain

class KillWandbAt4:
    def on_step(self, step, metrics):
        if step != 4:
            return
        me = str(os.getpid())  # wandb-core, the service this process started for its W&B run
        for pid in filter(str.isdigit, os.listdir("/proc")):
            stat = open(f"/proc/{pid}/stat").read()
            if stat.rsplit(") ", 1)[1].split()[1] == me and b"wandb-core" in open(f"/proc/{pid}/cmdline", "rb").read():
                os.kill(int(pid), signal.SIGKILL)

result = tracetrain.train(overrides=sys.argv[1:], callbacks=[KillWandbAt4()])
print("CHECKPOINT", result.summary["checkpoint"])
"""


def test_wandb_service_killed_mid_run_costs_one_warning(tmp_path):
    """A real failure: the wandb-core service of the run is killed at step 4. wandb prints its own lost-socket
    messages; tracetrain warns once, finishes the run and saves its final checkpoint."""
    pytest.importorskip("wandb", reason="wandb is an optional extra: pip install 'tracetrain[wandb]'")
    import os
    import subprocess
    import sys
    from pathlib import Path

    args = [*ARGS, "--train.steps=8", "--logging.log_interval=2", "--train.eval_interval=0", "--logging.wandb=true"]
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    proc = subprocess.run(
        [sys.executable, "-c", KILL_WANDB_MID_RUN, *args, f"--train.output_dir={tmp_path}", "--train.run_name=wk"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    checkpoint = proc.stdout.split("CHECKPOINT ")[1].strip()
    assert Path(checkpoint).is_dir() and Path(checkpoint).parent.parent == tmp_path / "wk"
    steps, _ = read_metrics(tmp_path / "wk")
    assert [r["step"] for r in steps] == list(range(1, 9))
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("warning: W&B stopped working")]
    assert len(warnings) == 1 and warnings[0].startswith("warning: W&B stopped working at step 5 "), proc.stderr


def test_a_wandb_run_that_cannot_start_is_one_line(tmp_path):
    pytest.importorskip("wandb", reason="wandb is an optional extra: pip install 'tracetrain[wandb]'")
    proc = run_cli(
        "train",
        *ARGS,
        "--logging.wandb=true",
        f"--train.output_dir={tmp_path}",
        check=False,
        env={"WANDB_MODE": "bogus"},
    )
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: logging.wandb: cannot start a W&B run: ") and "'bogus'" in last
