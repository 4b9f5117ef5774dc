"""The Python API and the command's one library call: `tracetrain.tune(config, ...)`.

    import tracetrain
    result = tracetrain.tune("configs/chat-lora.toml", budget_min=10, max_memory_gib=80)
    result.trials        # every trial: candidate (change, reason, predicted gain), outcome, measured gain
    result.config        # the tuned Config; result.changes: only the changed keys
    result.tuned_toml, result.report_html

The config is taken as `tracetrain.train` takes it (a TOML path, a Config, a dict of sections or None for
the built-in default run) with `overrides` on top, and validated as `tracetrain train` validates it.
"""

from __future__ import annotations

import datetime
import math
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tracetrain.config import Config, from_dict, parse_override
from tracetrain.errors import ConfigError
from tracetrain.tune.output import tuned_text, write_tuned
from tracetrain.tune.report import render
from tracetrain.tune.session import Options, Session, TuneResult, check_allow
from tracetrain.tune.trial import MIN_MEASURED, Window


def tune(
    config: Config | str | Path | Mapping[str, Any] | None = None,
    *,
    overrides: Sequence[str] = (),
    budget_min: float = 15.0,
    max_memory_gib: float | None = None,
    allow: Sequence[str] = (),
    out_dir: str | Path = ".",
    measured_steps: int = 10,
    warmup_steps: int = 3,
    gpus: int = 1,
    tries: Sequence[Mapping[str, Any] | str] = (),
    max_trials: int | None = None,
    say: Callable[[str], None] | None = None,
) -> TuneResult:
    """Measure the config, try the candidates, and write `out_dir/tuned.toml` and `out_dir/tune/report.html`.

    `budget_min`: wall-clock minutes for all trials; `max_memory_gib`: peak memory per GPU a result may
    use; `allow`: numerics-changing kinds to accept ('fp8', 'fp16', 'numerics' for any); `tries`: more
    changes to measure (`{"data.num_workers": 2}` or 'key=value,key=value'); `gpus`: GPUs per trial
    (torchrun; the planner's top layouts are candidates); `max_trials`: candidates measured at most
    (the baseline, its second seed and the combination come on top). Trials already in `out_dir/tune/trials.jsonl`
    are not measured again. Ctrl-C stops the running trial and still writes both files.
    """
    from tracetrain.models.build import model_args_from_config
    from tracetrain.train.api import _raw
    from tracetrain.validate import validate_run

    say = say or _say
    opts = _options(budget_min, max_memory_gib, allow, measured_steps, warmup_steps, gpus, tries, max_trials)
    raw, where = _raw(config, list(overrides))
    cfg = from_dict({k: dict(v) for k, v in raw.items()}, where)
    validate_run(cfg, model_args_from_config(cfg))
    _check_tries(cfg, tries, opts.tries)
    out = Path(out_dir)
    _check_out_dir(out)
    device, gpu = _device(cfg)
    session = Session(cfg, opts, out / "tune", device, gpu, say)
    say(f"tune: {device}, budget {budget_min:g} min, window {warmup_steps} warm-up + {measured_steps} measured steps")
    interrupted = session.run()
    return _finish(session, raw, out, _title(config), interrupted)


def _check_out_dir(out: Path) -> None:
    """--out must be (or be creatable as) a folder that can hold tuned.toml and tune/: checked before the
    first trial, not when its results are written."""
    existing = next(p for p in (out, *out.parents) if p.exists())  # '.' or '/' at the latest
    if not existing.is_dir():
        what = "is a file" if existing == out else f"is inside {existing}, which is a file"
        raise ConfigError(f"--out {out}: {what}; name a folder for tuned.toml and tune/")
    for name, want_dir in (("tune", True), ("tuned.toml", False)):
        if (out / name).exists() and (out / name).is_dir() != want_dir:
            kind = "a file" if want_dir else "a folder"
            raise ConfigError(
                f"--out {out}: {out / name} is {kind}; tune writes {name} there (move it or name another --out)"
            )


def _say(line: str) -> None:
    """Progress to stdout, flushed: a log file or a pipe shows each trial as it ends."""
    print(line, flush=True)


def _options(
    budget_min: float,
    max_memory_gib: float | None,
    allow: Sequence[str],
    measured: int,
    warmup: int,
    gpus: int,
    tries: Sequence[Mapping[str, Any] | str],
    max_trials: int | None,
) -> Options:
    if not 0 < budget_min < math.inf:
        raise ConfigError(f"--budget-min {budget_min}: must be above 0 (minutes)")
    if max_memory_gib is not None and not 0 < max_memory_gib < math.inf:
        raise ConfigError(f"--max-memory {max_memory_gib}: must be above 0 (GiB per GPU)")
    if measured < MIN_MEASURED:
        raise ConfigError(f"--steps {measured}: the median needs at least {MIN_MEASURED} measured steps")
    if warmup < 1:
        raise ConfigError(f"--warmup-steps {warmup}: at least 1 (compilation and allocator warm-up)")
    if gpus < 1:
        raise ConfigError(f"--gpus {gpus}: at least 1")
    if max_trials is not None and max_trials < 0:
        raise ConfigError(f"--max-trials {max_trials}: 0 or more")
    window = Window(warmup=warmup, measured=measured)
    tried = tuple(_try(t) for t in tries)
    return Options(budget_min, max_memory_gib, check_allow(allow), window, gpus, tried, max_trials)


def _try(item: Mapping[str, Any] | str) -> dict[str, Any]:
    """'data.num_workers=2,train.compile=off' (or a dict) as config changes."""
    if isinstance(item, Mapping):
        return dict(item)
    return dict(parse_override("--" + part.strip().removeprefix("--")) for part in item.split(",") if part.strip())


def _check_tries(cfg: Config, asked: Sequence[Mapping[str, Any] | str], tries: Sequence[dict[str, Any]]) -> None:
    """A --try the config refuses (a mistyped key, a value out of range) is one line now, before the
    baseline runs: later it would be a traceback, or dropped from the candidates without a word."""
    for item, changes in zip(asked, tries, strict=True):
        try:
            cfg.replace(changes)
        except ConfigError as e:
            label = item if isinstance(item, str) else ",".join(f"{k}={v}" for k, v in changes.items())
            raise ConfigError(f"--try {label}: {e}") from None


def _device(cfg: Config) -> tuple[str, str]:
    """The device the trials run on, and the GPU the planner plans for. The GPU's name is asked of a
    child process: this process stays off the GPU, whose memory belongs to the trials."""
    from tracetrain.train.runtime import resolve_device

    device = resolve_device(cfg.train.device)
    if device.type != "cuda":
        return "cpu", "h100-sxm"
    probe = "import torch; print(torch.cuda.get_device_name(0))"
    name = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True).stdout.strip()
    return f"cuda ({name})", name or "h100-sxm"


def _title(config: object) -> str:
    return str(config) if isinstance(config, (str, Path)) else "built-in default config" if config is None else "config"


def _finish(session: Session, raw: dict[str, dict[str, Any]], out: Path, title: str, interrupted: bool) -> TuneResult:
    """Pick the winner; write tuned.toml and tune/report.html from whatever was measured."""
    from tracetrain.train.rundir import atomic_write_text

    best = session.best()
    base = session.baseline
    changes = {**session.start, **(best.candidate.change_dict if best else {})}
    # A key the winner set back to your value (`dp_shard` 1 under DDP, after --gpus sharded it) is no change.
    changes = {k: v for k, v in changes.items() if _was(session.cfg, k) != repr(v)}
    comments = _comments(session, best, changes)
    tuned = session.cfg.replace(changes) if changes else session.cfg
    result = TuneResult(
        trials=session.trials,
        config=tuned,
        changes=changes,
        baseline=base,
        best=best,
        tuned_toml=out / "tuned.toml",
        report_html=out / "tune" / "report.html",
        interrupted=interrupted,
        seconds=time.monotonic() - session.started,
        device=session.device,
        notes=session.notes,
    )
    header = [
        f"tuned by `tracetrain tune` from {title} on {datetime.date.today().isoformat()}, {session.device}",
        f"{len([t for t in session.trials if t.outcome.status != 'pruned'])} trials in "
        f"{result.seconds / 60:.1f} min; every trial: tune/report.html",
    ]
    if base is not None and base.tokens_per_s:
        final = best.tokens_per_s if best and best.tokens_per_s else base.tokens_per_s
        header.append(
            f"baseline {base.tokens_per_s:,.0f} tokens/s -> {final:,.0f} tokens/s ({final / base.tokens_per_s - 1:+.1%})"
        )
    write_tuned(result.tuned_toml, tuned_text(raw, changes, comments, header), tuned)
    atomic_write_text(result.report_html, render(result, out / "tune", title))
    session.say(f"wrote {result.tuned_toml} and {result.report_html}")
    return result


def _comments(session: Session, best: Any, changes: dict[str, Any]) -> dict[str, str]:
    """Each changed key's comment: the measured gain of the trial that chose it."""
    out: dict[str, str] = {}
    base = session.baseline
    for key in changes:
        if best is not None and base is not None and key in best.candidate.change_dict:
            out[key] = (
                f"tune: {best.candidate.label} measured {best.gain:+.1%} tokens/s "
                f"({best.tokens_per_s:,.0f} against {base.tokens_per_s:,.0f}); was {_was(session.cfg, key)}"
            )
        elif key in session.implicit:
            out[key] = f"tune: --gpus {session.opts.gpus}: the data sharded over them; was {_was(session.cfg, key)}"
        else:
            measured = f"measured {base.tokens_per_s:,.0f} tokens/s" if base and base.tokens_per_s else "not measured"
            out[key] = f"tune: needed to fit (the planner's pick; {measured}); was {_was(session.cfg, key)}"
    return out


def _was(cfg: Config, key: str) -> str:
    section, name = key.split(".", 1)
    return repr(getattr(getattr(cfg, section), name))
