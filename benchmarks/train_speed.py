"""Training throughput of tracetrain's real step function next to the HF peer, in one process run.

Each case builds the model exactly as `tracetrain train` does (meta device -> GPU, transforms, fused
AdamW) and times `train_step` on random full-length rows (no packing, like the peer), median of the
timed steps after warm-up. The peer (../shared/peers/hf_peer.py, carried into the checkout) runs in
a subprocess after ours, on the same GPU. Prints a table; writes benchmarks/results/train_speed_<gpu>.json.

  python3 benchmarks/train_speed.py --peer .carry/peers/hf_peer.py --cases llama3.2-1b-full,llama2-7b-lora
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bench_train_step, environment, run_peer, write_result  # noqa: E402

from tracetrain.config import load_config  # noqa: E402

CASES = {
    "llama3.2-1b-full": dict(preset="llama3.2-1b", mode="full", batch=4, seq=2048,
                             peer=["--model", "llama3.2-1b", "--mode", "full"]),
    "llama2-7b-lora": dict(preset="llama2-7b", mode="lora", batch=4, seq=2048,
                           peer=["--model", "llama2-7b", "--mode", "lora"]),
}


def bench_case(name: str, spec: dict, warmup: int, steps: int) -> dict:
    cfg = load_config(None, [f"--model.preset={spec['preset']}", f"--train.mode={spec['mode']}",
                             f"--data.seq_len={spec['seq']}", "--data.pack=false", "--train.precision=bf16"])
    return {"case": name, "system": "tracetrain", **bench_train_step(cfg, spec["batch"], spec["seq"], warmup, steps)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--peer", default="", help="path to hf_peer.py; '' = skip the peer")
    ap.add_argument("--peer-liger", action="store_true", help="also run the peer with --liger")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    a = ap.parse_args()
    env = environment()
    rows = []
    for name in a.cases.split(","):
        spec = CASES[name]
        ours = bench_case(name, spec, a.warmup, a.steps)
        rows.append(ours)
        print(f"{name}: tracetrain {ours['tokens_per_s']:,.0f} tok/s, {ours['peak_gib']:.1f} GiB", flush=True)
        variants = [[]] + ([["--liger"]] if a.peer_liger else [])
        for extra in variants if a.peer else []:
            peer = run_peer(Path(a.peer), [*spec["peer"], "--batch", str(spec["batch"]), "--seq", str(spec["seq"]),
                                           "--steps", str(a.steps), "--warmup", str(a.warmup), *extra])
            peer.update({"case": name, "system": peer.get("peer", "peer" + "".join(extra))})
            if "tokens_per_s" in peer:
                peer["ratio_tracetrain_over_peer"] = ours["tokens_per_s"] / peer["tokens_per_s"]
            rows.append(peer)
            print(f"{name}: {peer['system']} {peer.get('tokens_per_s', peer.get('error'))}", flush=True)
    print(f"\n{'case':<18} {'system':<16} {'tok/s':>9} {'TFLOP/s':>8} {'MFU':>6} {'GiB':>6} {'ours/peer':>9}")
    for r in rows:
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") else "-"
        ratio = f"{r['ratio_tracetrain_over_peer']:.2f}" if r.get("ratio_tracetrain_over_peer") else ""
        print(f"{r['case']:<18} {r['system']:<16} {r.get('tokens_per_s', 0):>9,.0f} {r.get('tflops', 0):>8.1f} "
              f"{mfu:>6} {r.get('peak_gib', 0):>6.1f} {ratio:>9}")
    gpu = env["device"].replace(" ", "-").replace("/", "-")
    out = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    write_result(f"train_speed_{gpu}.json", {**env, "rows": rows}, out)


if __name__ == "__main__":
    main()
