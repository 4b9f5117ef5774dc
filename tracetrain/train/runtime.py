"""Device resolution, with clear errors for impossible requests.

(Precision and every other `auto` are resolved in tracetrain/spec.py.)"""

from __future__ import annotations

import torch

from tracetrain.config import check_device_spec
from tracetrain.errors import ConfigError


def resolve_device(spec: str, key: str = "config key 'train.device'") -> torch.device:
    """'auto' -> cuda when available, else cpu. Asking for CUDA without one is an error, not a fallback.

    `key` names the setting in errors (the eval and generate commands pass their --device flag).
    """
    # The config's rule, checked here too: a name torch.device cannot parse would raise RuntimeError.
    check_device_spec(spec, key)
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(spec)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(
                f"{key}: {spec!r} but no CUDA GPU is visible to PyTorch "
                f"(torch {torch.__version__}); use 'cpu' or 'auto'"
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(f"{key}: {spec!r} but only {torch.cuda.device_count()} GPU(s)")
        if device.index is not None:  # plain "cuda" is the current device; set_device needs an index
            torch.cuda.set_device(device)
    return device
