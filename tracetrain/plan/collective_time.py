"""Collective volumes and their time over the links of `inputs.LINKS` (formulas in time.py's docstring).

Mesh order [pp, dp_replicate, dp_shard, cp, tp], tp innermost as in torchtitan: a dimension's group
holds ranks `stride` apart, stride = the product of the sizes inside it. A group whose size times its
stride fits in `gpus_per_node` runs over NVLink. One that crosses nodes is hierarchical: NCCL builds
one ring per NIC, so the node's traffic leaves through the NICs of all `k` members it has on that node
(k = ranks of the group per node) and each ring keeps its intra-node hops on NVLink. Per GPU that is
min(NVLink, k x one NIC): FSDP over 16 nodes of 8 reaches 8 x 50 GB/s, not one NIC's 50 GB/s, while a
data-parallel group of one rank per node gets one NIC.
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


def _group(inp: PlanInput, dims: tuple[str, ...]) -> tuple[int, int]:
    """(size, stride) of the group over `dims`: its ranks and the distance between neighbours."""
    sizes = _sizes(inp)
    group = math.prod(sizes[d] for d in dims)
    stride = math.prod(sizes[n] for n in MESH_ORDER[max(MESH_ORDER.index(d) for d in dims) + 1 :])
    return group, stride


def spans_nodes(inp: PlanInput, dims: tuple[str, ...]) -> bool:
    """Whether a group over the mesh dimensions `dims` crosses nodes: its size times the stride of its
    innermost dimension (the product of the sizes inside it) exceeds a node."""
    group, stride = _group(inp, dims)
    return group * stride > inp.gpus_per_node


def ranks_per_node(inp: PlanInput, dims: tuple[str, ...]) -> int:
    """Members of one group over `dims` on the same node (1 when the stride is a node or more)."""
    group, stride = _group(inp, dims)
    return max(1, min(group, inp.gpus_per_node // stride))


def bandwidth(inp: PlanInput, hw: Hardware, dims: tuple[str, ...]) -> float:
    """Achievable bytes/s per GPU for a collective over `dims` (hierarchical across nodes, see above)."""
    if not spans_nodes(inp, dims):
        return hw.intra_node_bytes_s * NCCL_EFFICIENCY
    k = ranks_per_node(inp, dims)
    return min(hw.intra_node_bytes_s, k * hw.inter_node_bytes_s) * NCCL_EFFICIENCY


def all_reduce_s(size_bytes: float, n: int, bw: float) -> float:
    """Ring all-reduce of a `size_bytes` buffer on each of n ranks: 2(n-1)/n x size over the link."""
    return 0.0 if n <= 1 else 2 * (n - 1) / n * size_bytes / bw + COLLECTIVE_LATENCY_S


def all_gather_s(full_bytes: float, n: int, bw: float) -> float:
    """Ring all-gather (or reduce-scatter) of a buffer of `full_bytes` when whole: (n-1)/n x size."""
    return 0.0 if n <= 1 else (n - 1) / n * full_bytes / bw + COLLECTIVE_LATENCY_S


def all_to_all_s(bytes_per_rank: float, n: int, bw: float) -> float:
    """All-to-all where each rank sends `bytes_per_rank` in total, (n-1)/n of it off-rank."""
    return 0.0 if n <= 1 else (n - 1) / n * bytes_per_rank / bw + COLLECTIVE_LATENCY_S


def wire_bytes(full_bytes: float, n: int) -> float:
    """Bytes one rank sends in a ring all-gather or reduce-scatter of a `full_bytes` buffer."""
    return 0.0 if n <= 1 else (n - 1) / n * full_bytes
