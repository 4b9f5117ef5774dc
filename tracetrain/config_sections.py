"""The sections of the config tree: one frozen dataclass per component, each field with its default and doc.

`tracetrain.config` assembles them into `Config`, loads and validates it; import the sections from there.
A field is declared with `fld`: its one-line doc and numeric range live in the field's metadata, its
choices in its `Literal` type, so the loader's checks and `tracetrain config --reference` read one source.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal


def fld(
    default: Any,
    doc: str,
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    unset: str = "preset",
) -> Any:
    """A config field with its doc and numeric range (checked at load). Choices are the field's `Literal` type.

    `unset`: for a field whose default is None, the word that says who decides its value then ("preset":
    the model preset; "auto": a rule over the run), shown by `tracetrain config --reference` and config.toml.
    """
    meta = {"doc": doc, "ge": ge, "gt": gt, "le": le, "unset": unset}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


# The largest model shapes tracetrain builds or plans: several times today's largest open models (Llama 3
# 405B: dim 16384, 126 layers, ffn 53248; DeepSeek-V3: 256 experts; vocabularies near 256k). A larger
# value is a typo or a forged config, and refusing it up front keeps plan and build from allocating
# per-layer tables until memory runs out. The config fields and ModelArgs.validate (HF configs) share them.
MODEL_SHAPE_LIMITS: dict[str, int] = {
    "dim": 1 << 16,
    "n_layers": 1024,
    "n_heads": 1024,
    "n_kv_heads": 1024,
    "ffn_dim": 1 << 20,
    "vocab_size": 1 << 24,
    "num_experts": 4096,
    "max_seq_len": 1 << 24,
}


@dataclass(frozen=True)
class ModelSection:
    preset: str = fld("tiny", "Architecture preset name (see `tracetrain presets`).")
    init_from: str = fld("", "Hugging Face checkpoint directory to load weights and shape from ('' = random init).")
    dim: int | None = fld(None, "Override the preset's hidden size.", gt=0, le=MODEL_SHAPE_LIMITS["dim"])
    n_layers: int | None = fld(
        None, "Override the preset's number of transformer blocks.", gt=0, le=MODEL_SHAPE_LIMITS["n_layers"]
    )
    n_heads: int | None = fld(
        None, "Override the preset's number of attention heads.", gt=0, le=MODEL_SHAPE_LIMITS["n_heads"]
    )
    n_kv_heads: int | None = fld(
        None, "Override the preset's number of key/value heads (GQA).", gt=0, le=MODEL_SHAPE_LIMITS["n_kv_heads"]
    )
    ffn_dim: int | None = fld(None, "Override the preset's SwiGLU hidden size.", gt=0, le=MODEL_SHAPE_LIMITS["ffn_dim"])
    vocab_size: int | None = fld(
        None, "Override the preset's vocabulary size (embedding rows).", gt=0, le=MODEL_SHAPE_LIMITS["vocab_size"]
    )
    init_std: float = fld(0.02, "Standard deviation of the random weight init.", gt=0)
    num_experts: int = fld(
        0,
        "Mixture-of-experts variant of the preset: experts per block (0 = dense SwiGLU MLP; an MoE "
        "model.init_from, Mixtral or Qwen3-MoE, brings its own experts).",
        ge=0,
        le=MODEL_SHAPE_LIMITS["num_experts"],
    )
    experts_top_k: int = fld(2, "MoE: experts each token is routed to.", gt=0)
    moe_aux_loss_coef: float = fld(0.01, "MoE: weight of the load-balancing loss.", ge=0)


InstructionFormat = Literal["auto", "alpaca", "dolly", "prompt_completion", "fields"]


@dataclass(frozen=True)
class DataSource:
    """One entry of `[[data.sources]]`: a data file (or `hf:NAME`) mixed into training by weight."""

    path: str = fld("", "Data file, datasets folder or hf:NAME[:CONFIG] (required).")
    weight: float = fld(1.0, "Share of training examples, relative to the other sources' weights.", gt=0)
    kind: Literal["", "instruction", "chat"] = fld("", "This source's data kind ('' = data.kind).")
    format: Literal["", "auto", "alpaca", "dolly", "prompt_completion", "fields"] = fld(
        "", "Instruction source: its row format ('' = data.format)."
    )
    split: str = fld("", "Split of an hf: dataset or DatasetDict folder ('' = data.split).")


@dataclass(frozen=True)
class DataSection:
    kind: Literal["synthetic", "instruction", "chat", "text", "preference"] = fld(
        "synthetic",
        "Dataset kind: generated task, instruction/response pairs, multi-turn chat "
        "(messages or ShareGPT conversations), plain text, or preference pairs (prompt / chosen / "
        "rejected, strings or chat messages; for train.objective = dpo / simpo).",
    )
    path: str = fld(
        "",
        "Training data: JSONL, a JSON array, Parquet or a datasets save_to_disk folder (text also "
        "takes a plain text file). Unused for synthetic.",
    )
    eval_path: str = fld("", "Held-out data file; '' = split eval_fraction off the training data.")
    split: str = fld(
        "train", "Split read from data.path when it is hf:NAME (Hugging Face cache, offline) or a DatasetDict folder."
    )
    eval_split: str = fld("test", "Split read from data.eval_path when it is hf:NAME or a DatasetDict folder.")
    sources: list[DataSource] = fld(
        [],
        "Several training sources mixed by weight ([[data.sources]] tables: path, weight, kind, format, "
        "split); replaces data.path; each holds out data.eval_fraction.",
    )
    eval_fraction: float = fld(0.05, "Share of examples held out for eval when eval_path is ''.", ge=0, le=0.5)
    tokenizer: str = fld(
        "auto",
        "'auto' (model.init_from's tokenizer when it has a tokenizer.json, else 'byte'), "
        "'byte' (built-in byte-level), or a Hugging Face tokenizer folder or tokenizer.json.",
    )
    seq_len: int = fld(128, "Tokens per training sequence.", gt=1)
    pack: bool = fld(True, "Pack several examples into each sequence (document-masked attention).")
    format: InstructionFormat = fld(
        "auto",
        "Instruction rows: 'alpaca' (instruction/input/output), 'dolly' (instruction/context/response), "
        "'prompt_completion', 'fields' (the *_field keys), or 'auto' (from the first row; 'fields' when a "
        "*_field key is set).",
    )
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
    instruction_field: str = fld("instruction", "data.format = 'fields': field holding the instruction / prompt.")
    context_field: str = fld("context", "data.format = 'fields': field holding optional context ('' = none).")
    response_field: str = fld("response", "data.format = 'fields': field holding the target response / answer.")
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
        "auto",
        "Triton RMSNorm/RoPE/SwiGLU/LoRA kernels ('auto' = on for CUDA when compile is off, and for `generate` "
        "on CUDA, whose KV-cache forwards run the blocks eagerly beside compiled blocks).",
    )
    fused_ce: bool = fld(True, "Chunked fused lm_head + cross-entropy: full-vocabulary fp32 logits never exist.")
    fused_ce_chunk: int = fld(4096, "Tokens per chunk of the fused lm_head + cross-entropy.", gt=0)
    fused_ce_adaptive: bool = fld(
        True,
        "Shrink the fused cross-entropy chunk below fused_ce_chunk when free GPU memory cannot hold its "
        "logits (long contexts near the memory limit); never grows it.",
    )
    fp8: Literal["none", "tensorwise", "rowwise"] = fld(
        "none",
        "FP8 GEMMs in the blocks (GPU with compute capability >= 8.9): 'tensorwise' or 'rowwise' "
        "scaling; LoRA bases are quantised once, full fine-tuning uses torchao.",
    )
    objective: Literal["sft", "dpo", "simpo"] = fld(
        "sft",
        "What the step minimises: 'sft' (cross-entropy on target tokens), 'dpo' (sigmoid DPO against a "
        "frozen reference) or 'simpo' (reference-free SimPO); dpo and simpo need data.kind = 'preference'.",
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
    # Unset (None), not a number: a default of 50 refused every run shorter than 51 steps over a key the
    # user never wrote. Only a warm-up the user chose is held to "shorter than the run".
    warmup_steps: int | None = fld(
        None,
        "Linear warmup steps; unset = min(50, 10% of the run's steps), printed at start.",
        ge=0,
        unset="auto",
    )
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
    base_quant: Literal["none", "nf4"] = fld(
        "none",
        "QLoRA: store the frozen block projections in 4-bit NF4 with double-quantised scales (4.13 bits "
        "per weight), dequantised to lora.base_dtype for compute ('none' = keep lora.base_dtype).",
    )
    dora: bool = fld(False, "DoRA: learn a magnitude per output row of each adapted projection (PEFT's use_dora).")


@dataclass(frozen=True)
class PreferenceSection:
    """Preference tuning (train.objective = 'dpo' or 'simpo'): the loss's constants."""

    beta: float = fld(0.1, "Scale of the implicit reward (DPO: 0.1 is usual; SimPO: 2.0-2.5 is usual).", gt=0, le=100)
    label_smoothing: float = fld(
        0.0, "Share of pairs assumed mislabelled (conservative DPO / SimPO; 0 = plain sigmoid loss).", ge=0, le=0.5
    )
    simpo_gamma: float = fld(0.5, "SimPO: the target reward margin gamma (TRL's simpo_gamma).", ge=0)


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
    recompute_pointwise: Literal["auto", "on", "off"] = fld(
        "auto",
        "LoRA with compiled blocks: recompute the adapters' pointwise inputs in backward instead of saving them "
        "(less memory, ~1% slower measured; 'auto' = on for a 4-bit base, lora.base_quant = 'nf4', without memory.recompute).",
    )
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
    tiled_mlp: Literal["auto", "on", "off"] = fld(
        "auto",
        "Run each block's norm + MLP over sequence tiles, each recomputed in backward: one tile's "
        "intermediates exist at a time ('auto' = on from 65,536 tokens per micro-batch).",
    )
    tiled_mlp_tokens: int = fld(8192, "Tokens per tile of the tiled norm + MLP.", gt=0)
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
