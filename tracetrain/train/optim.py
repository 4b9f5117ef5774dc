"""AdamW with decoupled weight decay on matrices only, and warmup + cosine/linear decay."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch import nn

from tracetrain.config import Config, MemorySection, OptimSection, check_warmup, resolve_warmup


def build_optimizer(
    model: nn.Module,
    cfg: OptimSection,
    fused: bool,
    memory: MemorySection | None = None,
    *,
    triton_update: bool = True,
) -> torch.optim.Optimizer:
    """AdamW over trainable parameters; norms, biases and other 1-D tensors get no weight decay.

    `fused`: the spec's `optimizer_fused` (tracetrain/spec.py decides it): the fused kernel, one launch for
    all parameters, which honours `found_inf` so a non-finite step is skipped on the GPU without a host sync.
    `triton_update`: the spec's `optimizer_triton`: the fused update as `AdamW`'s Triton kernel where it
    applies (False: torch's own fused kernel throughout).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if memory is not None and memory.optimizer_offload:
        # fp32 master weights and moments live in host memory; gradients stream there during
        # backward (hooks on the Parameter objects: build this after every transform that swaps them).
        from tracetrain.memory.optimizer_offload import CPUOffloadAdamW

        return CPUOffloadAdamW(
            [g for g in groups if g["params"]],
            lr=cfg.lr,
            betas=(cfg.beta1, cfg.beta2),
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
            threads=memory.offload_threads,
        )
    return (AdamW if fused and triton_update else torch.optim.AdamW)(
        [g for g in groups if g["params"]],
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        fused=fused or None,
        foreach=None if fused else True,
    )


class AdamW(torch.optim.AdamW):
    """torch's fused AdamW (same arguments, state, state dict and checkpoints) whose update of plain float32
    CUDA parameters (host ones under the Triton interpreter) runs as one Triton kernel per parameter (kernels/adamw_triton.py) that does not
    write the gradient back: 28 bytes a parameter instead of 32 when the trainer hands the clip factor
    over as `grad_scale`. Honours `grad_scale` and `found_inf` on the device, as torch's fused kernel
    does (GradScaler and train/step.py set them). Anything else (no Triton, DTensor or non-float32
    parameters, amsgrad, maximize, a tensor lr) takes torch's own fused step."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        if closure is not None or not self._triton_applies():
            return super().step(closure)
        from tracetrain.kernels.adamw_triton import adamw_update

        grad_scale, found_inf = getattr(self, "grad_scale", None), getattr(self, "found_inf", None)
        for group in self.param_groups:
            params: list[torch.Tensor] = []
            grads: list[torch.Tensor] = []
            exp_avgs: list[torch.Tensor] = []
            exp_avg_sqs: list[torch.Tensor] = []
            steps: list[torch.Tensor] = []
            self._init_group(
                group, params, grads, exp_avgs, exp_avg_sqs, [], steps
            )  # torch's Adam helper: creates the state
            if not params:
                continue
            torch._foreach_add_(steps, 1)
            beta1, beta2 = group["betas"]
            for p, g, m, v, s in zip(params, grads, exp_avgs, exp_avg_sqs, steps, strict=True):
                adamw_update(
                    p,
                    g,
                    m,
                    v,
                    s,
                    lr=group["lr"],
                    beta1=beta1,
                    beta2=beta2,
                    weight_decay=group["weight_decay"],
                    eps=group["eps"],
                    grad_scale=grad_scale,
                    found_inf=found_inf,
                )
            if found_inf is not None:  # the skipped step does not count, as in torch's fused AdamW
                torch._foreach_sub_(steps, [found_inf] * len(steps))
        return None

    def _triton_applies(self) -> bool:
        from tracetrain.kernels import triton_available, triton_interpreting

        if not triton_available():
            return False
        device_type = "cpu" if triton_interpreting() else "cuda"  # the interpreter runs kernels on host tensors
        for group in self.param_groups:
            if group["amsgrad"] or group["maximize"] or isinstance(group["lr"], torch.Tensor):
                return False
            for p in group["params"]:
                g = p.grad
                if g is None:
                    continue
                plain = type(p) in (torch.Tensor, nn.Parameter) and type(g) is torch.Tensor
                if not (
                    plain and p.device.type == device_type and p.dtype == g.dtype == torch.float32 and not g.is_sparse
                ):
                    return False
                if not (p.is_contiguous() and g.is_contiguous()):
                    return False
        return True


def lr_factor(step: int, cfg: OptimSection, total_steps: int) -> float:
    """Multiplier on the peak lr for optimizer step `step` (0-based)."""
    warmup = resolve_warmup(cfg, total_steps)
    if step < warmup:
        return (step + 1) / warmup
    if cfg.schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    if cfg.schedule == "linear":
        decay = 1.0 - progress
    else:
        decay = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * decay


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: OptimSection, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, cfg, total_steps))


def steps_for_epochs(epochs: float, batches_per_epoch: int, grad_accum_steps: int) -> int:
    """Optimizer steps of `epochs` passes over `batches_per_epoch` micro-batches: ceil(epochs * b / accum).

    Rounded to 9 places before the ceiling, so that float noise (0.1 * 30 = 3.0000000000000004) does
    not add a step. At least one step.
    """
    return max(1, math.ceil(round(epochs * batches_per_epoch / grad_accum_steps, 9)))


def size_by_epochs(cfg: Config, batches_per_epoch: int) -> tuple[Config, dict[str, float | int]]:
    """`cfg` with train.steps set from train.epochs, plus {epochs, batches_per_epoch, steps} for the record.

    Called once the data is built (the loader knows its batches per epoch) and before the scheduler,
    so warmup/decay, checkpoint and eval cadence all count against the resolved number of steps. A warmup
    as long as the run is a ConfigError (the load-time check could not know the count).
    """
    steps = steps_for_epochs(cfg.train.epochs, batches_per_epoch, cfg.train.grad_accum_steps)
    check_warmup(cfg.optim, steps, source=f"train.epochs = {cfg.train.epochs} over {batches_per_epoch} batches")
    resolved = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=steps))
    return resolved, {"epochs": cfg.train.epochs, "batches_per_epoch": batches_per_epoch, "steps": steps}


def note_resolved_steps(config_toml: str, steps: int, epochs: float, batches_per_epoch: int) -> str:
    """The run's config.toml with `steps = ...` of [train] replaced by a comment giving the resolved count.

    The line stays a comment so the file loads back as it was given (epochs set, steps at its default),
    and a resumed run sizes itself from train.epochs again, to the same count (the data cannot change
    on resume).
    """
    lines = config_toml.splitlines()
    section = ""
    for i, line in enumerate(lines):
        if line.startswith("["):
            section = line
        elif section == "[train]" and line.startswith("steps = "):
            lines[i] = (
                f"# steps = {steps}  (resolved from epochs = {epochs}: {batches_per_epoch} micro-batches "
                "per epoch / grad_accum_steps)"
            )
    return "\n".join(lines) + ("\n" if config_toml.endswith("\n") else "")
