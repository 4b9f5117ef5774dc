"""The longest-context search of benchmarks/long_context.py (its module docstring, part 2, says how): probes
in subprocesses within the call's budget (`Runner`), the 2- and 3-block probes extrapolated to 32 blocks
(`depth_fit`, with the offload fraction moving the block inputs the host cannot hold to the GPU), a line
through the seeds' peaks to where memory runs out (`seed_length`) and the bisection (`search_longest`).
Its logic is tested on the CPU against a memory model of known limit (tests/plan/test_long_context_search.py)."""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

from common import last_json_line  # the script's folder is on sys.path (long_context.py's, or the test's)

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "long_context.py"  # its --probe runs tracetrain's probes
GIB = 2**30
FULL_DEPTH = 32  # Llama 3.1 8B
DIM = 4096
DEPTHS = (2, 3)  # blocks of the search's probes (same offload structure: two block inputs resident)
SEED_MARGIN = 0.95
CONTEXT_GIB = 0.6  # CUDA context and workspaces outside torch's allocator
SYSTEMS = {
    "tracetrain": {"kind": "ours", "fp8": False, "base": "bf16"},
    "tracetrain:fp8": {"kind": "ours", "fp8": True, "base": "fp8 (rowwise)"},
    "unsloth": {"kind": "unsloth", "four_bit": False, "base": "bf16"},
    "unsloth:4bit": {"kind": "unsloth", "four_bit": True, "base": "4-bit (bitsandbytes)"},
}


class Runner:
    """Runs probes in subprocesses within the call's time budget."""

    def __init__(self, a: argparse.Namespace) -> None:
        self.a, self.deadline, self.log = a, time.time() + a.budget_s, []

    def left_s(self) -> float:
        return self.deadline - time.time()

    def probe(self, system: str, seq: int, layers: int, steps: int) -> dict:
        base = {"system": system, "seq": seq, "layers": layers}
        timeout = min(self.a.probe_timeout_s, self.left_s())
        if timeout < self.a.min_probe_s:
            return {**base, "status": "skipped: time budget"}
        if SYSTEMS[system.partition("@")[0]]["kind"] == "ours":
            cmd = [sys.executable, str(SCRIPT), "--probe", system, str(seq), str(layers), str(steps)]
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        else:
            cmd = [
                sys.executable,
                str(REPO / "benchmarks" / "peers" / "unsloth_long.py"),
                "--seq",
                str(seq),
                "--layers",
                str(layers),
                "--steps",
                str(steps),
                "--gc",
                "unsloth",
                *(["--load-in-4bit"] if SYSTEMS[system]["four_bit"] else []),
            ]
            env = {**os.environ, "PYTHONPATH": self.a.peersite}
        start = time.time()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=REPO)
        except subprocess.TimeoutExpired:
            return {**base, "status": f"timed out after {timeout:.0f} s", "wall_s": round(time.time() - start, 1)}
        out = last_json_line(proc.stdout)
        if out is None:
            killed = proc.returncode in (-9, 137)
            status = (
                "killed (host memory?)" if killed else f"exit {proc.returncode}: {(proc.stderr or proc.stdout)[-800:]}"
            )
            out = {**base, "status": status}
        out = {**base, **out, "wall_s": round(time.time() - start, 1)}
        self.log.append(out)
        print(json.dumps({k: v for k, v in out.items() if k != "decisions"}), flush=True)
        return out


def extrapolate(shallow: dict, deep: dict, key: str) -> float:
    """The value at FULL_DEPTH blocks from the DEPTHS probes (linear in the number of blocks)."""
    (d1, d2), (v1, v2) = DEPTHS, (shallow[key], deep[key])
    return v2 + (FULL_DEPTH - d2) * (v2 - v1) / (d2 - d1)


def depth_fit(runner: Runner, system: str, seq: int, caps: dict) -> dict:
    """Probe `seq` at DEPTHS blocks; the 32-block extrapolation and whether it fits (None: no answer)."""
    probes = [runner.probe(system, seq, d, runner.a.probe_steps) for d in DEPTHS]
    out = {"seq": seq, "probes": probes}
    failed = next((p for p in probes if p.get("status") != "ok"), None)
    if failed is not None:
        ran_out = failed["status"] == "OOM" or "killed" in failed["status"]
        return {**out, "fits": False if ran_out else None, "why": failed["status"]}
    gpu = extrapolate(*probes, "reserved_gib") + CONTEXT_GIB
    host = extrapolate(*probes, "host_peak_gib")
    step_s = extrapolate(*probes, "step_s_median")
    extra = {}
    if SYSTEMS[system]["kind"] == "ours" and host > caps["host_gib"]:
        # memory.activation_offload_fraction keeps the last blocks' inputs on the GPU: move as many as the
        # host cannot hold (each is one block's bf16 residual stream, seq x dim x 2 bytes).
        block_gib = seq * DIM * 2 / GIB
        resident = min(FULL_DEPTH - 1, math.ceil((host - caps["host_gib"]) / block_gib))
        gpu, host = gpu + resident * block_gib, host - resident * block_gib
        extra = {"offload_fraction": (FULL_DEPTH - 1 - resident) / FULL_DEPTH, "blocks_kept_on_gpu": 1 + resident}
    fits = gpu <= caps["gpu_gib"] and host <= caps["host_gib"]
    why = "fits" if fits else ("GPU memory" if gpu > caps["gpu_gib"] else "host memory")
    # A deeper probe that steps faster than a shallower one (its one step held less warm-up) gives no
    # per-block step time: the extrapolated tokens/s is then left out, not reported negative.
    speed = {"step_s_32": round(step_s, 3), "tokens_per_s_32": round(seq / step_s, 1)} if step_s > 0 else {}
    return {
        **out,
        "fits": fits,
        "why": why,
        "gpu_gib_32": round(gpu, 2),
        "host_gib_32": round(host, 2),
        **speed,
        **extra,
    }


def seed_length(points: list[dict], caps: dict, pooled: bool) -> int | None:
    """Where the line through two lengths' 32-block GPU and host peaks (memory is linear in the length)
    meets the device's or the host's capacity (`pooled`: tracetrain, whose offload fraction moves block
    inputs between the two, so their sum against the sum of the capacities); None without two lengths."""
    ok = sorted((p for p in points if p.get("fits") is not None and "gpu_gib_32" in p), key=lambda p: p["seq"])
    if len(ok) < 2:
        return None
    a, b = ok[0], ok[-1]
    lines = [(lambda p: p["gpu_gib_32"], caps["gpu_gib"])]
    if pooled:
        lines.append((lambda p: p["gpu_gib_32"] + p["host_gib_32"], caps["gpu_gib"] + caps["host_gib"]))
    else:
        lines.append((lambda p: p["host_gib_32"], caps["host_gib"]))
    limits = []
    for value, cap in lines:
        slope = (value(b) - value(a)) / (b["seq"] - a["seq"])
        if slope > 0:
            limits.append(b["seq"] + (cap - value(b)) / slope)
    return int(min(limits)) if limits else None


def seed_lengths_for(spec: str, system: str) -> list[int]:
    """`--seed-lengths` for one row: "65536,131072" for every row, or per row, "tracetrain=131072,262144;
    unsloth=65536,98304" (a row not named takes the unnamed entry, if any: "131072,262144;unsloth=65536,98304")."""
    default, named = "", {}
    for entry in filter(None, (e.strip() for e in spec.split(";"))):
        name, eq, lengths = entry.rpartition("=")
        if eq:
            named[name.strip()] = lengths
        else:
            default = entry
    text = named.get(system, default)
    try:
        return [int(n) for n in text.split(",") if n.strip()]
    except ValueError:
        raise SystemExit(f"--seed-lengths: {text!r} is not a comma-separated list of token counts") from None


def search_longest(runner: Runner, system: str, caps: dict) -> dict:
    """The two `--seed-lengths` (cheap: short), a line through their peaks, then `--search-probes`
    lengths, bisecting (multiples of 4096; module docstring)."""
    step, limit = 4096, runner.a.max_seq
    tried = []

    def fit(seq: int) -> dict:
        result = depth_fit(runner, system, seq, caps)
        tried.append({k: v for k, v in result.items() if k != "probes"})
        print(f"  {system} {seq}: {tried[-1].get('why')} {tried[-1].get('gpu_gib_32', '')}", flush=True)
        return result

    seeds = [fit(n) for n in seed_lengths_for(runner.a.seed_lengths, system)]
    lo = max([t["seq"] for t in tried if t["fits"]], default=0)
    hi = min([t["seq"] for t in tried if t["fits"] is False], default=limit + step)
    seed = seed_length(seeds, caps, pooled=SYSTEMS[system]["kind"] == "ours")
    # A little below the line's crossing: the one probe the default budget affords should land inside.
    seq = min(limit, int(seed * SEED_MARGIN) // step * step) if seed else None
    for _ in range(runner.a.search_probes):
        if seq is None or not lo < seq < hi:
            break
        answer = fit(seq)
        if answer["fits"] is None:  # a probe did not answer (budget, error): stop here
            break
        lo, hi = (seq, hi) if answer["fits"] else (lo, seq)
        seq = (lo + hi) // 2 // step * step if hi <= limit else min(limit, (lo + max(step, lo // 8)) // step * step)
    best = next((t for t in tried if t["fits"] and t["seq"] == lo), None)
    return {
        "longest": lo or None,
        "first_failing": hi if hi <= limit else None,
        "seed": seed,
        "tried": tried,
        "at_longest": best,
        "how": f"{DEPTHS[0]}- and {DEPTHS[1]}-block probes extrapolated to {FULL_DEPTH}",
    }
