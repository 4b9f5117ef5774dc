"""`resolve(cfg, device, world_size) -> RunSpec`: every `auto` of a run decided once, with its reason.

The config says what the user asked for ('auto' included); the spec says what will run: precision,
dtypes, attention backend, compile, fused kernels, fused cross-entropy (and its adaptive chunk), the
tiled norm + MLP, LoRA's pointwise recompute in compiled blocks, FSDP compute dtype, fused AdamW.
It is frozen and is the single input of `assemble` (the model, its transforms and the optimizer),
of the training step's `StepContext`, of inference (`tracetrain.inference.load_trained`), of the planner
(`tracetrain.plan.inputs`) and of the benchmarks, which change a spec with `dataclasses.replace`
instead of patching library functions. A rule written here is never restated elsewhere.

`resolve` has no side effects and allocates nothing: the device is decided before (train/runtime.py
`resolve_device`, or the rank's device under torchrun).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch

from tracetrain.config import Config
from tracetrain.models.llama import ModelArgs

Precision = Literal["fp32", "bf16", "fp16"]


ASKED = "asked: "  # the reason of a decision the user made in the config


class Decision(NamedTuple):
    """One choice `resolve` made: the config key, what will run, and why ("asked" when the user set it)."""

    key: str
    value: str
    reason: str

    def line(self) -> str:
        return f"{self.key} = {self.value} ({self.reason})"


AUTOCAST_DTYPES: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class RunSpec:
    """What a run executes, every choice made (see module docstring). `decisions` records every choice
    that is not a plain copy of a config value, with its reason: printed at the start of train, eval,
    generate and `plan --explain`, saved as the run directory's spec.json, shown on the report page."""

    cfg: Config
    device: torch.device
    world_size: int  # processes of the job (1 = no process group)
    model_args: ModelArgs  # the architecture: preset or checkpoint, plus overrides
    precision: Precision
    weights_dtype: torch.dtype  # dtype the model is materialised in
    lora_base_dtype: torch.dtype | None  # frozen LoRA base weights (None: full fine-tuning)
    attention: Literal["sdpa", "flex"]
    compile: bool  # regional torch.compile of each block
    fused_kernels: tuple[str, ...]  # Triton kernels swapped in ('' = none); see kernels/apply.py
    fp8: Literal["none", "tensorwise", "rowwise"]
    fp8_fused_mlp: bool  # the opt-in fused FP8 feed-forward (benchmarks); config: always False
    fused_ce_chunk: int  # > 0: chunked fused lm_head + cross-entropy, tokens per chunk
    fused_ce_adaptive: bool  # the chunk shrinks when free GPU memory cannot hold its logits
    tiled_mlp_tokens: int  # > 0: each block's norm + MLP over sequence tiles of this many tokens
    # LoRA, compiled blocks: the adapters' pointwise inputs are recomputed in backward (kernels/apply.py
    # `apply_compile`); memory.recompute_pointwise, opt-in.
    recompute_pointwise: bool
    fsdp_param_dtype: torch.dtype | None  # FSDP compute dtype (None: the parameters' own, fp32)
    optimizer_fused: bool  # fused AdamW kernel (honours found_inf on the device)
    adapters_only: bool  # LoRA checkpoints hold only adapters (the base reloads from init_from)
    decisions: tuple[Decision, ...] = ()
    objective: Literal["sft", "dpo", "simpo"] = "sft"  # what the step minimises (train/preference.py)
    # DPO's reference: the model with its LoRA adapters off, or a frozen copy of the initial weights
    # (full fine-tuning); 'none' for objectives without one.
    reference: Literal["none", "adapters_off", "copy"] = "none"
    # The fused AdamW's update as train/optim.py's Triton kernel where it applies; False: torch's own fused
    # kernel (benchmarks/speed.py's A/B of the two). Config: always True.
    optimizer_triton: bool = True

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def document_mask(self) -> bool:
        """Attention is masked per document: packed rows, and preference rows (a pair shares a row)."""
        return self.cfg.data.pack or self.objective != "sft"

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return AUTOCAST_DTYPES[self.precision]

    def asked(self, key: str) -> bool:
        """Whether the user set decided key `key` (not 'auto'): e.g. an export keeps an asked dtype."""
        return any(d.key == key and d.reason.startswith(ASKED) for d in self.decisions)

    def decision_lines(self) -> list[str]:
        return [d.line() for d in self.decisions]

    def to_json(self) -> dict[str, object]:
        """The decisions and the resolved values (spec.json of a run directory)."""
        return {
            "device": str(self.device),
            "world_size": self.world_size,
            "decisions": [d._asdict() for d in self.decisions],
        }

    def replace(self, **changes: object) -> RunSpec:
        """A copy with `changes` (benchmarks and tests: a variant of the same run)."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]  # field names checked at runtime


def resolve_precision(spec: str, device: torch.device, probe: bool = True) -> Precision:
    """'auto' -> bf16 on GPUs that support it, fp32 otherwise. `probe` False: assume a bf16 GPU (planning
    for hardware this process does not see)."""
    from tracetrain.errors import ConfigError

    bf16_ok = not probe or (device.type == "cuda" and torch.cuda.is_bf16_supported())
    if spec == "auto":
        return "bf16" if device.type == "cuda" and bf16_ok else "fp32"
    if spec == "bf16" and device.type == "cuda" and not bf16_ok:
        raise ConfigError("config key 'train.precision': 'bf16' is not supported by this GPU; use 'fp32'")
    assert spec in ("fp32", "bf16", "fp16"), spec  # the config's choices
    return spec  # type: ignore[return-value]  # narrowed by the assert above


def resolve_switch(value: str, device: torch.device, unless: bool = False) -> bool:
    """'on' / 'off' as said; 'auto' = on for CUDA (unless `unless`), measured to win there (docs/speed.md)."""
    return value == "on" or (value == "auto" and device.type == "cuda" and not unless)


def lora_base_dtype(cfg: Config, device: torch.device) -> torch.dtype | None:
    """dtype of a LoRA run's frozen base ('auto': bf16 on GPUs, fp32 on CPU); None for full fine-tuning."""
    if cfg.train.mode != "lora":
        return None
    choice = cfg.lora.base_dtype
    if choice == "auto":
        choice = "bf16" if device.type == "cuda" else "fp32"
    return {"bf16": torch.bfloat16, "fp32": torch.float32}[choice]


def fused_ce_applies(tp: int, pp: int) -> bool:
    """The fused lm_head + cross-entropy runs in this layout: not under tensor parallelism (the head's
    weight is vocab-sharded: loss parallelism does that job) nor pipeline parallelism (the last stage
    computes the pipeline's loss). The planner asks this for the layouts it searches."""
    return tp == 1 and pp == 1


def fused_ce_chunk(cfg: Config) -> int:
    """Tokens per chunk of the fused lm_head + cross-entropy, 0 = off (`fused_ce_applies`; a preference
    objective needs each token's log-probability, not their sum: it reads the logits)."""
    on = cfg.train.fused_ce and fused_ce_applies(cfg.parallel.tp, cfg.parallel.pp) and cfg.train.objective == "sft"
    return cfg.train.fused_ce_chunk if on else 0


def preference_reference(cfg: Config) -> Literal["none", "adapters_off", "copy"]:
    """DPO's reference model: LoRA -> the same model with its adapters off (no second copy of the
    weights); full fine-tuning -> a frozen copy of the initial weights. SimPO and SFT have none."""
    if cfg.train.objective != "dpo":
        return "none"
    return "adapters_off" if cfg.train.mode == "lora" else "copy"


def fsdp_param_dtype_for(precision: str) -> torch.dtype | None:
    """FSDP's compute dtype for a precision: bf16 weights gathered for bf16 compute (autocast has
    nothing left to cast); None = the parameters' own dtype, which autocast casts (fp32, fp16)."""
    return torch.bfloat16 if precision == "bf16" else None


def _dtype_name(dtype: torch.dtype | None) -> str:
    return "the parameters' own" if dtype is None else str(dtype).removeprefix("torch.")


class _Decisions(list[Decision]):
    def add(self, key: str, asked: object, value: object, reason: str) -> None:
        """`reason` explains an 'auto' (or a derived choice); a value the user set says so."""
        self.append(Decision(key, str(value), reason if asked == "auto" or asked is None else f"{ASKED}{asked}"))


def family_limits(
    args: ModelArgs, attention: str, kernels: tuple[str, ...], ce_chunk: int
) -> tuple[str, tuple[str, ...], int, list[tuple[str, str, str]]]:
    """(attention, fused kernels, fused cross-entropy chunk) with what the model's family cannot run
    turned off, and a (key, value, reason) decision for each thing turned off (models/families.py says why)."""
    from tracetrain.models.families import kernel_limits

    decisions = []
    if args.family.startswith("gemma") and attention != "sdpa":
        attention = "sdpa"
        decisions.append(("train.attention", "sdpa", "Gemma's sliding-window and soft-capped layers take dense masks"))
    off, why = kernel_limits(args)
    if kernels and off:
        kernels = tuple(k for k in kernels if k not in off)
        decisions.append(("train.fused_kernels", f"{', '.join(kernels)} only", why))
    if ce_chunk and args.final_logit_softcap:
        ce_chunk = 0
        decisions.append(("train.fused_ce", "off", "the fused lm_head + cross-entropy does not soft-cap the logits"))
    return attention, kernels, ce_chunk, decisions


def architecture_notes(args: ModelArgs, kernels_on: bool, fp8: str) -> list[tuple[str, str, str]]:
    """(key, value, reason) per speed transform that skips part of this architecture: one line each."""
    notes = []
    if args.num_experts and kernels_on:
        notes.append(("train.fused_kernels", "not on the experts", "the swiglu kernel covers dense MLPs only"))
    if args.num_experts and fp8 != "none":
        notes.append(("train.fp8", "not on the experts", "their batched weights stay bf16; FP8 covers nn.Linear"))
    return notes


def resolve_tiled_mlp(cfg: Config, device: torch.device, d: _Decisions) -> tuple[int, bool]:
    """(tile tokens or 0, compile on): the tiled norm + MLP and regional compile decided together, since
    a tiled block is not compiled whole (memory/tiled_mlp.py). 'auto' tiling yields to an explicit
    `train.compile = "on"`; an explicit 'on' with it is a ConfigError."""
    from tracetrain.errors import ConfigError
    from tracetrain.memory.tiled_mlp import AUTO_MIN_TOKENS, tiled_mlp_applies

    mem, t = cfg.memory, cfg.train
    tokens = t.micro_batch_size * cfg.data.seq_len
    tiled = tiled_mlp_applies(mem.tiled_mlp, tokens) and not (mem.tiled_mlp == "auto" and t.compile == "on")
    if tiled and t.compile == "on":
        raise ConfigError(
            "config keys 'memory.tiled_mlp' = 'on' and 'train.compile' = 'on': a tiled block is not compiled "
            "whole; set train.compile to 'auto' or 'off', or memory.tiled_mlp to 'auto' or 'off'"
        )
    why = f"{tokens:,} tokens per micro-batch" + (" >= " if tiled else " < ") + f"{AUTO_MIN_TOKENS:,}"
    if t.compile == "on" and tiled_mlp_applies("auto", tokens):
        why = "train.compile = 'on' asks for whole compiled blocks"
    d.add("memory.tiled_mlp", mem.tiled_mlp, "on" if tiled else "off", why)
    compile_on = resolve_switch(t.compile, device) and not tiled
    why = "tiled norm + MLP runs eagerly" if tiled else ("CUDA" if compile_on else "not CUDA")
    d.add("train.compile", t.compile, "on" if compile_on else "off", why)
    return (mem.tiled_mlp_tokens if tiled else 0), compile_on


def resolve_kernels(asked: str, device: torch.device, compile_on: bool, generation: bool, d: _Decisions) -> bool:
    """The fused RMSNorm / RoPE / SwiGLU kernels. Inside compiled blocks they run the plain ops, which
    Inductor fuses (kernels/apply.py), so they matter where blocks run eagerly: every block without
    compile, and generation's KV-cache forwards (decode steps, the eager prefill) with it. 'auto' = on for
    CUDA without compile (measured to win in training, docs/speed.md), and on for generation on CUDA
    beside compiled blocks too: measured on one H100 (benchmarks/generate.py --prefill-variants
    eager,compiled,fused, llama2-7b and llama3-8b, batch 1 and 16, 4k and 32k; docs/inference.md) the
    eager prefill ran 1.23-1.45x faster with them and the graphed decode step 1.06-1.25x."""
    on = resolve_switch(asked, device, unless=compile_on and not generation)
    if not on:
        why = "not CUDA" if device.type != "cuda" else "train.compile covers them"
    elif generation and compile_on:
        why = "generation: KV-cache forwards run the blocks eagerly; compiled blocks trace the plain ops"
    else:
        why = "CUDA without compile"
    d.add("train.fused_kernels", asked, "on" if on else "off", why)
    return on


def resolve_recompute_pointwise(cfg: Config, compile_on: bool, d: _Decisions) -> bool:
    """memory.recompute_pointwise: 'on' / 'off' as asked (config.py refuses 'on' without LoRA); 'auto' = on
    for a LoRA run on a 4-bit base (lora.base_quant = 'nf4') whose blocks are compiled: QLoRA is chosen to
    save memory, and on one H100 (llama3-8b 4 x 2048, benchmarks/qlora.py) it kept 11 GiB less (31.1 vs
    42.2 GiB) at 0.7% fewer tokens/s. A bf16 base, or blocks recomputed (memory.recompute, where the
    blocks keep little besides their inputs), keeps 'off': those measured rows are without it. It
    acts on the compiled blocks' partitioner, so 'on' without compiled blocks is a ConfigError."""
    from tracetrain.errors import ConfigError

    asked = cfg.memory.recompute_pointwise
    if asked == "on" and not compile_on:
        raise ConfigError(
            "config key 'memory.recompute_pointwise' = 'on' needs compiled blocks, but train.compile resolves to "
            "off for this run (see its decision); set train.compile = 'on' (CUDA) or memory.recompute_pointwise = "
            "'auto' or 'off'"
        )
    lora = cfg.train.mode == "lora"
    if asked != "auto":
        on = asked == "on"
        if lora and compile_on:
            d.add("memory.recompute_pointwise", asked, asked, "")
        return on
    on = lora and compile_on and cfg.lora.base_quant == "nf4" and cfg.memory.recompute == "none"
    if on:
        d.add("memory.recompute_pointwise", None, "on", "a 4-bit base: the adapters' pointwise inputs are recomputed")
    elif lora and compile_on:
        why = "a 16-bit base" if cfg.lora.base_quant != "nf4" else "blocks recomputed (measured without it)"
        d.add("memory.recompute_pointwise", None, "off", f"{why}: the adapters' pointwise inputs are saved")
    return on


def resolve(
    cfg: Config,
    device: torch.device,
    world_size: int = 1,
    model_args: ModelArgs | None = None,
    *,
    probe: bool = True,
    generation: bool = False,
) -> RunSpec:
    """The RunSpec of `cfg` on `device` with `world_size` processes (see module docstring).

    `model_args`: the architecture when already read (it may come from a checkpoint's config.json).
    `probe` False: decide for a device this process does not have (the planner: a Hopper GPU assumed,
    no capability query). `generation`: the spec `tracetrain generate` runs the trained model with
    (`inference.load_trained`): the fused kernels, 'auto', run in generation's KV-cache forwards on CUDA
    beside compiled blocks too, since those forwards run the blocks eagerly (`resolve_kernels`).
    """
    from tracetrain.errors import ConfigError
    from tracetrain.kernels.apply import FUSED_KERNELS
    from tracetrain.kernels.fp8 import check_fp8_device
    from tracetrain.models.attention import resolve_attention
    from tracetrain.models.build import model_args_from_config

    args = model_args if model_args is not None else model_args_from_config(cfg)
    t, cuda = cfg.train, device.type == "cuda"
    if probe:
        check_fp8_device(t.fp8, device)  # before a 7B model is materialised
    d = _Decisions()
    precision = resolve_precision(t.precision, device, probe)
    d.add(
        "train.precision",
        t.precision,
        precision,
        "bf16 tensor cores on this GPU" if precision == "bf16" else "no bf16 GPU",
    )
    base_dtype = lora_base_dtype(cfg, device)
    weights_dtype = _weights_dtype(cfg, base_dtype, d)
    packed = cfg.data.pack or t.objective != "sft"  # a preference pair shares a row: two documents
    attention = resolve_attention(t.attention, device, packed=packed, seq_len=cfg.data.seq_len)
    window = args.sliding_window
    if attention == "flex" and 0 < window < cfg.data.seq_len:  # the block mask has no sliding window
        if t.attention == "flex":
            raise ConfigError(
                f"config key 'train.attention': 'flex' has no sliding window, and this model's ({window}) "
                f"is shorter than data.seq_len = {cfg.data.seq_len}; use 'sdpa' or 'auto'"
            )
        attention = "sdpa"
        d.add("train.attention", t.attention, attention, f"the model's sliding window ({window}) needs a dense mask")
    else:
        d.add("train.attention", t.attention, attention, _attention_reason(cfg, device, attention, packed))
    tiled_tokens, compile_on = resolve_tiled_mlp(cfg, device, d)
    recompute_pointwise = resolve_recompute_pointwise(cfg, compile_on, d)
    kernels_on = resolve_kernels(t.fused_kernels, device, compile_on, generation, d)
    for key, value, reason in architecture_notes(args, kernels_on, t.fp8):
        d.add(key, None, value, reason)
    ce_chunk = fused_ce_chunk(cfg)
    d.add("train.fused_ce", None, f"{ce_chunk} tokens per chunk" if ce_chunk else "off", _fused_ce_reason(cfg))
    fsdp_dtype = fsdp_param_dtype_for(precision)
    if cfg.parallel.dp_shard > 1:
        d.add("fsdp compute dtype", None, _dtype_name(fsdp_dtype), f"train.precision = {precision}")
    optimizer_fused = cfg.optim.fused == "on" or (cfg.optim.fused == "auto" and cuda)
    d.add("optim.fused", cfg.optim.fused, "on" if optimizer_fused else "off", "CUDA" if cuda else "not CUDA")
    adapters_only = t.mode == "lora" and bool(cfg.model.init_from)
    if t.mode == "lora":
        d.add(
            "checkpoint contents",
            None,
            "adapters only" if adapters_only else "whole model",
            "the base reloads from model.init_from" if adapters_only else "a random base cannot be reloaded",
        )
    reference = preference_reference(cfg)
    if t.objective != "sft":
        d.add(
            "preference reference",
            None,
            reference,
            {
                "adapters_off": "the LoRA base with the adapters off: no second copy",
                "copy": "a frozen copy of the initial weights (full fine-tuning)",
                "none": f"{t.objective} needs no reference model",
            }[reference],
        )
    kernels = tuple(FUSED_KERNELS) if kernels_on else ()
    attention, kernels, ce_chunk, limits = family_limits(args, attention, kernels, ce_chunk)
    if limits:  # each replaces the line recorded above for its key
        overridden = {key for key, _, _ in limits}
        d[:] = [x for x in d if x.key not in overridden]
        for key, value, reason in limits:
            d.add(key, None, value, reason)
    return RunSpec(
        cfg=cfg,
        device=device,
        world_size=world_size,
        model_args=args,
        precision=precision,
        weights_dtype=weights_dtype,
        lora_base_dtype=base_dtype,
        attention=attention,  # type: ignore[arg-type]  # resolve_attention returns 'sdpa' or 'flex' as str
        compile=compile_on,
        fused_kernels=kernels,
        fp8=t.fp8,
        fp8_fused_mlp=False,
        fused_ce_chunk=ce_chunk,
        fused_ce_adaptive=t.fused_ce_adaptive,
        tiled_mlp_tokens=tiled_tokens,
        recompute_pointwise=recompute_pointwise,
        fsdp_param_dtype=fsdp_dtype,
        optimizer_fused=optimizer_fused,
        adapters_only=adapters_only,
        decisions=tuple(d),
        objective=t.objective,
        reference=reference,
    )


def _weights_dtype(cfg: Config, base_dtype: torch.dtype | None, d: _Decisions) -> torch.dtype:
    """dtype the model is materialised in, recorded with the LoRA base dtype's reason."""
    if base_dtype is not None:
        d.add(
            "lora.base_dtype",
            cfg.lora.base_dtype,
            _dtype_name(base_dtype),
            "bf16 on GPUs, fp32 on CPU (frozen: allocated in its final dtype)",
        )
        return base_dtype
    if cfg.memory.optimizer_offload:
        d.add("weights dtype", None, "bfloat16", "memory.optimizer_offload keeps the fp32 master copy on the host")
        return torch.bfloat16
    return torch.float32


def _fused_ce_reason(cfg: Config) -> str:
    if not cfg.train.fused_ce:
        return "asked: train.fused_ce = false"
    if not fused_ce_applies(cfg.parallel.tp, cfg.parallel.pp):
        return "not under tensor or pipeline parallelism (loss parallelism / the last stage computes the loss)"
    if cfg.train.objective != "sft":
        return f"train.objective = {cfg.train.objective} reads each token's log-probability from the logits"
    return "lm_head and cross-entropy in chunks: the logits are never whole"


def _attention_reason(cfg: Config, device: torch.device, attention: str, packed: bool) -> str:
    from tracetrain.models.attention import FLEX_BLOCK_SIZE

    if attention == "flex":
        return "CUDA, packed rows (document masks), data.seq_len a whole number of FlexAttention tiles"
    if device.type != "cuda":
        return f"{device.type}: FlexAttention is compiled for CUDA"
    if not packed:
        return "data.pack = false: no document mask, SDPA's flash kernel"
    return f"data.seq_len = {cfg.data.seq_len} is not a multiple of FlexAttention's {FLEX_BLOCK_SIZE}-token tiles"
