"""Error types for user mistakes. The CLI prints these as one line, without a traceback."""


class TracetrainError(Exception):
    """A mistake the user can fix (bad config, bad data, missing file). Message is one line."""


class ConfigError(TracetrainError):
    """A config key has an unknown name, a wrong type or a value out of range."""


class DataError(TracetrainError):
    """A data file is missing, malformed, or yields no usable examples."""


class CheckpointError(TracetrainError):
    """A checkpoint is missing, incomplete, or does not match the model or run."""
