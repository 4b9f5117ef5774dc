"""Checks of a run that need the model's shape, not only the config: run them before the run directory exists.

`config.py` validates what the config alone can tell (types, ranges, finite numbers, keys that depend on
each other). What is left needs `ModelArgs` — a preset's or a Hugging Face checkpoint's shape — or the
job's size, so it lives here, in `validate`, which the trainer calls once, early, right after
`check_named_files` (the files the config names exist: a wrong path is reported before any setting):

- the parallel layout against the model and the world size (`parallel/mesh.py::validate_parallel`), and
  the switches not yet combined with several ranks (`refuse_with_parallel`);

- a LoRA rank larger than a targeted projection's smaller side (the update could never have that rank:
  the extra adapter rows and columns only cost memory and change the `alpha / rank` scale);
- `data.seq_len` beyond the context of the `model.init_from` checkpoint (`max_position_embeddings`):
  positions the model never saw in pre-training; the rotary embedding would silently extrapolate.
  Refused for now; a context-extension switch (RoPE scaling) would be the documented way to allow it.
"""

from __future__ import annotations

from pathlib import Path

from tracetrain.config import Config, check_warmup
from tracetrain.errors import ConfigError
from tracetrain.models.llama import ModelArgs
from tracetrain.models.lora import resolve_targets


def projection_features(args: ModelArgs) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of every LoRA-targetable projection of one block."""
    d, q, kv, f = args.dim, args.q_dim, args.n_kv_heads * args.head_dim, args.ffn_dim
    return {
        "q_proj": (d, q),
        "k_proj": (d, kv),
        "v_proj": (d, kv),
        "o_proj": (q, d),
        "gate_proj": (d, f),
        "up_proj": (d, f),
        "down_proj": (f, d),
    }


def check_lora_rank(cfg: Config, args: ModelArgs) -> None:
    """lora.rank must not exceed min(in, out) of any projection it adapts."""
    if cfg.train.mode != "lora":
        return
    try:
        targets = resolve_targets(cfg.lora.targets)
    except ValueError as e:
        raise ConfigError(f"config key 'lora.targets': {e}") from None
    features = projection_features(args)
    name = min(targets, key=lambda t: min(features[t]))
    fan_in, fan_out = features[name]
    if cfg.lora.rank > min(fan_in, fan_out):
        raise ConfigError(
            f"config key 'lora.rank': {cfg.lora.rank} is larger than the {name} layer it adapts "
            f"({fan_in} -> {fan_out} features); it must be <= {min(fan_in, fan_out)}"
        )


def check_context_length(cfg: Config) -> None:
    """data.seq_len must fit the context the `model.init_from` checkpoint was trained for."""
    if not cfg.model.init_from:
        return
    from tracetrain.models.hf import load_hf_config

    # Read config.json again: model_args_from_config already raised max_seq_len to data.seq_len.
    context = load_hf_config(cfg.model.init_from).max_seq_len
    if cfg.data.seq_len > context:
        raise ConfigError(
            f"config key 'data.seq_len': {cfg.data.seq_len} is longer than the context of "
            f"model.init_from {cfg.model.init_from} (max_position_embeddings = {context}); "
            f"use data.seq_len <= {context}"
        )


def check_family_layout(cfg: Config, args: ModelArgs) -> None:
    """A layout the model's family does not run (models/families.py `layout_refusal`) is one line."""
    from tracetrain.models.families import layout_refusal

    par = cfg.parallel
    refusal = layout_refusal(args, tp=par.tp, pp=par.pp, cp=par.cp, sequence_parallel=par.sequence_parallel)
    if refusal is not None:
        key, why = refusal
        raise ConfigError(f"config key '{key}' is not supported for a {args.family} model: {why}")


def validate_run(cfg: Config, args: ModelArgs) -> None:
    """Refuse a run whose config does not fit its model (`args`, from `model_args_from_config(cfg)`).

    Raises ConfigError naming the key, the value and what is allowed. Call before creating the run
    directory, so a refused run leaves nothing behind.
    """
    check_lora_rank(cfg, args)
    check_context_length(cfg)
    check_family_layout(cfg, args)
    # A new run only: a saved run's config.toml (eval, export, resume) loads whatever its schedule was.
    # With train.epochs the length is known once the data is built (train/optim.py::size_by_epochs checks it).
    if not cfg.train.epochs:
        check_warmup(cfg.optim, cfg.train.steps)


def refuse_with_parallel(cfg: Config) -> None:
    """Switches not combined with a multi-rank layout, each refused with its reason (one line).

    What composes, with its test: fp16 loss scaling with FSDP, TP and CP (every rank skips an overflowed
    step alike; tests/parallel/test_parallel_compose.py), activation offload with FSDP and DDP (gloo, and CUDA in
    benchmarks/compose_gpu.py), FP8 with FSDP / DDP (benchmarks/compose_gpu.py on one GPU: FSDP2 over a
    1-rank mesh, losses within 0.4% of the unsharded run), managed optimizer states with FSDP / DDP (the
    same script: DTensor moments on managed storage). With pipeline parallelism `validate_parallel`
    refuses fp16.
    """
    checks = {
        "memory.optimizer_offload": (
            cfg.memory.optimizer_offload,
            "its CPU AdamW owns whole gradients and weights, not FSDP/TP shards; use parallel.fsdp_cpu_offload "
            "for sharded CPU offload",
        ),
        "memory.unified_memory": (
            cfg.memory.unified_memory == "model"
            or (
                cfg.memory.unified_memory == "optimizer"
                and max(cfg.parallel.tp, cfg.parallel.cp, cfg.parallel.pp, cfg.parallel.ep) > 1
            ),
            "with several ranks only the optimizer states go to managed memory (memory.unified_memory = "
            "'optimizer', with FSDP or DDP): FSDP owns and re-creates the parameter storage, and the tensor-, "
            "context-, pipeline- and expert-parallel layouts were not checked with it",
        ),
        "lora.base_quant": (
            cfg.lora.base_quant != "none",
            "the NF4 base is held whole by each rank (its 4-bit buffers are not sharded by FSDP or split by "
            "the tensor-parallel plan)",
        ),
        "lora.dora": (
            cfg.lora.dora,
            "DoRA's row norms need each projection's whole rows, which the layouts were not checked to give",
        ),
        "train.fp8": (
            cfg.train.fp8 != "none" and max(cfg.parallel.tp, cfg.parallel.cp, cfg.parallel.pp, cfg.parallel.ep) > 1,
            "FP8 composes with data parallelism (FSDP, DDP) only; its matmuls do not take tensor-, context-, "
            "pipeline- or expert-parallel shards",
        ),
        "train.objective": (
            cfg.train.objective != "sft"
            and (
                max(cfg.parallel.tp, cfg.parallel.cp, cfg.parallel.pp) > 1
                or (cfg.train.objective == "dpo" and cfg.train.mode == "full")
            ),
            "preference objectives run with data parallelism (FSDP, DDP), and DPO there with train.mode = 'lora' "
            "(its reference is the base with adapters off); each pair's log-probabilities need whole rows and "
            "logits (no tensor-, context- or pipeline-parallel shards), and full fine-tuning's frozen reference "
            "copy is built on one process",
        ),
    }
    for key, (bad, why) in checks.items():
        if bad:
            raise ConfigError(
                f"config key '{key}' is not supported together with several ranks yet: {why}; "
                "turn it off or run on one process"
            )


def check_named_files(cfg: Config) -> None:
    """The files and folders the config names exist: model.init_from, then the data section's (data.path,
    data.eval_path, data.tokenizer, the chat template), and train.output_dir is not a file. Run first, before any check of a setting and
    before the model's shape is read, so that a user who mistyped a path is told that, not what a
    setting would conflict with. (The --config file itself is read, or refused, by `load_config`.)"""
    from tracetrain.data import check_data_files
    from tracetrain.models.hf_config import require_checkpoint_folder

    if cfg.model.init_from:
        require_checkpoint_folder(cfg.model.init_from)
    check_data_files(cfg.data)
    out = Path(cfg.train.output_dir)  # made if missing; the data cache is written there before the run directory
    existing = next(p for p in (out, *out.parents) if p.exists())  # '.' or '/' at the latest
    if not existing.is_dir():
        what = "is a file" if existing == out else f"is inside {existing}, which is a file"
        raise ConfigError(f"config key 'train.output_dir': {out} {what}; name a folder (runs are made in it)")


def validate(cfg: Config, args: ModelArgs, world_size: int) -> None:
    """Every check of a run that needs more than the config: its model shape and its job size. The one
    call the trainer makes before any rank waits on another and before the run directory exists."""
    from tracetrain.parallel.mesh import validate_parallel

    validate_parallel(cfg, args, world_size)
    if world_size > 1:
        refuse_with_parallel(cfg)
    validate_run(cfg, args)
