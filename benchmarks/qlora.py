"""QLoRA on one GPU: tracetrain's NF4 base next to unsloth's 4-bit (bitsandbytes), llama3-8b and llama3-70b (#30).

Our rows are tracetrain's real step on the run `tracetrain train` assembles with `lora.base_quant = "nf4"`
(random weights: each projection drawn and quantised one at a time, so 70B fits one GPU), LoRA r=16 on every
projection (unsloth's usual setting), unpacked rows of random tokens, as the peers train; the planner's
prediction for the same config sits beside each row. The peer is benchmarks/peers/unsloth_qlora_peer.py:
unsloth's `load_in_4bit` (NF4 with double quantisation) on a pre-quantised random checkpoint of the same
shape, with the same rank, targets, batch and length. Each row runs in its own process, one after the
other, on the same GPU; every row: median step time of 10 timed steps after warm-up (CUDA events), and the
allocator's peak over the timed steps.

Cases: 8b = llama3-8b, batch 4 x 2048, no recomputation (unsloth: no gradient checkpointing), as the 7B
LoRA peers rows; 70b = llama3-70b, batch 2 x 2048 (as the 8B full-fine-tuning peers row), every block
recomputed (tracetrain memory.recompute = full, unsloth's gradient checkpointing 'true'; its 'unsloth' mode,
which also offloads the checkpoints to the host, is the `--unsloth-gc-70b unsloth` variant).

  tar xzf .peers/peersite.tgz -C /tmp          # or let the script do it (it looks for .peers/peersite.tgz)
  PYTHONPATH=. python3 benchmarks/qlora.py                     # 8b and 70b, ours and unsloth: ~6-7 minutes
  PYTHONPATH=. python3 benchmarks/qlora.py --cases 8b --no-peer
  PYTHONPATH=. python3 benchmarks/qlora.py --cases 8b,8b-bf16 --no-peer     # what the 4-bit base costs us
  PYTHONPATH=. python3 benchmarks/qlora.py --cases 8b,8b-saved --no-peer   # memory.recompute_pointwise on / off
  PYTHONPATH=. python3 benchmarks/qlora.py --cases 70b-offload   # streamed offload vs unsloth's gc "unsloth"

Writes qlora_<gpu>.json under $OUT (when set) or benchmarks/results/, rows of earlier calls kept with their
own `call` stamp, so ratios are read within one call.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, last_json_line, median  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CASES = {
    "8b": dict(preset="llama3-8b", batch=4, seq=2048, recompute="none", unsloth_gc="false", warmup=3),
    "70b": dict(preset="llama3-70b", batch=2, seq=2048, recompute="full", unsloth_gc="true", warmup=2),
    # Our own bf16-base LoRA of the 8b case (no peer): what the 4-bit base costs in speed and saves in memory.
    "8b-bf16": dict(preset="llama3-8b", batch=4, seq=2048, recompute="none", unsloth_gc="", warmup=3, quant="none"),
    # The 8b case with memory.recompute_pointwise = "off" (the default for a 4-bit base is on: compiled blocks
    # recompute the adapters' pointwise inputs in backward): what the switch costs and saves (no peer).
    "8b-saved": dict(preset="llama3-8b", batch=4, seq=2048, recompute="none", unsloth_gc="", warmup=3, pointwise="off"),
    # The 70b case with the checkpointed block inputs streamed to pinned host memory (memory.activation_offload
    # = streamed), next to unsloth's gradient checkpointing "unsloth", which also offloads them to the host.
    "70b-offload": dict(preset="llama3-70b", batch=2, seq=2048, recompute="full", unsloth_gc="unsloth", warmup=2,
                        offload="streamed"),
}


def ours(case: str, steps: int, targets: str) -> dict:
    """One tracetrain QLoRA row (run in a child process: its own compile caches and GPU memory)."""
    import torch

    from speed_checks import unpacked_batch
    from tracetrain.config import load_config
    from tracetrain.plan import plan, plan_input_from_config
    from tracetrain.spec import resolve
    from tracetrain.train.assemble import assemble, run_step_context
    from tracetrain.train.step import train_step

    c = CASES[case]
    quant = c.get("quant", "nf4")
    cfg = load_config(None, [f"--model.preset={c['preset']}", "--train.mode=lora", f"--lora.base_quant={quant}",
                             f"--lora.targets={targets}", "--lora.rank=16", "--lora.alpha=32",
                             f"--data.seq_len={c['seq']}", f"--train.micro_batch_size={c['batch']}",
                             "--train.precision=bf16", "--train.compile=on", "--train.attention=sdpa",
                             f"--memory.recompute={c['recompute']}", "--optim.lr=1e-4",
                             f"--memory.recompute_pointwise={c.get('pointwise', 'auto')}",
                             f"--memory.activation_offload={c.get('offload', 'none')}"])
    predicted = plan(plan_input_from_config(cfg, 1, torch.cuda.get_device_name(0)))
    t0 = time.time()
    spec = resolve(cfg, torch.device("cuda"))
    built = assemble(spec)
    torch.cuda.synchronize()
    build_s = time.time() - t0
    model, opt = built.module, built.optimizer
    ctx = dataclasses.replace(run_step_context(built), use_document_mask=False)  # one document per row
    batch = {k: v.pin_memory() for k, v in unpacked_batch(c["batch"], c["seq"], model.args.vocab_size).items()}
    t0 = time.time()
    for _ in range(c["warmup"]):
        loss = train_step(model, opt, [batch], ctx).loss
    torch.cuda.synchronize()
    warmup_s = time.time() - t0
    torch.cuda.reset_peak_memory_stats()  # as the peer: the timed steps' peak
    times = []
    for _ in range(steps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        loss = train_step(model, opt, [batch], ctx).loss
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    step_s = median(times)
    base_bytes = sum(b.numel() * b.element_size() for n, b in model.named_buffers() if ".codes" in n or ".scaler" in n)
    return {"system": "tracetrain", "model": c["preset"], "mode": "qlora" if quant == "nf4" else "lora", "targets": targets,
            "batch": c["batch"], "seq": c["seq"], "recompute": c["recompute"],
            "recompute_pointwise": spec.recompute_pointwise, "activation_offload": c.get("offload", "none"),
            "step_s_median": step_s,
            "step_s_all": times, "tokens_per_s": c["batch"] * c["seq"] / step_s, "loss": float(loss),
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30, "nf4_base_gib": base_bytes / 2**30,
            "plan_peak_gib": predicted.peak_gib, "plan_step_s": predicted.step_s, "build_s": build_s,
            "warmup_s": warmup_s}


def child(args: list[str], env: dict[str, str], timeout_s: float) -> dict:
    try:
        proc = subprocess.run(args, capture_output=True, text=True, env=env, timeout=timeout_s, cwd=REPO)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f} s"}
    out = last_json_line(proc.stdout)
    if out is not None:
        return out
    return {"error": f"exit {proc.returncode}: {(proc.stderr or proc.stdout)[-1500:]}"}


def peersite(path: str) -> str | None:
    """The peers' packages: `path` if unpacked there, else .peers/peersite.tgz unpacked next to it."""
    if Path(path).is_dir():
        return path
    tgz = REPO / ".peers" / "peersite.tgz"
    if not tgz.is_file():
        return None
    with tarfile.open(tgz) as t:
        t.extractall(Path(path).parent, filter="data")  # holds the folder `peersite`
    return path if Path(path).is_dir() else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default="8b,70b", help=f"comma-separated: {', '.join(CASES)}")
    ap.add_argument("--targets", default="all-linear", help="all-linear, or q_proj,k_proj,v_proj,o_proj")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--no-peer", action="store_true", help="tracetrain rows only")
    ap.add_argument("--unsloth-gc-70b", default=CASES["70b"]["unsloth_gc"], help="false | true | unsloth")
    ap.add_argument("--peersite", default="/tmp/peersite")
    ap.add_argument("--timeout-s", type=float, default=330, help="per row (a hung peer must not eat the call)")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:  # one of our rows, in its own process
        print(json.dumps(ours(a.child, a.steps, a.targets)), flush=True)
        return
    import torch

    env = environment()
    call = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    stamp = {"date": env["date"], "commit": env["commit"], "torch": torch.__version__, "call": call,
             "device": torch.cuda.get_device_name(0)}
    site = None if a.no_peer else peersite(a.peersite)
    own_path = os.pathsep.join([str(REPO), *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]])
    own_env = {**os.environ, "PYTHONPATH": own_path}  # the peers' packages stay off our rows' path
    rows: list[dict] = []
    t_start = time.time()
    for case in [c for c in a.cases.split(",") if c]:
        c = CASES[case]
        out = child([sys.executable, __file__, "--child", case, "--steps", str(a.steps), "--targets", a.targets],
                    own_env, a.timeout_s)
        kind = ("qlora" if c.get("quant", "nf4") == "nf4" else "lora-bf16") + ("-saved" if c.get("pointwise") else "")
        kind += "-offload" if c.get("offload") else ""
        rows.append({"system": "tracetrain", "case": f"{c['preset']}-{kind}", **out, **stamp})
        print(f"tracetrain {case}: {out.get('tokens_per_s', out.get('error'))}", flush=True)
        save(rows)  # after every row: a call cut short keeps what it measured
        if site is None or not c["unsloth_gc"]:
            continue
        gc_mode = a.unsloth_gc_70b if case == "70b" else c["unsloth_gc"]
        tgt = "all-linear" if a.targets == "all-linear" else "qkvo"
        out = child([sys.executable, str(REPO / "benchmarks" / "peers" / "unsloth_qlora_peer.py"), c["preset"],
                     str(c["batch"]), str(c["seq"]), gc_mode, tgt], {**os.environ, "PYTHONPATH": site}, a.timeout_s)
        rows.append({"system": out.get("peer", "unsloth 4-bit"), "case": f"{c['preset']}-{kind}", **out, **stamp})
        print(f"unsloth {case}: {out.get('tokens_per_s', out.get('error'))}", flush=True)
        save(rows)
    if not a.no_peer and site is None:
        print("no peers: neither --peersite nor .peers/peersite.tgz exists", flush=True)
    report(rows)
    print(f"whole call: {time.time() - t_start:.0f} s")
    print(f"wrote {save(rows)}")


def save(rows: list[dict]) -> Path:
    """This call's rows after the earlier calls' rows of qlora_<gpu>.json (rewritten whole, atomically)."""
    import torch

    device = torch.cuda.get_device_name(0).replace(" ", "-")
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else REPO / "benchmarks" / "results"
    path = out_dir / f"qlora_{device}.json"
    kept = [r for r in json.loads(path.read_text()) if r.get("call") != rows[0].get("call")] if path.is_file() else []
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(kept + rows, indent=1) + "\n")
    tmp.replace(path)
    return path


def report(rows: list[dict]) -> None:
    print(f"\n{'system':<28} {'case':<20} {'tokens/s':>9} {'peak GiB':>9} {'plan GiB':>9}")
    for r in rows:
        tps, peak, plan_gib = r.get("tokens_per_s"), r.get("peak_gib"), r.get("plan_peak_gib")
        print(f"{r['system']:<28} {r['case']:<20} {tps or 0:>9,.0f} {peak or 0:>9.1f} "
              f"{plan_gib if plan_gib is not None else float('nan'):>9.1f}  {r.get('error', '')[:100]}")
    print("\nratios in this call (tracetrain / unsloth, same case): tokens/s, peak memory")
    for r in rows:
        if r["system"] != "tracetrain" or not r.get("tokens_per_s"):
            continue
        for p in rows:
            if p["system"] != "tracetrain" and p["case"] == r["case"] and p.get("tokens_per_s"):
                print(f"  {r['case']:<20} {r['tokens_per_s'] / p['tokens_per_s']:.2f}x tokens/s, "
                      f"{r['peak_gib'] / p['peak_gib']:.2f}x memory (goal >= 1.1x at <= 1.0x)")


if __name__ == "__main__":
    main()
