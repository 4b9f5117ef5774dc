"""Error types for user mistakes. The CLI prints these as one line, without a traceback."""

from __future__ import annotations

from collections.abc import Callable


class TracetrainError(Exception):
    """A mistake the user can fix (bad config, bad data, missing file). Message is one line."""


class ConfigError(TracetrainError):
    """A config key has an unknown name, a wrong type or a value out of range."""


class DataError(TracetrainError):
    """A data file is missing, malformed, or yields no usable examples."""


class CheckpointError(TracetrainError):
    """A checkpoint is missing, incomplete, or does not match the model or run."""


class OutOfMemory(TracetrainError):
    """A rank ran out of memory (train/oom.py `explain_oom` writes the line). `quiet`: the console of this
    rank does not print it (ranks other than 0: rank 0 prints the job's one line)."""

    MARK = "ran out of memory"  # in every such line: the watchdog tells them from other failures by it

    def __init__(self, message: str, quiet: bool = False) -> None:
        super().__init__(message)
        self.quiet = quiet


class PeerGone(TracetrainError):
    """Another rank's process ended without a word (kill -9, the OOM killer, a lost node) while this rank
    waited for it in a collective (parallel/dist.py `failure_guard`). `quiet`: the rank's log already put
    the line on this console (rank 0)."""

    exit_code = 1  # not 2: the config was fine, the job lost a process
    quiet = False


def utf8_text(data: bytes, error: Callable[[int, int], Exception]) -> str:
    """`data` as UTF-8 text (whatever the locale says), or `error(line, byte)` raised for the first byte that is
    not UTF-8 (its line counted from 1), so that a damaged file is one line naming where."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(data[: e.start].count(b"\n") + 1, data[e.start]) from None
