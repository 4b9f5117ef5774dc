"""Preference objectives over chosen/rejected pairs: DPO (sigmoid, against a frozen reference) and SimPO
(reference-free, length-normalised).

Rows (data/preference.py) hold whole pairs: a pair is two adjacent documents of one row, the chosen
completion at an even document index of the row and the rejected one at the next, each [prompt
completion] with labels on the completion only; the document mask keeps them apart. So one forward pass
scores both sides of every pair of the micro-batch, and no pair is ever split across micro-batches,
ranks or steps.

A sequence's log-probability is the sum of its completion tokens' log-probabilities, summed per (row,
document) with one scatter; nothing is read on the host. The step divides the summed loss by the step's
number of pairs (counted on the host from the document ids, like the target tokens of cross-entropy),
so accumulating micro-batches gives the mean over the step's pairs, as TRL's DPOTrainer does for one batch.

    dpo    z = (log pi(c) - log ref(c)) - (log pi(r) - log ref(r))        rewards beta * (log pi - log ref)
    simpo  z = log pi(c) / |c| - log pi(r) / |r| - gamma / beta          rewards beta * log pi / |.|
    loss   -(1 - eps) * logsigmoid(beta z) - eps * logsigmoid(-beta z)    (eps = label_smoothing)

The reference is the model itself with its LoRA adapters off (`adapters_disabled`: no second copy) or,
for full fine-tuning, a frozen copy of the initial weights (`reference_model`), under no_grad.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from tracetrain.labels import IGNORE_INDEX
from tracetrain.models.lora import adapters_disabled

Objective = Literal["dpo", "simpo"]
# What the step logs per pair (means over the step's pairs), besides the loss.
STAT_NAMES = ("reward_chosen", "reward_rejected", "reward_margin", "reward_accuracy")


def count_pairs(batch: dict[str, torch.Tensor]) -> int:
    """Pairs in a (host) micro-batch: each row holds (its number of documents) / 2."""
    docs_per_row = batch["document_ids"].amax(dim=1) + 1  # padding is -1: an empty row counts 0
    return int(docs_per_row.sum()) // 2


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor, document_ids: torch.Tensor) -> torch.Tensor:
    """(batch, seq, vocab) logits -> (batch, seq_even, 2) per-document sums: [..., 0] the summed log-prob
    of each document's target tokens, [..., 1] their count. Document d of row b lands at [b, d]; slots of
    absent documents hold zeros. float32 whatever the logits' dtype."""
    b, s = labels.shape
    token_logps = -F.cross_entropy(
        logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="none"
    )  # (batch * seq,): 0 where the label is ignored
    slots = s + s % 2  # an even number of slots per row: chosen / rejected interleave
    doc = document_ids.flatten()
    row = torch.arange(b, device=doc.device).repeat_interleave(s)
    index = torch.where(doc >= 0, row * slots + doc, b * slots)  # padding -> one spare slot, dropped
    values = torch.stack([token_logps, (labels.flatten() != IGNORE_INDEX).float()], dim=1)  # (tokens, 2)
    sums = torch.zeros(b * slots + 1, 2, device=logits.device).index_add_(0, index, values)
    return sums[:-1].view(b, slots, 2)


@dataclass
class PreferenceObjective:
    """The step's loss for preference rows (see the module docstring); `loss_sum` is what the step calls."""

    kind: Objective
    beta: float
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5
    reference: Literal["adapters_off", "copy", "none"] = "none"
    reference_model: nn.Module | None = None  # reference = "copy": frozen initial weights

    def count(self, batch: dict[str, torch.Tensor]) -> int:
        return count_pairs(batch)

    def loss_sum(
        self, model: nn.Module, batch: dict[str, torch.Tensor], ctx: Any
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Summed loss over the micro-batch's pairs, and the summed statistics (STAT_NAMES); `batch` is on
        the device, `ctx` the step's StepContext."""
        from tracetrain.train.step import autocast

        doc = batch["document_ids"]
        offload = ctx.activation_offload.forward_context() if ctx.activation_offload else contextlib.nullcontext()
        with autocast(ctx), offload:
            logits = model(batch["input_ids"], batch["position_ids"], doc)  # (batch, seq, vocab)
        policy = sequence_logps(logits, batch["labels"], doc)
        del logits
        reference = self.reference_logps(model, batch, ctx) if self.kind == "dpo" else None
        return self.pair_losses(policy, reference)

    @torch.no_grad()
    def reference_logps(self, model: nn.Module, batch: dict[str, torch.Tensor], ctx: Any) -> torch.Tensor:
        """The reference's per-document sums (as `sequence_logps`), without gradients."""
        from tracetrain.train.step import autocast

        doc = batch["document_ids"]
        scope: contextlib.AbstractContextManager = contextlib.nullcontext()
        if self.reference == "copy":
            assert self.reference_model is not None, "reference = 'copy' needs its frozen model"
            ref = self.reference_model
        else:
            ref, scope = model, adapters_disabled(model)
        with autocast(ctx), scope:
            logits = ref(batch["input_ids"], batch["position_ids"], doc)
        return sequence_logps(logits, batch["labels"], doc)

    def pair_losses(
        self, policy: torch.Tensor, reference: torch.Tensor | None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Per-document sums (batch, slots, 2) of the policy (and reference) -> (summed loss, summed stats)."""
        chosen, rejected = policy[:, 0::2, 0], policy[:, 1::2, 0]  # (batch, slots / 2)
        valid = policy[:, 0::2, 1] > 0  # a real pair: its chosen side has target tokens
        if self.kind == "dpo":
            assert reference is not None
            chosen = chosen - reference[:, 0::2, 0]
            rejected = rejected - reference[:, 1::2, 0]
            z = chosen - rejected
        else:  # simpo: mean log-prob per completion token
            chosen = chosen / policy[:, 0::2, 1].clamp(min=1)
            rejected = rejected / policy[:, 1::2, 1].clamp(min=1)
            z = chosen - rejected - self.simpo_gamma / self.beta
        eps = self.label_smoothing
        losses = -(1 - eps) * F.logsigmoid(self.beta * z) - eps * F.logsigmoid(-self.beta * z)
        zero = torch.zeros((), device=z.device)
        reward_c, reward_r = (self.beta * chosen).detach(), (self.beta * rejected).detach()
        stats = {
            "reward_chosen": torch.where(valid, reward_c, zero).sum(),
            "reward_rejected": torch.where(valid, reward_r, zero).sum(),
            "reward_margin": torch.where(valid, reward_c - reward_r, zero).sum(),
            "reward_accuracy": (valid & (reward_c > reward_r)).float().sum(),
        }
        return torch.where(valid, losses, zero).sum(), stats
