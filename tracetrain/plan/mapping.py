"""The one mapping between a run and the planner's `PlanInput`, both ways.

`plan_input_from_spec(spec, gpu)`: the run the trainer would execute — its `RunSpec`, every `auto`
already decided by `tracetrain/spec.py` `resolve` — as the planner's input. `plan_to_config_overrides(plan)`:
the `--section.key=value` overrides that select a planned row. Both read `FIELDS`, one row per
`PlanInput` field that a run's config sets: the config key, how the value is read from the spec (a
decided value from the spec, a plain one from its config) and how a planned value is written back. Three
kinds of field stay outside the table, each for a stated reason: the layout and the batch (`_layout`,
`_batch`: the planner's what-if of extra GPUs and the pipeline's cut of the batch), and what no config
key holds (`NOT_FROM_CONFIG`: the GPU and its overrides). A test checks that every field is in one of
these, and that plan -> overrides -> resolve -> plan gives the same input back.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tracetrain.config import Config, field_choices
from tracetrain.models.llama import ModelArgs
from tracetrain.models.lora import resolve_targets as _lora_targets
from tracetrain.plan.core import Plan
from tracetrain.plan.inputs import PlanInput, PlanInputError
from tracetrain.spec import RunSpec, resolve

# PlanInput fields no config key sets: the hardware (CLI flags of `tracetrain plan`), and two
# numerics tracetrain does not choose (its trainable weights are fp32; SDPA's Hopper kernel is torch's).
NOT_FROM_CONFIG = frozenset(
    {
        "model",  # spec.model_args, read as a whole (preset or checkpoint, plus overrides)
        "num_gpus",
        "gpu",
        "gpu_memory_gib",
        "hbm_tb_s",
        "intra_node_gb_s",
        "inter_node_gb_s",
        "host_gb_s",
        "gpus_per_node",
        "host_memory_gib",
        "cpu_adam_gb_s",
        "param_dtype",
        "sdpa_kernel",
    }
)
LAYOUT_FIELDS = ("dp_replicate", "dp_shard", "tp", "pp", "cp")
BATCH_FIELDS = ("micro_batch", "grad_accum", "pp_microbatches")
_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float32: "fp32"}


def _on_off(value: object) -> str:
    return "on" if value else "off"


def _always(inp: PlanInput) -> bool:
    return True


@dataclass(frozen=True)
class Field:
    """One PlanInput field and the config key that selects it.

    `read`: the value of a run (None: leave PlanInput's default, the field does not apply to this run).
    `write`: the config value for a planned value (default: the field's value as is); `when`: whether
    the override is written for a plan (a key that does not apply to it is left out).
    """

    name: str
    key: str
    read: Callable[[RunSpec], object] | None
    write: Callable[[PlanInput], object] | None = None
    when: Callable[[PlanInput], bool] = _always

    def value_of(self, inp: PlanInput) -> object:
        return self.write(inp) if self.write else getattr(inp, self.name)


def _cfg(key: str) -> Callable[[RunSpec], object]:
    """Read a config key as the user wrote it (a value `resolve` does not decide)."""
    section, name = key.split(".")
    return lambda s: getattr(getattr(s.cfg, section), name)


def _lora(inp: PlanInput) -> bool:
    return inp.mode == "lora"


def _moe(inp: PlanInput) -> bool:
    return inp.num_experts > 0


def _moe_variant(inp: PlanInput) -> bool:
    """An MoE variant of a preset: a checkpoint's experts are its own (not a config key to write)."""
    return inp.num_experts > 0 and not inp.load_checkpoint


def _pipelined(inp: PlanInput) -> bool:
    return inp.pp > 1


FIELDS: tuple[Field, ...] = (
    Field("seq_len", "data.seq_len", _cfg("data.seq_len")),
    Field("mode", "train.mode", _cfg("train.mode")),
    # Decided by resolve: read from the spec, written back as the explicit choice (never 'auto').
    # FP8 GEMMs run inside bf16 autocast (kernels/fp8.py): the planner's "fp8" is train.fp8 on top.
    Field(
        "precision",
        "train.precision",
        lambda s: "fp8" if s.fp8 != "none" else s.precision,
        lambda i: "bf16" if i.precision == "fp8" else i.precision,
    ),
    Field(
        "fp8_recipe",
        "train.fp8",
        lambda s: s.fp8 if s.fp8 != "none" else None,
        lambda i: i.fp8_recipe if i.precision == "fp8" else "none",
    ),
    Field(
        "lora_base_dtype",
        "lora.base_dtype",
        lambda s: _DTYPE_NAMES[s.lora_base_dtype] if s.lora_base_dtype is not None else None,
        when=_lora,
    ),
    Field("fused_adamw", "optim.fused", lambda s: s.optimizer_fused, lambda i: _on_off(i.fused_adamw)),
    Field("compile", "train.compile", lambda s: s.compile, lambda i: _on_off(i.compile)),
    Field("fused_kernels", "train.fused_kernels", lambda s: bool(s.fused_kernels), lambda i: _on_off(i.fused_kernels)),
    Field("attention", "train.attention", lambda s: s.attention),
    Field("fused_ce_chunk", "train.fused_ce", lambda s: s.fused_ce_chunk, lambda i: i.fused_ce_chunk > 0),
    Field("fused_ce_chunk", "train.fused_ce_chunk", None, when=lambda i: i.fused_ce_chunk > 0),
    # As the config says.
    Field("lora_rank", "lora.rank", _cfg("lora.rank"), when=_lora),
    Field("lora_base_quant", "lora.base_quant", _cfg("lora.base_quant"), when=_lora),
    Field("lora_dora", "lora.dora", _cfg("lora.dora"), when=_lora),
    Field(
        "lora_targets",
        "lora.targets",
        lambda s: tuple(_lora_targets(s.cfg.lora.targets)),
        lambda i: list(i.lora_targets),
        when=_lora,
    ),
    Field("recompute", "memory.recompute", _cfg("memory.recompute")),
    Field("recompute_every", "memory.recompute_every", _cfg("memory.recompute_every")),
    Field("activation_offload", "memory.activation_offload", _cfg("memory.activation_offload")),
    Field(
        "activation_offload_fraction", "memory.activation_offload_fraction", _cfg("memory.activation_offload_fraction")
    ),
    Field("optimizer_offload", "memory.optimizer_offload", _cfg("memory.optimizer_offload")),
    Field("tiled_mlp_tokens", "memory.tiled_mlp", lambda s: s.tiled_mlp_tokens, lambda i: _on_off(i.tiled_mlp_tokens)),
    Field("tiled_mlp_tokens", "memory.tiled_mlp_tokens", None, when=lambda i: i.tiled_mlp_tokens > 0),
    Field(
        "recompute_pointwise",
        "memory.recompute_pointwise",
        lambda s: s.recompute_pointwise,
        when=lambda i: i.recompute_pointwise,
    ),
    Field("unified_memory", "memory.unified_memory", _cfg("memory.unified_memory")),
    Field("expandable_segments", "memory.expandable_segments", _cfg("memory.expandable_segments")),
    Field("load_checkpoint", "model.init_from", lambda s: bool(s.cfg.model.init_from), when=lambda i: False),
    Field("peak_tflops", "logging.peak_tflops", lambda s: s.cfg.logging.peak_tflops or None, when=lambda i: False),
    # The model's experts (model.num_experts, or an MoE checkpoint's, which no override may change).
    Field("num_experts", "model.num_experts", lambda s: s.model_args.num_experts, when=_moe_variant),
    Field(
        "top_k",
        "model.experts_top_k",
        lambda s: s.model_args.experts_top_k if s.model_args.num_experts else None,
        when=_moe_variant,
    ),
    Field("ep", "parallel.ep", _cfg("parallel.ep"), when=_moe),
    Field("zero_stage", "parallel.zero_stage", _cfg("parallel.zero_stage")),
    Field("reshard_after_forward", "parallel.reshard_after_forward", _cfg("parallel.reshard_after_forward")),
    Field("fsdp_cpu_offload", "parallel.fsdp_cpu_offload", _cfg("parallel.fsdp_cpu_offload")),
    Field("sequence_parallel", "parallel.sequence_parallel", _cfg("parallel.sequence_parallel")),
    Field("loss_parallel", "parallel.loss_parallel", _cfg("parallel.loss_parallel")),
    Field("pp_schedule", "parallel.pp_schedule", _cfg("parallel.pp_schedule"), when=_pipelined),
    Field(
        "pp_virtual_stages",
        "parallel.pp_stages_per_rank",
        lambda s: s.cfg.parallel.pp_stages_per_rank if s.cfg.parallel.pp_schedule == "interleaved_1f1b" else None,
        when=lambda i: i.pp > 1 and i.pp_schedule == "interleaved_1f1b",
    ),
)


def _layout(cfg: Config, num_gpus: int) -> dict[str, int]:
    """The config's [parallel] layout; when it names a single GPU and `num_gpus` > 1, the extra GPUs are
    planned as FSDP (ZeRO-3) shards (the planner's what-if, `tracetrain plan --gpus N`)."""
    par = cfg.parallel
    layout = {name: getattr(par, name) for name in LAYOUT_FIELDS}
    used = math.prod(layout.values())
    if used == 1:
        layout["dp_shard"] = num_gpus
    elif num_gpus not in (1, used):
        raise PlanInputError(
            f"--gpus {num_gpus} but the config's [parallel] layout (dp_replicate x dp_shard x tp x pp x cp) "
            f"uses {used} GPUs; pass --gpus {used} or change the layout"
        )
    return layout


def _batch(cfg: Config) -> dict[str, int]:
    """micro_batch, grad_accum and pp_microbatches as the step runs them. With pp > 1,
    parallel/pipeline.py concatenates a step's micro_batch_size * grad_accum_steps rows per
    data-parallel rank and cuts them into pp_microbatches (0 = pp) pipeline micro-batches."""
    t, par = cfg.train, cfg.parallel
    if par.pp == 1:
        return {"micro_batch": t.micro_batch_size, "grad_accum": t.grad_accum_steps, "pp_microbatches": 0}
    pp_micro = par.pp_microbatches or par.pp
    rows = t.micro_batch_size * t.grad_accum_steps
    if rows % pp_micro:
        raise PlanInputError(
            f"each step's {rows} rows per rank (train.micro_batch_size * train.grad_accum_steps) "
            f"must split into parallel.pp_microbatches = {pp_micro} pipeline micro-batches"
        )
    return {"micro_batch": rows // pp_micro, "grad_accum": pp_micro, "pp_microbatches": pp_micro}


def dense_shape(args: ModelArgs) -> ModelArgs:
    """The planner's view of a model: its dense shape, the experts (PlanInput.num_experts, top_k) apart.
    An expert has the MLP's shape there, so an MoE model's MLP width is its experts' (Qwen3-MoE's dense
    blocks, mlp_only_layers, are counted as MoE blocks: the released checkpoints have none)."""
    if not args.num_experts:
        return args
    return dataclasses.replace(
        args, num_experts=0, experts_top_k=0, ffn_dim=args.expert_ffn_dim, moe_ffn_dim=0, dense_layers=()
    )


def plan_input_from_spec(spec: RunSpec, gpu: str | None = None, num_gpus: int | None = None) -> PlanInput:
    """The `PlanInput` of the run `spec` describes, on `gpu` (default: this process's GPU, else an
    H100 SXM) with `num_gpus` GPUs (default: the spec's world size)."""
    values: dict[str, object] = {}
    for f in FIELDS:
        value = f.read(spec) if f.read else None
        if value is not None and f.name not in values:
            values[f.name] = value
    layout = _layout(spec.cfg, num_gpus or spec.world_size)
    return PlanInput(
        model=dense_shape(spec.model_args),
        num_gpus=math.prod(layout.values()),
        gpu=gpu or _visible_gpu() or "h100-sxm",
        **layout,  # type: ignore[arg-type]  # the five integer axes; a dict[str, int] is checked against every field
        **_batch(spec.cfg),  # type: ignore[arg-type]  # the three integer counts; a dict[str, int] is checked against every field
        **values,  # type: ignore[arg-type]  # FIELDS' values, of the fields' types
    )


def plan_input_from_config(cfg: Config, num_gpus: int = 1, gpu: str | None = None) -> PlanInput:
    """The `PlanInput` a `tracetrain train` run of `cfg` would be on a CUDA GPU: `resolve` decides its
    `auto` choices (for a GPU this process need not see: no capability probe), `plan_input_from_spec`
    reads them."""
    return plan_input_from_spec(plan_spec(cfg, num_gpus), gpu, num_gpus)


def plan_spec(cfg: Config, num_gpus: int = 1) -> RunSpec:
    """The spec of `cfg` on a CUDA GPU this process need not see (no capability probe), `num_gpus` ranks."""
    return resolve(cfg, torch.device("cuda"), world_size=math.prod(_layout(cfg, num_gpus).values()), probe=False)


def plan_to_config_overrides(p: Plan) -> list[str]:
    """The overrides that select `p`'s row: `FIELDS` written back, the layout and the batch. A value the
    config does not accept comes back as a '# ...' line, so the list can be pasted into a shell as is."""
    i = p.input
    wanted: list[tuple[str, object]] = [
        ("train.micro_batch_size", i.micro_batch),
        ("train.grad_accum_steps", i.num_microbatches),
    ]
    wanted += [(f.key, f.value_of(i)) for f in FIELDS if f.when(i)]
    wanted += [(f"parallel.{name}", getattr(i, name)) for name in LAYOUT_FIELDS]
    if i.pp > 1:
        wanted.append(("parallel.pp_microbatches", i.num_microbatches))
    out, missing = [], []
    for key, value in wanted:
        line = f"--{key}={_literal(value)}"
        allowed = _choices(key)
        if allowed is None or value in allowed:
            out.append(line)
        else:
            missing.append(f"# {line}  (not a value the config allows)")
    return out + missing


def _literal(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return json.dumps(list(value), separators=(",", ":"))
    return str(value)


def _choices(key: str) -> tuple | None:
    """The values a config key allows (None: any value of its type)."""
    section, name = key.split(".", 1)
    section_cls = type(getattr(Config(), section))
    assert name in {f.name for f in dataclasses.fields(section_cls)}, key  # FIELDS names real keys (tested)
    return field_choices(section_cls, name) or None


def _visible_gpu() -> str | None:
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
