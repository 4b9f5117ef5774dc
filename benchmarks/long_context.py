"""Longest context on one GPU (#32): Llama 3.1 8B LoRA (r=32, alpha 32, every linear layer, batch 1, one
sequence of random tokens), tracetrain with a bf16 base and with an FP8 base, unsloth with its bf16 base and
with its 4-bit base, all in one call; tokens/s and peak memory at 16k, 32k, 64k, the longest length that
trains, and the planner's prediction of it.

Rows (`SYSTEMS`):
- tracetrain, tracetrain:fp8 — the run `tracetrain train` assembles for the same config (spec.py,
  train/assemble.py, the real `train_step`): full recomputation, streamed offload of the checkpointed
  block inputs, `memory.tiled_mlp` and `train.compile` left at 'auto' (compiled blocks below 64k tokens,
  the tiled norm + MLP from 64k on), the fused cross-entropy with its adaptive chunk; :fp8 adds
  `train.fp8 = rowwise` (the frozen base quantised once).
- unsloth, unsloth:4bit — benchmarks/peers/unsloth_long.py under the peers' packages (`--peersite`,
  unpacked from .peers/peersite.tgz when missing): its gradient checkpointing "unsloth" (layer inputs
  offloaded to the host), bf16 base, and its bitsandbytes 4-bit base as users run it.

Every probe runs in its own process (an OOM leaves nothing behind; unsloth patches transformers).

1. Timed lengths: the full 32-block model, `--steps` steps; tokens/s from the median step after the
   first (which compiles / warms up); peak allocated and reserved GiB; the host's peak resident GiB;
   `pool_alloc_s_all`, the host seconds each step spent allocating the offload's pinned buffers (all in
   the first: a one-step row at 300k tokens pins ~70 GiB inside its timed step).
   A tracetrain row runs the `MEMORY` settings the planner predicts fastest among those whose GPU and host
   memory it fits at that length with a 10% margin (no recomputation or offload; the tiled MLP alone; the
   tiled MLP with every block's saved tensors streamed to the host and no recomputation, `offload`, the
   pick at 64k on an 80 GB H100; or the long-context settings), as a user following `tracetrain plan`
   would (marked "*" in the table unless the long-context ones; the row's `memory` says which); should
   that run fail, it runs again with the long-context ones. `--memory NAME` runs the `MEMORY` settings
   named instead. Each tracetrain row carries the
   planner's tokens/s, GPU and host GiB for its own settings (`plan_tok_s`, `plan_gib`, `plan_host_gib`).
2. Longest: a 32-block step at 300k+ tokens takes minutes (attention is quadratic in the length), so
   the search probes the same shape with 2 and 3 blocks and extrapolates per block to 32: each block
   adds its weights and its checkpointed input (offloaded to the host by both systems), while the
   embedding, the head and one block's recomputation do not grow with depth (with the streamed offload
   two block inputs are on the GPU at a block's backward at any depth from 2 on: the last block's, never
   offloaded, and the one copied back). value(32) = v3 + 29 (v3 - v2) for GPU reserved bytes, host
   resident bytes and step seconds alike. (Probes of 1 and 2 blocks, before 2026-11-28, counted the
   second resident input once per block: 53.3 GiB at 64k where 32 blocks hold 24.3, hence the 204,800
   of long_context_NVIDIA-H200_longest_tracetrain+unsloth.json; benchmarks/long_context_peak.py measured
   the 32-block peaks directly.) A length fits when both probes train and the
   extrapolated GPU peak (+ 0.6 GiB CUDA context) and host peak are within the device's memory and 92%
   of the host's available memory; for tracetrain, whose probes offload every block input but the last,
   block inputs the host cannot hold are counted on the GPU instead (seq x 4096 x 2 bytes each), as
   `memory.activation_offload_fraction` = k / 32 keeps them there (the row records that fraction). The search probes two short seed lengths, draws a line through their
   extrapolated peaks (memory is linear in the length) to where it meets the capacity, probes there and
   bisects (`--search-probes` lengths, multiples of 4096). Tokens/s "at the longest" comes from the
   extrapolated step time (marked so). `--confirm` also runs all 32 blocks at the found length (minutes).
3. The planner's longest (`tracetrain.plan.longest.longest_context`, this GPU, 92% of this host's
   available memory) for the tracetrain rows; unsloth rows carry none (the planner models tracetrain).

Budget: a call runs one `--part` (PARTS), and no probe starts after `--budget-s` (default 450 s; each
probe's timeout is what is left, at most `--probe-timeout-s`); what did not run says "skipped: time
budget". Timed lengths run 11 steps (the median of the 10 after the warm-up one), so a call holds about two
rows of the speed part (`--systems tracetrain,unsloth --lengths 32768`: estimated 4-5 minutes on one H200)
and two of the 64k one; longest (2- and 3-block probes at 64k and 128k, then one length near the limit,
one step each) about 4 minutes per row, so two calls of a tracetrain row and its unsloth row each
(`--systems tracetrain,unsloth`, `--systems tracetrain:fp8,unsloth:4bit`). The one-step probes' step
time includes its warm-up (small next to a 300k+ token step).
`--systems` narrows a call to some rows. `--from` combines the calls' JSON files into one table and
the docs' PNG (matplotlib; runs anywhere, no GPU).

  tar xzf .peers/peersite.tgz -C /tmp     # (the script does it when /tmp/peersite is missing)
  PYTHONPATH=. python3 benchmarks/long_context.py --part speed     # JSON to $OUT and benchmarks/results/
  PYTHONPATH=. python3 benchmarks/long_context.py --part 64k
  PYTHONPATH=. python3 benchmarks/long_context.py --part longest --systems tracetrain,unsloth
  PYTHONPATH=. python3 benchmarks/long_context.py --part longest --systems tracetrain:fp8,unsloth:4bit
  # one call, each row seeded where it will fit (a 128 GiB host limits unsloth long before us):
  PYTHONPATH=. python3 benchmarks/long_context.py --part longest --systems tracetrain,unsloth \
      --seed-lengths 'tracetrain=131072,262144;unsloth=65536,131072'
  python3 benchmarks/long_context.py --from benchmarks/results/long_context_NVIDIA-H200_*.json \\
      --png docs/long_context.png
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tarfile
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from long_context_search import (
    DEPTHS,
    FULL_DEPTH,
    GIB,
    REPO,
    SYSTEMS,
    Runner,
    search_longest,
    seed_lengths_for,
)

# ------------------------------------------------------------------------------- tracetrain's probe

# Memory settings of the tracetrain rows: "long" is the longest-context search's; a timed length runs the
# one the planner predicts fastest among those it fits (module docstring).
MEMORY = {
    "long": ("--memory.recompute=full", "--memory.activation_offload=streamed"),
    "none": (),
    "tiled": ("--memory.tiled_mlp=on",),
    # Every block's saved tensors streamed to the host, no recomputation (a row of the planner's long-context
    # remedies, plan/longest.py): at 64k on an 80 GB H100 5,241 tok/s, 26.5 GiB, 87 GiB of host memory
    # (planned 5,094, 27.2 and 86); its host memory grows with the length as fast as the GPU's would.
    "offload": ("--memory.tiled_mlp=on", "--memory.activation_offload=streamed"),
}
AUTO_MEMORY = ("long", "none", "tiled", "offload")  # what `fastest_memory` chooses from


def our_overrides(seq: int, layers: int, fp8: bool, memory: str = "long") -> list[str]:
    """The config of the tracetrain rows (module docstring), with the `MEMORY` settings named."""
    return ["--model.preset=llama3.1-8b", f"--model.n_layers={layers}", "--train.mode=lora", "--lora.rank=32",
            "--lora.alpha=32", "--lora.targets=all-linear", "--train.micro_batch_size=1", f"--data.seq_len={seq}",
            "--data.pack=false", "--train.precision=bf16", "--optim.lr=1e-4", *MEMORY[memory],
            *(["--train.fp8=rowwise"] if fp8 else [])]


def fastest_memory(system: str, seq: int, gpu: str, caps: dict) -> str:
    """The `MEMORY` settings the planner predicts fastest among those it fits at `seq` with a 10% margin
    ("long" when none does)."""
    from tracetrain.config import load_config
    from tracetrain.plan import plan, plan_input_from_config

    best, best_tok_s = "long", 0.0
    for name in AUTO_MEMORY:
        cfg = load_config(None, our_overrides(seq, FULL_DEPTH, SYSTEMS[system]["fp8"], name))
        p = plan(plan_input_from_config(cfg, 1, gpu))
        fits = p.memory.required_bytes <= 0.9 * caps["gpu_gib"] * GIB
        fits = fits and p.memory.host_bytes_per_node <= 0.9 * caps["host_gib"] * GIB
        if fits and p.tokens_per_s > best_tok_s:
            best, best_tok_s = name, p.tokens_per_s
    return best


def host_peak_gib() -> float:
    found = re.search(r"VmHWM:\s+(\d+) kB", open("/proc/self/status").read())
    return int(found.group(1)) / 2**20 if found else float("nan")


class HostPeak:
    """Peak resident host memory while the steps run (VmRSS sampled every 20 ms in a thread): what the
    offloaded activations hold, without what building or loading the model touched before (VmHWM)."""

    def __init__(self) -> None:
        self.peak_bytes, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        page = os.sysconf("SC_PAGE_SIZE")
        while True:
            with open("/proc/self/statm") as f:
                self.peak_bytes = max(self.peak_bytes, int(f.read().split()[1]) * page)
            if self._stop.wait(0.02):
                return

    def __enter__(self) -> HostPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def probe_ours(system: str, seq: int, layers: int, steps: int) -> dict:
    """One row of ours: assemble the run as `tracetrain train` does and time its real step. `system`
    "@<name>" runs the `MEMORY` settings of that name (default "long")."""
    import dataclasses

    import torch

    from tracetrain.config import load_config
    from tracetrain.spec import resolve
    from tracetrain.train.assemble import assemble, run_step_context
    from tracetrain.train.oom import configure_allocator
    from tracetrain.train.step import train_step

    system, _, memory = system.partition("@")
    memory = memory or "long"
    row = {"system": system, "seq": seq, "layers": layers, "memory": memory, "overrides": list(MEMORY[memory])}
    try:
        cfg = load_config(None, our_overrides(seq, layers, SYSTEMS[system]["fp8"], memory))
        device = torch.device("cuda")
        configure_allocator(cfg.memory, device)  # expandable segments, as the trainer sets them
        spec = resolve(cfg, device)
        row.update(compile=spec.compile, tiled_mlp_tokens=spec.tiled_mlp_tokens, decisions={d.key: f"{d.value} ({d.reason})" for d in spec.decisions})
        from tracetrain.plan import plan, plan_input_from_spec

        planned = plan(plan_input_from_spec(spec, torch.cuda.get_device_name(0)))  # this row's prediction
        row.update(plan_tok_s=round(planned.tokens_per_s, 1), plan_gib=round(planned.memory.required_bytes / GIB, 2),
                   plan_host_gib=round(planned.memory.host_bytes_per_node / GIB, 2))
        built = assemble(spec)
        ctx = dataclasses.replace(run_step_context(built), use_document_mask=False)  # one document per row
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, spec.model_args.vocab_size, (1, seq + 1), generator=g)
        batch = {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:], "position_ids": torch.arange(seq)[None],
                 "document_ids": torch.zeros(1, seq, dtype=torch.long)}
        batch = {k: v.contiguous().pin_memory() for k, v in batch.items()}
        torch.cuda.reset_peak_memory_stats()
        times, pinning, loss = [], [], None
        pool = getattr(built.activation_offload, "pool", None)  # the streamed offload's pinned buffers
        with HostPeak() as host:
            for _ in range(steps):
                pinned_before = pool.alloc_s if pool is not None else 0.0
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                loss = train_step(built.module, built.optimizer, [batch], ctx).loss
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
                pinning.append(round((pool.alloc_s if pool is not None else 0.0) - pinned_before, 3))
        row["host_peak_gib"] = round(host.peak_bytes / GIB, 2)
        step_s = statistics.median(times[1:] if len(times) > 1 else times)
        # Host seconds each step spent allocating pinned buffers (the first step's share of a one-step row).
        row["pool_alloc_s_all"] = pinning
        row.update(status="ok", step_s_all=[round(t, 4) for t in times], step_s_median=round(step_s, 4),
                   tokens_per_s=round(seq / step_s, 1), loss=float(loss),
                   peak_gib=round(torch.cuda.max_memory_allocated() / GIB, 3),
                   reserved_gib=round(torch.cuda.max_memory_reserved() / GIB, 3))
    except Exception as e:  # the row says what happened
        oom = isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()
        row["status"] = "OOM" if oom else f"error: {type(e).__name__}: {str(e)[:400]}"
        if not oom:
            import traceback

            traceback.print_exc()
    row["host_hwm_gib"] = round(host_peak_gib(), 2)  # the whole process, build included
    return row


# ---------------------------------------------------------------------------------- probes, budget

# ------------------------------------------------------------------------------------ the call

def caps_now() -> dict:
    import torch

    total = torch.cuda.get_device_properties(0).total_memory / GIB
    avail = next(int(line.split()[1]) for line in open("/proc/meminfo") if line.startswith("MemAvailable:")) / 2**20
    return {"gpu_gib": round(total, 2), "host_gib": round(0.92 * avail, 2), "host_available_gib": round(avail, 2)}


def planner_longest(system: str, gpu: str, host_gib: float) -> dict | None:
    if SYSTEMS[system]["kind"] != "ours":
        return None
    from tracetrain.config import load_config
    from tracetrain.plan.longest import longest_context

    cfg = load_config(None, our_overrides(2048, FULL_DEPTH, SYSTEMS[system]["fp8"]))
    found = longest_context(cfg, gpu, multiple=4096, host_memory_gib=host_gib, fit_offload_fraction=True)
    return {"seq": found.seq_len, "limited_by": found.limited_by, "line": found.line()}


def ensure_peersite(a: argparse.Namespace, systems: list[str]) -> None:
    tgz = REPO / a.peers_dir / "peersite.tgz"
    if any(SYSTEMS[s]["kind"] == "unsloth" for s in systems) and not Path(a.peersite).is_dir() and tgz.is_file():
        with tarfile.open(tgz) as t:
            t.extractall(Path(a.peersite).parent)  # the archive holds one folder, peersite/


def run(a: argparse.Namespace) -> dict:
    import torch
    from common import environment

    systems = [s for s in a.systems.split(",") if s]
    ensure_peersite(a, systems)
    runner, caps = Runner(a), caps_now()
    gpu = torch.cuda.get_device_name(0)
    result = {"env": environment(), "caps": caps, "steps": a.steps, "probe_steps": a.probe_steps,
              "budget_s": a.budget_s, "rows": {}}
    rows = result["rows"]
    for s in systems:
        rows[s] = {"system": s, "base": SYSTEMS[s]["base"], "timed": [], "planner": planner_longest(s, gpu, caps["host_gib"])}
    lengths = sorted((int(x) for x in a.lengths.split(",") if x), key=lambda n: (n != 32768, n))
    for seq in lengths:  # 32k first: the headline ratio
        for s in systems:
            earlier = [r for r in rows[s]["timed"] if r["seq"] < seq and r.get("status") not in ("ok",)]
            if any(r.get("status") == "OOM" for r in earlier):
                rows[s]["timed"].append({"system": s, "seq": seq, "status": "skipped: a shorter length ran out"})
                continue
            if SYSTEMS[s]["kind"] != "ours":
                memory = "long"
            else:
                memory = a.memory if a.memory != "auto" else fastest_memory(s, seq, gpu, caps)
            if memory != "long":
                row = runner.probe(f"{s}@{memory}", seq, FULL_DEPTH, a.steps)  # the fastest settings that fit
                if row.get("status") == "ok":
                    rows[s]["timed"].append({**row, "system": s})
                    continue
            rows[s]["timed"].append(runner.probe(s, seq, FULL_DEPTH, a.steps))
    for s in systems:
        rows[s]["timed"].sort(key=lambda r: r["seq"])
    if a.seed_lengths:
        for s in systems:
            rows[s]["search"] = search_longest(runner, s, caps)
            longest = rows[s]["search"]["longest"]
            if a.confirm and longest:
                rows[s]["confirm"] = runner.probe(s, longest, FULL_DEPTH, a.steps)
    result["wall_s"] = round(a.budget_s - runner.left_s(), 1)
    return result


def render(result: dict) -> str:
    lines = [f"{'system':<16} {'base':<20} " + " ".join(f"{'tok/s ' + str(n // 1024) + 'k':>11} {'GiB':>6}"
                                                        for n in (16384, 32768, 65536))
             + f" {'longest':>9} {'tok/s there':>12} {'planner':>9}  how / first failing"]
    for s, r in result["rows"].items():
        cells = []
        for n in (16384, 32768, 65536):
            t = next((x for x in r["timed"] if x["seq"] == n), None)
            ok = t is not None and t.get("status") == "ok"
            mark = "*" if ok and t.get("memory", "long") != "long" else ""
            cells.append(f"{str(t['tokens_per_s']) + mark if ok else (t or {}).get('status', '-')[:11]:>11} "
                         f"{t['reserved_gib'] if ok else '':>6}")
        sr = r.get("search", {})
        at = sr.get("at_longest") or {}
        planner = (r.get("planner") or {}).get("seq", "-")
        lines.append(f"{s:<16} {r['base']:<20} " + " ".join(cells)
                     + f" {sr.get('longest') or '-':>9} {_positive(at.get('tokens_per_s_32')):>12} {planner:>9}  "
                     + f"{sr.get('how', '')}; first failing {sr.get('first_failing')}")
    lines.append(f"tok/s at the longest: extrapolated from {DEPTHS[0]}- and {DEPTHS[1]}-block probes; GiB: peak reserved, full depth; "
                 "* tracetrain with the memory settings the planner predicts fastest (the row's `memory`)")
    return "\n".join(lines)


def _positive(value: object) -> object:
    """An extrapolated tokens/s, or 'n/a' where the probes' step times gave none (<= 0 or missing)."""
    return value if isinstance(value, (int, float)) and value > 0 else "n/a"


def plot(result: dict, png: Path) -> None:
    """Tokens/s vs length per row (measured points solid, the extrapolated longest hollow), peak GiB below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    for s, r in result["rows"].items():
        ok = [t for t in r["timed"] if t.get("status") == "ok"]
        line, = top.plot([t["seq"] for t in ok], [t["tokens_per_s"] for t in ok], "o-", label=s)
        bottom.plot([t["seq"] for t in ok], [t["reserved_gib"] for t in ok], "o-", color=line.get_color())
        at = (r.get("search") or {}).get("at_longest")
        if at:
            bottom.plot([at["seq"]], [at["gpu_gib_32"]], "o", mfc="none", color=line.get_color())
            bottom.annotate(f"{at['seq'] // 1024}k", (at["seq"], at["gpu_gib_32"]), fontsize=8)
        if at and (at.get("tokens_per_s_32") or 0) > 0:  # results of older calls may hold a negative one
            top.plot([at["seq"]], [at["tokens_per_s_32"]], "o", mfc="none", color=line.get_color())
    top.set_ylabel("tokens/s")
    bottom.set_ylabel("peak GPU GiB (reserved)")
    bottom.set_xlabel("sequence length (tokens, batch 1)")
    for ax in (top, bottom):
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
    top.legend(fontsize=8)
    env = result.get("env", {})
    top.set_title(f"Llama 3.1 8B LoRA r32 all linear, {env.get('device', '')} (hollow: longest, extrapolated)",
                  fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=120)


PARTS = {  # what one call runs: each part fits the budget on one H200 (module docstring)
    # steps: the first warms up, the median of the other 10 is the row's (speed comparisons); the longest's
    # --confirm runs one 300k+ token step after the warm-up one
    "speed": dict(lengths="32768,16384", seed_lengths="", steps=11),
    "64k": dict(lengths="65536", seed_lengths="", steps=11),
    "longest": dict(lengths="", seed_lengths="65536,131072", steps=2),
}


def combine(paths: list[Path]) -> dict:
    """Several calls' results as one: timed rows by (system, length), the latest call winning; a row's
    search and planner from the last call that has them."""
    calls = [json.loads(p.read_text()) for p in paths]
    rows: dict[str, dict] = {}
    for call in calls:
        for s, r in call["rows"].items():
            row = rows.setdefault(s, {"system": s, "base": r["base"], "timed": [], "planner": None})
            seqs = {t["seq"] for t in r["timed"]}
            row["timed"] = sorted([t for t in row["timed"] if t["seq"] not in seqs] + r["timed"], key=lambda t: t["seq"])
            row["planner"] = r.get("planner") or row["planner"]
            if r.get("search"):
                row["search"] = r["search"]
    return {"env": calls[-1]["env"], "calls": [{"part": c.get("part"), "env": c["env"]} for c in calls], "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", choices=list(PARTS), default="speed", help="what this call runs (PARTS)")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated: {', '.join(SYSTEMS)}")
    ap.add_argument("--lengths", default=None, help="full-depth timed lengths (default: the part's)")
    ap.add_argument("--seed-lengths", default=None,
                    help="lengths probed to seed the search (default: the part's); per row: 'tracetrain=131072,262144;unsloth=65536,98304'")
    ap.add_argument("--steps", type=int, default=None,
                    help="steps per full-depth timed length, the first warms up (default: the part's, PARTS)")
    ap.add_argument("--probe-steps", type=int, default=1, help="steps per search probe (2- and 3-block models)")
    ap.add_argument("--search-probes", type=int, default=1, help="lengths the search tries after its seeds")
    ap.add_argument("--max-seq", type=int, default=1 << 20)
    ap.add_argument("--memory", choices=["auto", *MEMORY], default="auto",
                    help="tracetrain rows' memory settings at the timed lengths (auto: the planner's fastest that fits)")
    ap.add_argument("--confirm", action="store_true", help="run the full model at the found longest too (slow)")
    ap.add_argument("--budget-s", type=float, default=450.0)
    ap.add_argument("--probe-timeout-s", type=float, default=240.0)
    ap.add_argument("--min-probe-s", type=float, default=25.0, help="start no probe with less time left")
    ap.add_argument("--peersite", default="/tmp/peersite")
    ap.add_argument("--peers-dir", default=".peers")
    ap.add_argument("--probe", nargs=4, metavar=("SYSTEM", "SEQ", "LAYERS", "STEPS"), help=argparse.SUPPRESS)
    ap.add_argument("--from", dest="sources", type=Path, nargs="+", help="combine result JSONs: table + plot, no run")
    ap.add_argument("--png", type=Path, default=None, help="with --from: where the plot goes")
    a = ap.parse_args()
    if a.probe:
        system, seq, layers, steps = a.probe
        print(json.dumps(probe_ours(system, int(seq), int(layers), int(steps))), flush=True)
        return
    if a.sources:
        result = combine(a.sources)
        print(render(result))
        if a.png:
            plot(result, a.png)
            print(f"written: {a.png}")
        return
    if unknown := {s for s in a.systems.split(",") if s} - set(SYSTEMS):
        ap.error(f"unknown systems {sorted(unknown)}; choose from {', '.join(SYSTEMS)}")
    a.lengths = PARTS[a.part]["lengths"] if a.lengths is None else a.lengths
    a.seed_lengths = PARTS[a.part]["seed_lengths"] if a.seed_lengths is None else a.seed_lengths
    named = {e.split("=")[0].strip() for e in a.seed_lengths.split(";") if "=" in e}
    if named - set(SYSTEMS):
        ap.error(f"--seed-lengths names unknown rows {sorted(named - set(SYSTEMS))}; choose from {', '.join(SYSTEMS)}")
    for system in (x for x in a.systems.split(",") if x):
        seed_lengths_for(a.seed_lengths, system)  # a malformed list stops here, not after other rows ran
    a.steps = PARTS[a.part]["steps"] if a.steps is None else a.steps
    result = {"part": a.part, **run(a)}
    from common import write_result

    out = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    systems = [x for x in a.systems.split(",") if x]
    tag = a.part if set(systems) == set(SYSTEMS) else f"{a.part}_{'_'.join(x.replace(':', '-') for x in systems)}"
    if a.lengths != PARTS[a.part]["lengths"]:  # a narrowed call must not overwrite the full part's file
        tag += "_" + a.lengths.replace(",", "_")
    name = f"long_context_{result['env']['device'].replace(' ', '-')}_{tag}.json"
    path = write_result(name, result, out)
    table = render(result)
    print(table)
    if out is not None:
        (out / f"long_context_{tag}_table.txt").write_text(table + "\n")
    print(f"written: {path}")


if __name__ == "__main__":
    main()
