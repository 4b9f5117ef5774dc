"""The typed config tree: one dataclass per section, loaded from TOML plus dotted CLI overrides.

Every field has a default and a one-line doc (`metadata["doc"]`), and a `Literal` type of choices or a numeric
range. Validation happens once, in `load_config`, and a bad value raises `ConfigError` naming the key,
the value and what is allowed. The resolved tree is written to the run directory with `to_toml`, so a
run can be reproduced (and resumed) from its own `config.toml`.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from tracetrain.errors import ConfigError


def fld(default: Any, doc: str, *, ge: float | None = None, gt: float | None = None, le: float | None = None) -> Any:
    """A config field with its doc and numeric range (checked at load). Choices are the field's `Literal` type."""
    meta = {"doc": doc, "ge": ge, "gt": gt, "le": le}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class ModelSection:
    preset: str = fld("tiny", "Architecture preset name (see `tracetrain presets`).")
    init_from: str = fld("", "Hugging Face checkpoint directory to load weights and shape from ('' = random init).")
    dim: int | None = fld(None, "Override the preset's hidden size.", gt=0)
    n_layers: int | None = fld(None, "Override the preset's number of transformer blocks.", gt=0)
    n_heads: int | None = fld(None, "Override the preset's number of attention heads.", gt=0)
    n_kv_heads: int | None = fld(None, "Override the preset's number of key/value heads (GQA).", gt=0)
    ffn_dim: int | None = fld(None, "Override the preset's SwiGLU hidden size.", gt=0)
    vocab_size: int | None = fld(None, "Override the preset's vocabulary size (embedding rows).", gt=0)
    init_std: float = fld(0.02, "Standard deviation of the random weight init.", gt=0)
    num_experts: int = fld(0, "Mixture-of-experts: experts per block (0 = dense SwiGLU MLP).", ge=0)
    experts_top_k: int = fld(2, "MoE: experts each token is routed to.", gt=0)
    moe_aux_loss_coef: float = fld(0.01, "MoE: weight of the load-balancing loss.", ge=0)


@dataclass(frozen=True)
class DataSection:
    kind: Literal["synthetic", "instruction", "chat", "text"] = fld(
        "synthetic",
        "Dataset kind: generated task, instruction/response pairs, multi-turn chat "
        "(messages or ShareGPT conversations), or plain text.",
    )
    path: str = fld(
        "",
        "Training data: JSONL, a JSON array, Parquet or a datasets save_to_disk folder (text also "
        "takes a plain text file). Unused for synthetic.",
    )
    eval_path: str = fld("", "Held-out data file; '' = split eval_fraction off the training data.")
    eval_fraction: float = fld(0.05, "Share of examples held out for eval when eval_path is ''.", ge=0, le=0.5)
    tokenizer: str = fld(
        "auto",
        "'auto' (model.init_from's tokenizer when it has a tokenizer.json, else 'byte'), "
        "'byte' (built-in byte-level), or a Hugging Face tokenizer folder or tokenizer.json.",
    )
    seq_len: int = fld(128, "Tokens per training sequence.", gt=1)
    pack: bool = fld(True, "Pack several examples into each sequence (document-masked attention).")
    template: Literal["alpaca", "plain", "chatml"] = fld("alpaca", "Prompt template for instruction data.")
    chat_template: str = fld(
        "auto",
        "Chat data: 'auto' (the tokenizer's own chat_template), a built-in name "
        "(chatml, llama-3, mistral) or a path to a .jinja file.",
    )
    messages_field: str = fld(
        "messages",
        "Chat data: field with the list of {role, content} messages; rows with "
        "ShareGPT 'conversations' ({from, value}) are read too.",
    )
    text_field: str = fld("text", "Text data in JSONL/JSON/Parquet/datasets form: the field holding each document.")
    instruction_field: str = fld("instruction", "JSONL field holding the instruction / question / prompt.")
    context_field: str = fld("context", "JSONL field holding optional context ('' = none).")
    response_field: str = fld("response", "JSONL field holding the target response / answer.")
    train_on_prompt: bool = fld(
        False,
        "Also compute loss on prompt tokens (default: response only; for chat: "
        "every assistant turn with its end-of-turn token).",
    )
    tokenize: Literal["ahead", "on_the_fly"] = fld(
        "ahead",
        "Tokenise all data before training ('ahead'), or each row as the loader asks for it "
        "('on_the_fly': no start-up cost, work moves into data.num_workers; needs pack = false).",
    )
    skip_bad_lines: bool = fld(
        False,
        "Skip bad rows (malformed JSON, missing fields, bad chat messages) and report how many, instead of failing.",
    )
    synthetic_examples: int = fld(20000, "Number of generated examples for the built-in synthetic task.", gt=0)
    num_workers: int = fld(0, "DataLoader worker processes.", ge=0)
    pin_memory: bool = fld(True, "Pin host batches for faster, asynchronous copies to the GPU.")
    prefetch_factor: int = fld(2, "Batches each worker loads ahead (needs num_workers > 0).", gt=0)
    seed: int = fld(1234, "Seed for shuffling and the synthetic task.")


@dataclass(frozen=True)
class TrainSection:
    mode: Literal["full", "lora"] = fld("full", "Train every weight ('full') or low-rank adapters only ('lora').")
    steps: int = fld(600, "Optimizer steps to run.", gt=0)
    epochs: float = fld(
        0.0,
        "Passes over the training data instead of train.steps (0 = use steps): steps = "
        "ceil(epochs * batches per epoch / grad_accum_steps), sized once the data is built.",
        ge=0,
    )
    micro_batch_size: int = fld(16, "Sequences per forward/backward pass.", gt=0)
    grad_accum_steps: int = fld(1, "Micro-batches accumulated per optimizer step.", gt=0)
    precision: Literal["auto", "fp32", "bf16", "fp16"] = fld(
        "auto", "Compute precision ('auto' = bf16 on GPU, fp32 on CPU); fp16 uses dynamic loss scaling."
    )
    device: str = fld("auto", "'auto' (cuda if available), 'cpu', 'cuda' or 'cuda:N'.")
    compile: Literal["auto", "on", "off"] = fld("auto", "torch.compile each transformer block ('auto' = on for CUDA).")
    attention: Literal["auto", "sdpa", "flex"] = fld(
        "auto",
        "Attention kernel: 'flex' (FlexAttention, document masks as block masks), 'sdpa', "
        "or 'auto' (flex for packed rows on CUDA, else sdpa).",
    )
    fused_kernels: Literal["auto", "on", "off"] = fld(
        "auto", "Triton RMSNorm/RoPE/SwiGLU/LoRA kernels ('auto' = on for CUDA when compile is off)."
    )
    fused_ce: bool = fld(True, "Chunked fused lm_head + cross-entropy: full-vocabulary fp32 logits never exist.")
    fused_ce_chunk: int = fld(4096, "Tokens per chunk of the fused lm_head + cross-entropy.", gt=0)
    fp8: Literal["none", "tensorwise", "rowwise"] = fld(
        "none",
        "FP8 GEMMs in the blocks (GPU with compute capability >= 8.9): 'tensorwise' or 'rowwise' "
        "scaling; LoRA bases are quantised once, full fine-tuning uses torchao.",
    )
    seed: int = fld(0, "Seed for weight init and dropout.")
    grad_clip: float = fld(1.0, "Clip the global gradient norm to this value (0 = off).", ge=0)
    eval_interval: int = fld(200, "Evaluate on the held-out split every N steps (0 = only at the end).", ge=0)
    eval_batches: int = fld(20, "Held-out batches per evaluation.", gt=0)
    eval_generate: int = fld(64, "Held-out examples scored by greedy generation (exact match) at the end.", ge=0)
    max_bad_steps: int = fld(5, "Stop with an error after this many consecutive non-finite losses.", gt=0)
    output_dir: str = fld("runs", "Parent folder of run directories.")
    run_name: str = fld("", "Run directory name ('' = timestamp).")


@dataclass(frozen=True)
class OptimSection:
    # An AdamW step moves each weight by about lr, whatever the gradient's scale: beyond 1 a single step
    # outweighs any pre-trained weight, so larger values are typos (1e39 for 1e-3), not experiments.
    lr: float = fld(1e-3, "Peak learning rate (AdamW: 0 < lr <= 1).", gt=0, le=1)
    min_lr_ratio: float = fld(0.1, "Final learning rate as a fraction of lr.", ge=0, le=1)
    schedule: Literal["cosine", "linear", "constant"] = fld("cosine", "Decay after warmup.")
    warmup_steps: int = fld(50, "Linear warmup steps.", ge=0)
    weight_decay: float = fld(0.1, "AdamW decoupled weight decay (not applied to norms and biases).", ge=0)
    beta1: float = fld(0.9, "AdamW beta1.", ge=0, le=1)
    beta2: float = fld(0.95, "AdamW beta2.", ge=0, le=1)
    eps: float = fld(1e-8, "AdamW epsilon.", gt=0)
    fused: Literal["auto", "on", "off"] = fld("auto", "Fused AdamW kernel ('auto' = on for CUDA).")


@dataclass(frozen=True)
class LoraSection:
    rank: int = fld(16, "Adapter rank r.", gt=0)
    alpha: float = fld(32.0, "Adapter scale numerator: the update is (alpha / rank) * B @ A.", gt=0)
    dropout: float = fld(0.0, "Dropout on the adapter input.", ge=0, le=1)
    targets: list[str] = fld(
        ["q_proj", "k_proj", "v_proj", "o_proj"], "Linear layers to adapt, by name ('all-linear' = every projection)."
    )
    base_dtype: Literal["auto", "fp32", "bf16"] = fld(
        "auto", "dtype of frozen base weights ('auto' = bf16 on GPU, fp32 on CPU)."
    )
    adapter_dtype: Literal["fp32", "bf16"] = fld(
        "fp32", "dtype of the trained adapter weights (and their optimizer states)."
    )


@dataclass(frozen=True)
class CheckpointSection:
    interval: int = fld(0, "Save every N steps (0 = only at the end and on interrupt).", ge=0)
    keep_last: int = fld(2, "Checkpoints to keep; older ones are deleted after a successful save.", gt=0)
    save_final: bool = fld(True, "Save a checkpoint when training ends.")


@dataclass(frozen=True)
class LoggingSection:
    log_interval: int = fld(10, "Read back metrics (one host sync) and log every N steps.", gt=0)
    progress: bool = fld(True, "Show a live progress bar on the console.")
    tensorboard: bool = fld(False, "Also write TensorBoard event files (needs the tensorboard package).")
    peak_tflops: float = fld(0.0, "Peak dense FLOP/s (in TFLOP/s) for MFU; 0 = look up the GPU in the table.", ge=0)
    report: bool = fld(True, "Keep RUN/report.html (loss, throughput, memory charts) current at every log interval.")
    mlflow: bool = fld(
        False, "Log metrics, the resolved config and the summary to MLflow (pip install 'tracetrain[mlflow]')."
    )
    mlflow_tracking_uri: str = fld(
        "", "MLflow tracking URI; empty = $MLFLOW_TRACKING_URI, else a local file store at <output_dir>/mlruns."
    )
    mlflow_experiment: str = fld("tracetrain", "MLflow experiment name (created if missing).")
    wandb: bool = fld(False, "Log to Weights & Biases (pip install 'tracetrain[wandb]'); WANDB_MODE=offline honoured.")
    wandb_project: str = fld("tracetrain", "W&B project; the run is named after train.run_name.")


@dataclass(frozen=True)
class MemorySection:
    recompute: Literal["none", "full", "selective"] = fld(
        "none", "Activation recomputation: none, full (whole blocks) or selective (cheap ops only)."
    )
    recompute_every: int = fld(1, "Recompute every k-th block only (1 = all blocks).", gt=0)
    activation_offload: Literal["none", "save_on_cpu", "streamed"] = fld(
        "none", "Move saved activations to pinned CPU memory during forward."
    )
    activation_offload_fraction: float = fld(
        1.0,
        "Streamed offload: share of blocks offloaded, the first ones "
        "(1.0 = all but the last; less = faster, less saved).",
        gt=0,
        le=1,
    )
    optimizer_offload: bool = fld(False, "Keep fp32 master weights and AdamW moments in CPU memory (ZeRO-Offload).")
    offload_threads: int = fld(0, "CPU threads for the offloaded optimizer step (0 = all cores).", ge=0)
    unified_memory: Literal["none", "optimizer", "model"] = fld(
        "none", "Allocate these in CUDA managed memory (experimental)."
    )
    coherent_memory: bool = fld(
        False, "The GPU shares coherent memory with the CPU (GH200): allow managed memory beyond free GPU memory."
    )
    expandable_segments: bool = fld(True, "Use the CUDA caching allocator's expandable segments (less fragmentation).")
    oom_snapshot: bool = fld(True, "On CUDA out-of-memory, write an allocator snapshot into the run directory.")


@dataclass(frozen=True)
class ProfileSection:
    enabled: bool = fld(False, "Capture a profile of steps [start_step, start_step + num_steps).")
    start_step: int = fld(10, "First profiled step (earlier steps are warm-up).", ge=1)
    num_steps: int = fld(5, "Number of profiled steps.", gt=0)
    ranks: list[str] = fld(["0"], "Ranks to profile (as strings; ['all'] = every rank).")
    record_shapes: bool = fld(True, "Record operator input shapes (needed for FLOP and bound analysis).")
    with_stack: bool = fld(False, "Record Python stacks (large traces).")
    profile_memory: bool = fld(True, "Record allocator events (memory over time).")
    memory_snapshot: bool = fld(False, "Also dump a CUDA allocator snapshot (pickle) for pytorch.org/memory_viz.")
    nvtx: bool = fld(True, "Emit NVTX ranges for steps and phases (for Nsight Systems).")
    cuda_profiler_api: bool = fld(
        False,
        "Call cudaProfilerStart/Stop around the profiled steps, for "
        "`nsys profile --capture-range=cudaProfilerApi` (the torch profiler is off).",
    )
    analyze: bool = fld(True, "Analyze the captured trace at the end and write report.html / report.json.")


@dataclass(frozen=True)
class ParallelSection:
    dp_replicate: int = fld(1, "Data-parallel replicas (DDP-style, or the replicate axis of HSDP).", gt=0)
    dp_shard: int = fld(1, "Data-parallel shards (ZeRO / FSDP axis).", gt=0)
    tp: int = fld(1, "Tensor-parallel degree (column/row-wise projections).", gt=0)
    pp: int = fld(1, "Pipeline-parallel stages.", gt=0)
    cp: int = fld(1, "Context-parallel degree (sequence split across GPUs, ring attention).", gt=0)
    ep: int = fld(1, "Expert-parallel degree (MoE experts sharded; needs model.num_experts > 0).", gt=0)
    zero_stage: int = fld(
        3, "With dp_shard > 1: 1 = shard optimizer states, 2 = + gradients, 3 = + parameters (FSDP).", ge=1, le=3
    )
    reshard_after_forward: bool = fld(
        True, "ZeRO-3: free gathered parameters after forward (less memory, one more all-gather in backward)."
    )
    sequence_parallel: bool = fld(True, "With tp > 1: shard norms and residuals along the sequence too.")
    loss_parallel: bool = fld(True, "With tp > 1: compute the loss on vocabulary-sharded logits.")
    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b"] = fld("1f1b", "Pipeline schedule.")
    pp_microbatches: int = fld(0, "Micro-batches per pipeline step (0 = number of stages).", ge=0)
    pp_stages_per_rank: int = fld(2, "Virtual stages per rank for interleaved_1f1b.", gt=0)
    fsdp_cpu_offload: bool = fld(False, "Keep FSDP-sharded parameters, gradients and optimizer states in CPU memory.")
    timeout_s: int = fld(600, "End the whole job with an error when a collective waits longer than this.", gt=0)


@dataclass(frozen=True)
class Config:
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection = field(default_factory=TrainSection)
    optim: OptimSection = field(default_factory=OptimSection)
    lora: LoraSection = field(default_factory=LoraSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
    memory: MemorySection = field(default_factory=MemorySection)
    profile: ProfileSection = field(default_factory=ProfileSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)

    def replace(self, changes: dict[str, Any]) -> Config:
        """A validated copy with dotted keys changed: `cfg.replace({"optim.lr": 1e-4, "train.steps": 100})`.
        Every check of `load_config` runs again (field values and cross-field rules)."""
        raw: dict[str, dict[str, Any]] = {
            name: {k: v for k, v in values.items() if v is not None} for name, values in to_dict(self).items()
        }
        for key, value in changes.items():
            section, dot, name = key.partition(".")
            if not dot:
                raise ConfigError(f"config key {key!r}: use the dotted form section.key (e.g. 'optim.lr')")
            raw.setdefault(section, {})[name] = value
        return from_dict(raw)


# ----------------------------------------------------------------------------------------------------
# Loading and validation


def _allowed_types(tp: Any) -> tuple[tuple[type, ...], bool]:
    """Python types a TOML value may have for annotation `tp`, and whether None is allowed."""
    optional = False
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        optional = len(args) < len(typing.get_args(tp))
        tp = args[0]
    if typing.get_origin(tp) is list:
        return (list,), optional
    if typing.get_origin(tp) is Literal:
        return (str,), optional
    return {int: (int,), float: (int, float), bool: (bool,), str: (str,)}[tp], optional


def field_choices(section: type, name: str) -> tuple[str, ...]:
    """The values a `Literal`-typed config field allows (empty for free-form fields)."""
    tp = typing.get_type_hints(section)[name]
    return typing.get_args(tp) if typing.get_origin(tp) is Literal else ()


def _describe(tp: Any) -> str:
    kinds, optional = _allowed_types(tp)
    names = {int: "an integer", float: "a number", bool: "true or false", str: "a string", list: "a list"}
    return names[kinds[-1]] + (" (or omitted)" if optional else "")


def _check_value(key: str, f: dataclasses.Field, value: Any) -> Any:
    tp = typing.get_type_hints(_SECTION_OWNER[key.split(".")[0]])[f.name]
    kinds, optional = _allowed_types(tp)
    if value is None and optional:
        return None
    if list in kinds and isinstance(value, str):
        # --lora.targets=all-linear, --lora.targets=q_proj,v_proj: a word or comma-separated words.
        value = [v.strip() for v in value.split(",") if v.strip()]
    # bool is a subclass of int: reject true/false where a number is expected.
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise ConfigError(f"config key '{key}': {value!r} is not {_describe(tp)}")
    if float in kinds:
        value = float(value)  # type: ignore[arg-type]  # an int or float: checked by isinstance above
        # TOML spells inf and nan, and 1e400 overflows to inf: no float setting means anything there.
        if not math.isfinite(value):
            raise ConfigError(f"config key '{key}': {value!r} is not a finite number")
    if list in kinds and not all(isinstance(v, str) for v in value):
        raise ConfigError(f"config key '{key}': {value!r} must be a list of strings")
    meta = f.metadata
    choices = typing.get_args(tp) if typing.get_origin(tp) is Literal else ()
    if choices and value not in choices:
        allowed = ", ".join(repr(c) for c in choices)
        raise ConfigError(f"config key '{key}': {value!r} is not allowed; choose one of {allowed}")
    for bound, ok, word in (
        ("ge", lambda v, b: v >= b, ">="),
        ("gt", lambda v, b: v > b, ">"),
        ("le", lambda v, b: v <= b, "<="),
    ):
        if meta.get(bound) is not None and not ok(value, meta[bound]):
            raise ConfigError(f"config key '{key}': {value!r} is out of range; it must be {word} {meta[bound]}")
    return value


_SECTION_OWNER: dict[str, type] = {f.name: f.default_factory for f in dataclasses.fields(Config)}  # type: ignore[misc]


# What other tools (Hugging Face Trainer, PEFT, torchtitan) call some keys: `--optim.learning_rate` is met
# with "did you mean 'optim.lr'?".
ALIASES = {
    "learning_rate": "optim.lr",
    "max_steps": "train.steps",
    "num_train_steps": "train.steps",
    "batch_size": "train.micro_batch_size",
    "per_device_train_batch_size": "train.micro_batch_size",
    "local_batch_size": "train.micro_batch_size",
    "gradient_accumulation_steps": "train.grad_accum_steps",
    "max_seq_length": "data.seq_len",
    "max_length": "data.seq_len",
    "seq_length": "data.seq_len",
    "r": "lora.rank",
    "lora_r": "lora.rank",
    "lora_alpha": "lora.alpha",
    "lora_dropout": "lora.dropout",
    "target_modules": "lora.targets",
    "model_name_or_path": "model.init_from",
    "gradient_checkpointing": "memory.recompute",
    "activation_checkpointing": "memory.recompute",
    "dataloader_num_workers": "data.num_workers",
    "bf16": "train.precision",
    "fp16": "train.precision",
    "mixed_precision": "train.precision",
    "warmup": "optim.warmup_steps",
    "lr_scheduler_type": "optim.schedule",
}


def _all_keys() -> list[str]:
    return [f"{name}.{f.name}" for name, owner in _SECTION_OWNER.items() for f in dataclasses.fields(owner)]


def _key_hint(name: str) -> str | None:
    """The key meant by an unknown `section.key`: an alias of its last component, a close match of that
    component in any section, or a close match of the whole name."""
    last = name.rsplit(".", 1)[-1]
    keys = _all_keys()
    if last in ALIASES and ALIASES[last] in keys:
        return ALIASES[last]
    by_last: dict[str, str] = {}
    for key in keys:
        by_last.setdefault(key.rsplit(".", 1)[-1], key)
    same = [k for k in keys if k.rsplit(".", 1)[-1] == last]
    if same:
        return same[0]
    close = difflib.get_close_matches(last, list(by_last), n=1, cutoff=0.75)
    if close:
        return by_last[close[0]]
    whole = difflib.get_close_matches(name, keys, n=1)
    return whole[0] if whole else None


def _unknown(kind: str, name: str, known: list[str], where: str) -> ConfigError:
    hint = [h] if kind == "config key" and (h := _key_hint(name)) else difflib.get_close_matches(name, known, n=1)
    suggestion = f" (did you mean '{hint[0]}'?)" if hint else f"; known: {', '.join(sorted(known))}"
    return ConfigError(f"{where}unknown {kind} '{name}'{suggestion}")


def from_dict(raw: dict[str, Any], where: str = "") -> Config:
    """Build and validate a Config from nested dicts (TOML layout). `where` prefixes error messages."""
    sections: dict[str, Any] = {}
    for section_name, values in raw.items():
        if section_name not in _SECTION_OWNER:
            raise _unknown("config section", section_name, list(_SECTION_OWNER), where)
        if not isinstance(values, dict):
            raise ConfigError(f"{where}config section '{section_name}' must be a table, got {values!r}")
        owner = _SECTION_OWNER[section_name]
        fields = {f.name: f for f in dataclasses.fields(owner)}
        checked = {}
        for key, value in values.items():
            if key not in fields:
                raise _unknown("config key", f"{section_name}.{key}", [f"{section_name}.{k}" for k in fields], where)
            try:
                checked[key] = _check_value(f"{section_name}.{key}", fields[key], value)
            except ConfigError as e:
                raise ConfigError(f"{where}{e}") from None
        sections[section_name] = owner(**checked)
    cfg = Config(**sections)
    _check_cross_fields(cfg, where)
    return cfg


def check_device_spec(spec: str, key: str = "config key 'train.device'") -> None:
    """The one rule for device names: 'auto', 'cpu', 'cuda' or 'cuda:N' (`key` names the setting in errors)."""
    if not (spec in ("auto", "cpu", "cuda") or (spec.startswith("cuda:") and spec[5:].isdigit())):
        raise ConfigError(f"{key}: {spec!r} is not allowed; use 'auto', 'cpu', 'cuda' or 'cuda:N'")


def check_warmup(optim: OptimSection, total_steps: int, where: str = "", source: str = "train.steps") -> None:
    """Warmup must end before the run does: else the learning rate never reaches optim.lr and never decays.

    `total_steps` is the run's resolved number of optimizer steps: train.steps, or the count derived from
    train.epochs once the data is built (that caller passes it, and `source` = e.g. "train.epochs = 2").
    """
    if optim.warmup_steps >= total_steps:
        raise ConfigError(
            f"{where}config key 'optim.warmup_steps': {optim.warmup_steps} is not shorter than the "
            f"run ({total_steps} steps from {source}); set it below {total_steps} "
            f"(e.g. --optim.warmup_steps={total_steps // 10})"
        )


def _check_data_path_used(data: DataSection, where: str) -> None:
    """Synthetic data reads no file: a data path given with it would be silently ignored."""
    if data.kind != "synthetic":
        return
    for key in ("path", "eval_path"):
        if getattr(data, key):
            # Listed from the field's own choices, so a new data kind needs no edit here.
            kinds = [k for k in field_choices(DataSection, "kind") if k != "synthetic"]
            raise ConfigError(
                f"{where}config key 'data.{key}': {getattr(data, key)!r} is ignored with "
                f"data.kind = 'synthetic'; set data.kind to one of {', '.join(kinds)}"
            )


def _field(section: type, name: str) -> dataclasses.Field:
    return next(f for f in dataclasses.fields(section) if f.name == name)


def _check_cross_fields(cfg: Config, where: str) -> None:
    _check_data_path_used(cfg.data, where)
    if cfg.train.epochs and cfg.train.steps != TrainSection.steps:  # steps left at its default: epochs decides
        raise ConfigError(
            f"{where}config keys 'train.steps' ({cfg.train.steps}) and 'train.epochs' "
            f"({cfg.train.epochs}) are both set; set one (epochs sizes the run from the data)"
        )
    if cfg.data.kind in ("instruction", "chat", "text") and not cfg.data.path:
        raise ConfigError(f"{where}config key 'data.path' is required when data.kind = '{cfg.data.kind}'")
    if cfg.data.tokenize == "on_the_fly" and (cfg.data.pack or cfg.data.kind == "text"):
        raise ConfigError(
            f"{where}config key 'data.tokenize': 'on_the_fly' needs data.pack = false and "
            "instruction or synthetic data (packing must know every length ahead of time)"
        )
    mem = cfg.memory
    if mem.optimizer_offload and (cfg.train.mode == "lora" or cfg.train.precision == "fp16"):
        raise ConfigError(
            f"{where}config key 'memory.optimizer_offload' works with full fine-tuning in bf16 or "
            "fp32 (LoRA optimizer states are tiny; fp16 loss scaling is not supported with it)"
        )
    if mem.optimizer_offload and mem.unified_memory == "optimizer":
        raise ConfigError(
            f"{where}config keys 'memory.optimizer_offload' and memory.unified_memory = 'optimizer' "
            "both place optimizer states; choose one"
        )
    if cfg.data.num_workers == 0 and cfg.data.prefetch_factor != 2:
        raise ConfigError(f"{where}config key 'data.prefetch_factor' needs data.num_workers > 0")
    if cfg.train.attention == "flex" and cfg.train.device == "cpu":
        raise ConfigError(
            f"{where}config key 'train.attention': 'flex' trains on CUDA only (FlexAttention has no "
            "CPU backward); use 'sdpa' or 'auto'"
        )
    check_device_spec(cfg.train.device, f"{where}config key 'train.device'")


def parse_override(arg: str) -> tuple[str, Any]:
    """'--optim.lr=3e-4' -> ('optim.lr', 0.0003). Values are TOML literals; bare words are strings."""
    body = arg[2:] if arg.startswith("--") else arg
    if "=" not in body or "." not in body.split("=", 1)[0]:
        raise ConfigError(f"override {arg!r} must look like --section.key=value (e.g. --optim.lr=3e-4)")
    key, text = body.split("=", 1)
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text  # a bare word such as --data.path=my.jsonl
    return key, value


def _read_toml(path: Path) -> dict[str, Any]:
    """The tables of a TOML config file; every way reading it can fail is one ConfigError naming the file."""
    if path.is_dir():
        raise ConfigError(f"config file {path} is a directory; give a .toml file")
    if not path.exists():
        raise ConfigError(f"config file {path} does not exist")
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"config file {path}: cannot read it ({e.strerror})") from None
    try:
        text = data.decode("utf-8")  # TOML is UTF-8 by definition, whatever the locale says
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise ConfigError(
            f"{path}: line {line}: byte 0x{data[e.start]:02x} is not UTF-8 text (TOML files must be saved as UTF-8)"
        ) from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Load a TOML config (or the defaults when `path` is None), apply overrides, validate once."""
    raw: dict[str, Any] = {}
    where = ""
    if path is not None:
        path = Path(path)
        where = f"{path}: "
        raw = _read_toml(path)
    for arg in overrides or []:
        key, value = parse_override(arg)
        section, name = key.split(".", 1)
        raw.setdefault(section, {})
        if not isinstance(raw[section], dict):
            raise ConfigError(f"override {arg!r}: '{section}' is not a config section")
        raw[section][name] = value
    return from_dict(raw, where)


def to_dict(cfg: Config) -> dict[str, dict[str, Any]]:
    return dataclasses.asdict(cfg)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {v!r} as TOML")


def to_toml(cfg: Config) -> str:
    """The fully resolved config as TOML. Unset optional fields (None) are written as comments."""
    lines: list[str] = []
    for section, values in to_dict(cfg).items():
        lines.append(f"[{section}]")
        for key, value in values.items():
            lines.append(f"# {key} = (preset)" if value is None else f"{key} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def reference_markdown() -> str:
    """The config reference (every section and key, default and doc) as Markdown, for the docs."""
    out: list[str] = []
    for sf in dataclasses.fields(Config):
        out += [f"### [{sf.name}]", "", "| key | default | allowed | meaning |", "|---|---|---|---|"]
        for f in dataclasses.fields(sf.default_factory()):  # type: ignore[operator]  # sections have factories
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[operator]  # list fields
            m = f.metadata
            choices = field_choices(sf.default_factory, f.name)  # type: ignore[arg-type]  # a section class
            allowed = (
                " / ".join(choices)
                if choices
                else " ".join(
                    s
                    for s in (
                        f">= {m['ge']}" if m.get("ge") is not None else "",
                        f"> {m['gt']}" if m.get("gt") is not None else "",
                        f"<= {m['le']}" if m.get("le") is not None else "",
                    )
                    if s
                )
            )
            shown = "(preset)" if default is None else f"`{_toml_value(default)}`"
            out.append(f"| `{f.name}` | {shown} | {allowed} | {m['doc']} |")
        out.append("")
    return "\n".join(out)
