"""Seeded initial values that do not depend on the layout, written straight into each rank's shards.

A parameter's full values are a function of (seed, its name, its shape) only: the tensor is cut along
dim 0 into chunks of at most `CHUNK_ELEMENTS` elements, and chunk c is drawn from its own generator
seeded with a hash of (seed, name, c). A rank that owns rows [a, b) and columns [c, d) of a parameter
(an FSDP dim-0 shard, a TP row or column shard, a pipeline stage's layers, an expert shard) draws only
the chunks that overlap its rows and keeps its slice of them: it never holds more than its shard plus
one chunk, and 1, 2 or 4 ranks of any layout hold the same numbers (tests/parallel/test_sharded_init.py).

The rule for each parameter (normal with `init_std`, residual outputs scaled by 1/sqrt(2 * n_layers),
norms one (Gemma's zero: they scale by 1 + weight), biases zero, LoRA A kaiming-uniform and B zero as in
PEFT) is `init_rule`, read from the parameter's canonical name: the one the plain model gives it, whatever wrappers (LoRA's `.base`,
checkpointing, compile, FSDP) sit in between. Random draws use a generator on the parameter's own
device, so a GPU run draws on the GPU (fast) and every rank of the same GPU model draws the same.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Literal

import torch

from tracetrain.models.llama import ModelArgs

CHUNK_ELEMENTS = 1 << 24  # 16 Mi elements (64 MiB in fp32): one chunk is the most a rank holds beyond its shards

# Name segments that are not part of the plain model's names (checkpointing, compile, FSDP1-style, LoRA base).
_WRAPPERS = frozenset({"_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module", "base"})


@dataclass(frozen=True)
class InitRule:
    """How a parameter's values are drawn: `normal` (std=scale), `uniform` (-scale, scale), or a constant."""

    kind: Literal["normal", "uniform", "ones", "zeros"]
    scale: float = 0.0


def canonical_name(name: str, tied: bool = False) -> str:
    """The plain model's name of a parameter: wrapper segments removed (`q_proj.base.weight` -> `q_proj.weight`);
    a tied head is the embedding (a last pipeline stage holds it as `lm_head.weight`)."""
    parts = name.split(".")
    name = ".".join(p for i, p in enumerate(parts) if p not in _WRAPPERS or i == len(parts) - 1)
    return "embed_tokens.weight" if tied and name == "lm_head.weight" else name


def init_rule(name: str, shape: tuple[int, ...], args: ModelArgs) -> InitRule:
    """The initial distribution of the parameter `name` (canonical) of a model of `args`."""
    std, out_std = args.init_std, args.init_std / math.sqrt(2 * args.n_layers)
    leaf = name.rpartition(".")[2]
    if name.endswith("lora_A.weight"):  # kaiming_uniform_(a=sqrt(5)): bound 1 / sqrt(fan_in), as nn.Linear and PEFT
        return InitRule("uniform", 1.0 / math.sqrt(shape[1]))
    if name.endswith("lora_magnitude_vector"):  # DoRA: set to the base's row norms once the base is filled
        return InitRule("ones")
    if name.endswith("lora_B.weight") or leaf == "bias":
        return InitRule("zeros")
    if name.endswith(("norm.weight", "layernorm.weight")):  # Gemma's norms scale by 1 + weight
        return InitRule("zeros" if args.family.startswith("gemma") else "ones")
    if name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
        return InitRule("normal", out_std)
    if name.endswith(("_proj.weight", "router.weight", "embed_tokens.weight", "lm_head.weight")):
        return InitRule("normal", std)
    if name.endswith(("experts.gate_proj", "experts.up_proj")):
        return InitRule("normal", std)
    raise AssertionError(f"no initialisation rule for parameter {name!r}: add one to models/init.py")


def _chunk_seed(seed: int, name: str, chunk: int) -> int:
    digest = hashlib.blake2b(f"{seed}:{name}:{chunk}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def rows_per_chunk(shape: tuple[int, ...], chunk_elements: int = CHUNK_ELEMENTS) -> int:
    """Rows (dim-0 slices) per chunk: a function of the full shape only, so the same on every layout."""
    row = math.prod(shape[1:]) if len(shape) > 1 else 1
    return max(1, chunk_elements // max(row, 1))


@torch.no_grad()
def fill_local(
    local: torch.Tensor,
    name: str,
    shape: tuple[int, ...],
    offsets: tuple[int, ...],
    rule: InitRule,
    seed: int,
    chunk_elements: int = CHUNK_ELEMENTS,
) -> None:
    """Write into `local` (this rank's block of the full `shape`, starting at `offsets`) the values the
    full tensor `name` has under `rule` and `seed`. Only the chunks overlapping the block are drawn."""
    if rule.kind in ("ones", "zeros"):
        local.fill_(1.0 if rule.kind == "ones" else 0.0)
        return
    if local.numel() == 0:
        return
    rows = rows_per_chunk(shape, chunk_elements)
    start, stop = offsets[0], offsets[0] + local.shape[0]
    trailing = tuple(slice(o, o + n) for o, n in zip(offsets[1:], local.shape[1:], strict=True))
    for chunk in range(start // rows, (stop - 1) // rows + 1):
        lo, hi = chunk * rows, min((chunk + 1) * rows, shape[0])
        gen = torch.Generator(device=local.device).manual_seed(_chunk_seed(seed, name, chunk))
        size = (hi - lo, *shape[1:])
        if rule.kind == "normal":
            values = torch.randn(size, generator=gen, device=local.device, dtype=torch.float32).mul_(rule.scale)
        else:
            values = torch.rand(size, generator=gen, device=local.device, dtype=torch.float32)
            values.mul_(2 * rule.scale).sub_(rule.scale)
        a, b = max(lo, start), min(hi, stop)
        local[a - start : b - start].copy_(values[(slice(a - lo, b - lo), *trailing)])
