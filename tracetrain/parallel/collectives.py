"""Two differentiable collectives on plain c10d calls (work on NCCL and gloo, any torch >= 2.4).

- `all_gather_dim`: concatenate every rank's tensor along `dim`; backward = reduce-scatter (sum).
- `all_to_all`: exchange variable-sized row blocks; backward = the reverse exchange.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class _AllGatherDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        size = dist.get_world_size(group)
        moved = x.movedim(dim, 0).contiguous()  # collectives work on dim 0
        out = moved.new_empty((size * moved.shape[0], *moved.shape[1:]))
        dist.all_gather_into_tensor(out, moved, group=group)
        return out.movedim(0, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        size = dist.get_world_size(ctx.group)
        moved = grad.movedim(ctx.dim, 0).contiguous()
        out = moved.new_empty((moved.shape[0] // size, *moved.shape[1:]))
        dist.reduce_scatter_tensor(out, moved, op=dist.ReduceOp.SUM, group=ctx.group)
        return out.movedim(0, ctx.dim), None, None


def all_gather_dim(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Every rank's `x` concatenated along `dim` in rank order (differentiable)."""
    return _AllGatherDim.apply(x, dim, group)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        x: torch.Tensor,
        send_rows: list[int],
        recv_rows: list[int],
        group: dist.ProcessGroup,
    ) -> torch.Tensor:
        ctx.send_rows, ctx.recv_rows, ctx.group = send_rows, recv_rows, group
        out = x.new_empty((sum(recv_rows), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv_rows, send_rows, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = grad.new_empty((sum(ctx.send_rows), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), ctx.send_rows, ctx.recv_rows, group=ctx.group)
        return out, None, None, None


def all_to_all(x: torch.Tensor, send_rows: list[int], recv_rows: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """Send `send_rows[r]` consecutive rows of `x` to rank r; receive `recv_rows[r]` from each (differentiable)."""
    return _AllToAll.apply(x, send_rows, recv_rows, group)
