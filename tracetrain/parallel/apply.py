"""`ParallelModel`: this rank's model part(s) and the few hooks a training step needs for its layout.

The layout itself (pipeline split, expert, tensor and context parallelism, recomputation, compile,
FSDP / HSDP / replicate, pipeline schedule) is applied by rows of the one transform table
(`tracetrain.train.assemble.TRANSFORMS`), which says why each sits where it does. Its last layout row
builds the ParallelModel, for several ranks only: a single process has none (`StepContext.par` is None),
and the step checks `par is not None` before each hook (batch sharding and the target count, the
per-micro-batch gradient sync, the loss reduction, the fp16 found_inf agreement, the gradient norm over
the shards, evaluation's batch sharding) and takes the pipeline schedule when `par.pipeline` is set. It
never branches on a single axis (no `if tp:` in the step or the model): what tp, cp, ep, pp and FSDP
need happens inside the hooks.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from tracetrain.labels import IGNORE_INDEX
from tracetrain.parallel.context_parallel import shard_sequence
from tracetrain.parallel.data_parallel import GradSync
from tracetrain.parallel.grads import all_reduce_sum, clip_grads_, grad_norm
from tracetrain.parallel.mesh import ParallelMesh
from tracetrain.parallel.pipeline import Pipeline
from tracetrain.parallel.tensor_parallel import cross_entropy_sum, loss_parallel


class _PartsView(nn.Module):
    """Several pipeline stages of one rank seen as one module with the plain model's names."""

    def __init__(self, parts: list[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleDict()
        for part in parts:
            self.layers.update(part.layers)  # type: ignore[arg-type]  # nn.Module attributes are typed Tensor | Module in torch's stubs
            for name in ("embed_tokens", "norm", "lm_head"):
                if getattr(part, name, None) is not None:
                    setattr(self, name, getattr(part, name))


@dataclass
class ParallelModel:
    """This rank's model part(s) and the step hooks of its layout (all no-ops without a mesh)."""

    parts: list[nn.Module]
    mesh: ParallelMesh | None = None
    grad_sync: GradSync | None = None
    pipeline: Pipeline | None = None
    loss_parallel: bool = False

    @functools.cached_property
    def module(self) -> nn.Module:
        """The model as one module with plain-model parameter names (optimizer, state dicts, DCP)."""
        return self.parts[0] if len(self.parts) == 1 else _PartsView(self.parts)

    def parameters(self) -> list[nn.Parameter]:
        return list(self.module.parameters())

    def _size(self, axis: str) -> int:
        return self.mesh.size(axis) if self.mesh is not None else 1

    @property
    def dp_rank(self) -> int:
        """Index of this rank's rows in the global batch (ranks that differ only in tp/cp/pp share it)."""
        return self.mesh.local_rank("dp") if self.mesh is not None else 0

    @property
    def dp_size(self) -> int:
        return self._size("dp")

    def shard_batch(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's part of a global micro-batch (dp_size * micro_batch_size rows, every rank alike):
        its rows, then (cp > 1) its chunks of the sequence."""
        if self.mesh is None:
            return batch
        rows = next(iter(batch.values())).shape[0]
        if rows % self.dp_size:
            raise ValueError(
                f"a global micro-batch of {rows} rows does not split over {self.dp_size} data-parallel ranks"
            )
        mine = {k: v.chunk(self.dp_size, dim=0)[self.dp_rank] for k, v in batch.items()}
        cp = self._size("cp")
        return shard_sequence(mine, self.mesh.local_rank("cp"), cp) if cp > 1 else mine

    def global_num_targets(
        self,
        batches: list[dict[str, torch.Tensor]],
        device: torch.device,
        count: Callable[[dict[str, torch.Tensor]], int] | None = None,
    ) -> torch.Tensor:
        """Target tokens of the whole step over all ranks (device tensor, >= 1): the loss divisor.

        Counted on the host from this rank's (sharded) labels, then summed over the ranks whose tokens
        differ (dp and cp) on the device: no host sync. `count` counts something else per batch (a
        preference objective's pairs).
        """
        local = sum(count(b) if count else int((b["labels"] != IGNORE_INDEX).sum()) for b in batches)
        total = torch.tensor(float(local))
        if device.type == "cuda":  # a pageable copy would wait for the GPU's queue: pin, copy async
            total = total.pin_memory().to(device, non_blocking=True)
        group = self.mesh.group("dp_cp") if self.mesh is not None and self._size("dp_cp") > 1 else None
        return all_reduce_sum(total, group).clamp(min=1.0)

    @contextlib.contextmanager
    def micro_batch(self, is_last: bool) -> Iterator[None]:
        """Wrap one micro-batch's forward AND backward: gradient-sync choice, loss parallelism."""
        if self.grad_sync is not None and self.pipeline is None:
            self.grad_sync.set(is_last)
        with loss_parallel() if self.loss_parallel else contextlib.nullcontext():
            yield

    @staticmethod
    def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Summed cross-entropy over target tokens (float32, plain tensor), vocab-sharded logits allowed."""
        return cross_entropy_sum(logits, labels)

    def shard_eval_batch(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A held-out batch for this rank: every data-parallel rank evaluates all rows (eval batches need
        not split evenly), each context-parallel rank its sequence chunks (CP attention expects them)."""
        cp = self._size("cp")
        return shard_sequence(batch, self.mesh.local_rank("cp"), cp) if self.mesh is not None and cp > 1 else batch

    def reduce_eval_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """A held-out batch's summed loss from this rank's chunks: summed over the cp group."""
        group = self.mesh.group("cp") if self.mesh is not None and self._size("cp") > 1 else None
        return all_reduce_sum(loss, group)

    def reduce_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The step's loss from this rank's share (local sum / global count): summed over dp and cp."""
        group = self.mesh.group("dp_cp") if self.mesh is not None and self._size("dp_cp") > 1 else None
        return all_reduce_sum(loss, group)

    def agree_on_found_inf(self, scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> None:
        """After `scaler.unscale_`: the inf/NaN flags of every rank's shards, OR-ed over the job (in place),
        so that `scaler.step` skips and `scaler.update` backs off on every rank or on none.

        With FSDP2 on torch 2.13 the flags already agree (the unscale of DTensor gradients reduces them;
        measured on 2 gloo ranks with an inf in one rank's shard); this one all-reduce per fp16 step makes
        it explicit instead of a side effect of DTensor dispatch. The flags live in GradScaler's
        per-optimizer state (torch keeps no public handle; FSDP1's ShardedGradScaler syncs the same)."""
        if self.mesh is None:
            return
        state = scaler._per_optimizer_states[id(optimizer)]
        for flag in state["found_inf_per_device"].values():
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Global gradient norm over every shard and stage (float32, device); clips to `max_norm`."""
        params = self.parameters()
        pp_group = self.mesh.group("pp") if self.mesh is not None and self._size("pp") > 1 else None
        norm = grad_norm(params, pp_group)
        clip_grads_(params, max_norm, norm)
        return norm
