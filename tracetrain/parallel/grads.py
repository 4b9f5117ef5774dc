"""Reductions the training step needs across ranks: the global target count, the loss, the grad norm.

None of these waits for the host: counts become device tensors that are all-reduced on the device,
and the gradient norm is assembled from per-mesh partial norms with collectives on the device.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def all_reduce_sum(value: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """`value` summed over `group` (returned as is when there is no group)."""
    if group is None:
        return value
    value = value.clone()
    dist.all_reduce(value, op=dist.ReduceOp.SUM, group=group)
    return value


def grad_norm(params: Iterable[torch.nn.Parameter], pp_group: dist.ProcessGroup | None) -> torch.Tensor:
    """The L2 norm of all gradients of the (full, unsharded) model, float32, on every rank.

    Gradients may be plain tensors or DTensors on different meshes (FSDP, TP, EP). Per mesh,
    `get_total_norm` reduces over that mesh's shards; the squares of the per-mesh norms are added, and
    across pipeline stages (which hold different parameters) summed with an all-reduce.
    """
    by_mesh: dict[object, list[torch.Tensor]] = {}
    device = None
    for p in params:
        if p.grad is None:
            continue
        key = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
        by_mesh.setdefault(key, []).append(p.grad)
        device = p.grad.device if not isinstance(p.grad, DTensor) else p.grad.to_local().device
    if device is None:
        raise ValueError("no parameter has a gradient")
    total_sq = torch.zeros((), device=device, dtype=torch.float32)
    for grads in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(grads, 2.0, foreach=True)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        total_sq = total_sq + norm.float() ** 2
    return all_reduce_sum(total_sq, pp_group).sqrt()


def clip_grads_(params: list[torch.nn.Parameter], max_norm: float, total_norm: torch.Tensor) -> None:
    """Scale gradients so that their global norm is at most `max_norm` (no-op for inf)."""
    if max_norm == float("inf"):
        return
    by_mesh: dict[object, list[torch.nn.Parameter]] = {}
    for p in params:
        if p.grad is not None:
            by_mesh.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    for group in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total_norm, foreach=True)
