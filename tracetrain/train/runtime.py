"""Device and precision resolution, with clear errors for impossible requests."""

from __future__ import annotations

import torch

from tracetrain.errors import ConfigError


def resolve_device(spec: str) -> torch.device:
    """'auto' -> cuda when available, else cpu. Asking for CUDA without one is an error, not a fallback."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(spec)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"config key 'train.device': {spec!r} but no CUDA GPU is visible to PyTorch "
                              f"(torch {torch.__version__}); use 'cpu' or 'auto'")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(f"config key 'train.device': {spec!r} but only {torch.cuda.device_count()} GPU(s)")
        torch.cuda.set_device(device)
    return device


def resolve_precision(spec: str, device: torch.device) -> str:
    """'auto' -> bf16 on GPUs that support it, fp32 otherwise."""
    if spec == "auto":
        return "bf16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "fp32"
    if spec == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError("config key 'train.precision': 'bf16' is not supported by this GPU; use 'fp32'")
    return spec


# Config keys whose feature is not wired into the trainer yet, with their inert value. A run that sets
# one of them must stop rather than silently train without it. Entries leave as features land.
NOT_YET_IMPLEMENTED: dict[str, object] = {
    "parallel.dp_replicate": 1, "parallel.dp_shard": 1, "parallel.tp": 1, "parallel.pp": 1, "parallel.cp": 1,
    "parallel.ep": 1, "model.num_experts": 0,
}


def refuse_unimplemented(cfg: object) -> None:
    """ConfigError for any key set to a feature the trainer does not run yet."""
    for key, inert in NOT_YET_IMPLEMENTED.items():
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if value != inert:
            raise ConfigError(f"config key '{key}': {value!r} is not supported by the trainer yet "
                              f"(only {inert!r}); see the project's open issues")
