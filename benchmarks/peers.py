"""tracetrain next to unsloth and torchtitan on one GPU, in one process run, like for like (#19).

Our rows are tracetrain's real step on the run `tracetrain train` assembles (benchmarks/speed.py
`bench_run`: random weights, unpacked rows of one full-length document each, as the peers train); the
peers are ../shared/peers/unsloth_peer.py and torchtitan_peer.py, carried into the checkout as
`.peers/` with their packages (`fetch_peer_wheels.sh` -> `.peers/peersite.tgz`), each in its own
process after ours, on the same GPU. Every row: median step time over the timed steps after warm-up.

Writes benchmarks/results/peers_<gpu>.json: rows `{system, case, tokens_per_s, peak_gib, mfu, batch, seq,
date, commit, torch}` (`system` "tracetrain" / "tracetrain:fp8" for ours, the peer's name otherwise), rows
of earlier calls in the file kept with their own `call` stamp, so ratios are read within one call.

  tar xzf .peers/peersite.tgz -C /tmp
  python3 benchmarks/peers.py --peersite /tmp/peersite --ours 7b-lora,7b-lora:fp8,1b-full \
      --unsloth qkvo --torchtitan --data .carry/shared/data/tinyshakespeare.txt
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, last_json_line  # noqa: E402

# Our case -> (speed.py case, variant, the peers' case name). The variants are what `tracetrain train`
# resolves for unpacked rows on a GPU (train.attention = auto -> sdpa without a document mask; compile,
# fused cross-entropy); the `:flex` rows keep FlexAttention, which auto picks for packed rows.
OURS = {
    "7b-lora": ("7b-lora", "compile_sdpa", "llama2-7b-lora"),
    "7b-lora:flex": ("7b-lora", "compile", "llama2-7b-lora"),
    "7b-lora:fp8": ("7b-lora", "compile_sdpa_fp8_rowwise", "llama2-7b-lora"),
    "7b-lora-all": ("7b-lora-all", "compile_sdpa", "llama2-7b-lora-all-linear"),
    "7b-lora-all:fp8": ("7b-lora-all", "compile_sdpa_fp8_rowwise", "llama2-7b-lora-all-linear"),
    "1b-full": ("1b-full", "compile_sdpa", "llama3.2-1b-full"),
    "1b-full:flex": ("1b-full", "compile", "llama3.2-1b-full"),
    "8b-full": ("8b-full", "compile_sdpa", "llama3-8b-full-ac"),
    "8b-full-b1": ("8b-full-b1", "compile_sdpa", "llama3-8b-full-ac-b1"),
}
UNSLOTH_CASES = {"qkvo": "llama2-7b-lora", "all-linear": "llama2-7b-lora-all-linear"}
REPO = Path(__file__).resolve().parents[1]


def run_peer(cmd: list[str], peersite: str, extra_env: dict[str, str], timeout_s: float) -> dict:
    env = {**os.environ, "PYTHONPATH": peersite, **extra_env}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s, cwd=REPO)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f} s"}
    out = last_json_line(proc.stdout)
    if proc.returncode != 0 or out is None:
        return {"error": f"exit {proc.returncode}: {(proc.stderr or proc.stdout)[-1500:]}"}
    return out


def ours(name: str, warmup: int, steps: int) -> dict:
    from speed import bench_run

    case, variant, peer_case = OURS[name]
    row = bench_run(case, "unpacked", variant, warmup, steps, {}, 1e-4)
    system = "tracetrain:fp8" if "fp8" in variant else "tracetrain"
    return {"system": system + (":flex" if name.endswith(":flex") else ""), "case": peer_case,
            "tokens_per_s": row["tokens_per_s"], "peak_gib": row["peak_gib"], "mfu": row["mfu"],
            "batch": row["batch"], "seq": row["seq"], "variant": variant, "step_s_all": row["step_s_all"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ours", default="7b-lora,1b-full", help=f"comma-separated: {', '.join(OURS)}")
    ap.add_argument("--unsloth", default="qkvo", help="comma-separated: qkvo, all-linear ('' = none)")
    ap.add_argument("--torchtitan", action="store_true", help="torchtitan 1B on one GPU (--no-cudagraphs)")
    ap.add_argument("--torchtitan-8b", default="", help="torchtitan 8B with full activation checkpointing at "
                    "these batch sizes, comma-separated (one H200: the fp32 states alone are 128 GB)")
    ap.add_argument("--peersite", default="/tmp/peersite")
    ap.add_argument("--peers-dir", default=".peers")
    ap.add_argument("--data", default=".carry/shared/data/tinyshakespeare.txt", help="text file for torchtitan")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--peer-timeout-s", type=float, default=300)
    a = ap.parse_args()
    env = environment()
    import torch

    call = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    stamp = {"date": env.get("date"), "commit": env.get("commit"), "torch": torch.__version__, "call": call,
             "device": torch.cuda.get_device_name(0)}
    rows: list[dict] = []
    for name in [n for n in a.ours.split(",") if n]:
        try:
            row = {**ours(name, a.warmup, a.steps), **stamp}
        except Exception as e:  # recorded (an 8B that does not fit is a result too); the peers still run
            kind = "OOM" if isinstance(e, torch.OutOfMemoryError) else type(e).__name__
            rows.append({"system": "tracetrain", "case": OURS[name][2], "error": f"{kind}: {str(e)[:300]}", **stamp})
            print(f"{name}: {rows[-1]['error']}", flush=True)
            from speed_checks import free

            free()
            continue
        rows.append(row)
        print(f"{row['system']:16} {row['case']:28} {row['tokens_per_s']:9,.0f} tok/s  {row['peak_gib']:5.1f} GiB",
              flush=True)
    peers = Path(a.peers_dir)
    for targets in [t for t in a.unsloth.split(",") if t]:
        out = run_peer([sys.executable, str(peers / "unsloth_peer.py"), "4", "2048", "false"], a.peersite,
                       {"LORA_TARGETS": targets}, a.peer_timeout_s)
        rows.append({"system": out.get("peer", "unsloth"), "case": UNSLOTH_CASES[targets], **out, **stamp})
        print(f"unsloth {targets}: {out.get('tokens_per_s', out.get('error'))}", flush=True)
    if a.torchtitan:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
               str(peers / "torchtitan_peer.py"), "--data", a.data, "--no-cudagraphs", "--steps", "30"]
        out = run_peer(cmd, a.peersite, {}, a.peer_timeout_s)
        rows.append({"system": "torchtitan 0.3.0 (--no-cudagraphs)", "case": "llama3.2-1b-full", **out, **stamp})
        print(f"torchtitan 1B: {out.get('tokens_per_s', out.get('error'))}", flush=True)
    for batch in [b for b in a.torchtitan_8b.split(",") if b]:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
               str(peers / "torchtitan_peer.py"), "--data", a.data, "--no-cudagraphs", "--flavour", "8B", "--ac", "full",
               "--batch", batch, "--steps", "20", "--skip", "6"]
        out = run_peer(cmd, a.peersite, {}, a.peer_timeout_s)
        case = "llama3-8b-full-ac" + ("" if batch == "2" else f"-b{batch}")
        rows.append({"system": "torchtitan 0.3.0 (--no-cudagraphs, --ac full)", "case": case, **out, **stamp})
        print(f"torchtitan 8B batch {batch}: {out.get('tokens_per_s', out.get('error'))}", flush=True)
    print("\nratios in this call (tracetrain / peer, same case):")
    for r in rows:
        if r["system"].startswith("tracetrain") and r.get("tokens_per_s"):
            for p in rows:
                if not p["system"].startswith("tracetrain") and p["case"] == r["case"] and p.get("tokens_per_s"):
                    print(f"  {r['system']:16} {r['case']:28} / {p['system']}: {r['tokens_per_s'] / p['tokens_per_s']:.2f}x")
    device = torch.cuda.get_device_name(0).replace(" ", "-")
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else REPO / "benchmarks" / "results"
    path = out_dir / f"peers_{device}.json"
    kept = json.loads(path.read_text()) if path.is_file() else []
    path.write_text(json.dumps(kept + rows, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
