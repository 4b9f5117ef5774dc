"""Resuming a run: which checkpoint, which config, and what may change between the two.

A resumed run must continue exactly, so any config change that would silently alter it (model shape,
data, sequence length, optimizer, precision, seed) is refused; changes that do not (number of steps —
which does re-shape the lr schedule from here on —, logging, checkpointing, eval cadence, loader
workers, device) are allowed.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tracetrain.config import Config, load_config, to_dict
from tracetrain.errors import CheckpointError, ConfigError, DataError, utf8_text
from tracetrain.train.checkpoint import latest_checkpoint, newest_checkpoint
from tracetrain.train.manifest import step_of
from tracetrain.train.rundir import RunLock, atomic_write_text, claim_new_run_dir, in_use_error, lock_holder

ALLOWED_CHANGES = (
    "train.steps",
    "train.epochs",
    "train.eval_interval",
    "train.eval_batches",
    "train.eval_generate",
    "train.max_bad_steps",
    "train.output_dir",
    "train.run_name",
    "train.device",
    "data.num_workers",
    "data.pin_memory",
    "data.prefetch_factor",
    "checkpoint.",
    "logging.",
)


@dataclass
class ResumePoint:
    run_dir: Path
    checkpoint: Path
    note: str | None = None  # said before the run continues (a changed train.steps)

    def truncate_metrics(self, run_dir: Path, step: int) -> bool:
        """Drop metric lines written after the checkpoint (they will be produced again), and a torn last
        line (the partial write of a killed process); True if there was one. Replaced atomically."""
        path = run_dir / "metrics.jsonl"
        if not path.is_file():
            return False
        torn = False
        lines = [line for line in _metrics_text(path).splitlines() if line]
        kept = []
        for number, line in enumerate(lines, 1):
            try:
                record = json.loads(line)
            except (ValueError, RecursionError):
                if number == len(lines):
                    torn = True
                    break
                raise CheckpointError(
                    f"{path}:{number}: not a JSON line; repair or remove that line before resuming"
                ) from None
            saved = record.get("step") if isinstance(record, dict) else None
            if not isinstance(saved, int) or isinstance(saved, bool):
                raise CheckpointError(
                    f"{path}:{number}: not a metrics record (an object with a 'step' number); "
                    "repair or remove that line before resuming"
                )
            if saved <= step:
                kept.append(line)
        atomic_write_text(path, "".join(line + "\n" for line in kept))
        return torn


def _metrics_text(path: Path) -> str:
    return utf8_text(
        path.read_bytes(),
        lambda line, byte: CheckpointError(
            f"{path}:{line}: byte 0x{byte:02x} is not UTF-8 text; repair or remove that line before resuming"
        ),
    )


def _flatten(cfg: Config) -> dict[str, object]:
    return {f"{s}.{k}": v for s, section in to_dict(cfg).items() for k, v in section.items()}


def check_compatible(saved: Config, new: Config, where: Path) -> None:
    old, cur = _flatten(saved), _flatten(new)
    changed = [k for k in cur if cur[k] != old.get(k) and not k.startswith(ALLOWED_CHANGES)]
    if changed:
        detail = ", ".join(f"{k}: {old.get(k)!r} -> {cur[k]!r}" for k in changed[:4])
        raise ConfigError(
            f"cannot resume {where}: the config changed in ways that would alter the run ({detail}). "
            "Start a new run instead, or keep these values"
        )


def find_auto(cfg: Config) -> Path | None:
    """`--resume auto`: the named run if it has a checkpoint, else the newest run with one."""
    out = Path(cfg.train.output_dir)
    if cfg.train.run_name:
        named = out / cfg.train.run_name
        return named if newest_checkpoint(named) else None
    runs = [p for p in out.iterdir() if p.is_dir() and newest_checkpoint(p)] if out.is_dir() else []
    return max(runs, key=lambda p: _mtime(newest_checkpoint(p))) if runs else None


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
    try:
        ckpt = latest_checkpoint(run_dir)
    except CheckpointError:
        holder = lock_holder(run_dir)  # a run still in its first steps: say who has it, not "no checkpoint"
        if holder is not None:
            raise in_use_error(run_dir, holder) from None
        raise
    saved = load_config(ckpt / "config.toml")
    cfg = load_config(config_path or run_dir / "config.toml", overrides)
    check_compatible(saved, cfg, run_dir)
    check_steps_cover(cfg, ckpt)
    return cfg, ResumePoint(run_dir=run_dir, checkpoint=ckpt, note=steps_change_note(saved, cfg, step_of(ckpt)))


def steps_change_note(saved: Config, cfg: Config, step: int | None) -> str | None:
    """What a changed `train.steps` does to the learning-rate schedule from the resumed step on."""
    from tracetrain.train.optim import lr_factor

    before, after = saved.train.steps, cfg.train.steps
    if before == after or step is None or cfg.train.epochs or saved.train.epochs:
        return None
    if cfg.optim.schedule == "constant":
        return f"train.steps {before} -> {after}: the learning rate stays constant; the run continues to step {after}"
    lr = cfg.optim.lr
    old, new = lr * lr_factor(step, saved.optim, before), lr * lr_factor(step, cfg.optim, after)
    return (
        f"train.steps {before} -> {after}: the {cfg.optim.schedule} decay now spans {after} steps, so the learning "
        f"rate at step {step} moves from {old:.3g} to {new:.3g} and decays to step {after} from there"
    )


def check_steps_cover(cfg: Config, ckpt: Path) -> None:
    """A resumed run must not end before its checkpoint: it would save a step it never reached."""
    step = step_of(ckpt)
    if step is not None and cfg.train.steps < step:
        raise ConfigError(
            f"config key 'train.steps': {cfg.train.steps} is below the step of the checkpoint to "
            f"resume ({ckpt.name}, step {step}); use train.steps >= {step}"
        )


def data_fingerprint(dataset: object) -> str:
    """A hash of exactly what the run trains on: the packed rows' token ids and labels, or, for rows
    tokenised on the fly, the examples themselves (the tokenizer and seq_len are config, checked apart).
    Cheap: one pass of blake2b over the arrays' bytes, without copies."""
    h = hashlib.blake2b(digest_size=16)
    rows = getattr(dataset, "rows", None)
    if rows is not None:  # PackedDataset: (num_rows, seq_len) int32 tensors
        for key in ("input_ids", "labels"):
            array = np.ascontiguousarray(rows[key].numpy())
            h.update(f"{key}{array.shape}{array.dtype}".encode())
            h.update(array.tobytes())
    else:  # OnTheFlyDataset: (prompt, response) pairs
        for prompt, response in dataset.examples:  # type: ignore[attr-defined]  # no rows: an OnTheFlyDataset, which keeps its (prompt, response) examples
            h.update(json.dumps([prompt, response]).encode())
    return h.hexdigest()


def check_data_unchanged(saved: str, current: str, cfg: Config, ckpt: Path, num_rows: int) -> str | None:
    """Refuse to resume on different training data; a note (returned) for checkpoints older than the
    fingerprint. `num_rows`: the rows the checkpoint's loader position counts, for the message."""
    if not saved:
        return (
            f"{ckpt} has no data fingerprint (saved by an older tracetrain): cannot check that the "
            "training data is unchanged"
        )
    if saved != current:
        source = f"data.path {cfg.data.path!r}" if cfg.data.path else f"data.kind {cfg.data.kind!r}"
        raise DataError(
            f"cannot resume from {ckpt}: the training data changed since it was saved ({source}: "
            f"{num_rows} rows with other token ids or labels; fingerprint {saved} -> {current}). "
            "Restore the original data or start a new run"
        )
    return None


def claim_run_dir(cfg: Config) -> RunLock:
    """Create a fresh run directory and lock it; refuse to write into a used one (nothing is ever
    overwritten). Of several processes claiming one `train.run_name` at once, exactly one wins.

    Under torchrun every rank writes into the same folder: rank 0 claims it (a timestamp when
    `train.run_name` is empty) and hands its name to the other ranks through the launcher's store."""
    out = Path(cfg.train.output_dir)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1 and rank != 0:  # rank 0 claims and locks it for the job
        name = cfg.train.run_name or _shared_run_name(None, cfg.parallel.timeout_s)
        (out / name).mkdir(parents=True, exist_ok=True)
        return RunLock(out / name, None, created=False)
    name = cfg.train.run_name or time.strftime("%Y%m%d-%H%M%S")
    lock = _claim(out / name)
    if lock is None and cfg.train.run_name:
        raise ConfigError(
            f"run directory {out / name} already exists; choose another train.run_name "
            f"or continue it with --resume {out / name}"
        )
    suffix = 0
    while lock is None:  # a timestamped name taken (by another run started in the same second)
        suffix += 1
        lock = _claim(out / f"{name}-{suffix}")
    if world > 1 and not cfg.train.run_name:
        _shared_run_name(lock.path.name, cfg.parallel.timeout_s)
    return lock


def _claim(run_dir: Path) -> RunLock | None:
    """`claim_new_run_dir`; a place where no folder can be made (train.output_dir a file, or under one, or
    not writable) is one line."""
    try:
        return claim_new_run_dir(run_dir)
    except OSError as e:
        raise ConfigError(
            f"config key 'train.output_dir': cannot create the run directory {run_dir} ({e.strerror})"
        ) from None


def _shared_run_name(name: str | None, timeout_s: int) -> str:
    """Rank 0 publishes the run directory's name (`name`); the other ranks (None) wait for it. Through
    the store torchrun's agent hosts at MASTER_ADDR:MASTER_PORT, before any process group exists; the
    key holds the restart count, so a restarted job picks a new name."""
    import datetime

    from torch.distributed import TCPStore

    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true":
        raise ConfigError(
            "config key 'train.run_name' is required with several ranks when not launched by torchrun: "
            "all ranks must agree on the run directory"
        )
    store = TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    key = f"tracetrain/run_name/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    if name is not None:
        store.set(key, name)
        return name
    return store.get(key).decode()


def prepare_run_dir(cfg: Config) -> Path:
    """`claim_run_dir` for API callers that pass the directory to `train(cfg, run_dir)`: the directory is
    claimed (its .lock file marks it used) and `train` locks it again for the run."""
    lock = claim_run_dir(cfg)
    lock.release()
    return lock.path


def _mtime(path: Path | None) -> float:
    return path.stat().st_mtime if path is not None else 0.0
