"""LoRA DPO on one GPU: tracetrain's step next to TRL's DPOTrainer (HF transformers + PEFT), same call (#30).

Llama-2-7B shape, random weights, LoRA r=16 on q/k/v/o, bf16, DPO sigmoid loss (beta 0.1) with the
reference = the base with the adapters off (both systems: no second copy). Synthetic pairs: a prompt of
--prompt tokens and chosen / rejected completions of --completion tokens each (fixed lengths: no
padding in either system), --pairs pairs per step.

Ours: the run `tracetrain train` assembles for `data.kind = "preference"`, `train.objective = "dpo"`
(`resolve` + `assemble`: compile, FlexAttention with the document mask, since each pair shares one row
of 2 * (prompt + completion) tokens, packed by the real packer), timed on the real `train_step`.
TRL: benchmarks/peers/trl_dpo.py in its own process after ours (PYTHONPATH = the carried peersite with
TRL 1.15), gradient checkpointing off for both. tokens/s counts the tokens of the step's sequences
(2 * pairs * (prompt + completion)) for both; median step time after warm-up.

  tar xzf .peers/peersite.tgz -C /tmp
  PYTHONPATH=. python3 benchmarks/dpo.py --peersite /tmp/peersite

Writes dpo_<gpu>.json under $OUT (or benchmarks/results/): one row per system with the call's stamp.
Runs in about 4 minutes on one H200 (7B random init twice, compile, 13 steps each).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment

REPO = Path(__file__).resolve().parents[1]


def pair_rows(pairs: int, prompt: int, completion: int, vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """`pairs` rows of one (chosen, rejected) pair each, built by the packer preference data goes through."""
    from tracetrain.data.packing import compact_document, iter_packed_rows

    g = torch.Generator().manual_seed(seed)
    docs = []
    for _ in range(2 * pairs):
        ids = torch.randint(2, vocab, (prompt + completion,), generator=g).tolist()
        docs.append(compact_document(ids, [False] * prompt + [True] * completion))
    seq = 2 * (prompt + completion)
    return next(iter_packed_rows(docs, seq, pad_id=0, pack=True, chunk_rows=pairs, group=2))


def ours(pairs: int, prompt: int, completion: int, warmup: int, steps: int, preset: str = "llama2-7b") -> dict:
    from tracetrain.config import load_config
    from tracetrain.spec import resolve
    from tracetrain.train.assemble import assemble, run_step_context
    from tracetrain.train.step import train_step

    seq = 2 * (prompt + completion)
    cuda = torch.cuda.is_available()
    cfg = load_config(
        None,
        [
            f"--model.preset={preset}",
            "--train.mode=lora",
            "--train.objective=dpo",
            "--data.kind=preference",
            "--data.path=unused-synthetic-pairs.jsonl",
            f"--data.seq_len={seq}",
            f"--train.micro_batch_size={pairs}",
            "--optim.lr=1e-4",
            "--preference.beta=0.1",
        ],
    )
    spec = resolve(cfg, torch.device("cuda" if cuda else "cpu"))
    built = assemble(spec)
    ctx = run_step_context(built)
    batch = pair_rows(pairs, prompt, completion, spec.model_args.vocab_size)
    if cuda:
        batch = {k: v.pin_memory() for k, v in batch.items()}
        torch.cuda.reset_peak_memory_stats()
    times, losses, accuracy = [], [], []
    for i in range(warmup + steps):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = train_step(built.module, built.optimizer, [batch], ctx)
        losses.append(float(out.loss))  # waits for the step: its wall time, as the peer's is measured
        accuracy.append(float(out.stats["reward_accuracy"]))
        if i >= warmup:
            times.append(time.perf_counter() - start)
    step_s = statistics.median(times)
    tokens = 2 * pairs * (prompt + completion)
    row = {
        "system": "tracetrain",
        "case": "llama2-7b-lora-dpo",
        "pairs": pairs,
        "prompt": prompt,
        "completion": completion,
        "tokens_per_step": tokens,
        "step_s_median": step_s,
        "step_s_all": times,
        "tokens_per_s": tokens / step_s,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "losses": losses,
        "reward_accuracy": accuracy,
        "attention": spec.attention,
        "compile": spec.compile,
        "reference": spec.reference,
    }
    del built, ctx, batch
    import gc

    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return row


def trl_peer(a: argparse.Namespace) -> dict:
    cmd = [
        sys.executable,
        str(REPO / "benchmarks" / "peers" / "trl_dpo.py"),
        "--pairs",
        str(a.pairs),
        "--prompt",
        str(a.prompt),
        "--completion",
        str(a.completion),
        "--warmup",
        str(a.warmup),
        "--steps",
        str(a.steps),
    ]
    env = {**os.environ, "PYTHONPATH": a.peersite, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=a.peer_timeout_s, cwd=REPO)
    except subprocess.TimeoutExpired:
        return {"system": "trl", "error": f"timed out after {a.peer_timeout_s:.0f} s"}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"system": "trl", "error": f"exit {proc.returncode}: {(proc.stderr or proc.stdout)[-2000:]}"}
    out = json.loads(lines[-1])
    return {"system": out.pop("peer"), **out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--completion", type=int, default=512)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--peersite", default="/tmp/peersite")
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--peer-timeout-s", type=float, default=240)
    ap.add_argument("--cpu-test", action="store_true", help="the tiny preset on the CPU, no peer: checks the script")
    a = ap.parse_args()
    if a.cpu_test:
        a.no_peer = True
    env = environment()
    call = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    stamp = {
        "date": env["date"],
        "commit": env["commit"],
        "torch": torch.__version__,
        "call": call,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
    }
    rows = []
    try:
        preset = "tiny" if a.cpu_test else "llama2-7b"
        rows.append({**ours(a.pairs, a.prompt, a.completion, a.warmup, a.steps, preset), **stamp})
    except Exception as e:  # recorded; the peer still runs
        rows.append({"system": "tracetrain", "error": f"{type(e).__name__}: {str(e)[:500]}", **stamp})
    print(json.dumps(rows[-1])[:600], flush=True)
    if not a.no_peer:
        rows.append({**trl_peer(a), "call": call, "commit": env["commit"], "date": env["date"]})
        print(json.dumps(rows[-1])[:600], flush=True)
    print(f"\n{'system':40} {'tokens/s':>10} {'step s':>8} {'peak GiB':>9}")
    for r in rows:
        if r.get("tokens_per_s"):
            print(
                f"{r['system'][:40]:40} {r['tokens_per_s']:10,.0f} {r['step_s_median']:8.3f} {r['peak_gib'] or 0:9.1f}"
            )
        else:
            print(f"{r['system'][:40]:40} error: {r.get('error', '')[:200]}")
    if len(rows) == 2 and rows[0].get("tokens_per_s") and rows[1].get("tokens_per_s"):
        print(f"tracetrain / TRL: {rows[0]['tokens_per_s'] / rows[1]['tokens_per_s']:.2f}x (goal >= 1.5x)")
    if a.cpu_test:
        return
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else REPO / "benchmarks" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"dpo_{stamp['device'].replace(' ', '-')}.json"
    kept = json.loads(path.read_text()) if path.is_file() else []
    path.write_text(json.dumps(kept + rows, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
