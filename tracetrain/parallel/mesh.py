"""The device mesh: one named axis per parallelism, and the config checks that make a layout legal.

Axes, outermost first (torchtitan's order, so that the chattiest axis, tp, joins neighbouring ranks,
which share a node):

    pp, dp_replicate, efsdp, ep, cp, tp

Expert parallelism borrows its ranks from the data-parallel shard axis: `dp_shard = efsdp * ep`. EP
ranks see different tokens, exactly like data-parallel ranks; dense parameters are sharded over all of
dp_shard, expert parameters are split over `ep` and FSDP-sharded over `efsdp` only. With ep = 1,
efsdp is dp_shard. Flattened views used by the transforms:

    dp_shard    = efsdp * ep                    dense FSDP axis without CP
    dp          = dp_replicate * dp_shard       ranks that read different rows of the global batch
    dp_shard_cp = dp_shard * cp                 dense FSDP shard axis (CP ranks see different tokens too)
    dp_cp       = dp_replicate * dp_shard * cp  ranks whose tokens differ: loss normalisation, loss sum

World size = pp * dp_replicate * dp_shard * cp * tp (ep is not a factor: it lives inside dp_shard).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from tracetrain.config import Config, ParallelSection
from tracetrain.errors import ConfigError
from tracetrain.models.llama import ModelArgs

MESH_AXES: tuple[str, ...] = ("pp", "dp_replicate", "efsdp", "ep", "cp", "tp")
_FLATTENED: dict[str, tuple[str, ...]] = {
    "dp_shard": ("efsdp", "ep"),
    "dp": ("dp_replicate", "efsdp", "ep"),
    "dp_shard_cp": ("efsdp", "ep", "cp"),
    "dp_cp": ("dp_replicate", "efsdp", "ep", "cp"),
}


def world_size_of(par: ParallelSection) -> int:
    """Ranks the layout needs."""
    return par.pp * par.dp_replicate * par.dp_shard * par.cp * par.tp


def axis_sizes(par: ParallelSection) -> dict[str, int]:
    """Size of every mesh axis (size-1 axes included, so every name always exists)."""
    return {
        "pp": par.pp,
        "dp_replicate": par.dp_replicate,
        "efsdp": par.dp_shard // par.ep,
        "ep": par.ep,
        "cp": par.cp,
        "tp": par.tp,
    }


def _need(ok: bool, keys: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"config key(s) {keys}: {message}")


def validate_parallel(cfg: Config, args: ModelArgs, world_size: int) -> None:
    """Raise ConfigError (naming the keys) unless the [parallel] layout fits the job and the model."""
    p, m = cfg.parallel, cfg.model
    total = world_size_of(p)
    _need(
        total == world_size,
        "parallel.pp * dp_replicate * dp_shard * cp * tp",
        f"{p.pp} * {p.dp_replicate} * {p.dp_shard} * {p.cp} * {p.tp} = {total}, but the job has "
        f"{world_size} rank(s); the product must equal the world size",
    )
    _check_tp(cfg, args)
    _check_cp(cfg, args)
    _check_ep(cfg, args)
    _check_pp(cfg, args)
    if p.fsdp_cpu_offload:
        _need(p.dp_shard * p.cp > 1, "parallel.fsdp_cpu_offload", "needs FSDP (parallel.dp_shard * cp > 1)")
    if m.num_experts:
        _need(
            m.experts_top_k <= m.num_experts,
            "model.experts_top_k",
            f"{m.experts_top_k} exceeds model.num_experts = {m.num_experts}",
        )


def _check_tp(cfg: Config, args: ModelArgs) -> None:
    p = cfg.parallel
    if p.tp == 1:
        return
    for name, value in (
        ("n_heads", args.n_heads),
        ("n_kv_heads", args.n_kv_heads),
        ("ffn_dim", args.ffn_dim),
        ("vocab_size", args.vocab_size),
    ):
        _need(value % p.tp == 0, f"parallel.tp, model.{name}", f"tp = {p.tp} must divide {name} = {value}")
    if p.sequence_parallel:
        local = cfg.data.seq_len // p.cp
        _need(
            local % p.tp == 0,
            "parallel.tp, parallel.sequence_parallel, data.seq_len",
            f"sequence parallelism splits each rank's {local} tokens over tp = {p.tp}: they must divide",
        )
    _need(
        cfg.train.mode == "full",
        "parallel.tp, train.mode",
        "tensor parallelism of LoRA-wrapped projections is not supported; use dp_shard for LoRA",
    )
    _need(
        args.num_experts == 0,
        "parallel.tp, model.num_experts",
        "tensor parallelism of MoE blocks is not supported; shard experts with parallel.ep",
    )
    # Each rank's heads would give its q/k norm weights a partial gradient that nothing sums over tp.
    _need(
        not args.qk_norm,
        "parallel.tp, model.init_from",
        "tensor parallelism of Qwen3's per-head q/k norms is not supported; use parallel.dp_shard",
    )


def _check_cp(cfg: Config, args: ModelArgs) -> None:
    p = cfg.parallel
    if p.cp == 1:
        return
    _need(
        not 0 < args.sliding_window < cfg.data.seq_len,
        "parallel.cp, data.seq_len",
        f"context parallelism has no sliding window; the model's ({args.sliding_window}) is shorter than "
        f"seq_len = {cfg.data.seq_len}: use parallel.cp = 1 or data.seq_len <= {args.sliding_window}",
    )
    _need(
        cfg.data.seq_len % (2 * p.cp) == 0,
        "parallel.cp, data.seq_len",
        f"seq_len = {cfg.data.seq_len} must be divisible by 2 * cp = {2 * p.cp} (load-balanced chunks)",
    )


def _check_ep(cfg: Config, args: ModelArgs) -> None:
    p = cfg.parallel
    if p.ep == 1:
        return
    _need(
        args.num_experts > 0,
        "parallel.ep, model.num_experts",
        "expert parallelism needs an MoE model (model.num_experts > 0, or an MoE model.init_from)",
    )
    _need(
        args.num_experts % p.ep == 0,
        "parallel.ep, model.num_experts",
        f"ep = {p.ep} must divide num_experts = {args.num_experts}",
    )
    _need(
        p.dp_shard % p.ep == 0,
        "parallel.ep, parallel.dp_shard",
        f"ep = {p.ep} borrows ranks from dp_shard = {p.dp_shard}, so it must divide it",
    )
    _need(p.cp == 1, "parallel.ep, parallel.cp", "expert parallelism with context parallelism is not supported")


def _check_pp(cfg: Config, args: ModelArgs) -> None:
    p = cfg.parallel
    if p.pp == 1:
        return
    num_stages = p.pp * (p.pp_stages_per_rank if p.pp_schedule == "interleaved_1f1b" else 1)
    _need(
        args.n_layers >= num_stages,
        "parallel.pp, parallel.pp_stages_per_rank, model.n_layers",
        f"{num_stages} pipeline stages need at least that many layers (the model has {args.n_layers})",
    )
    _need(
        not args.tie_embeddings,
        "parallel.pp",
        "pipeline parallelism needs untied embeddings (the input "
        "embedding and the output head live on different stages)",
    )
    _need(
        cfg.train.precision != "fp16",
        "parallel.pp, train.precision",
        "pipeline parallelism does not support fp16 loss scaling; use bf16",
    )
    rows = cfg.train.micro_batch_size * cfg.train.grad_accum_steps
    n_micro = num_microbatches(p)
    _need(
        rows % n_micro == 0,
        "parallel.pp_microbatches, train.micro_batch_size, train.grad_accum_steps",
        f"each step's {rows} rows per rank (micro_batch_size * grad_accum_steps) must split into "
        f"{n_micro} pipeline micro-batches",
    )
    if p.pp_schedule == "1f1b":
        _need(n_micro >= p.pp, "parallel.pp_microbatches", f"1F1B needs at least pp = {p.pp} micro-batches")


def num_microbatches(p: ParallelSection) -> int:
    """Pipeline micro-batches per step (`pp_microbatches`, 0 = one per pipeline rank)."""
    return p.pp_microbatches or p.pp


@dataclass
class ParallelMesh:
    """The job's DeviceMesh with every axis and flattened view named (see module docstring)."""

    mesh: DeviceMesh
    sizes: dict[str, int]
    flattened: dict[str, DeviceMesh]

    def __getitem__(self, names: str | tuple[str, ...]) -> DeviceMesh:
        if isinstance(names, str) and names in self.flattened:
            return self.flattened[names]  # keep flattened meshes ourselves (slicing them from the root is deprecated)
        return self.mesh[names]

    def size(self, name: str) -> int:
        return self[name].size()

    def local_rank(self, name: str) -> int:
        """This rank's coordinate along axis (or flattened view) `name`."""
        return self[name].get_local_rank()

    def group(self, name: str) -> dist.ProcessGroup:
        return self[name].get_group()


def build_mesh(par: ParallelSection, device_type: str) -> ParallelMesh:
    """The mesh for `par` over the initialised process group (see `dist.init_distributed`)."""
    sizes = axis_sizes(par)
    mesh = init_device_mesh(device_type, tuple(sizes[a] for a in MESH_AXES), mesh_dim_names=MESH_AXES)
    # `_flatten` is private but stable since torch 2.5 (torchtitan relies on it too).
    flattened = {name: mesh[axes]._flatten(name) for name, axes in _FLATTENED.items()}
    return ParallelMesh(mesh=mesh, sizes=sizes, flattened=flattened)
