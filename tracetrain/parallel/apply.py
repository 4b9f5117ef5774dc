"""`parallelize(model, mesh, cfg)`: every parallelism applied to the plain model, in one fixed order.

Order, and why:
0. (build time, models/build.py) weights, MoE (`apply_moe`), LoRA, attention backend, fused kernels.
1. pipeline split (pp): cut the model into this rank's stage modules first: everything after works
   per stage and must only touch (and allocate) this rank's layers.
2. expert parallelism (ep): re-shards expert weights into DTensors and swaps the token dispatcher;
   it must precede FSDP, which shards whatever parameters it finds.
3. tensor + sequence + loss parallelism (tp): replaces Linear weights by DTensors and adds the
   layout hooks; it must precede recomputation and compile so that both see (and recompute / trace)
   the collectives, and precede FSDP, which then shards the TP shards (2-D).
4. context parallelism (cp): swaps the attention core and mask builder; like TP it changes what a
   block computes, so it comes before recomputation and compile.
5. activation recomputation (memory.recompute): wraps whole blocks, with their final contents.
6. compile (regional, per block): traces the final block, recomputation included.
7. data parallelism (FSDP2 / HSDP / replicate, ZeRO stage): outermost, it gathers parameters around
   the compiled, recomputed blocks and reduces their gradients.
8. pipeline schedule: wraps the finished stage modules.

The result, `ParallelModel`, carries the model part(s) and the few hooks a training step needs; for a
single process they are all no-ops, so `train_step` calls them unconditionally (no `if tp:` anywhere).
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from tracetrain.config import Config
from tracetrain.labels import IGNORE_INDEX
from tracetrain.parallel.context_parallel import apply_context_parallel, shard_sequence
from tracetrain.parallel.data_parallel import GradSync, apply_data_parallel, grad_sync_for, model_blocks
from tracetrain.parallel.expert_parallel import apply_expert_parallel
from tracetrain.parallel.grads import all_reduce_sum, clip_grads_, grad_norm
from tracetrain.parallel.mesh import ParallelMesh
from tracetrain.parallel.pipeline import Pipeline, build_pipeline, split_model, stage_ids_of_rank
from tracetrain.parallel.tensor_parallel import apply_tensor_parallel, cross_entropy_sum, loss_parallel


class _PartsView(nn.Module):
    """Several pipeline stages of one rank seen as one module with the plain model's names."""

    def __init__(self, parts: list[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleDict()
        for part in parts:
            self.layers.update(part.layers)
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
            raise ValueError(f"a global micro-batch of {rows} rows does not split over {self.dp_size} "
                             "data-parallel ranks")
        mine = {k: v.chunk(self.dp_size, dim=0)[self.dp_rank] for k, v in batch.items()}
        cp = self._size("cp")
        return shard_sequence(mine, self.mesh.local_rank("cp"), cp) if cp > 1 else mine

    def global_num_targets(self, batches: list[dict[str, torch.Tensor]], device: torch.device) -> torch.Tensor:
        """Target tokens of the whole step over all ranks (device tensor, >= 1): the loss divisor.

        Counted on the host from this rank's (sharded) labels, then summed over the ranks whose tokens
        differ (dp and cp) on the device: no host sync.
        """
        local = sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in batches)
        count = torch.tensor(float(local))
        if device.type == "cuda":  # a pageable copy would wait for the GPU's queue: pin, copy async
            count = count.pin_memory().to(device, non_blocking=True)
        group = self.mesh.group("dp_cp") if self.mesh is not None and self._size("dp_cp") > 1 else None
        return all_reduce_sum(count, group).clamp(min=1.0)

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

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Global gradient norm over every shard and stage (float32, device); clips to `max_norm`."""
        params = self.parameters()
        pp_group = self.mesh.group("pp") if self.mesh is not None and self._size("pp") > 1 else None
        norm = grad_norm(params, pp_group)
        clip_grads_(params, max_norm, norm)
        return norm


def _blocks_view(part: nn.Module) -> types.SimpleNamespace:
    # apply_recompute / apply_compile iterate `model.layers`; a stage keeps its blocks in a ModuleDict.
    return types.SimpleNamespace(layers=model_blocks(part))


def _recompute(part: nn.Module, cfg: Config) -> None:
    """Step 5. `build_model` may already have wrapped the blocks (its single-process order); the
    wrapper swaps the block's class and checkpoints its forward, so TP / CP hooks, which live on the
    submodules, run inside the recomputed region either way and wrapping again is not needed."""
    from tracetrain.memory.recompute import apply_recompute, is_recomputed

    blocks = model_blocks(part)
    if not any(is_recomputed(b) for b in blocks):
        apply_recompute(_blocks_view(part), cfg.memory.recompute, cfg.memory.recompute_every)  # type: ignore[arg-type]


def parallelize(model: nn.Module, mesh: ParallelMesh | None, cfg: Config, *, device: torch.device,
                param_dtype: torch.dtype | None = None, compile: bool = False) -> ParallelModel:
    """Apply cfg.parallel (and cfg.memory.recompute, and `compile`) to `model` in the documented order.

    `model` is the plain, materialised model, identical on every rank (same seed or same checkpoint).
    `param_dtype`: FSDP compute dtype (bf16 on GPUs; None = fp32). With `mesh` None (one process)
    only recomputation and compile are applied. Call `validate_parallel` first (at config load).
    """
    from tracetrain.kernels.apply import apply_compile

    par = cfg.parallel
    if mesh is None:
        _recompute(model, cfg)
        if compile:
            apply_compile(model)  # type: ignore[arg-type]
        return ParallelModel(parts=[model])
    pp_rank = mesh.local_rank("pp")
    parts: list[nn.Module] = split_model(model, pp_rank, par) if par.pp > 1 else [model]  # 1
    units = []
    for part in parts:
        if par.ep > 1:
            apply_expert_parallel(part, mesh["ep"])                                      # 2
        if par.tp > 1:
            apply_tensor_parallel(part, mesh["tp"], sequence_parallel=par.sequence_parallel,
                                  loss_parallel=par.loss_parallel and getattr(part, "lm_head", None) is not None)  # 3
        if par.cp > 1:
            apply_context_parallel(part, mesh.group("cp"), mesh.local_rank("cp"), par.cp)  # 4
        _recompute(part, cfg)                                                            # 5
        if compile:
            apply_compile(_blocks_view(part))  # type: ignore[arg-type]                   # 6
        units += apply_data_parallel(part, mesh, par, param_dtype=param_dtype, experts_sharded=par.ep > 1)  # 7
    pipeline = None
    if par.pp > 1:                                                                         # 8
        pipeline = build_pipeline(parts, stage_ids_of_rank(pp_rank, par), par, mesh.group("pp"), device,
                                  cross_entropy_sum)
    return ParallelModel(parts=parts, mesh=mesh, grad_sync=grad_sync_for(units, mesh, par) if units else None,
                         pipeline=pipeline, loss_parallel=par.tp > 1 and par.loss_parallel)
