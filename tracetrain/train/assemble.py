"""`assemble(spec, mesh)`: the model, every transform and the optimizer, from one ordered table.

`TRANSFORMS` is the only place a transform is applied. Each row says when it applies (a function of
the frozen `RunSpec`), what it does, and why it sits where it does; `assemble` walks the rows in order.
A new transform is a new row here: the model (models/llama.py), the loop (train/loop.py) and the step
(train/step.py) do not change. The same path builds the trainer's run, inference's model (rows up to
`compile`), the benchmarks' variants (a spec changed with `RunSpec.replace`) and the tests' runs and layouts
(tests/house/test_architecture.py checks that tests and benchmarks build no run by hand).

The model is built on the meta device; the layout rows cut, shard and wrap this rank's part(s) of it
there, and `materialise` then allocates only this rank's shards on the target device, in their final
dtype, and fills them (seeded values that do not depend on the layout, or a checkpoint's slices); the result's `par` (a `ParallelModel`) carries the hooks the
training step calls (all of them no-ops on one process, where `par` is None).
"""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from tracetrain.models.llama import Transformer
from tracetrain.spec import RunSpec
from tracetrain.train.step import StepContext


@dataclass
class Assembly:
    """A run being assembled: what the rows read and write, and in the end the result.

    `parts` are this rank's model parts: [model], or its pipeline stages once `pipeline_split` ran.
    """

    spec: RunSpec
    mesh: Any = None  # tracetrain.parallel.mesh.ParallelMesh with several ranks (or one: `shard_mesh`)
    shard_mesh: Any = None  # a 1-D DeviceMesh the data-parallel row shards over instead of the layout's
    model: nn.Module | None = None  # the plain model, on meta until `materialise` (rows model .. fp8 act on it)
    parts: list[nn.Module] = field(default_factory=list)
    fsdp_units: list[Any] = field(default_factory=list)
    pipeline: Any = None  # tracetrain.parallel.pipeline.Pipeline (pp > 1)
    optimizer: torch.optim.Optimizer | None = None
    activation_offload: Any = None  # tracetrain.memory.ActivationOffload
    par: Any = None  # tracetrain.parallel.apply.ParallelModel (several ranks)
    reference: nn.Module | None = None  # DPO with full fine-tuning: the frozen initial model
    applied: list[str] = field(default_factory=list)  # names of the rows that ran, in order

    def plain(self) -> Transformer:
        """The plain model, for the rows before the layout."""
        assert isinstance(self.model, Transformer), "the model row builds the model first"
        return self.model

    @property
    def module(self) -> nn.Module:
        """The model as one module with plain-model parameter names (optimizer, state dicts, DCP)."""
        if self.par is not None:
            return self.par.module
        assert self.model is not None
        return self.model


@dataclass(frozen=True)
class Transform:
    name: str
    applies: Callable[[RunSpec], bool]
    apply: Callable[[Assembly], None]
    why: str


def _blocks(part: nn.Module) -> types.SimpleNamespace:
    # apply_recompute / apply_compile iterate `model.layers`; a pipeline stage keeps its blocks in a ModuleDict.
    from tracetrain.parallel.data_parallel import model_blocks

    return types.SimpleNamespace(layers=model_blocks(part))


# ---------------------------------------------------------------------------------------------------
# The rows' apply functions, in table order


def _model(a: Assembly) -> None:
    from tracetrain.models.build import build_on_meta

    a.model = build_on_meta(a.spec.model_args, a.spec.weights_dtype)
    a.parts = [a.plain()]


def _materialise(a: Assembly) -> None:
    from tracetrain.models.build import materialize_parts

    s = a.spec
    source = None
    if s.cfg.model.init_from:
        from tracetrain.models.hf import open_hf_checkpoint

        source = open_hf_checkpoint(s.cfg.model.init_from, a.plain())  # names and shapes checked first
    # Under FSDP's CPU offload the sharded parameters live on the host (FSDP moves what it gathers).
    offload = s.distributed and s.cfg.parallel.fsdp_cpu_offload
    host = torch.device("cpu") if offload else None
    materialize_parts(a.parts, s.model_args, s.device, s.cfg.train.seed, params_device=host, source=source)
    if source is not None:
        source.close()


def _moe(a: Assembly) -> None:
    from tracetrain.models.moe import set_aux_loss_weight

    cfg = a.spec.cfg
    # The model row built the experts (ModelArgs.num_experts: model.num_experts or the checkpoint's).
    # The load-balancing term is the mean over every forward pass of a step: its micro-batches on
    # every data- and context-parallel rank.
    par = cfg.parallel
    passes = cfg.train.grad_accum_steps * par.dp_replicate * par.dp_shard * par.cp
    set_aux_loss_weight(a.plain(), cfg.model.moe_aux_loss_coef / passes)


def _lora(a: Assembly) -> None:
    from tracetrain.errors import ConfigError
    from tracetrain.kernels import triton_available
    from tracetrain.models.lora import apply_lora

    lc = a.spec.cfg.lora
    if lc.base_quant == "nf4" and triton_available():
        # Registers the one-pass Triton kernel as CUDA's `tracetrain::nf4_dequantise` (the NF4 bases' matmuls).
        import tracetrain.kernels.nf4_triton  # noqa: F401
    try:
        apply_lora(
            a.plain(),
            rank=lc.rank,
            alpha=lc.alpha,
            dropout=lc.dropout,
            targets=lc.targets,
            base_dtype=a.spec.lora_base_dtype,
            adapter_dtype=torch.bfloat16 if lc.adapter_dtype == "bf16" else torch.float32,
            base_quant=lc.base_quant,
            dora=lc.dora,
        )
    except ValueError as e:
        raise ConfigError(f"config key 'lora.targets': {e}") from None


def _attention(a: Assembly) -> None:
    from tracetrain.models.attention import apply_attention

    apply_attention(a.plain(), a.spec.attention)


def _fused_kernels(a: Assembly) -> None:
    from tracetrain.kernels.apply import apply_fused_kernels

    apply_fused_kernels(a.plain(), a.spec.fused_kernels)


def _fused_ce(a: Assembly) -> None:
    from tracetrain.kernels.fused_ce import apply_fused_ce

    apply_fused_ce(a.plain(), a.spec.fused_ce_chunk, adaptive=a.spec.fused_ce_adaptive)


def _tiled_mlp(a: Assembly) -> None:
    from tracetrain.memory.tiled_mlp import apply_tiled_mlp

    apply_tiled_mlp(a.plain(), a.spec.tiled_mlp_tokens)


def _fp8(a: Assembly) -> None:
    from tracetrain.kernels.fp8_apply import apply_fp8

    apply_fp8(a.plain(), a.spec.fp8, fused_mlp=a.spec.fp8_fused_mlp)  # type: ignore[arg-type]  # not 'none': the row runs only when fp8 is set (its predicate in TRANSFORMS)


def _pipeline_split(a: Assembly) -> None:
    from tracetrain.parallel.pipeline import split_model

    a.parts = list(split_model(a.plain(), a.mesh.local_rank("pp"), a.spec.cfg.parallel))


def _expert_parallel(a: Assembly) -> None:
    from tracetrain.parallel.expert_parallel import apply_expert_parallel

    for part in a.parts:
        apply_expert_parallel(part, a.mesh["ep"])


def _tensor_parallel(a: Assembly) -> None:
    from tracetrain.parallel.tensor_parallel import apply_tensor_parallel

    par = a.spec.cfg.parallel
    for part in a.parts:
        apply_tensor_parallel(
            part,
            a.mesh["tp"],
            sequence_parallel=par.sequence_parallel,
            loss_parallel=par.loss_parallel and getattr(part, "lm_head", None) is not None,
        )


def _context_parallel(a: Assembly) -> None:
    from tracetrain.parallel.context_parallel import apply_context_parallel

    cp = a.spec.cfg.parallel.cp
    for part in a.parts:
        apply_context_parallel(part, a.mesh.group("cp"), a.mesh.local_rank("cp"), cp)


def _recompute(a: Assembly) -> None:
    from tracetrain.memory.recompute import apply_recompute

    mem = a.spec.cfg.memory
    for part in a.parts:
        apply_recompute(_blocks(part), mem.recompute, mem.recompute_every)  # type: ignore[arg-type]  # apply_recompute reads only `.layers`, which the namespace carries


def _compile(a: Assembly) -> None:
    from tracetrain.kernels.apply import apply_compile

    for part in a.parts:
        apply_compile(_blocks(part), a.spec.recompute_pointwise)  # type: ignore[arg-type]  # only `.layers` is read


def _data_parallel(a: Assembly) -> None:
    from tracetrain.parallel.data_parallel import apply_data_parallel

    par = a.spec.cfg.parallel
    for part in a.parts:
        a.fsdp_units += apply_data_parallel(
            part,
            a.mesh,
            par,
            param_dtype=a.spec.fsdp_param_dtype,
            experts_sharded=par.ep > 1,
            shard_mesh=a.shard_mesh,
        )


def build_reference(spec: RunSpec, mesh: Any = None) -> nn.Module:
    """DPO's frozen reference for full fine-tuning: the model rows again (one process: validate.py), so it
    holds the initial weights the policy starts from (the seeded init, or model.init_from) with the same
    kernels; frozen, in eval mode. Also what `tracetrain eval` scores a trained DPO run against."""
    ref = assemble(spec.replace(reference="none"), mesh, until="materialise").module
    ref.requires_grad_(False)
    return ref.eval()


def _reference(a: Assembly) -> None:
    a.reference = build_reference(a.spec, a.mesh)


def _pipeline_schedule(a: Assembly) -> None:
    from tracetrain.parallel.pipeline import build_pipeline, stage_ids_of_rank
    from tracetrain.parallel.tensor_parallel import cross_entropy_sum

    par = a.spec.cfg.parallel
    a.pipeline = build_pipeline(
        a.parts,
        stage_ids_of_rank(a.mesh.local_rank("pp"), par),
        par,
        a.mesh.group("pp"),
        a.spec.device,
        cross_entropy_sum,
    )


def _layout(a: Assembly) -> None:
    from tracetrain.parallel.apply import ParallelModel
    from tracetrain.parallel.data_parallel import grad_sync_for

    par = a.spec.cfg.parallel
    a.par = ParallelModel(
        parts=a.parts,
        mesh=a.mesh,
        grad_sync=grad_sync_for(a.fsdp_units, a.mesh, par) if a.fsdp_units else None,
        pipeline=a.pipeline,
        loss_parallel=par.tp > 1 and par.loss_parallel,
    )


def _optimizer(a: Assembly) -> None:
    from tracetrain.train.optim import build_optimizer

    cfg = a.spec.cfg
    a.optimizer = build_optimizer(
        a.module, cfg.optim, a.spec.optimizer_fused, cfg.memory, triton_update=a.spec.optimizer_triton
    )


def _unified_memory(a: Assembly) -> None:
    from tracetrain.memory.unified import apply_unified_memory

    mem = a.spec.cfg.memory
    target = a.module if mem.unified_memory == "model" else a.optimizer
    assert target is not None
    apply_unified_memory(target, mem.unified_memory, coherent_memory=mem.coherent_memory)  # type: ignore[arg-type]  # not 'none': the row runs only when unified_memory is set (its predicate in TRANSFORMS)


def _activation_offload(a: Assembly) -> None:
    from tracetrain.memory import apply_activation_offload

    mem = a.spec.cfg.memory
    a.activation_offload = apply_activation_offload(
        a.module,
        mem.activation_offload,
        fraction=mem.activation_offload_fraction,
    )


def _always(spec: RunSpec) -> bool:
    return True


def _parallel(axis: str) -> Callable[[RunSpec], bool]:
    return lambda s: s.distributed and getattr(s.cfg.parallel, axis) > 1


TRANSFORMS: tuple[Transform, ...] = (
    Transform(
        "model",
        _always,
        _model,
        "first: the plain model on the meta device in its final dtype (LoRA base, bf16 under optimizer "
        "offload); the rows up to `materialise` change modules, not values, and cost no memory",
    ),
    Transform(
        "moe",
        lambda s: s.model_args.num_experts > 0,
        _moe,
        "the experts' load-balancing weight (the model row built them from model_args), before LoRA freezes "
        "the base: with LoRA the routers do not train and the term is inert",
    ),
    Transform(
        "lora",
        lambda s: s.cfg.train.mode == "lora",
        _lora,
        "before any wrapping row (recompute, compile, sharding must see the final modules); freezes the base "
        "(QLoRA: NF4 modules on meta, quantised one weight at a time by `materialise`)",
    ),
    Transform(
        "attention",
        _always,
        _attention,
        "after LoRA, before context parallelism (which replaces the core), recompute and compile",
    ),
    Transform(
        "fused_kernels",
        lambda s: bool(s.fused_kernels),
        _fused_kernels,
        "after LoRA (the lora kernel swaps existing adapters), before recompute and compile",
    ),
    Transform(
        "fused_ce",
        lambda s: s.fused_ce_chunk > 0,
        _fused_ce,
        "the head's loss path (no full logits), on the root module: independent of the block rows",
    ),
    Transform(
        "materialise_for_fp8",
        lambda s: s.fp8 != "none",
        _materialise,
        "FP8 quantises the frozen bases' values once, so they must exist before it; FP8 runs with FSDP "
        "alone (validate.py), and each rank holds the whole model until FSDP shards it",
    ),
    Transform(
        "fp8",
        lambda s: s.fp8 != "none",
        _fp8,
        "after LoRA (frozen bases are quantised once, adapters stay); before TP, recompute and compile, "
        "which must see the FP8 matmuls",
    ),
    Transform(
        "tiled_mlp",
        lambda s: s.tiled_mlp_tokens > 0,
        _tiled_mlp,
        "after LoRA, fused kernels and FP8 (each tile reruns the final norm + MLP); before the layout rows "
        "and recompute, whose recomputed block then reruns its tiles (checkpoints nest)",
    ),
    Transform(
        "pipeline_split",
        _parallel("pp"),
        _pipeline_split,
        "first of the layout: every later row works per stage and touches only this rank's layers",
    ),
    Transform(
        "expert_parallel",
        _parallel("ep"),
        _expert_parallel,
        "re-shards the expert weights into DTensors; before FSDP, which shards whatever it finds",
    ),
    Transform(
        "tensor_parallel",
        _parallel("tp"),
        _tensor_parallel,
        "Linear weights become DTensors with layout hooks; before recompute and compile (they must "
        "recompute / trace the collectives) and FSDP (which then shards the TP shards: 2-D)",
    ),
    Transform(
        "context_parallel",
        _parallel("cp"),
        _context_parallel,
        "changes what a block computes (ring attention core, sequence chunks): before recompute and compile",
    ),
    Transform(
        "recompute",
        lambda s: s.cfg.memory.recompute != "none",
        _recompute,
        "wraps whole blocks with their final contents (LoRA, kernels, FP8, TP, CP); before compile",
    ),
    Transform(
        "compile",
        lambda s: s.compile,
        _compile,
        "regional, per block: traces the final block, recomputation included; before FSDP, which "
        "gathers parameters around the compiled blocks",
    ),
    Transform(
        "data_parallel",
        lambda s: s.distributed,
        _data_parallel,
        "outermost wrapper: FSDP2 / HSDP / replicate gathers parameters around the compiled, recomputed "
        "blocks and reduces their gradients",
    ),
    Transform(
        "materialise",
        lambda s: s.fp8 == "none",
        _materialise,
        "after every layout row, before the schedule and the optimizer (which need real tensors): "
        "allocates only this rank's shards and fills them with layout-independent seeded values or the "
        "checkpoint's slices, so no rank ever holds the whole model",
    ),
    Transform(
        "reference",
        lambda s: s.reference == "copy",
        _reference,
        "DPO with full fine-tuning: a frozen copy of the materialised initial model, built by the model "
        "rows again; before the optimizer, which must not see it (LoRA's reference is the base itself)",
    ),
    Transform(
        "pipeline_schedule", _parallel("pp"), _pipeline_schedule, "wraps the finished stage modules in the schedule"
    ),
    Transform(
        "layout",
        lambda s: s.distributed,
        _layout,
        "the step's hooks of the finished layout (batch sharding, grad sync, loss and norm reductions)",
    ),
    Transform(
        "optimizer",
        _always,
        _optimizer,
        "after every row that swaps Parameter objects (LoRA adapters, DTensors): the optimizer, and the "
        "offloaded optimizer's gradient hooks, hold the final ones",
    ),
    Transform(
        "unified_memory",
        lambda s: s.cfg.memory.unified_memory != "none",
        _unified_memory,
        "after the optimizer exists: its states (or the model's weights) move into managed memory",
    ),
    Transform(
        "activation_offload",
        lambda s: s.cfg.memory.activation_offload != "none",
        _activation_offload,
        "last: hooks the saved-tensor packing of the finished model; the step enters its context",
    ),
)


def reapply_after_load(a: Assembly) -> bool:
    """Rows whose result loading a checkpoint undoes, applied again; True if any was. `Optimizer.load_state_dict`
    replaces the managed Adam moments with plain device tensors: without this a resumed run would hold its
    optimizer states in the GPU memory that `memory.unified_memory` was set to spare."""
    if a.spec.cfg.memory.unified_memory == "optimizer":
        _unified_memory(a)
        return True
    return False


# The rows that also run on one process when `assemble` is given a `shard_mesh`.
ONE_RANK_FSDP_ROWS = ("data_parallel", "layout")


def assemble(spec: RunSpec, mesh: Any = None, *, until: str | None = None, shard_mesh: Any = None) -> Assembly:
    """Apply every row of TRANSFORMS that applies to `spec`, in order; stop after row `until` if given.

    `mesh` is the ParallelMesh of a multi-rank job (required when spec.world_size > 1). The model must be
    identical on every rank (same seed or same checkpoint): `materialise` fills each shard with the values
    the whole model has at that place, whatever the layout. `shard_mesh` (a 1-rank DeviceMesh, with the
    one-rank `mesh`): FSDP2 over one GPU, parameters as DTensors gathered and freed around each block as
    on several GPUs, without the traffic (benchmarks/compose_gpu.py: transforms meeting FSDP on real kernels).
    """
    if (spec.distributed or shard_mesh is not None) and mesh is None:
        raise ValueError(f"a RunSpec for {spec.world_size} rank(s) with a layout needs their ParallelMesh")
    names = [t.name for t in TRANSFORMS]
    if until is not None and until not in names:
        raise ValueError(f"no transform {until!r}; the rows are {', '.join(names)}")
    a = Assembly(spec=spec, mesh=mesh, shard_mesh=shard_mesh)
    for t in TRANSFORMS:
        if t.applies(spec) or (shard_mesh is not None and t.name in ONE_RANK_FSDP_ROWS):
            t.apply(a)
            a.applied.append(t.name)
        if t.name == until:
            break
    return a


def step_context(
    spec: RunSpec,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    par: Any = None,
    activation_offload: Any = None,
    scaler: torch.amp.GradScaler | None = None,
    phase: Callable[[str], Any] | None = None,
    reference: nn.Module | None = None,
) -> StepContext:
    """The training step's fixed inputs, from the spec and what `assemble` built (for evaluation
    alone: no optimizer; `reference`: DPO's frozen copy under full fine-tuning). The one place a
    StepContext is made."""
    extra = {"phase": phase} if phase is not None else {}
    return StepContext(
        device=spec.device,
        autocast_dtype=spec.autocast_dtype,
        grad_clip=spec.cfg.train.grad_clip,
        use_document_mask=spec.document_mask,
        fused_skip=bool(optimizer is not None and optimizer.defaults.get("fused")),
        scaler=scaler,
        activation_offload=activation_offload,
        fused_ce_chunk=spec.fused_ce_chunk,
        par=par,
        objective=preference_objective(spec, reference),
        **extra,
    )


def preference_objective(spec: RunSpec, reference: nn.Module | None = None) -> Any:
    """The step's PreferenceObjective for a dpo / simpo spec (None: token cross-entropy)."""
    if spec.objective == "sft":
        return None
    from tracetrain.train.preference import PreferenceObjective

    pc = spec.cfg.preference
    return PreferenceObjective(
        spec.objective,
        beta=pc.beta,
        label_smoothing=pc.label_smoothing,
        simpo_gamma=pc.simpo_gamma,
        reference=spec.reference,
        reference_model=reference,
    )


def run_step_context(
    a: Assembly, *, scaler: torch.amp.GradScaler | None = None, phase: Callable[[str], Any] | None = None
) -> StepContext:
    """`step_context` of an assembled run: its optimizer, layout and activation offload."""
    return step_context(
        a.spec,
        optimizer=a.optimizer,
        par=a.par,
        activation_offload=a.activation_offload,
        scaler=scaler,
        phase=phase,
        reference=a.reference,
    )


def build_model(cfg: Any, device: torch.device) -> nn.Module:
    """The single-process model of `cfg` on `device`: every model row up to `materialise` (no optimizer)."""
    from tracetrain.spec import resolve

    return assemble(resolve(cfg, device), until="materialise").module
