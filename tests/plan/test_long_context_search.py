"""benchmarks/long_context.py's longest-length search (benchmarks/long_context_search.py), with its probes answered by a memory model of known
limit instead of a GPU: the depth extrapolation (2- and 3-block probes to 32 blocks), tracetrain's move of
the block inputs the host cannot hold onto the GPU (`memory.activation_offload_fraction`), and a bisection
that brackets the known limit. The GPU runs of the same code are in benchmarks/results/long_context_*."""

from __future__ import annotations

import argparse
import sys

import pytest
from helpers import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import long_context_search as lc  # after the path: the benchmark is a script, not a package

GIB = 2**30
BLOCK_BYTES_PER_TOKEN = lc.DIM * 2  # one block input, bf16


class ModelRunner:
    """Probes answered by a linear model of a run at `layers` blocks: fixed GPU bytes, per-block weights,
    per-token bytes resident on the GPU whatever the depth, and every block input but the last on the host."""

    def __init__(self, seed_lengths: str, search_probes: int, fixed_gib: float = 18.0, per_token: int = 61568) -> None:
        self.a = argparse.Namespace(
            probe_steps=1, seed_lengths=seed_lengths, search_probes=search_probes, max_seq=1 << 21
        )
        self.fixed_gib, self.per_token, self.calls = fixed_gib, per_token, []

    def gpu_gib(self, seq: int, layers: int) -> float:
        return self.fixed_gib + 0.47 * layers + seq * (self.per_token + 2 * BLOCK_BYTES_PER_TOKEN) / GIB

    def host_gib(self, seq: int, layers: int) -> float:
        return 1.2 + (layers - 1) * seq * BLOCK_BYTES_PER_TOKEN / GIB

    def probe(self, system: str, seq: int, layers: int, steps: int) -> dict:
        self.calls.append((seq, layers))
        return {
            "status": "ok",
            "reserved_gib": self.gpu_gib(seq, layers),
            "host_peak_gib": self.host_gib(seq, layers),
            "step_s_median": layers * (seq / 1e5) ** 2,
        }


def true_fit(runner: ModelRunner, seq: int, caps: dict, pooled: bool) -> bool:
    """Whether 32 blocks fit, block inputs moved to the GPU where the host is short (`pooled`)."""
    gpu, host = runner.gpu_gib(seq, lc.FULL_DEPTH) + lc.CONTEXT_GIB, runner.host_gib(seq, lc.FULL_DEPTH)
    if pooled and host > caps["host_gib"]:
        block = seq * BLOCK_BYTES_PER_TOKEN / GIB
        moved = -(-(host - caps["host_gib"]) // block)
        gpu, host = gpu + moved * block, host - moved * block
    return gpu <= caps["gpu_gib"] and host <= caps["host_gib"]


def test_extrapolation_is_the_32_block_value() -> None:
    runner = ModelRunner("", 0)
    shallow, deep = (runner.probe("tracetrain", 200_000, d, 1) for d in lc.DEPTHS)
    assert lc.extrapolate(shallow, deep, "reserved_gib") == pytest.approx(runner.gpu_gib(200_000, 32))
    assert lc.extrapolate(shallow, deep, "host_peak_gib") == pytest.approx(runner.host_gib(200_000, 32))


@pytest.mark.parametrize("host_gib", [400.0, 110.0])  # host roomy; host short (the offload fraction moves inputs)
def test_search_brackets_the_limit(host_gib: float) -> None:
    caps = {"gpu_gib": 139.8, "host_gib": host_gib}
    runner = ModelRunner("131072,262144", search_probes=4)
    out = lc.search_longest(runner, "tracetrain", caps)  # type: ignore[arg-type]  # the runner's probe is all it calls
    longest, failing = out["longest"], out["first_failing"]
    assert longest and failing and longest < failing
    assert true_fit(runner, longest, caps, pooled=True)
    assert not true_fit(runner, failing, caps, pooled=True)
    assert failing - longest <= max(4096, longest // 8)  # four probes past the seeds narrow it this far
    best = out["at_longest"]
    if host_gib < 200:  # the host holds fewer than 31 block inputs: the GPU keeps the rest
        assert best["blocks_kept_on_gpu"] > 1 and best["host_gib_32"] <= host_gib
        assert best["offload_fraction"] == (lc.FULL_DEPTH - best["blocks_kept_on_gpu"]) / lc.FULL_DEPTH
    else:
        assert "blocks_kept_on_gpu" not in best
    assert all(layers in lc.DEPTHS for _, layers in runner.calls)


def test_peer_rows_do_not_move_inputs_to_the_gpu() -> None:
    """unsloth's offload has no fraction: a length whose block inputs overflow the host does not fit."""
    caps = {"gpu_gib": 139.8, "host_gib": 60.0}
    runner = ModelRunner("", 0)
    seq = 300_000  # 31 inputs: 70.9 GiB of host, on a GPU that would hold them
    ours, peer = lc.depth_fit(runner, "tracetrain", seq, caps), lc.depth_fit(runner, "unsloth", seq, caps)  # type: ignore[arg-type]
    assert ours["fits"] and ours["blocks_kept_on_gpu"] > 1
    assert peer["fits"] is False and peer["why"] == "host memory"


def test_a_failed_probe_stops_with_its_reason() -> None:
    class OOMRunner(ModelRunner):
        def probe(self, system: str, seq: int, layers: int, steps: int) -> dict:
            return {"status": "OOM"} if seq > 200_000 else super().probe(system, seq, layers, steps)

    runner = OOMRunner("131072,262144", search_probes=0)
    out = lc.search_longest(runner, "tracetrain", {"gpu_gib": 139.8, "host_gib": 400.0})  # type: ignore[arg-type]
    assert out["longest"] == 131072 and out["first_failing"] == 262144
    assert out["tried"][1]["why"] == "OOM"


def test_seed_lengths_per_row() -> None:
    spec = "131072,262144;unsloth=65536,98304"
    assert lc.seed_lengths_for(spec, "tracetrain") == [131072, 262144]
    assert lc.seed_lengths_for(spec, "unsloth") == [65536, 98304]
    assert lc.seed_lengths_for("tracetrain=1,2", "unsloth") == []  # no seeds: the row's search stops at once
    assert lc.seed_lengths_for("65536,131072", "unsloth:4bit") == [65536, 131072]
    with pytest.raises(SystemExit, match="not a comma-separated list"):
        lc.seed_lengths_for("unsloth=64k", "unsloth")
