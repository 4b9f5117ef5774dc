"""Tiled norm + MLP: each block's feed-forward half runs over sequence tiles, each tile recomputed in backward.

At long context the largest activations of a block are its MLP's: for Llama 3.1 8B (ffn 14,336) the
gate, up and SiLU(gate) * up outputs are 3 x 28 KiB per token in bf16, and the post-attention RMSNorm
keeps a float32 copy of its input (16 KiB per token) besides its bf16 output: ~110 KiB per token, 44 GB
at 400k tokens, alive at once when backward recomputes a block. The norm and the MLP act token by token,
so `TransformerBlock.ffn` (norm, then MLP) can run on slices of the sequence; each slice runs under a
non-reentrant `checkpoint`, which saves only the slice (a view of the block's input: no copy) and
recomputes the slice's intermediates when its backward comes. One tile's intermediates exist at a time.

Cost: the feed-forward half's forward runs once more per step (about +20% of a LoRA step's matmul FLOPs
under full recomputation; unsloth's tiled MLP pays the same). Numerics: the same ops on the same rows,
so outputs and gradients equal the untiled block's (tests/train/test_tiled_mlp.py); only the order in which
the weight gradients of the tiles are summed differs.

Composition: apply after LoRA, fused kernels and FP8 (the tile reruns whatever `ffn` holds then), and
before recomputation (a recomputed block reruns its tiled forward in backward; checkpoints nest). A
tiled block is not compiled whole: `resolve` turns compile off with it (Dynamo would have to trace the
tile loop and nested checkpoints with `fullgraph`); the fused Triton kernels then run eagerly instead.
The block's class is swapped, as `apply_recompute` does: names and state dicts are unchanged.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from tracetrain.models.llama import Transformer, TransformerBlock

DEFAULT_TILE_TOKENS = 8192
# tokens per micro-batch from which `memory.tiled_mlp = "auto"` tiles: below it the MLP's intermediates
# (about 3.5 GB for an 8B model at 32k tokens) are small next to the weights and the tiling's extra
# forward is pure cost.
AUTO_MIN_TOKENS = 65536


def tiled_mlp_applies(choice: str, tokens_per_micro_batch: int) -> bool:
    """'on' / 'off' as said; 'auto' = on from AUTO_MIN_TOKENS tokens per micro-batch."""
    return choice == "on" or (choice == "auto" and tokens_per_micro_batch >= AUTO_MIN_TOKENS)


def tiles(num_tokens: int, tile_tokens: int) -> list[tuple[int, int]]:
    """[start, end) ranges covering num_tokens, each at most tile_tokens long."""
    return [(a, min(a + tile_tokens, num_tokens)) for a in range(0, num_tokens, tile_tokens)]


class _TiledBlock(nn.Module):
    """Mixin in front of the block's class: `ffn` over sequence tiles, each under its own checkpoint."""

    _tile_tokens: int

    def ffn(self, x: torch.Tensor) -> torch.Tensor:
        seq = x.shape[1]  # x: (batch, seq, dim)
        if seq <= self._tile_tokens:
            return super().ffn(x)  # type: ignore[misc]  # the block class behind this mixin defines ffn
        run = super().ffn  # type: ignore[misc]  # the block class behind this mixin defines ffn (mypy sees the mixin alone)
        if torch.is_grad_enabled():  # without grad (evaluation) nothing is saved: plain tiles
            run = functools.partial(checkpoint, run, use_reentrant=False)
        # cat's backward only slices the gradient; the tiles' outputs are freed once joined.
        return torch.cat([run(x[:, a:b]) for a, b in tiles(seq, self._tile_tokens)], dim=1)

    def extra_repr(self) -> str:
        return f"tiled_mlp_tokens={self._tile_tokens}"


@functools.cache
def _tiled_class(cls: type[nn.Module]) -> type[nn.Module]:
    return type(f"Tiled{cls.__name__}", (_TiledBlock, cls), {})


def is_tiled(block: nn.Module) -> bool:
    return isinstance(block, _TiledBlock)


def apply_tiled_mlp(model: Transformer, tile_tokens: int = DEFAULT_TILE_TOKENS) -> int:
    """Run every block's norm + MLP over tiles of `tile_tokens` tokens, in place; returns the count.

    Raises ValueError for tile_tokens < 1 or blocks already tiled."""
    if tile_tokens < 1:
        raise ValueError(f"tile_tokens must be >= 1, got {tile_tokens}")
    for index, block in enumerate(model.layers):
        assert isinstance(block, TransformerBlock), f"layers.{index} is a {type(block).__name__}"
        if is_tiled(block):
            raise ValueError("model blocks are already tiled")
        block.__class__ = _tiled_class(type(block))  # type: ignore[arg-type, assignment]  # nn.Module attributes are typed Tensor | Module in torch's stubs
        block._tile_tokens = tile_tokens  # type: ignore[assignment]  # nn.Module attributes are typed Tensor | Module in torch's stubs; an int here
    return len(model.layers)
