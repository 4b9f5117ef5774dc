"""Pipeline parallelism: the layers split into stages, micro-batches streamed through them.

Split: `num_stages = pp` (GPipe, 1F1B) or `pp * pp_stages_per_rank` (interleaved 1F1B) contiguous
runs of layers, sizes as even as possible with the extra layers on the earliest stages (the last stage
also carries the output head, the heaviest single matmul). Stage s runs on pipeline rank s % pp (the
"loop" placement interleaving needs). The first stage holds the embedding, the last the final norm and
the head. A stage is a `PipelineStageModule` that references the plain model's own submodules under
their original names (`layers.7.self_attn.q_proj.weight`), so state dicts, DCP checkpoints and every
later transform (TP, recomputation, compile, FSDP) see the usual names.

Every stage needs the batch's position ids (rotary embedding) and, for packed rows, its document ids
(mask): they go to every stage as keyword arguments, which the schedules split into micro-batches
alongside the activations; only the hidden states travel between stages.

Schedules (torch.distributed.pipelining): GPipe (all forwards, then all backwards: simple, holds all
micro-batches' activations), 1F1B (at most pp micro-batches in flight), interleaved 1F1B (several
stages per rank: a bubble pp_stages_per_rank times smaller, more point-to-point traffic).

The training step (`train.step.train_step`) runs the schedule in `pipeline_forward_backward`: the
step's micro-batches are concatenated, then cut into `pp_microbatches` pipeline micro-batches, and the
loss is normalised by the global number of target tokens; its `optimizer_update` clips over all stages,
as for every layout.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from tracetrain.config import ParallelSection
from tracetrain.models.llama import Transformer
from tracetrain.parallel.mesh import num_microbatches


def split_layers(num_layers: int, num_stages: int) -> list[list[int]]:
    """Contiguous layer indices per stage; the first `num_layers % num_stages` stages get one more."""
    base, extra = divmod(num_layers, num_stages)
    out, start = [], 0
    for s in range(num_stages):
        size = base + (1 if s < extra else 0)
        out.append(list(range(start, start + size)))
        start += size
    return out


class PipelineStageModule(nn.Module):
    """One stage: some of the model's blocks, plus the embedding (first) or the head (last)."""

    def __init__(self, model: Transformer, layer_ids: list[int], is_first: bool, is_last: bool) -> None:
        super().__init__()
        self.args = model.args
        self.is_first, self.is_last = is_first, is_last
        self.embed_tokens = model.embed_tokens if is_first else None
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in layer_ids})
        self.norm = model.norm if is_last else None
        self.lm_head = model.lm_head if is_last else None
        self.register_buffer("rope_inv_freq", model.rope_inv_freq.clone(), persistent=False)
        self.mask_fn = model.mask_fn

    def forward(
        self, x: torch.Tensor, position_ids: torch.Tensor, document_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x: token ids (batch, seq) on the first stage, hidden states (batch, seq, dim) after it."""
        cos, sin = Transformer.rope(self, position_ids)  # type: ignore[arg-type]  # the model's one formula
        mask = self.mask_fn(document_ids) if document_ids is not None else None
        h = self.embed_tokens(x) if self.is_first else x  # type: ignore[misc]  # embed_tokens exists on the first stage (is_first)
        for layer in self.layers.values():
            h = layer(h, cos, sin, mask)
        return self.lm_head(self.norm(h)) if self.is_last else h  # type: ignore[misc]  # norm and lm_head exist on the last stage (is_last)


def stage_ids_of_rank(pp_rank: int, par: ParallelSection) -> list[int]:
    """Stage indices pipeline rank `pp_rank` runs (loop placement)."""
    per_rank = par.pp_stages_per_rank if par.pp_schedule == "interleaved_1f1b" else 1
    return [pp_rank + i * par.pp for i in range(per_rank)]


def split_model(model: Transformer, pp_rank: int, par: ParallelSection) -> list[PipelineStageModule]:
    """This rank's stage modules, in stage order. The blocks of other ranks are left unreferenced."""
    num_stages = par.pp * (par.pp_stages_per_rank if par.pp_schedule == "interleaved_1f1b" else 1)
    layers = split_layers(model.args.n_layers, num_stages)
    return [
        PipelineStageModule(model, layers[s], is_first=s == 0, is_last=s == num_stages - 1)
        for s in stage_ids_of_rank(pp_rank, par)
    ]


@dataclass
class Pipeline:
    """A rank's stages and the schedule that runs them."""

    schedule: object
    stages: list[PipelineStage]
    group: dist.ProcessGroup
    # Divisor of every micro-batch's summed loss: the global target count of the current step.
    num_targets: list[torch.Tensor] = field(default_factory=list)

    @property
    def has_first(self) -> bool:
        return any(s.is_first for s in self.stages)

    @property
    def has_last(self) -> bool:
        return any(s.is_last for s in self.stages)


def build_pipeline(
    parts: list[nn.Module],
    stage_ids: list[int],
    par: ParallelSection,
    group: dist.ProcessGroup,
    device: torch.device,
    loss_sum: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> Pipeline:
    """Wrap the (already parallelized) stage modules in `PipelineStage`s and build the schedule.

    `loss_sum(logits, labels)` is the summed token loss; the schedule's loss is that sum divided by
    the step's global target count, so micro-batch losses add up to the step's mean (scale_grads=False).
    """
    num_stages = par.pp * len(stage_ids)
    stages = [PipelineStage(part, s, num_stages, device, group=group) for part, s in zip(parts, stage_ids)]
    pipe = Pipeline(schedule=None, stages=stages, group=group)

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return loss_sum(logits, labels) / pipe.num_targets[0]

    n_micro = num_microbatches(par)
    if par.pp_schedule == "interleaved_1f1b":
        pipe.schedule = ScheduleInterleaved1F1B(stages, n_micro, loss_fn=loss_fn, scale_grads=False)  # type: ignore[arg-type]  # torch's overloads are narrower than what the call passes (checked by the tests)
    else:
        cls = ScheduleGPipe if par.pp_schedule == "gpipe" else Schedule1F1B
        pipe.schedule = cls(stages[0], n_micro, loss_fn=loss_fn, scale_grads=False)
    return pipe


def all_reduce_pp(value: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    value = value.clone()
    dist.all_reduce(value, op=dist.ReduceOp.SUM, group=group)
    return value
