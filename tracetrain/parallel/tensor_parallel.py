"""Tensor parallelism (Megatron-style), sequence parallelism and loss parallelism via DTensor.

Per block, with tp ranks:
- q/k/v and gate/up projections are column-parallel (each rank computes n_heads / tp heads and
  ffn_dim / tp hidden units); o_proj and down_proj are row-parallel, their partial sums reduced.
- Sequence parallel (`parallel.sequence_parallel`): between those regions the residual stream is split
  along the sequence, so norms and residual adds run on seq / tp tokens. The all-reduce of a row-parallel
  output becomes a reduce-scatter, and an all-gather precedes the column-parallel projections: the same
  bytes on the wire, 1/tp of the activation memory outside attention and MLP.
- Without SP the residual stream is replicated; the norms stay plain (replicated) parameters whose
  gradients every TP rank computes in full.
- The embedding is row-parallel over the vocabulary; the output head column-parallel over it. With
  loss parallelism (`parallel.loss_parallel`) the logits stay sharded over the vocabulary and the
  cross-entropy is computed on the shards (`loss_parallel()`): the (batch, seq, vocab) logits are never
  gathered. `cross_entropy_sum` returns a plain tensor either way.

The model code is untouched: the transform sets each attention's `n_heads` / `n_kv_heads` to the local
head count (the projections' local outputs hold that many heads), which is the only attribute it changes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from tracetrain.labels import IGNORE_INDEX
from tracetrain.parallel.data_parallel import model_blocks


def _block_plan(sequence_parallel: bool) -> dict[str, object]:
    if not sequence_parallel:
        return {
            "self_attn.q_proj": ColwiseParallel(),
            "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(),
        }
    return {
        "input_layernorm": SequenceParallel(),
        # Attention gets (x, cos, sin, mask, cache): only x is sequence-sharded; gather it whole.
        "self_attn": PrepareModuleInput(
            input_layouts=(Shard(1), None, None, None, None),
            desired_input_layouts=(Replicate(), None, None, None, None),
        ),
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
        "post_attention_layernorm": SequenceParallel(),
        "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
    }


def apply_tensor_parallel(
    part: nn.Module, tp_mesh: DeviceMesh, *, sequence_parallel: bool, loss_parallel: bool
) -> None:
    """Parallelize `part` (the model, or one pipeline stage) over `tp_mesh`, in place."""
    tp = tp_mesh.size()
    sp = sequence_parallel
    outer: dict[str, object] = {}
    if getattr(part, "embed_tokens", None) is not None:
        outer["embed_tokens"] = RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Shard(1) if sp else Replicate()
        )
    if getattr(part, "norm", None) is not None and sp:
        outer["norm"] = SequenceParallel()
    if getattr(part, "lm_head", None) is not None:
        outer["lm_head"] = ColwiseParallel(
            input_layouts=Shard(1) if sp else Replicate(),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    tied = getattr(getattr(part, "args", None), "tie_embeddings", False)
    if outer:
        parallelize_module(part, tp_mesh, outer)  # type: ignore[arg-type]  # torch's overloads are narrower than what the call passes (checked by the tests)
    if tied:
        # Both styles shard the (vocab, dim) weight on dim 0: one DTensor can serve both modules again.
        part.lm_head.weight = part.embed_tokens.weight  # type: ignore[union-attr]  # nn.Module attributes are typed Tensor | Module in torch's stubs
    plan = _block_plan(sp)
    for block in model_blocks(part):
        parallelize_module(block, tp_mesh, plan)  # type: ignore[arg-type]  # torch's overloads are narrower than what the call passes (checked by the tests)
        attn = block.self_attn
        attn.n_heads, attn.n_kv_heads = attn.n_heads // tp, attn.n_kv_heads // tp  # type: ignore[operator, union-attr]  # nn.Module attributes are typed Tensor | Module in torch's stubs


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy over target tokens, float32, as a plain tensor.

    `logits` (batch, seq, vocab) may be a DTensor sharded over the vocabulary (loss parallelism);
    the forward and the backward must then run inside `loss_parallel()` (see `ParallelModel.micro_batch`).
    """
    loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
    # loss_parallel's sum is Replicate over tp: every rank's local value is the full sum.
    return loss.to_local() if isinstance(loss, DTensor) else loss


__all__ = ["apply_tensor_parallel", "cross_entropy_sum", "loss_parallel"]
