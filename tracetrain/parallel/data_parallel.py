"""Data parallelism with FSDP2 (`fully_shard`): replicate (DDP-like), ZeRO-1/2/3 and HSDP.

Every data-parallel flavour is `fully_shard` over a data-parallel mesh; they differ in the mesh and in
when parameters are resharded and gradients reduced:

| flavour          | mesh                            | params between fwd/bwd  | gradients of a micro-batch     |
|------------------|---------------------------------|-------------------------|--------------------------------|
| replicate (DDP)  | (dp_replicate, 1): HSDP, 1 shard| full                    | all-reduced once per step      |
| ZeRO-1           | dp_shard_cp                     | full, kept across       | full, accumulated locally,     |
|                  |                                 | micro-batches           | reduce-scattered once per step |
| ZeRO-2           | dp_shard_cp                     | full, kept across       | reduce-scattered every         |
|                  |                                 | micro-batches           | micro-batch (sharded)          |
| ZeRO-3 (FSDP)    | dp_shard_cp                     | resharded after forward | reduce-scattered every         |
|                  |                                 | (reshard_after_forward) | micro-batch (sharded)          |
| HSDP             | (dp_replicate, dp_shard_cp)     | as the ZeRO stage       | + all-reduce across replicas   |
|                  |                                 |                         |   once per step                |

Optimizer states always live on the sharded parameters (ZeRO-1 and up). The "kept across
micro-batches" and "once per step" columns are `set_grad_sync` (called before each micro-batch's
backward): `set_requires_gradient_sync(False)` skips the reduce-scatter, `set_requires_all_reduce(False)`
skips only the HSDP all-reduce, and `set_reshard_after_backward(False)` keeps the gathered parameters.
With one micro-batch per step every flavour reduces exactly once.

Gradients are SUMMED over data-parallel ranks (`set_gradient_divide_factor(1.0)`), not averaged: the
loss on each rank is its token-loss sum divided by the global number of target tokens (all-reduced), so
the sum is exactly the single-process gradient whatever the per-rank token counts. Expert gradients
need the same convention (their tokens come from every EP rank).

Units (one all-gather / reduce-scatter each): every transformer block, the embedding, the final
norm + output head together, and the root (whatever is left). A tied embedding stays in the root
group, because its weight is used at both ends of the forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from tracetrain.config import ParallelSection
from tracetrain.parallel.mesh import ParallelMesh


@dataclass
class GradSync:
    """When this rank's FSDP units reduce gradients during gradient accumulation (see module doc)."""

    modules: list[FSDPModule]
    defer_reduce_scatter: bool  # replicate / ZeRO-1: full gradients accumulate locally
    keep_params: bool  # replicate / ZeRO-1 / ZeRO-2: do not reshard between micro-batches
    hsdp: bool  # an all-reduce across replicas follows the reduce-scatter

    def set(self, is_last: bool) -> None:
        """Call before each micro-batch's backward; `is_last` for the step's final micro-batch."""
        for module in self.modules:
            module.set_requires_gradient_sync(is_last or not self.defer_reduce_scatter, recurse=False)
            if self.hsdp and not self.defer_reduce_scatter:
                module.set_requires_all_reduce(is_last, recurse=False)
            module.set_reshard_after_backward(is_last or not self.keep_params, recurse=False)


def dense_dp_mesh(pm: ParallelMesh) -> DeviceMesh | None:
    """The mesh dense parameters are sharded on: 1-D FSDP, 2-D HSDP, or None without DP."""
    replicate, shard = pm.size("dp_replicate"), pm.size("dp_shard_cp")
    if replicate * shard == 1:
        return None
    return pm[("dp_replicate", "dp_shard_cp")] if replicate > 1 else pm["dp_shard_cp"]


def expert_dp_mesh(pm: ParallelMesh) -> DeviceMesh | None:
    """The mesh expert parameters are sharded on (ep > 1): efsdp, with dp_replicate for HSDP."""
    replicate, shard = pm.size("dp_replicate"), pm.size("efsdp")
    if replicate * shard == 1:
        return None
    return pm[("dp_replicate", "efsdp")] if replicate > 1 else pm["efsdp"]


def model_blocks(part: nn.Module) -> list[nn.Module]:
    """The transformer blocks of the model or of a pipeline stage (whose `layers` is a ModuleDict)."""
    layers = part.layers
    return list(layers.values()) if isinstance(layers, nn.ModuleDict) else list(layers)  # type: ignore[arg-type]  # nn.Module attributes are typed Tensor | Module in torch's stubs


def apply_data_parallel(
    part: nn.Module,
    pm: ParallelMesh,
    par: ParallelSection,
    *,
    param_dtype: torch.dtype | None,
    experts_sharded: bool,
    shard_mesh: DeviceMesh | None = None,
) -> list[FSDPModule]:
    """Shard `part` (the model, or one pipeline stage) over the data-parallel mesh, in place.

    `param_dtype`: compute dtype of the gathered parameters (bf16 on GPUs; None = as stored, fp32);
    gradients are always reduced in fp32. `experts_sharded`: MoE experts already split over `ep`
    (expert_parallel.py); they then get their own FSDP units over `expert_dp_mesh`. Returns the FSDP
    units created, outermost (the root) last; empty when the layout has no data parallelism.
    `shard_mesh`: shard on this 1-D mesh instead of the layout's (a 1-rank mesh: FSDP2 exercised on one
    GPU, benchmarks/compose_gpu.py).
    """
    mesh = shard_mesh if shard_mesh is not None else dense_dp_mesh(pm)
    if mesh is None:
        return []
    pure_replicate = pm.size("dp_shard_cp") == 1 and shard_mesh is None
    zero3 = par.zero_stage == 3 and not pure_replicate
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    offload: OffloadPolicy = CPUOffloadPolicy() if par.fsdp_cpu_offload else OffloadPolicy()
    reshard = par.reshard_after_forward if zero3 else False
    units: list[FSDPModule] = []

    def shard(module: nn.Module | list[nn.Module], unit_mesh: DeviceMesh, after_forward: bool, **extra: object) -> None:
        unit = fully_shard(  # type: ignore[call-overload]  # torch's overloads are narrower than what the call passes (checked by the tests)
            module, mesh=unit_mesh, reshard_after_forward=after_forward, mp_policy=mp, offload_policy=offload, **extra
        )
        units.append(unit[0] if isinstance(unit, list) else unit)  # a group's state lives on its first module

    tied = getattr(getattr(part, "args", None), "tie_embeddings", False)
    if getattr(part, "embed_tokens", None) is not None and not tied:
        shard(part.embed_tokens, mesh, reshard)  # type: ignore[arg-type]  # nn.Module attributes are typed Tensor | Module in torch's stubs
    for block in model_blocks(part):
        experts = getattr(block.mlp, "experts", None) if experts_sharded else None
        extra: dict[str, object] = {}
        if experts is not None:
            expert_mesh = expert_dp_mesh(pm)
            if expert_mesh is None:  # one copy per expert shard: nothing to reduce, nothing to shard
                extra["ignored_params"] = set(experts.parameters())
            else:
                shard(experts, expert_mesh, reshard)
        shard(block, mesh, reshard, **extra)
    head = [m for m in (getattr(part, "norm", None), getattr(part, "lm_head", None)) if m is not None]
    if head and not tied:
        # Used last in forward and first in backward: resharding it in between only costs a gather.
        shard(head, mesh, False)
    shard(part, mesh, False)
    for unit in units:
        # Sum over ranks (the loss carries the global 1 / num_targets), as a plain SUM collective:
        # with a custom factor FSDP would otherwise pick NCCL's PREMUL_SUM, which gloo lacks.
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)
    return units


def grad_sync_for(units: list[FSDPModule], pm: ParallelMesh, par: ParallelSection) -> GradSync:
    """The accumulation behaviour of the flavour `apply_data_parallel` chose (see module table)."""
    pure_replicate = pm.size("dp_shard_cp") == 1
    stage = 1 if pure_replicate else par.zero_stage
    return GradSync(
        modules=units, defer_reduce_scatter=stage == 1, keep_params=stage <= 2, hsdp=pm.size("dp_replicate") > 1
    )
