"""MLflow end to end against the real package: a real `mlflow server` (started here on 127.0.0.1, a sqlite
backend in tmp), a `sqlite:///` and a `file://` store, the default store read by `mlflow ui`, the URI forms
that cannot work refused in one line, and a store that goes away mid-run (the server killed, the file store
deleted) costing one warning while the run completes with its final checkpoint.

Everything here needs the full mlflow package (the `[mlflow]` extra; mlflow-skinny has no server and no
SQLAlchemy) and skips without it."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import cli_here
from helpers import SMALL, read_metrics

mlflow = pytest.importorskip("mlflow.server", reason="needs the full mlflow package: pip install 'tracetrain[mlflow]'")
from mlflow import MlflowClient  # noqa: E402

ARGS = [*SMALL, "--train.steps=8", "--train.eval_interval=0", "--train.eval_generate=0", "--logging.progress=false"]
ARGS += ["--logging.log_interval=2", "--data.synthetic_examples=200"]
# A server that is down costs MLflow's HTTP retries before the warning; one retry keeps these tests short.
FAST_HTTP = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "0"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`mlflow server` (or `mlflow ui`) in its own process group, up once /health answers."""

    def __init__(self, command: str, store: str, cwd: Path, env: dict[str, str] | None = None) -> None:
        port = _free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log = cwd / f"{command}-{port}.log"
        args = [sys.executable, "-m", "mlflow", command, "--backend-store-uri", store, "--host", "127.0.0.1"]
        args += ["--port", str(port), "--workers", "1"]
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                args,
                cwd=cwd,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})},
                start_new_session=True,
            )
        deadline = time.monotonic() + 300  # a loaded machine; a healthy server answers in seconds
        while not self._healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"mlflow {command} did not start:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.25)

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as response:
                return response.status == 200
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the server and its uvicorn worker: a group we started
        self.proc.wait()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mlflow_server")
    srv = Server("server", f"sqlite:///{tmp / 'mlflow.db'}", tmp)
    yield srv
    srv.stop()


def _train_args(tmp_path: Path, name: str, extra: tuple[str, ...]) -> list[str]:
    return [*ARGS, "--logging.mlflow=true", f"--train.output_dir={tmp_path}", f"--train.run_name={name}", *extra]


def train_cli(tmp_path: Path, name: str, env: dict[str, str], *extra: str) -> subprocess.CompletedProcess:
    """`tracetrain train` with MLflow on, in its own process; the MLflow variables are only those given."""
    full = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    full.update(env)
    args = _train_args(tmp_path, name, extra)
    return subprocess.run(
        [sys.executable, "-m", "tracetrain.cli", "train", *args], capture_output=True, text=True, env=full
    )


def train_here(tmp_path: Path, name: str, env: dict[str, str], *extra: str) -> subprocess.CompletedProcess:
    """train_cli's command through the CLI's `main` in this process (conftest.cli_here), under the same
    variables: no MLFLOW_ one but those given while it runs, and this process's own restored after it (the
    tracker sets some). The real process is test_http_server_gets_metrics_params_and_summary's (and the
    SQLAlchemy-less refusal's); this one skips seconds of imports (torch, mlflow)."""
    saved = os.environ.copy()
    for key in [key for key in os.environ if key.startswith("MLFLOW_")]:
        del os.environ[key]
    os.environ.update(env)
    try:
        return cli_here("train", *_train_args(tmp_path, name, extra), check=False)
    finally:
        os.environ.clear()
        os.environ.update(saved)


def assert_logged(client: MlflowClient, run_dir: Path, experiment: str = "tracetrain") -> None:
    """The run in the store holds metrics.jsonl's losses at their steps, the config and the summary."""
    exp = client.get_experiment_by_name(experiment)
    runs = client.search_runs([exp.experiment_id], filter_string=f"attributes.run_name = '{run_dir.name}'")
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    run = runs[0]
    steps, _ = read_metrics(run_dir)
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert sorted((m.step, m.value) for m in history) == [(r["step"], pytest.approx(r["loss"])) for r in steps]
    assert run.data.params["train.steps"] == "8"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert run.data.metrics["summary/tokens_per_s"] == pytest.approx(summary["tokens_per_s"])
    assert run.data.tags["tracetrain.run_dir"] == str(run_dir)


def test_http_server_gets_metrics_params_and_summary(server, tmp_path):
    proc = train_cli(tmp_path, "http", {"MLFLOW_TRACKING_URI": server.url})
    assert proc.returncode == 0, proc.stderr
    assert_logged(MlflowClient(server.url), tmp_path / "http")


def test_sqlite_store_end_to_end(tmp_path):
    uri = f"sqlite:///{tmp_path / 'runs.db'}"
    proc = train_here(tmp_path, "sq", {}, f"--logging.mlflow_tracking_uri={uri}", "--logging.mlflow_experiment=e2")
    assert proc.returncode == 0, proc.stderr
    assert_logged(MlflowClient(uri), tmp_path / "sq", "e2")


def test_file_uri_store_without_the_opt_in_variable(tmp_path, monkeypatch):
    """MLflow 3 refuses a file store unless MLFLOW_ALLOW_FILE_STORE=true; naming one is opting in."""
    uri = (tmp_path / "store").as_uri()
    proc = train_here(tmp_path, "fs", {"MLFLOW_TRACKING_URI": uri})
    assert proc.returncode == 0, proc.stderr
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # to read it here
    assert_logged(MlflowClient(uri), tmp_path / "fs")


def test_default_store_is_read_by_mlflow_ui(tmp_path):
    """The README's way to look: `MLFLOW_ALLOW_FILE_STORE=true mlflow ui --backend-store-uri runs/mlruns`."""
    proc = train_here(tmp_path / "runs", "df", {})
    assert proc.returncode == 0, proc.stderr
    ui = Server("ui", "runs/mlruns", tmp_path, {"MLFLOW_ALLOW_FILE_STORE": "true"})
    try:
        assert_logged(MlflowClient(ui.url), tmp_path / "runs" / "df")
    finally:
        ui.stop()


@pytest.mark.parametrize(
    ("uri", "env", "expected"),
    [
        ("http://127.0.0.1:{port}", FAST_HTTP, "no MLflow server answered"),
        ("{tmp}/store", {"MLFLOW_ALLOW_FILE_STORE": "false"}, "opens only with MLFLOW_ALLOW_FILE_STORE=true"),
        ("foo://x", {}, "unsupported URI 'foo://x'"),
        ("sqlite:///{tmp}/m.db", {"PYTHONPATH": "{shadow}"}, "needs the full mlflow package (mlflow-skinny has no"),
    ],
)
def test_a_store_that_cannot_be_opened_is_one_line(tmp_path, uri, env, expected):
    uri = uri.format(port=_free_port(), tmp=tmp_path)
    run = train_here
    if env.get("PYTHONPATH") == "{shadow}":  # SQLAlchemy absent, as with mlflow-skinny: a fresh process
        (tmp_path / "shadow" / "sqlalchemy").mkdir(parents=True)
        (tmp_path / "shadow" / "sqlalchemy" / "__init__.py").write_text("raise ImportError('absent (test shadow)')\n")
        env = {**env, "PYTHONPATH": os.pathsep.join([str(tmp_path / "shadow"), os.environ.get("PYTHONPATH", "")])}
        run = train_cli
    proc = run(tmp_path, "bad", {**env, "MLFLOW_TRACKING_URI": uri})
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and expected in last and "MLFLOW_TRACKING_URI" in last, proc.stderr


def test_the_experiment_name_must_not_be_empty(tmp_path):
    proc = train_here(tmp_path, "e", {}, "--logging.mlflow_experiment= ")
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("error: logging.mlflow_experiment is empty")


class At:
    """A training callback that does `action` once, at the log interval ending at `step`."""

    def __init__(self, step: int, action) -> None:
        self.step, self.action = step, action

    def on_step(self, step: int, metrics: dict) -> None:
        if step == self.step:
            self.action()


def train_api(tmp_path: Path, name: str, callback: At, *overrides: str):
    import tracetrain

    args = [*ARGS, f"--train.output_dir={tmp_path}", *overrides]
    return tracetrain.train(overrides=args, run_name=name, callbacks=[callback])


def assert_survived(result, stderr: str, trackers: list[str]) -> None:
    """The run went to its end and saved its final checkpoint; each failed tracker warned once, no traceback."""
    assert result.signum is None and Path(result.summary["checkpoint"]).is_dir(), result.summary
    steps, _ = read_metrics(result.run_dir)
    assert [r["step"] for r in steps] == list(range(1, 9))
    assert "Traceback" not in stderr, stderr
    warnings = [line for line in stderr.splitlines() if line.startswith("warning: ")]
    for name in trackers:
        mine = [line for line in warnings if line.startswith(f"warning: {name} stopped working at step ")]
        assert len(mine) == 1, stderr
        assert mine[0].endswith("training goes on without it (metrics.jsonl has every record)")


def test_a_server_killed_mid_run_costs_one_warning(tmp_path, monkeypatch, capfd):
    srv = Server("server", f"sqlite:///{tmp_path / 'k.db'}", tmp_path)
    for key, value in FAST_HTTP.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", srv.url)
    try:
        result = train_api(tmp_path, "killed", At(4, srv.stop), "--logging.mlflow=true")
    finally:
        srv.stop()
    assert_survived(result, capfd.readouterr().err, ["MLflow"])


def test_a_file_store_and_tensorboard_folder_deleted_mid_run_cost_one_warning_each(tmp_path, monkeypatch, capfd):
    pytest.importorskip("tensorboard", reason="tensorboard is an optional extra: pip install 'tracetrain[tensorboard]'")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")

    def delete() -> None:
        shutil.rmtree(tmp_path / "mlruns")
        shutil.rmtree(tmp_path / "gone" / "tensorboard")

    result = train_api(tmp_path, "gone", At(4, delete), "--logging.mlflow=true", "--logging.tensorboard=true")
    assert_survived(result, capfd.readouterr().err, ["MLflow", "TensorBoard"])
