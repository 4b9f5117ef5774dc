"""Resuming a run: which checkpoint, which config, and what may change between the two.

A resumed run must continue exactly, so any config change that would silently alter it (model shape,
data, sequence length, optimizer, precision, seed) is refused; changes that do not (number of steps —
which does re-shape the lr schedule from here on —, logging, checkpointing, eval cadence, loader
workers, device) are allowed.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from tracetrain.config import Config, load_config, to_dict
from tracetrain.errors import CheckpointError, ConfigError
from tracetrain.train.checkpoint import latest_checkpoint, list_checkpoints

ALLOWED_CHANGES = ("train.steps", "train.eval_interval", "train.eval_batches", "train.eval_generate",
                   "train.max_bad_steps", "train.output_dir", "train.run_name", "train.device",
                   "data.num_workers", "data.pin_memory", "data.prefetch_factor", "checkpoint.", "logging.")


@dataclass
class ResumePoint:
    run_dir: Path
    checkpoint: Path

    def truncate_metrics(self, run_dir: Path, step: int) -> None:
        """Drop metric lines written after the checkpoint (they will be produced again)."""
        path = run_dir / "metrics.jsonl"
        if not path.is_file():
            return
        kept = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
        path.write_text("".join(line + "\n" for line in kept))


def _flatten(cfg: Config) -> dict[str, object]:
    return {f"{s}.{k}": v for s, section in to_dict(cfg).items() for k, v in section.items()}


def check_compatible(saved: Config, new: Config, where: Path) -> None:
    old, cur = _flatten(saved), _flatten(new)
    changed = [k for k in cur if cur[k] != old.get(k) and not k.startswith(ALLOWED_CHANGES)]
    if changed:
        detail = ", ".join(f"{k}: {old.get(k)!r} -> {cur[k]!r}" for k in changed[:4])
        raise ConfigError(f"cannot resume {where}: the config changed in ways that would alter the run ({detail}). "
                          "Start a new run instead, or keep these values")


def find_auto(cfg: Config) -> Path | None:
    """`--resume auto`: the named run if it has a checkpoint, else the newest run with one."""
    out = Path(cfg.train.output_dir)
    if cfg.train.run_name:
        named = out / cfg.train.run_name
        return named if list_checkpoints(named) else None
    runs = [p for p in out.iterdir() if p.is_dir() and list_checkpoints(p)] if out.is_dir() else []
    return max(runs, key=lambda p: latest_checkpoint(p).stat().st_mtime) if runs else None


def resolve_resume(spec: str, config_path: str | None, overrides: list[str]) -> tuple[Config, ResumePoint | None]:
    """Config and resume point for `tracetrain train --resume SPEC`."""
    if spec == "auto":
        cfg = load_config(config_path, overrides)
        run_dir = find_auto(cfg)
        if run_dir is None:
            return cfg, None  # nothing to resume yet: a fresh start (e.g. the first launch of a requeued job)
    else:
        run_dir = Path(spec)
        if not (run_dir / "config.toml").is_file():
            raise CheckpointError(f"{run_dir} is not a tracetrain run directory (no config.toml)")
    ckpt = latest_checkpoint(run_dir)
    saved = load_config(ckpt / "config.toml")
    cfg = load_config(config_path or run_dir / "config.toml", overrides)
    check_compatible(saved, cfg, run_dir)
    return cfg, ResumePoint(run_dir=run_dir, checkpoint=ckpt)


def prepare_run_dir(cfg: Config) -> Path:
    """Create a fresh run directory; refuse to write into a used one (nothing is ever overwritten)."""
    out = Path(cfg.train.output_dir)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # Every rank must write into the same folder, decided before the ranks can talk.
        if not cfg.train.run_name:
            raise ConfigError("config key 'train.run_name' is required with several ranks (torchrun): all "
                              "ranks must agree on the run directory")
        if int(os.environ.get("RANK", "0")) != 0:
            (out / cfg.train.run_name).mkdir(parents=True, exist_ok=True)
            return out / cfg.train.run_name
    name = cfg.train.run_name or time.strftime("%Y%m%d-%H%M%S")
    run_dir = out / name
    if run_dir.exists() and any(run_dir.iterdir()):
        if cfg.train.run_name:
            raise ConfigError(f"run directory {run_dir} already exists; choose another train.run_name "
                              f"or continue it with --resume {run_dir}")
        suffix = 1
        while (out / f"{name}-{suffix}").exists():
            suffix += 1
        run_dir = out / f"{name}-{suffix}"
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir
