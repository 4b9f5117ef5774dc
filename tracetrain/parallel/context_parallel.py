"""Context parallelism: the sequence of every row split over `cp` ranks, attention over all of it.

Layout (load-balanced, "zig-zag"): the sequence is cut into 2 * cp chunks and rank r keeps chunks r and
2cp - 1 - r, so that under a causal mask every rank does the same attention work. `shard_sequence`
cuts input ids, labels, position ids and document ids alike, so rotary embeddings (computed from
position ids) and the loss (over pre-shifted labels) need nothing else.

Attention (`ContextParallelCore`, swapped into every `Attention.attn_core`): each rank all-gathers
the keys and values of the whole sequence (an autograd-aware all-gather, whose backward is a
reduce-scatter that sums every rank's key/value gradients) and attends its own query chunks to them:
chunk g sees keys [0, (g + 1) * chunk) with a lower-right-aligned causal mask. This is the all-gather
flavour of CP (as in Llama 3 training), not a ring: the key/value all-gather is not overlapped with
compute, but with grouped-query attention it is small (n_kv_heads * head_dim per token), it needs no
attention-kernel internals (log-sum-exp merging), and it supports packed rows: for those,
`Transformer.mask_fn` is replaced by one that all-gathers the document ids, and each chunk's dense
document-causal mask is cut from them.

On GPUs the unpacked path runs SDPA's flash kernel with its lower-right causal variant (`CausalBias`);
on CPU (the tests) SDPA materialises that mask.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.bias import causal_lower_right

from tracetrain.parallel.collectives import all_gather_dim
from tracetrain.parallel.data_parallel import model_blocks

SEQUENCE_KEYS: tuple[str, ...] = ("input_ids", "labels", "position_ids", "document_ids")


def chunk_ids(cp_rank: int, cp_size: int) -> tuple[int, int]:
    """The two (of 2 * cp_size) sequence chunks rank `cp_rank` keeps."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def shard_sequence(batch: dict[str, torch.Tensor], cp_rank: int, cp_size: int) -> dict[str, torch.Tensor]:
    """This rank's part of every (batch, seq) tensor: chunks `chunk_ids(cp_rank, cp_size)`, concatenated."""
    out = dict(batch)
    for key in SEQUENCE_KEYS:
        if key in batch:
            chunks = batch[key].chunk(2 * cp_size, dim=1)
            out[key] = torch.cat([chunks[i] for i in chunk_ids(cp_rank, cp_size)], dim=1).contiguous()
    return out


def _global_order(cp_size: int) -> list[int]:
    """Position, in the rank-ordered all-gather, of each global chunk 0 .. 2cp-1."""
    gathered = [c for r in range(cp_size) for c in chunk_ids(r, cp_size)]
    return [gathered.index(g) for g in range(2 * cp_size)]


def _unzigzag(x: torch.Tensor, cp_size: int, dim: int) -> torch.Tensor:
    """Reorder a tensor all-gathered along `dim` (rank order) into sequence order."""
    chunks = x.chunk(2 * cp_size, dim=dim)
    return torch.cat([chunks[i] for i in _global_order(cp_size)], dim=dim)


@dataclass
class CPDocuments:
    """The mask object packed rows pass to every attention core: document ids of the whole sequence."""

    document_ids: torch.Tensor  # (batch, seq) in sequence order

    def chunk_mask(self, chunk: int, chunk_len: int) -> torch.Tensor:
        """(batch, 1, chunk_len, end) bool: queries of `chunk` may see keys [0, end) of their document."""
        start, end = chunk * chunk_len, (chunk + 1) * chunk_len
        q_doc = self.document_ids[:, start:end]
        k_doc = self.document_ids[:, :end]
        q_pos = torch.arange(start, end, device=q_doc.device).unsqueeze(1)
        k_pos = torch.arange(end, device=q_doc.device).unsqueeze(0)
        same_doc = q_doc.unsqueeze(2) == k_doc.unsqueeze(1)  # (batch, chunk_len, end)
        return (same_doc & (k_pos <= q_pos)).unsqueeze(1)


def cp_document_mask(document_ids: torch.Tensor, *, group: dist.ProcessGroup, cp_size: int) -> CPDocuments:
    """`Transformer.mask_fn` under CP: gather this row's document ids from every CP rank (no gradient)."""
    gathered = torch.empty(
        (cp_size * document_ids.shape[0], document_ids.shape[1]), dtype=document_ids.dtype, device=document_ids.device
    )
    dist.all_gather_into_tensor(gathered, document_ids.contiguous(), group=group)
    full = torch.cat(gathered.chunk(cp_size, dim=0), dim=1)  # (batch, seq) in rank order
    return CPDocuments(_unzigzag(full, cp_size, dim=1))


class ContextParallelCore(nn.Module):
    """Attention of this rank's two query chunks against the all-gathered keys and values."""

    def __init__(self, group: dist.ProcessGroup, cp_rank: int, cp_size: int) -> None:
        super().__init__()
        self.group, self.cp_rank, self.cp_size = group, cp_rank, cp_size

    def _gather(self, x: torch.Tensor) -> torch.Tensor:
        # (batch, kv_heads, local_seq, head_dim) -> (batch, kv_heads, seq, head_dim), sequence order
        full = all_gather_dim(x, 2, self.group)
        return _unzigzag(full, self.cp_size, dim=2)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: CPDocuments | None) -> torch.Tensor:
        k_all, v_all = self._gather(k), self._gather(v)
        chunk_len = q.shape[2] // 2
        gqa = q.shape[1] != k.shape[1]
        outs = []
        for half, chunk in enumerate(chunk_ids(self.cp_rank, self.cp_size)):
            q_chunk = q[:, :, half * chunk_len : (half + 1) * chunk_len]
            end = (chunk + 1) * chunk_len
            k_seen, v_seen = k_all[:, :, :end], v_all[:, :, :end]
            if mask is None:
                bias = causal_lower_right(chunk_len, end)
                outs.append(F.scaled_dot_product_attention(q_chunk, k_seen, v_seen, attn_mask=bias, enable_gqa=gqa))
            else:
                outs.append(
                    F.scaled_dot_product_attention(
                        q_chunk, k_seen, v_seen, enable_gqa=gqa, attn_mask=mask.chunk_mask(chunk, chunk_len)
                    )
                )
        return torch.cat(outs, dim=2)  # (batch, heads, local_seq, head_dim)


def apply_context_parallel(part: nn.Module, group: dist.ProcessGroup, cp_rank: int, cp_size: int) -> None:
    """Swap every block's attention core, and the mask builder, for their CP versions (in place).

    Apply after `apply_attention` (it replaces whatever core that chose) and before recomputation /
    compile, which must see the final cores.
    """
    for block in model_blocks(part):
        block.self_attn.attn_core = ContextParallelCore(group, cp_rank, cp_size)  # type: ignore[union-attr]  # nn.Module attributes are typed Tensor | Module in torch's stubs
    part.mask_fn = partial(cp_document_mask, group=group, cp_size=cp_size)  # type: ignore[assignment]  # nn.Module attributes are typed Tensor | Module in torch's stubs
