"""`plan_to_config_overrides(plan)`: the `--section.key=value` overrides that select a planned row.

Only keys that exist in `tracetrain.config.Config` today are emitted as overrides; the others (the
parallel layout, fp8, MoE) come back as comments, so the list can be pasted into a shell as is and
shows what a future config section would need.
"""

from __future__ import annotations

import dataclasses
import json

from tracetrain.config import Config, field_choices
from tracetrain.plan.core import Plan


def _config_keys() -> set[str]:
    keys = set()
    for section in dataclasses.fields(Config):
        for f in dataclasses.fields(section.default_factory()):  # type: ignore[operator]  # config sections always have a default or a factory
            keys.add(f"{section.name}.{f.name}")
    return keys


def _literal(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return json.dumps(list(value), separators=(",", ":"))
    return str(value)


def plan_to_config_overrides(p: Plan) -> list[str]:
    """Overrides for the row's settings; settings with no config key yet are returned as '# ...' lines."""
    i = p.input
    wanted: list[tuple[str, object]] = [
        ("train.mode", i.mode),
        ("train.precision", i.precision),
        ("train.micro_batch_size", i.micro_batch),
        ("train.grad_accum_steps", i.num_microbatches),
        ("data.seq_len", i.seq_len),
        ("memory.recompute", i.recompute),
        ("memory.recompute_every", i.recompute_every),
        ("memory.activation_offload", i.activation_offload),
        ("memory.optimizer_offload", i.optimizer_offload),
        ("memory.unified_memory", i.unified_memory),
        ("optim.fused", "on" if i.fused_adamw else "off"),
        ("train.compile", "on" if i.compile else "off"),
        ("train.fused_kernels", "on" if i.fused_kernels else "off"),
        ("train.attention", i.attention),
        ("train.fused_ce", i.fused_ce_chunk > 0),
    ]
    if i.fused_ce_chunk:
        wanted.append(("train.fused_ce_chunk", i.fused_ce_chunk))
    if i.mode == "lora":
        wanted += [("lora.rank", i.lora_rank), ("lora.targets", i.lora_targets), ("lora.base_dtype", i.lora_base_dtype)]
    wanted += [
        ("parallel.dp_replicate", i.dp_replicate),
        ("parallel.dp_shard", i.dp_shard),
        ("parallel.zero_stage", i.zero_stage),
        ("parallel.reshard_after_forward", i.reshard_after_forward),
        ("parallel.fsdp_cpu_offload", i.fsdp_cpu_offload),
        ("parallel.tp", i.tp),
        ("parallel.sequence_parallel", i.sequence_parallel),
        ("parallel.loss_parallel", i.loss_parallel),
        ("parallel.pp", i.pp),
        ("parallel.cp", i.cp),
    ]
    if i.pp > 1:
        wanted += [("parallel.pp_schedule", i.pp_schedule), ("parallel.pp_microbatches", i.num_microbatches)]
        if i.pp_schedule == "interleaved_1f1b":
            wanted.append(("parallel.pp_stages_per_rank", i.pp_virtual_stages))
    if i.num_experts:
        wanted += [("parallel.ep", i.ep), ("model.num_experts", i.num_experts), ("model.experts_top_k", i.top_k)]
    if i.precision == "fp8":
        wanted.append(("train.fp8", "rowwise"))
    keys = _config_keys()
    out, missing = [], []
    for key, value in wanted:
        line = f"--{key}={_literal(value)}"
        allowed = _choices(key)
        if key in keys and (allowed is None or value in allowed):
            out.append(line)
        else:
            missing.append(f"# {line}  (no such config key or value yet)")
    return out + missing


def _choices(key: str) -> tuple | None:
    section, name = key.split(".", 1)
    for sf in dataclasses.fields(Config):
        if sf.name == section:
            for f in dataclasses.fields(sf.default_factory()):  # type: ignore[operator]  # config sections always have a default or a factory
                if f.name == name:
                    return field_choices(sf.default_factory, name) or None  # type: ignore[arg-type]  # a section class
    return None
