"""The MLflow tracker (train/tracking.py): every tracking URI form MLflow takes, or one line saying what to set.

Where: `logging.mlflow_tracking_uri`, else `$MLFLOW_TRACKING_URI`, else a file store at `<output_dir>/mlruns`
(nothing to run). Each form is made to work, or refused before training in one line:
- a file store (`file://...` or a plain path): MLflow 3 serves one only with `MLFLOW_ALLOW_FILE_STORE=true`,
  which is set (unless the user set it) because naming a file store is asking for one;
- a database (`sqlite:///...`, `postgresql://...`): needs SQLAlchemy, which the full `mlflow` package (the
  `[mlflow]` extra) has and mlflow-skinny has not;
- a server (`http(s)://...`): MLflow's HTTP client retries for about four minutes by default; a run sets
  shorter limits (`_HTTP_DEFAULTS`, each overridden by its environment variable) so that a server that is
  down costs seconds, at start-up (one line) or mid-run (one warning, train/tracking.py).
Runs are written through an `MlflowClient` of their own, so MLflow's global active run is never touched (two
`tracetrain.train()` calls in one process each get their run).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from tracetrain.config import Config
from tracetrain.errors import TracetrainError
from tracetrain.train.tracking import flat_config, one_line, scalars

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
