"""Experiment trackers: MLflow and Weights & Biases, on rank 0, fed the same records as metrics.jsonl.

`open_trackers(cfg, run_dir, run_name)` returns the trackers the config turns on (`logging.mlflow`,
`logging.wandb`, and `logging.report`: RUN/report.html); each gets the resolved config as parameters when it starts, every metrics.jsonl record
(`log(record)`: train lines under `train/`, eval lines under `eval/`, at their step) and the summary at
the end (`finish(summary)`). A package that is not installed is a one-line error naming the extra.

MLflow: the tracking URI is `logging.mlflow_tracking_uri`, else the standard `MLFLOW_TRACKING_URI`, else
a local file store at `<output_dir>/mlruns` (nothing to run; `mlflow ui --backend-store-uri` reads it).
MLflow 3 keeps its file store only behind `MLFLOW_ALLOW_FILE_STORE=true`, which is set for that default.
W&B: project `logging.wandb_project`, files under the run directory (`RUN/wandb`), and the standard
environment (`WANDB_MODE=offline`, `WANDB_API_KEY`, ...) as wandb reads it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Protocol

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


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The numeric values of a metrics record, named `<kind>/<key>` (booleans as 0/1, None dropped)."""
    kind = record.get("kind", "train")
    out = {}
    for key, value in record.items():
        if key in _SKIP or value is None or isinstance(value, str | list | dict):
            continue
        out[f"{kind}/{key}"] = float(value)
    return out


class MlflowTracker:
    def __init__(self, cfg: Config, run_dir: Path, run_name: str) -> None:
        try:
            import mlflow
        except ImportError:
            raise TracetrainError(
                "logging.mlflow = true needs the mlflow package: pip install 'tracetrain[mlflow]'"
            ) from None
        uri = cfg.logging.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI", "")
        if not uri:
            uri = (Path(cfg.train.output_dir).resolve() / "mlruns").as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.mlflow = mlflow
        self.uri = uri
        mlflow.set_tracking_uri(uri)
        mlflow.set_experiment(cfg.logging.mlflow_experiment)
        self.run = mlflow.start_run(run_name=run_name)
        params = {k: str(v)[:500] for k, v in flat_config(cfg).items()}
        items = list(params.items())
        for i in range(0, len(items), 100):  # MLflow takes at most 100 params per call
            mlflow.log_params(dict(items[i : i + 100]))
        mlflow.set_tag("tracetrain.run_dir", str(run_dir))

    def log(self, record: dict[str, Any]) -> None:
        values = scalars(record)
        if values:
            self.mlflow.log_metrics(values, step=int(record.get("step", 0)))

    def refresh(self) -> None:
        pass

    def finish(self, summary: dict[str, Any] | None) -> None:
        if summary:
            values = scalars({**summary, "kind": "summary"})
            if values:
                self.mlflow.log_metrics(values, step=int(summary.get("steps", summary.get("step", 0)) or 0))
        self.mlflow.end_run("FINISHED" if summary is not None else "KILLED")


class WandbTracker:
    def __init__(self, cfg: Config, run_dir: Path, run_name: str) -> None:
        try:
            import wandb
        except ImportError:
            raise TracetrainError(
                "logging.wandb = true needs the wandb package: pip install 'tracetrain[wandb]'"
            ) from None
        self.run = wandb.init(
            project=cfg.logging.wandb_project,
            name=run_name,
            dir=str(run_dir),
            config=flat_config(cfg),
            reinit="create_new",
        )

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


def open_trackers(cfg: Config, run_dir: Path, run_name: str, world_size: int = 1) -> list[Tracker]:
    """The trackers the config turns on, the report page (train/run_report.py) first."""
    trackers: list[Tracker] = []
    if cfg.logging.report:
        from tracetrain.train.run_report import RunReport

        trackers.append(RunReport(run_dir, world_size))
    if cfg.logging.mlflow:
        trackers.append(MlflowTracker(cfg, run_dir, run_name))
    if cfg.logging.wandb:
        (run_dir / "wandb").mkdir(parents=True, exist_ok=True)
        trackers.append(WandbTracker(cfg, run_dir, run_name))
    return trackers
