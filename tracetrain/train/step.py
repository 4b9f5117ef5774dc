"""The training step and held-out evaluation.

`train_step` is the whole of one optimizer step, straight-line. It never waits for the GPU: the loss,
gradient norm and "was this step finite" flag come back as device tensors that the metrics logger reads
every `logging.log_interval` steps (one host sync per interval instead of one per step).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

from tracetrain.labels import IGNORE_INDEX


@dataclass
class StepContext:
    """What the step needs besides the batch; fixed for the whole run."""

    device: torch.device
    autocast_dtype: torch.dtype | None  # None = no autocast (fp32)
    grad_clip: float  # 0 = no clipping (the norm is still measured)
    use_document_mask: bool  # packed rows: attention must not cross documents
    fused_skip: bool  # optimizer honours `found_inf` on the device (fused AdamW)
    scaler: torch.amp.GradScaler | None = None  # fp16 only: dynamic loss scaling
    activation_offload: Any = None  # tracetrain.memory.ActivationOffload: saved activations -> host
    fused_ce_chunk: int = 0  # > 0: the model's fused lm_head + cross-entropy (apply_fused_ce)
    par: Any = None  # tracetrain.parallel.ParallelModel when the job has several ranks
    # tracetrain.train.preference.PreferenceObjective for train.objective = dpo / simpo; None = token
    # cross-entropy (`loss_sum`). The spec decides it; `micro_batch_loss` is the one loss the step calls.
    objective: Any = None
    # Named ranges for the profiler / NVTX (tracetrain/forward, ...); a no-op unless profiling.
    phase: Callable[[str], contextlib.AbstractContextManager] = field(default=lambda name: contextlib.nullcontext())


@dataclass
class StepOutput:
    loss: torch.Tensor  # () float32 on device: mean loss per target token over the whole step
    grad_norm: torch.Tensor  # () float32 on device, before clipping (unscaled under fp16)
    finite: torch.Tensor  # () bool on device: the update was applied
    diverged: torch.Tensor  # () bool on device: counts toward the "NaN/inf N steps in a row" stop
    # The objective's per-step means besides the loss (preference: rewards, margin, accuracy), on device.
    stats: dict[str, torch.Tensor] = field(default_factory=dict)


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    # non_blocking: with pinned host memory the copy overlaps the previous micro-batch's compute.
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def autocast(ctx: StepContext) -> contextlib.AbstractContextManager:
    if ctx.autocast_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(ctx.device.type, dtype=ctx.autocast_dtype)


def loss_sum(model: nn.Module, batch: dict[str, torch.Tensor], ctx: StepContext) -> torch.Tensor:
    """Summed cross-entropy over target tokens of one micro-batch (labels are pre-shifted)."""
    doc = batch["document_ids"] if ctx.use_document_mask else None
    # Activation offload hooks only the model's forward: the logits feed the loss straight away.
    offload = ctx.activation_offload.forward_context() if ctx.activation_offload else contextlib.nullcontext()
    if ctx.fused_ce_chunk > 0:
        # lm_head and cross-entropy chunk by chunk over tokens: only one chunk's logits exist at a time.
        # Through the model's forward, so FSDP's root hooks run; the activation offload's hooks only
        # touch tensors saved inside transformer blocks, so covering the head as well changes nothing.
        with autocast(ctx), offload:
            return model(batch["input_ids"], batch["position_ids"], doc, labels=batch["labels"])
    with autocast(ctx), offload:
        logits = model(batch["input_ids"], batch["position_ids"], doc)  # (batch, seq, vocab)
    if ctx.par is not None:  # vocabulary-sharded logits under tensor parallelism
        return ctx.par.cross_entropy_sum(logits, batch["labels"])
    # Loss in float32 whatever the compute precision: bf16 log-softmax over a large vocab is lossy.
    return F.cross_entropy(
        logits.float().flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )


def count_targets(batch: dict[str, torch.Tensor]) -> int:
    """Target tokens of a (host) micro-batch: the cross-entropy's divisor."""
    return int((batch["labels"] != IGNORE_INDEX).sum())


def micro_batch_loss(
    model: nn.Module, batch: dict[str, torch.Tensor], ctx: StepContext
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The objective's summed loss over one (device) micro-batch and its summed statistics: token
    cross-entropy (no statistics), or the preference objective over the micro-batch's pairs."""
    if ctx.objective is None:
        return loss_sum(model, batch, ctx), {}
    return ctx.objective.loss_sum(model, batch, ctx)


@runtime_checkable
class OffloadedOptimizer(Protocol):
    """An optimizer that owns its gradients (tracetrain.memory.optimizer_offload.CPUOffloadAdamW): they
    stream to host buffers during backward, and it clips, measures and updates in one call."""

    def step_with_clip(self, max_norm: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Clip to `max_norm` (inf = measure only) and update; returns (grad_norm, applied)."""
        ...

    def zero_grad(self, set_to_none: bool = True) -> None: ...


def train_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: list[dict[str, torch.Tensor]], ctx: StepContext
) -> StepOutput:
    """Forward/backward over every micro-batch, clip, and one optimizer update (skipped if non-finite).

    The one training step of every run and layout: `forward_backward` (plain, or the pipeline schedule)
    then `optimizer_update`.
    """
    par = ctx.par
    stats: dict[str, torch.Tensor] = {}
    if par is not None and par.pipeline is not None:  # the pipeline schedule runs forward and backward
        total = pipeline_forward_backward(par, micro_batches, ctx)
    else:
        total = forward_backward(model, micro_batches, ctx, stats)
    out = optimizer_update(optimizer, total, ctx)
    out.stats.update(stats)
    return out


def forward_backward(
    model: nn.Module,
    micro_batches: list[dict[str, torch.Tensor]],
    ctx: StepContext,
    stats: dict[str, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Accumulate the step's gradients; returns the step's loss (mean per target token, or per pair for a
    preference objective; device tensor). `stats`, when given, receives the objective's step means."""
    par = ctx.par
    # Normalise by the target tokens (preference: pairs) of the whole step, so that accumulating k
    # micro-batches gives the same gradient as one batch k times larger. Labels are still on the host:
    # counting costs no sync. With several ranks each takes its rows (and sequence chunks) of the global
    # micro-batch, and the count is summed over the ranks on the device (no host sync).
    count = ctx.objective.count if ctx.objective is not None else count_targets
    if par is not None:
        micro_batches = [par.shard_batch(mb) for mb in micro_batches]
        num_targets = par.global_num_targets(micro_batches, ctx.device, count)
    else:
        num_targets = max(1, sum(count(mb) for mb in micro_batches))
    sums: dict[str, torch.Tensor] = {}
    total = torch.zeros((), device=ctx.device)
    scaler = ctx.scaler
    for i, mb in enumerate(micro_batches):
        # Several ranks: gradient sync only on the last micro-batch; loss parallelism for TP.
        sync = par.micro_batch(is_last=i == len(micro_batches) - 1) if par is not None else contextlib.nullcontext()
        with sync:
            with ctx.phase("forward"):
                loss, mb_stats = micro_batch_loss(model, to_device(mb, ctx.device), ctx)
                loss = loss / num_targets
            with ctx.phase("backward"):
                # fp16: scale the loss so small gradients do not underflow; unscaled again below.
                (scaler.scale(loss) if scaler else loss).backward()  # .grad accumulates across micro-batches
        total += loss.detach()
        for name, value in mb_stats.items():
            sums[name] = sums.get(name, 0) + value / num_targets
    if par is not None:
        total = par.reduce_loss(total)  # every rank's share: the step's loss, on every rank
        sums = {name: par.reduce_loss(value) for name, value in sums.items()}
    if stats is not None:
        stats.update(sums)
    return total


def pipeline_forward_backward(par: Any, micro_batches: list[dict[str, torch.Tensor]], ctx: StepContext) -> torch.Tensor:
    """The pipeline schedule's forward and backward over the step's rows; returns the step's loss, the
    same on every rank (only the last stage computes it; a sum over the pipeline group hands it on)."""
    from tracetrain.parallel.pipeline import all_reduce_pp

    pipe = par.pipeline
    batches = [par.shard_batch(mb) for mb in micro_batches]
    # The step's micro-batches become one batch; the schedule cuts it into pipeline micro-batches.
    batch = to_device({k: torch.cat([b[k] for b in batches]) for k in batches[0]}, ctx.device)
    pipe.num_targets[:] = [par.global_num_targets(batches, ctx.device)]
    kwargs = {"position_ids": batch["position_ids"]}
    if ctx.use_document_mask:
        kwargs["document_ids"] = batch["document_ids"]
    args = (batch["input_ids"],) if pipe.has_first else ()
    losses: list[torch.Tensor] = []
    with ctx.phase("pipeline"), par.micro_batch(is_last=True), autocast(ctx):
        pipe.schedule.step(
            *args,
            target=batch["labels"] if pipe.has_last else None,
            losses=losses if pipe.has_last else None,
            return_outputs=False,
            **kwargs,
        )
    total = (
        torch.stack([loss.detach().float() for loss in losses]).sum() if losses else torch.zeros((), device=ctx.device)
    )
    return par.reduce_loss(all_reduce_pp(total, pipe.group))


def optimizer_update(optimizer: torch.optim.Optimizer, total: torch.Tensor, ctx: StepContext) -> StepOutput:
    """Clip, measure and apply one update from the accumulated gradients (skipped if non-finite)."""
    par = ctx.par
    max_norm = ctx.grad_clip if ctx.grad_clip > 0 else float("inf")
    if isinstance(optimizer, OffloadedOptimizer):
        with ctx.phase("optimizer"):
            # CPU optimizer offload: gradients already streamed to host buffers during backward; the
            # norm, clipping and AdamW run on the CPU and the new weights stream back. Waiting for the
            # gradients to arrive is a host sync, and a necessary one.
            grad_norm, applied = optimizer.step_with_clip(max_norm)
            finite = torch.isfinite(total) & applied.to(ctx.device)
            optimizer.zero_grad(set_to_none=True)
        return StepOutput(loss=total, grad_norm=grad_norm.to(ctx.device), finite=finite, diverged=~finite)

    scaler = ctx.scaler
    with ctx.phase("optimizer"):
        if scaler:
            scaler.unscale_(optimizer)  # clip and measure the true gradient norm
            if par is not None:
                # Each rank found inf/NaN in its own shards only: every rank must skip, and back off the
                # scale, alike, or their weights and loss scales part ways.
                par.agree_on_found_inf(scaler, optimizer)
        # One device with the fused kernel: the clip factor is handed to AdamW as its gradient divisor
        # (`grad_scale`), so clipping costs no separate pass over the gradients (for llama3.2-1b on an
        # H100 that pass read and wrote 5 GB, 2.5% of the step; folded into torch's fused kernel, which
        # still writes the clipped gradients back, the step ran 0.9% faster). tracetrain's Triton AdamW
        # (train/optim.py `AdamW`, float32 CUDA parameters) skips that write too: zero_grad frees them.
        fold_clip = par is None and scaler is None and ctx.fused_skip and max_norm != float("inf")
        if par is not None:  # norm over every shard, mesh axis and stage
            grad_norm = par.clip_grad_norm_(max_norm)
        elif fold_clip:
            grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
            grad_norm = torch.nn.utils.get_total_norm(grads, 2.0, foreach=True).float()
        else:
            params = [p for g in optimizer.param_groups for p in g["params"]]
            grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True).float()
        finite = torch.isfinite(total) & torch.isfinite(grad_norm)
        if scaler:
            # GradScaler skips the update when the unscaled gradients hold inf/NaN (it then lowers the
            # scale); with fused AdamW it hands found_inf to the kernel, so there is no host sync. An
            # overflow is routine under fp16; only a non-finite loss means the run diverged.
            scaler.step(optimizer)
            scaler.update()
            diverged = ~torch.isfinite(total)
        elif ctx.fused_skip:
            # Fused AdamW skips the update on the device when found_inf is non-zero: no host sync.
            optimizer.found_inf = (~finite).float()  # type: ignore[attr-defined]  # read by the fused kernel
            # The kernel divides each gradient by grad_scale: max(1, norm / max_norm), clip_grad_norm_'s
            # factor inverted. torch's fused kernel stores the divided gradient back, as clip_grad_norm_
            # would leave it; the Triton AdamW (train/optim.py) does not, as nothing reads it before zero_grad.
            optimizer.grad_scale = clip_divisor(grad_norm, max_norm) if fold_clip else None  # type: ignore[attr-defined]  # read by the fused kernel
            optimizer.step()
            diverged = ~finite
        else:
            # Host sync: needed to decide whether to step. Only on paths without the fused kernel
            # (CPU, where there is no asynchronous queue to stall, or optim.fused = "off").
            if bool(finite):
                optimizer.step()
            diverged = ~finite
        optimizer.zero_grad(set_to_none=True)
    return StepOutput(loss=total, grad_norm=grad_norm, finite=finite, diverged=diverged)


def clip_divisor(grad_norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """What the gradients are divided by to clip them to `max_norm`: 1 / clip_grad_norm_'s coefficient
    min(1, max_norm / (norm + 1e-6)), as a () float32 device tensor (no host sync)."""
    return torch.clamp((grad_norm + 1e-6) / max_norm, min=1.0)


@torch.no_grad()
def evaluate(model: nn.Module, batches: list[dict[str, torch.Tensor]], ctx: StepContext) -> dict[str, Any]:
    """Held-out loss of the step's objective: mean per target token and perplexity (cross-entropy), or
    mean per pair with the objective's statistics (preference)."""
    was_training = model.training
    model.eval()
    count = ctx.objective.count if ctx.objective is not None else count_targets
    total = torch.zeros((), device=ctx.device, dtype=torch.float64)
    sums: dict[str, torch.Tensor] = {}
    num_targets = 0
    for batch in batches:
        num_targets += count(batch)
        # Several ranks: the same loss-parallel context as training (vocabulary-sharded logits under TP);
        # under context parallelism each rank scores its sequence chunks and the sums are added up.
        with ctx.par.micro_batch(is_last=True) if ctx.par is not None else contextlib.nullcontext():
            part = ctx.par.shard_eval_batch(batch) if ctx.par is not None else batch
            loss, stats = micro_batch_loss(model, to_device(part, ctx.device), ctx)
            if ctx.par is not None:
                loss, stats = ctx.par.reduce_eval_loss(loss), {k: ctx.par.reduce_eval_loss(v) for k, v in stats.items()}
        total += loss.double()
        for name, value in stats.items():
            sums[name] = sums.get(name, 0) + value.double()
    model.train(was_training)
    mean = total.item() / max(1, num_targets)
    if ctx.objective is not None:
        means = {f"eval_{k}": float(v) / max(1, num_targets) for k, v in sums.items()}
        return {"eval_loss": mean, **means, "eval_pairs": num_targets}
    return {"eval_loss": mean, "eval_ppl": float(torch.tensor(mean).exp()), "eval_tokens": num_targets}
