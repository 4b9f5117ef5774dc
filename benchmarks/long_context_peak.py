"""What is live at the GPU peak of a long-context step (#32 point 2): the planner's memory model against
the allocator, term by term.

For each `--points` entry SEQ:LAYERS it runs benchmarks/long_context.py's tracetrain probe (the run
`tracetrain train` assembles: full recomputation, streamed offload, 'auto' tiled MLP / compile, the
fused cross-entropy) for one step in its own process with the allocator's history recorded, replays
the history to the moment of the largest allocated total, and groups what is live there by the frames
that allocated it and its bytes per token. tests/plan/test_plan_long_context.py holds the planner to these
peaks. One JSON per call ($OUT/long_context_peak_<device>.json, and benchmarks/results/). The committed
one (one H200, about 12 minutes in three calls):

  PYTHONPATH=. python3 benchmarks/long_context_peak.py --points 32768:32,131072:32,262144:32
  PYTHONPATH=. python3 benchmarks/long_context_peak.py --points 1048576:2
  PYTHONPATH=. python3 benchmarks/long_context_peak.py --points 16384:4,32768:4

The 2-block model at 1M tokens holds what the 32-block one holds per token at its peak (two block inputs
resident under the streamed offload, one block's backward), at a 1/16 of its step time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
REPO = Path(__file__).resolve().parents[1]
GIB = 2**30
MAX_ENTRIES = 3_000_000


def frame_key(frames: list[dict], seq: int, size: int) -> str:
    """Up to four innermost tracetrain / checkpoint / autograd frames of an allocation (else its innermost
    Python frame, '?' for the autograd engine's own), and its bytes per token of the sequence."""
    mine = [f for f in frames if any(k in f.get("filename", "") for k in ("tracetrain/", "checkpoint", "autograd"))]
    where = " < ".join(f"{f['filename'].split('/')[-1]}:{f['line']} {f['name']}" for f in mine[:4])
    if not where:
        where = next((f"{f['filename'].split('/')[-1]}:{f['line']} {f['name']}" for f in frames
                      if f.get("filename", "").endswith(".py")), "?")
    return f"{where} {size / seq:.0f}"


def live_at_peak(snapshot: dict, seq: int) -> dict:
    """Replay the device trace (alloc / free_completed) to its largest allocated total."""
    trace = snapshot["device_traces"][0]
    live: dict[int, tuple[int, str]] = {}
    total = peak = peak_at = 0
    peak_live: dict[int, tuple[int, str]] = {}
    for i, e in enumerate(trace):
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], frame_key(e.get("frames", []), seq, e["size"]))
            total += e["size"]
        elif e["action"] == "free_completed" and e["addr"] in live:
            total -= live.pop(e["addr"])[0]
        if total > peak:
            peak, peak_live, peak_at = total, dict(live), i
    groups: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for size, key in peak_live.values():
        groups[key][0] += size
        groups[key][1] += 1
    top = sorted(groups.items(), key=lambda kv: -kv[1][0])[:70]
    frames = trace[peak_at].get("frames", []) if trace else []
    return {"replayed_peak_gib": round(peak / GIB, 3), "events": len(trace),
            "allocating_at_peak": frame_key(frames, seq, 0).rsplit(" ", 1)[0],
            "live": [{"where": k, "gib": round(v[0] / GIB, 3), "count": v[1]} for k, v in top if v[0] >= GIB // 1000]}


def probe(seq: int, layers: int, steps: int) -> dict:
    """The tracetrain probe with the allocator history on (run in a child process)."""
    import torch
    from long_context import probe_ours

    torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python", max_entries=MAX_ENTRIES)
    row = probe_ours("tracetrain", seq, layers, steps)
    if row.get("status") == "ok":
        try:
            row["at_peak"] = live_at_peak(torch.cuda.memory._snapshot(), seq)
        except Exception as e:  # the row still has the allocator's peak
            row["at_peak"] = f"replay failed: {type(e).__name__}: {e}"
    torch.cuda.memory._record_memory_history(enabled=None)
    row["steps"] = steps  # one step: the peak holds no AdamW states yet (they appear at the first update)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--points", default="65536:32,131072:32", help="SEQ:LAYERS,... (full depth: 32)")
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--timeout-s", type=float, default=560.0, help="the whole call")
    ap.add_argument("--child", nargs=3, type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(probe(*a.child)), flush=True)
        return
    import torch
    from common import environment

    out, deadline = {"env": environment(), "rows": []}, time.time() + a.timeout_s
    for point in a.points.split(","):
        seq, layers = (int(x) for x in point.split(":"))
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(seq), str(layers), str(a.steps)]
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO,
                                  timeout=max(1.0, deadline - time.time()))
            lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
            row = json.loads(lines[-1]) if lines else {"seq": seq, "layers": layers, "status": proc.stderr[-1500:]}
        except subprocess.TimeoutExpired:
            row = {"seq": seq, "layers": layers, "status": "timed out"}
        out["rows"].append(row)
        print(json.dumps({k: row.get(k) for k in ("seq", "layers", "status", "peak_gib", "reserved_gib", "step_s_all")}), flush=True)
    name = f"long_context_peak_{torch.cuda.get_device_name(0).replace(' ', '-')}.json"
    earlier = REPO / "benchmarks" / "results" / name  # rows of earlier calls stay unless measured again
    if earlier.is_file():
        done = {(r["seq"], r["layers"]) for r in out["rows"]}
        out["rows"] = [r for r in json.loads(earlier.read_text())["rows"] if (r["seq"], r["layers"]) not in done] + out["rows"]
    text = json.dumps(out, indent=1)
    for folder in filter(None, [os.environ.get("OUT"), str(REPO / "benchmarks" / "results")]):
        Path(folder, name).write_text(text)


if __name__ == "__main__":
    main()
