"""The tune directory's record of finished trials (`tune/trials.jsonl`): what makes `tune` resumable.

Each trial is one JSON line, appended (one write, fsynced) as soon as the trial ends, under a key that
hashes everything its result depends on: the base config's text, the trial's overrides (window and
candidate), the device and the number of GPUs. A rerun computes the same keys and skips every trial
already on file; a changed config or window gives new keys, so stale results are never reused. Trials
stopped by the budget or by Ctrl-C are not recorded: a rerun measures them.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from tracetrain.train.manifest import fsync_path
from tracetrain.train.rundir import open_no_follow
from tracetrain.tune.trial import Measurement, TrialOutcome

FILENAME = "trials.jsonl"


def trial_key(base_toml: str, overrides: list[str], device: str, gpus: int) -> str:
    text = json.dumps([base_toml, overrides, device, gpus])
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:12]


class Ledger:
    """Finished trials by key, read from and appended to `tune_dir/trials.jsonl`."""

    def __init__(self, tune_dir: Path) -> None:
        self.path = tune_dir / FILENAME
        self.done: dict[str, dict[str, Any]] = {}
        if self.path.is_file():
            for line in self.path.read_text(encoding="utf-8").splitlines():
                with contextlib.suppress(ValueError):  # a line torn by a crash mid-write is measured again
                    rec = json.loads(line)
                    if isinstance(rec, dict) and isinstance(rec.get("key"), str):
                        self.done[rec["key"]] = rec

    def get(self, key: str) -> TrialOutcome | None:
        rec = self.done.get(key)
        if rec is None:
            return None
        m = rec.get("measurement")
        return TrialOutcome(
            status=rec["status"],
            seconds=float(rec.get("seconds", 0.0)),
            measurement=Measurement(**m) if isinstance(m, dict) else None,
            message=rec.get("message", ""),
            advice=rec.get("advice", []),
        )

    def add(self, key: str, label: str, outcome: TrialOutcome) -> None:
        """Record a finished trial (not one stopped by the budget: a rerun measures it)."""
        if outcome.status == "budget":
            return
        rec = {
            "key": key,
            "label": label,
            "status": outcome.status,
            "seconds": round(outcome.seconds, 3),
            "measurement": outcome.measurement.to_json() if outcome.measurement else None,
            "message": outcome.message,
            "advice": outcome.advice,
        }
        self.done[key] = rec
        fd = open_no_follow(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        with open(fd, "ab", buffering=0) as f:  # one write(2) per line: a crash tears at most this line
            f.write((json.dumps(rec) + "\n").encode("utf-8"))
            os.fsync(f.fileno())
        fsync_path(self.path.parent)
