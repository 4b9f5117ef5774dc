"""Device and precision resolution, with clear errors for impossible requests."""

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
            raise ConfigError(f"{key}: {spec!r} but no CUDA GPU is visible to PyTorch "
                              f"(torch {torch.__version__}); use 'cpu' or 'auto'")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(f"{key}: {spec!r} but only {torch.cuda.device_count()} GPU(s)")
        torch.cuda.set_device(device)
    return device


def resolve_precision(spec: str, device: torch.device) -> str:
    """'auto' -> bf16 on GPUs that support it, fp32 otherwise."""
    if spec == "auto":
        return "bf16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "fp32"
    if spec == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError("config key 'train.precision': 'bf16' is not supported by this GPU; use 'fp32'")
    return spec


def refuse_with_parallel(cfg: object) -> None:
    """Switches not yet combined with a multi-rank layout (no test covers them there)."""
    checks = {"memory.optimizer_offload": cfg.memory.optimizer_offload,  # type: ignore[attr-defined]
              "memory.activation_offload": cfg.memory.activation_offload != "none",  # type: ignore[attr-defined]
              "memory.unified_memory": cfg.memory.unified_memory != "none",  # type: ignore[attr-defined]
              "train.precision": cfg.train.precision == "fp16",  # type: ignore[attr-defined]
              "train.fp8": cfg.train.fp8 != "none"}  # type: ignore[attr-defined]
    for key, bad in checks.items():
        if bad:
            raise ConfigError(f"config key '{key}' is not supported together with several ranks yet; "
                              "turn it off or run on one process")
