"""Experiment trackers: the report page, TensorBoard, MLflow and Weights & Biases, on rank 0, fed the same
records as metrics.jsonl.

`open_trackers(cfg, run_dir, run_name)` returns the trackers the config turns on (`logging.report`:
RUN/report.html, `logging.tensorboard`, `logging.mlflow`, `logging.wandb`); each gets the resolved config
as parameters when it starts, every metrics.jsonl record (`log(record)`: MLflow and W&B name train lines
`train/<field>`, eval lines `eval/<field>`, at their step), `refresh()` at each log interval and the summary
at the end (`finish(summary)`). A package that is not installed, or a store that cannot be opened, is a
one-line error before training; a tracker that fails mid-run is one warning and is left out (`_Guarded`).

MLflow: `MlflowTracker` (every tracking URI form, below). W&B: project `logging.wandb_project`, files
under the run directory (`RUN/wandb`), and the standard environment (`WANDB_MODE=offline`,
`WANDB_API_KEY`, ...) as wandb reads it.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlparse

from tracetrain.config import Config
from tracetrain.errors import TracetrainError

_SKIP = {"step", "kind", "time"}


class Tracker(Protocol):
    def log(self, record: dict[str, Any]) -> None: ...

    def refresh(self) -> None: ...  # the log interval ended (the report page redraws)

    def finish(self, summary: dict[str, Any] | None) -> None: ...


def flat_config(cfg: Config) -> dict[str, Any]:
    """The resolved config as `section.key` -> value (lists joined with commas)."""
    import dataclasses

    out: dict[str, Any] = {}
    for section in dataclasses.fields(cfg):
        values = getattr(cfg, section.name)
        for f in dataclasses.fields(values):
            v = getattr(values, f.name)
            out[f"{section.name}.{f.name}"] = ",".join(map(str, v)) if isinstance(v, list | tuple) else v
    return out


def one_line(exc: BaseException) -> str:
    """An exception's message in one line of at most 300 characters (trackers' messages run to paragraphs)."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The numeric values of a metrics record, named `<kind>/<key>` (booleans as 0/1, None dropped)."""
    kind = record.get("kind", "train")
    out = {}
    for key, value in record.items():
        if key in _SKIP or value is None or isinstance(value, str | list | dict):
            continue
        out[f"{kind}/{key}"] = float(value)
    return out


class WandbTracker:
    def __init__(self, cfg: Config, run_dir: Path, run_name: str) -> None:
        try:
            import wandb
        except ImportError:
            raise TracetrainError(
                "logging.wandb = true needs the wandb package: pip install 'tracetrain[wandb]'"
            ) from None
        try:
            self.run = wandb.init(
                project=cfg.logging.wandb_project,
                name=run_name,
                dir=str(run_dir),
                config=flat_config(cfg),
                reinit="create_new",
            )
        except Exception as exc:  # no key, a bad WANDB_MODE or project: the user's setting, in one line
            raise TracetrainError(f"logging.wandb: cannot start a W&B run: {one_line(exc)}") from None

    def log(self, record: dict[str, Any]) -> None:
        values = scalars(record)
        if values:
            self.run.log(values, step=int(record.get("step", 0)))

    def refresh(self) -> None:
        pass

    def finish(self, summary: dict[str, Any] | None) -> None:
        for key, value in scalars({**(summary or {}), "kind": "summary"}).items():
            self.run.summary[key] = value
        self.run.finish(exit_code=0 if summary is not None else 1)


class TensorBoardTracker:
    """TensorBoard event files under RUN/tensorboard, tagged by field (`loss`, `eval_loss`) as before. Written on
    this thread at each log interval, the file opened for each append: a failure (the folder removed, a full
    disk) is an exception here, which the guard turns into one warning, not a traceback from a writer thread
    (SummaryWriter's) that the run cannot see."""

    def __init__(self, run_dir: Path) -> None:
        try:
            from tensorboard.compat.proto import event_pb2, summary_pb2
            from tensorboard.summary.writer.record_writer import RecordWriter
        except ImportError:
            raise TracetrainError(
                "logging.tensorboard = true needs the tensorboard package: pip install 'tracetrain[tensorboard]'"
            ) from None
        self.event_pb2, self.summary_pb2, self.record_writer = event_pb2, summary_pb2, RecordWriter
        folder = run_dir / "tensorboard"
        folder.mkdir(parents=True, exist_ok=True)
        name = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}"
        self.path = folder / name
        self.pending = [event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2")]
        self.refresh()

    def log(self, record: dict[str, Any]) -> None:
        Value = self.summary_pb2.Summary.Value
        values = [
            Value(tag=key, simple_value=float(v))
            for key, v in record.items()
            if key not in ("step", "time") and isinstance(v, int | float) and not isinstance(v, bool)
        ]
        if values:
            summary = self.summary_pb2.Summary(value=values)
            self.pending.append(self.event_pb2.Event(wall_time=time.time(), step=int(record["step"]), summary=summary))

    def refresh(self) -> None:
        events, self.pending = self.pending, []
        with open(self.path, "ab") as f:  # a removed folder fails here, on the training thread
            writer = self.record_writer(f)
            for event in events:
                writer.write(event.SerializeToString())

    def finish(self, summary: dict[str, Any] | None) -> None:
        self.refresh()


# ---------------------------------------------------------------------------------------------------
# The MLflow tracker: every tracking URI form MLflow takes, or one line saying what to set.
#
# Where: `logging.mlflow_tracking_uri`, else `$MLFLOW_TRACKING_URI`, else a file store at `<output_dir>/mlruns`
# (nothing to run). Each form is made to work, or refused before training in one line:
# - a file store (`file://...` or a plain path): MLflow 3 serves one only with `MLFLOW_ALLOW_FILE_STORE=true`,
#   which is set (unless the user set it) because naming a file store is asking for one;
# - a database (`sqlite:///...`, `postgresql://...`): needs SQLAlchemy, which the full `mlflow` package (the
#   `[mlflow]` extra) has and mlflow-skinny has not;
# - a server (`http(s)://...`): MLflow's HTTP client retries for about four minutes by default; a run sets
#   shorter limits (`_HTTP_DEFAULTS`, each overridden by its environment variable) so that a server that is
#   down costs seconds, at start-up (one line) or mid-run (one warning, `_Guarded`).
# Runs are written through an `MlflowClient` of their own, so MLflow's global active run is never touched (two
# `tracetrain.train()` calls in one process each get their run).

_DATABASES = {"sqlite", "postgresql", "mysql", "mssql"}
_HTTP_DEFAULTS = {  # at most 3 retries, 1 s backoff doubling (~7 s); MLflow's own: 7 retries, ~4 min
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "3",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "30",
}
_MAX_PARAMS = 100  # per log_batch call (MLflow's limit)


def tracking_uri(cfg: Config) -> tuple[str, str]:
    """(the tracking URI a run logs to, where it came from: the config key or variable that named it)."""
    if cfg.logging.mlflow_tracking_uri:
        return cfg.logging.mlflow_tracking_uri, "logging.mlflow_tracking_uri"
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"], "MLFLOW_TRACKING_URI"
    return (Path(cfg.train.output_dir).resolve() / "mlruns").as_uri(), "the default store"


def prepare_store(uri: str, source: str) -> None:
    """Set what the store needs, or raise one line saying what to install or set."""
    scheme = urlparse(uri).scheme.split("+")[0]  # "postgresql+psycopg2" names its driver after a "+"
    if scheme in ("", "file"):
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        if os.environ["MLFLOW_ALLOW_FILE_STORE"].strip().lower() not in ("true", "1"):
            raise TracetrainError(
                f"{source} = {uri!r} is an MLflow file store, which MLflow 3 opens only with "
                f"MLFLOW_ALLOW_FILE_STORE=true (it is {os.environ['MLFLOW_ALLOW_FILE_STORE']!r}); "
                "unset it, or use a database such as sqlite:///mlflow.db"
            )
    elif scheme in _DATABASES and not _has_sqlalchemy():
        raise TracetrainError(
            f"{source} = {uri!r} needs the full mlflow package (mlflow-skinny has no SQLAlchemy): "
            "pip install 'tracetrain[mlflow]'"
        )
    elif scheme in ("http", "https"):
        for name, value in _HTTP_DEFAULTS.items():
            os.environ.setdefault(name, value)


def _has_sqlalchemy() -> bool:
    try:
        import sqlalchemy  # noqa: F401
    except ImportError:
        return False
    return True


def _reason(exc: BaseException) -> str:
    """The cause of a failed MLflow call in one line (MLflow's messages run to paragraphs)."""
    chain: list[BaseException] = []
    e: BaseException | None = exc
    while e is not None and len(chain) < 10:
        chain.append(e)
        e = e.__cause__ or e.__context__
    if any(isinstance(c, ConnectionError) or type(c).__name__ == "ConnectionError" for c in chain):
        return "no MLflow server answered (is one running there? `mlflow server --host HOST --port PORT`)"
    return one_line(exc)


class MlflowTracker:
    """One MLflow run: the flat config as parameters, each metrics record at its step, the summary at the end."""

    def __init__(self, cfg: Config, run_dir: Path, run_name: str) -> None:
        try:
            from mlflow import MlflowClient
        except ImportError:
            raise TracetrainError(
                "logging.mlflow = true needs the mlflow package: pip install 'tracetrain[mlflow]'"
            ) from None
        if not cfg.logging.mlflow_experiment.strip():
            raise TracetrainError("logging.mlflow_experiment is empty; name an experiment (default 'tracetrain')")
        self.uri, source = tracking_uri(cfg)
        prepare_store(self.uri, source)
        try:
            self.client = MlflowClient(tracking_uri=self.uri)
            experiment_id = self._experiment(cfg.logging.mlflow_experiment)
            run = self.client.create_run(experiment_id, run_name=run_name, tags={"tracetrain.run_dir": str(run_dir)})
            self.run_id = run.info.run_id
            self._log_params(flat_config(cfg))
        except Exception as exc:  # any start-up failure of the store is the user's setting: one line
            raise TracetrainError(f"logging.mlflow: cannot log to {self.uri} ({source}): {_reason(exc)}") from None

    def _experiment(self, name: str) -> str:
        found = self.client.get_experiment_by_name(name)
        if found is not None:
            return str(found.experiment_id)
        try:
            return str(self.client.create_experiment(name))
        except Exception:  # another run created it first
            found = self.client.get_experiment_by_name(name)
            if found is None:
                raise
            return str(found.experiment_id)

    def _log_params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(k, str(v)[:500]) for k, v in params.items()]
        for i in range(0, len(items), _MAX_PARAMS):
            self.client.log_batch(self.run_id, params=items[i : i + _MAX_PARAMS])

    def log(self, record: dict[str, Any]) -> None:
        self._log_metrics(scalars(record), int(record.get("step", 0)))

    def refresh(self) -> None:
        pass

    def finish(self, summary: dict[str, Any] | None) -> None:
        if summary:
            step = int(summary.get("steps", summary.get("step", 0)) or 0)
            self._log_metrics(scalars({**summary, "kind": "summary"}), step)
        self.client.set_terminated(self.run_id, "FINISHED" if summary is not None else "KILLED")

    def _log_metrics(self, values: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        if values:
            now_ms = int(time.time() * 1000)
            self.client.log_batch(self.run_id, metrics=[Metric(k, v, now_ms, step) for k, v in values.items()])


class _Guarded:
    """A tracker whose failure mid-run is one warning on stderr, after which it is left out: trackers copy what
    metrics.jsonl already holds, so a store that goes away must not stop training or cost the checkpoint the
    run is heading to. Start-up failures are not guarded: they are the user's setting, refused in one line."""

    def __init__(self, name: str, tracker: Tracker) -> None:
        self.name, self.tracker = name, tracker
        self.failed = False
        self.step = 0

    def log(self, record: dict[str, Any]) -> None:
        self.step = int(record.get("step", self.step))
        self._call(self.tracker.log, record)

    def refresh(self) -> None:
        self._call(self.tracker.refresh)

    def finish(self, summary: dict[str, Any] | None) -> None:
        self._call(self.tracker.finish, summary)

    def _call(self, method: Any, *args: Any) -> None:
        if self.failed:
            return
        try:
            method(*args)
        except Exception as exc:  # warned, not hidden: the run goes on and metrics.jsonl keeps every record
            self.failed = True
            print(
                f"warning: {self.name} stopped working at step {self.step} ({type(exc).__name__}: {one_line(exc)}); "
                "training goes on without it (metrics.jsonl has every record)",
                file=sys.stderr,
                flush=True,
            )


def open_trackers(cfg: Config, run_dir: Path, run_name: str, world_size: int = 1) -> list[Tracker]:
    """The trackers the config turns on, the report page (train/run_report.py) first, each guarded (`_Guarded`)."""
    trackers: list[tuple[str, Tracker]] = []
    if cfg.logging.report:
        from tracetrain.train.run_report import RunReport

        trackers.append(("the report page", RunReport(run_dir, world_size)))
    if cfg.logging.tensorboard:
        trackers.append(("TensorBoard", TensorBoardTracker(run_dir)))
    if cfg.logging.mlflow:
        trackers.append(("MLflow", MlflowTracker(cfg, run_dir, run_name)))
    if cfg.logging.wandb:
        (run_dir / "wandb").mkdir(parents=True, exist_ok=True)
        trackers.append(("W&B", WandbTracker(cfg, run_dir, run_name)))
    return [_Guarded(name, tracker) for name, tracker in trackers]
