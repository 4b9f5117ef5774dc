"""`resolve(cfg, device, world_size) -> RunSpec`: every `auto` of a run decided once, with its reason.

The config says what the user asked for ('auto' included); the spec says what will run: precision,
dtypes, attention backend, compile, fused kernels, fused cross-entropy, FSDP compute dtype, fused
AdamW. It is frozen and is the single input of `assemble` (the model, its transforms and the optimizer),
of the training step's `StepContext`, of inference (`tracetrain.inference.load_trained`), of the planner
(`tracetrain.plan.inputs`) and of the benchmarks, which change a spec with `dataclasses.replace`
instead of patching library functions. A rule written here is never restated elsewhere.

`resolve` has no side effects and allocates nothing: the device is decided before (train/runtime.py
`resolve_device`, or the rank's device under torchrun).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import torch

from tracetrain.config import Config
from tracetrain.models.llama import ModelArgs

Precision = Literal["fp32", "bf16", "fp16"]
AUTOCAST_DTYPES: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class RunSpec:
    """What a run executes, every choice made (see module docstring). `decisions` records each `auto`
    resolved, as (config key, "value: reason"), for the console and the run directory."""

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
    fsdp_param_dtype: torch.dtype | None  # FSDP compute dtype (None: the parameters' own, fp32)
    optimizer_fused: bool  # fused AdamW kernel (honours found_inf on the device)
    adapters_only: bool  # LoRA checkpoints hold only adapters (the base reloads from init_from)
    decisions: tuple[tuple[str, str], ...] = ()
    objective: Literal["sft", "dpo", "simpo"] = "sft"  # what the step minimises (train/preference.py)
    # DPO's reference: the model with its LoRA adapters off, or a frozen copy of the initial weights
    # (full fine-tuning); 'none' for objectives without one.
    reference: Literal["none", "adapters_off", "copy"] = "none"

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


def resolve(
    cfg: Config, device: torch.device, world_size: int = 1, model_args: ModelArgs | None = None, *, probe: bool = True
) -> RunSpec:
    """The RunSpec of `cfg` on `device` with `world_size` processes (see module docstring).

    `model_args`: the architecture when already read (it may come from a checkpoint's config.json).
    `probe` False: decide for a device this process does not have (the planner: a Hopper GPU assumed,
    no capability query).
    """
    from tracetrain.kernels.apply import FUSED_KERNELS
    from tracetrain.kernels.fp8 import check_fp8_device
    from tracetrain.models.attention import resolve_attention
    from tracetrain.models.build import model_args_from_config

    args = model_args if model_args is not None else model_args_from_config(cfg)
    t = cfg.train
    if probe:
        check_fp8_device(t.fp8, device)  # before a 7B model is materialised
    decisions: list[tuple[str, str]] = []
    precision = resolve_precision(t.precision, device, probe)
    if t.precision == "auto":
        decisions.append(
            (
                "train.precision",
                f"{precision}: " + ("bf16 tensor cores on this GPU" if precision == "bf16" else "no bf16 GPU: fp32"),
            )
        )
    base_dtype = lora_base_dtype(cfg, device)
    if base_dtype is not None:
        weights_dtype = base_dtype  # a LoRA base is frozen: allocate it in its final dtype at once
    elif cfg.memory.optimizer_offload:
        weights_dtype = torch.bfloat16  # the fp32 master copy lives on the host: bf16 weights on the GPU
    else:
        weights_dtype = torch.float32
    packed = cfg.data.pack or t.objective != "sft"  # a preference pair shares a row: two documents
    attention = resolve_attention(t.attention, device, packed=packed, seq_len=cfg.data.seq_len)
    if t.attention == "auto":
        decisions.append(
            (
                "train.attention",
                f"{attention}: "
                + (
                    "packed rows on CUDA, whole FlexAttention tiles"
                    if attention == "flex"
                    else "unpacked rows, CPU, or a length that is not whole FlexAttention tiles"
                ),
            )
        )
    compile_on = resolve_switch(t.compile, device)
    kernels_on = resolve_switch(t.fused_kernels, device, unless=compile_on)
    if t.compile == "auto":
        decisions.append(
            ("train.compile", f"{'on' if compile_on else 'off'}: " + ("CUDA" if compile_on else "not CUDA"))
        )
    if t.fused_kernels == "auto":
        decisions.append(
            (
                "train.fused_kernels",
                f"{'on' if kernels_on else 'off'}: "
                + ("CUDA without compile" if kernels_on else "compile covers them, or not CUDA"),
            )
        )
    optimizer_fused = cfg.optim.fused == "on" or (cfg.optim.fused == "auto" and device.type == "cuda")
    reference = preference_reference(cfg)
    if reference != "none":
        decisions.append(
            (
                "train.objective",
                f"dpo reference: {reference}: "
                + (
                    "the LoRA base (adapters off), no second copy"
                    if reference == "adapters_off"
                    else "a frozen copy of the initial weights (full fine-tuning)"
                ),
            )
        )
    return RunSpec(
        cfg=cfg,
        device=device,
        world_size=world_size,
        model_args=args,
        precision=precision,
        weights_dtype=weights_dtype,
        lora_base_dtype=base_dtype,
        attention=attention,  # type: ignore[arg-type]  # resolved: sdpa | flex
        compile=compile_on,
        fused_kernels=tuple(FUSED_KERNELS) if kernels_on else (),
        fp8=t.fp8,
        fp8_fused_mlp=False,
        fused_ce_chunk=fused_ce_chunk(cfg),
        fsdp_param_dtype=fsdp_param_dtype_for(precision),
        optimizer_fused=optimizer_fused,
        adapters_only=t.mode == "lora" and bool(cfg.model.init_from),
        decisions=tuple(decisions),
        objective=t.objective,
        reference=reference,
    )
