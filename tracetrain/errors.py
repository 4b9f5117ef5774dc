"""Error types for user mistakes. The CLI prints these as one line, without a traceback."""


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
