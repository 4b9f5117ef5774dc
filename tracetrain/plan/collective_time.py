"""Collective volumes and their time over the links of `inputs.LINKS` (formulas in time.py's docstring).

A mesh dimension's group stays inside a node when its size times the sizes of all dimensions inside
it (mesh order [pp, dp_replicate, dp_shard, cp, tp], tp innermost as in torchtitan) fits in
`gpus_per_node`; otherwise its ring runs at the inter-node (InfiniBand) bandwidth.
"""

from __future__ import annotations

import math

from tracetrain.plan.inputs import Hardware, PlanInput

MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
# NCCL ring collectives reach ~80% of the link's unidirectional bandwidth (bus bandwidth).
NCCL_EFFICIENCY = 0.80
# Fixed cost of one collective call (launch + ring latency), seconds.
COLLECTIVE_LATENCY_S = 15e-6


def _sizes(inp: PlanInput) -> dict[str, int]:
    return {"pp": inp.pp, "dp_replicate": inp.dp_replicate, "dp_shard": inp.dp_shard, "cp": inp.cp, "tp": inp.tp}


def spans_nodes(inp: PlanInput, dims: tuple[str, ...]) -> bool:
    """Whether a group over the mesh dimensions `dims` crosses nodes: its size times the stride of its
    innermost dimension (the product of the sizes inside it) exceeds a node."""
    sizes = _sizes(inp)
    group = math.prod(sizes[d] for d in dims)
    stride = math.prod(sizes[n] for n in MESH_ORDER[max(MESH_ORDER.index(d) for d in dims) + 1 :])
    return group * stride > inp.gpus_per_node


def bandwidth(inp: PlanInput, hw: Hardware, dims: tuple[str, ...]) -> float:
    """Achievable bytes/s per GPU for a collective over `dims`."""
    link = hw.inter_node_bytes_s if spans_nodes(inp, dims) else hw.intra_node_bytes_s
    return link * NCCL_EFFICIENCY


def all_reduce_s(size_bytes: float, n: int, bw: float) -> float:
    """Ring all-reduce of a `size_bytes` buffer on each of n ranks: 2(n-1)/n x size over the link."""
    return 0.0 if n <= 1 else 2 * (n - 1) / n * size_bytes / bw + COLLECTIVE_LATENCY_S


def all_gather_s(full_bytes: float, n: int, bw: float) -> float:
    """Ring all-gather (or reduce-scatter) of a buffer of `full_bytes` when whole: (n-1)/n x size."""
    return 0.0 if n <= 1 else (n - 1) / n * full_bytes / bw + COLLECTIVE_LATENCY_S


def all_to_all_s(bytes_per_rank: float, n: int, bw: float) -> float:
    """All-to-all where each rank sends `bytes_per_rank` in total, (n-1)/n of it off-rank."""
    return 0.0 if n <= 1 else (n - 1) / n * bytes_per_rank / bw + COLLECTIVE_LATENCY_S
