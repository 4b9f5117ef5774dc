"""Expert parallelism: MoE experts split over the `ep` axis, tokens routed to them by all-to-all.

With E experts and ep ranks, rank r holds experts [r * E / ep, (r + 1) * E / ep) (a DTensor `Shard(0)`
of each batched expert weight, so checkpoints and the gradient norm see the full tensors). The router
and everything else stay data-parallel. One MoE layer's forward on a rank:

1. route locally and sort this rank's token-expert pairs by expert (as `LocalDispatcher`);
2. exchange per-expert counts (all-to-all of E integers), then the tokens themselves
   (all-to-all of rows: to each rank the rows for its experts);
3. regroup the received rows by local expert (they arrive grouped by source rank) and run the experts;
4. undo 3 and 2 (the reverse all-to-all), weight by the gate probabilities and sum per token.

Backward mirrors every exchange. Gradients of an expert collect the contributions of every EP rank's
tokens in this backward, so across `ep` they need no further reduction; across `efsdp` (and
dp_replicate) FSDP sums them (data_parallel.py). Token counts cross the host once per layer (the
all-to-all needs split sizes), as in every dropless EP implementation without device-side splits.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from tracetrain.models.moe import GroupedExperts, MoEFeedForward
from tracetrain.parallel.collectives import all_to_all
from tracetrain.parallel.data_parallel import model_blocks


class ShardedExperts(GroupedExperts):
    """`GroupedExperts` whose weights are DTensors split over ep: computes only the local experts."""

    def weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return tuple(
            w.to_local() if isinstance(w, DTensor) else w  # type: ignore[return-value]  # tuple() of a generator is typed tuple[Tensor, ...]; it holds the three weights
            for w in (self.gate_proj, self.up_proj, self.down_proj)
        )


class AllToAllDispatcher:
    """Send each token-expert pair to the rank owning the expert, and the results back."""

    def __init__(self, group: dist.ProcessGroup, num_experts: int) -> None:
        self.group = group
        self.ep = dist.get_world_size(group)
        self.num_local = num_experts // self.ep

    def __call__(
        self, tokens: torch.Tensor, expert_idx: torch.Tensor, weights: torch.Tensor, experts: GroupedExperts
    ) -> torch.Tensor:
        top_k, ep, num_local = expert_idx.shape[1], self.ep, self.num_local
        flat = expert_idx.flatten()  # (T * top_k,)
        order = flat.argsort(stable=True)
        token_of = order // top_k
        send_counts = torch.bincount(flat, minlength=ep * num_local)  # (E,) rows per global expert
        recv_counts = torch.empty_like(send_counts)  # (ep * num_local,) by source rank
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        # One host sync for every split size this layer needs.
        counts = torch.stack([send_counts, recv_counts]).view(2, ep, num_local).tolist()
        send_rows = [sum(c) for c in counts[0]]
        recv_rows = [sum(c) for c in counts[1]]
        received = all_to_all(tokens[token_of], send_rows, recv_rows, self.group)  # by (source, expert)
        # Regroup by (local expert, source): expert e's rows from every source, contiguous.
        source = torch.arange(ep, device=tokens.device).repeat_interleave(num_local)
        local_expert = torch.arange(num_local, device=tokens.device).repeat(ep)
        row_key = (local_expert * ep + source).repeat_interleave(recv_counts)  # one key per received row
        index_t = row_key.argsort(stable=True)
        per_expert = [sum(counts[1][s][e] for s in range(ep)) for e in range(num_local)]
        y_grouped = experts(received[index_t], per_expert)
        y_received = torch.empty_like(y_grouped).index_copy_(0, index_t, y_grouped)  # back to (source, expert)
        y = all_to_all(y_received, recv_rows, send_rows, self.group)  # (T * top_k, dim), sorted order
        y = y * weights.flatten()[order].unsqueeze(-1).to(y.dtype)
        return torch.zeros_like(tokens).index_add_(0, token_of, y.to(tokens.dtype))


def _shard_param(param: nn.Parameter, ep_mesh: DeviceMesh) -> nn.Parameter:
    # Every rank built the same full weights (same seed): keep this rank's slice, no communication.
    local = param.detach().chunk(ep_mesh.size(), dim=0)[ep_mesh.get_local_rank()].clone()
    return nn.Parameter(
        DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False), requires_grad=param.requires_grad
    )


def apply_expert_parallel(part: nn.Module, ep_mesh: DeviceMesh) -> int:
    """Split every MoE block's experts over `ep_mesh` and swap in the all-to-all dispatcher (in place).

    Returns the number of MoE blocks converted.
    """
    num_converted = 0
    for block in model_blocks(part):
        moe = block.mlp
        if not isinstance(moe, MoEFeedForward):
            continue
        experts = moe.experts
        for name in ("gate_proj", "up_proj", "down_proj"):
            setattr(experts, name, _shard_param(getattr(experts, name), ep_mesh))
        experts.__class__ = ShardedExperts
        moe.dispatcher = AllToAllDispatcher(ep_mesh.get_group(), moe.num_experts)  # type: ignore[assignment]  # both dispatchers have the same interface
        num_converted += 1
    return num_converted
