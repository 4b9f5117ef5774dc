"""Activation recomputation (a.k.a. activation checkpointing) as a transform over the plain model.

`apply_recompute(model, mode, every)` makes chosen `TransformerBlock`s drop their intermediate
activations in the forward pass and recompute them in the backward pass:

- "full": a block keeps only its inputs (the residual stream `x`; the rotary tables and the mask are
  shared by all blocks) and reruns its whole forward during backward. Costs about one extra forward
  (~+33% FLOPs), saves nearly all activation memory of the block.
- "selective": op-level selective checkpointing (`torch.utils.checkpoint.create_selective_checkpoint_
  contexts`). Outputs of matmuls and of the attention kernel are SAVED (expensive to recompute: they are
  the FLOPs of the block); everything else (RMSNorm, rotary, SiLU * up, residual adds, dtype casts) is
  RECOMPUTED: cheap elementwise work whose saved inputs would otherwise cost as much memory as the
  matmul outputs.

How a block is wrapped: the block's class is swapped for a subclass whose `forward` calls
`torch.utils.checkpoint.checkpoint(<original forward>, ...)` (the same technique FSDP2's `fully_shard`
uses). No module level is added, so parameter names, state-dict keys (`layers.0.self_attn.q_proj...`),
`get_submodule` paths and `isinstance(block, TransformerBlock)` are all unchanged: checkpoints, HF
export, LoRA helpers and later transforms (compile, sharding) see the same module tree. A wrapped block
cannot be pickled whole (`torch.save(model)`); state dicts are unaffected.

Recomputation restores the RNG state (checkpoint's `preserve_rng_state`), so dropout masks (LoRA
dropout) are identical in the recomputation: losses and gradients are bit-identical to no recompute.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Literal

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from tracetrain.models.llama import KVCacheLayer, Transformer, TransformerBlock
from tracetrain.models.qlora import nf4_linear  # noqa: F401  # registers torch.ops.tracetrain.nf4_linear

RecomputeMode = Literal["none", "full", "selective"]
RECOMPUTE_MODES: tuple[str, ...] = ("none", "full", "selective")

# ATen ops whose outputs selective recomputation keeps. Names, not attributes, because some exist only
# in some builds/versions (`_scaled_mm` needs FP8-capable builds, the cuDNN attention op torch >= 2.5).
_SAVED_OP_NAMES: tuple[str, ...] = (
    "mm",
    "addmm",
    "bmm",
    "_scaled_mm",
    "_scaled_dot_product_flash_attention",  # CUDA, no mask (is_causal)
    "_scaled_dot_product_efficient_attention",  # CUDA, with a document mask
    "_scaled_dot_product_cudnn_attention",  # CUDA, cuDNN backend
    "_scaled_dot_product_flash_attention_for_cpu",  # CPU (the unit tests)
)


@functools.cache
def saved_ops() -> frozenset[object]:
    """The default overloads of `_SAVED_OP_NAMES` that this torch build has, and FlexAttention.

    The FlexAttention operator reaches the policy only where the block is compiled (`apply_compile`:
    the policy becomes the partitioner's save/recompute tags); an eager block calls an opaquely
    compiled flex_attention, which checkpoint can only rerun.
    """
    ops: set[object] = set()
    for name in _SAVED_OP_NAMES:
        packet = getattr(torch.ops.aten, name, None)
        if packet is not None and hasattr(packet, "default"):
            ops.add(packet.default)
    flex = getattr(torch.ops.higher_order, "flex_attention", None)
    if flex is not None:
        ops.add(flex)
    # QLoRA's 4-bit matmul (models/qlora.py): recomputing it would dequantise the weight and run the GEMM again.
    ops.add(torch.ops.tracetrain.nf4_linear.default)
    return frozenset(ops)


def _selective_policy(ctx: Any, op: object, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    # MUST_SAVE (not PREFER_SAVE): under torch.compile the partitioner must not override the choice.
    return CheckpointPolicy.MUST_SAVE if op in saved_ops() else CheckpointPolicy.PREFER_RECOMPUTE


def selective_context_fn() -> tuple[AbstractContextManager, AbstractContextManager]:
    """`context_fn` for `checkpoint`: save matmul and attention outputs, recompute everything else."""
    return create_selective_checkpoint_contexts(_selective_policy)


class _RecomputedBlock(nn.Module):
    """Mixin placed in front of the block's own class: its forward runs under `checkpoint`."""

    _recompute_context_fn: Callable[[], tuple[AbstractContextManager, AbstractContextManager]] | None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None,
        cache: KVCacheLayer | None = None,
    ) -> torch.Tensor:
        # Nothing to save in eval / no-grad, and generation's KV-cache writes must happen exactly once.
        if cache is not None or not self.training or not torch.is_grad_enabled():
            return super().forward(x, cos, sin, mask, cache)
        # Non-reentrant checkpoint: works when no input requires grad (a frozen LoRA base) and with
        # keyword context_fn for selective recomputation.
        # Full mode passes no context_fn: Dynamo cannot trace the default noop_context_fn when the
        # block is compiled (measured on an H100: full recompute + compile failed to compile).
        extra = {"context_fn": self._recompute_context_fn} if self._recompute_context_fn is not None else {}
        return checkpoint(super().forward, x, cos, sin, mask, use_reentrant=False, **extra)  # type: ignore[arg-type]  # torch's overloads are narrower than what the call passes (checked by the tests)


@functools.cache
def _recomputed_class(cls: type[nn.Module]) -> type[nn.Module]:
    """One subclass per block class (cached, so every wrapped block shares it)."""
    return type(f"Recomputed{cls.__name__}", (_RecomputedBlock, cls), {})


def is_recomputed(block: nn.Module) -> bool:
    return isinstance(block, _RecomputedBlock)


def apply_recompute(model: Transformer, mode: RecomputeMode, every: int = 1) -> int:
    """Recompute the activations of every `every`-th block (indices 0, every, 2*every, ...), in place.

    `mode` "none" leaves the model as it is. Returns the number of wrapped blocks. Raises ValueError for
    an unknown mode, `every` < 1, or a model whose blocks are already wrapped.
    """
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"recompute mode {mode!r} is not one of {', '.join(RECOMPUTE_MODES)}")
    if every < 1:
        raise ValueError(f"recompute_every must be >= 1, got {every}")
    if mode == "none":
        return 0
    if any(is_recomputed(b) for b in model.layers):
        raise ValueError("model blocks are already wrapped for recomputation")
    context_fn = selective_context_fn if mode == "selective" else None
    num_wrapped = 0
    for index, block in enumerate(model.layers):
        if index % every:
            continue
        assert isinstance(block, TransformerBlock), f"layers.{index} is a {type(block).__name__}"
        block.__class__ = _recomputed_class(type(block))  # type: ignore[arg-type, assignment]  # nn.Module attributes are typed Tensor | Module in torch's stubs
        block._recompute_context_fn = context_fn  # type: ignore[assignment]  # nn.Module attributes are typed Tensor | Module in torch's stubs
        num_wrapped += 1
    return num_wrapped
