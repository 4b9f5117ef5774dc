"""Peak host memory and time of building the training rows of a large instruction or chat dataset: the
data path as `train` builds it (`build_datasets`), each build in a fresh Python process so that its peak
is its own. The record-file sibling of tokenize_memory.py (text corpora).

The data is generated here from a fixed word list (seeded), never committed: `chat` is a JSONL file of
conversations ({"messages": [system?, user, assistant, ...]}, 1-3 user/assistant turns of varying
lengths, rendered with the built-in `chatml` template), `instruction` a JSONL file of Dolly-style rows
({"instruction", "context", "response", "category"}, the default `alpaca` prompt template).

Each case is built twice in one cache folder (`build_datasets(..., cache_dir=...)` where it takes that
keyword): `first` builds from the data file, `second` runs in a new process against the same folder, so
it shows whether the rows are reused (a kind without a row cache simply tokenises again).

Columns: peak RSS (VmHWM: everything resident, file-backed pages of memory-mapped row files included),
RSS before the build (VmHWM after importing tracetrain and loading the tokenizer), anonymous RSS at the
end (RssAnon: what the process holds that the kernel cannot drop), build seconds, training tokens, rows
(train + eval), the size of the cache folder after the build, and a hash of the four row arrays of both
splits (values as int64, so a change of storage dtype alone does not change it): equal hash =
bit-identical training data, across the two builds and across code versions.

  python3 benchmarks/tokenize_records.py [--kind chat,instruction] [--mb 40] [--tokenizers byte,gpt2]
                                         [--seq-len 1024] [--repo PATH]... [--out NAME]

`--repo` (repeatable) measures other checkouts too, e.g. an exported older commit
(`git archive <commit> | tar x -C /tmp/old`), in the same table.
Writes benchmarks/results/tokenize_records.json (`--out`).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, write_result
from tokenize_memory import WORDS  # the text-corpus benchmark's word list

REPO = Path(__file__).resolve().parents[1]
GPT2 = REPO.parent / "shared" / "data" / "gpt2_tokenizer.json"
CATEGORIES = ["open_qa", "closed_qa", "general_qa", "summarization", "information_extraction", "brainstorming"]
KINDS = ("chat", "instruction")
BUILDS = ("first", "second")

# Runs in the child: build the data as the trainer does, report the peak before anything else reads the rows.
CHILD = r"""
import hashlib, inspect, json, os, sys, time
import numpy as np
import tracetrain
from tracetrain.config import DataSection
from tracetrain.data import build_datasets, load_tokenizer

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024  # kB -> MiB

def folder_mib(folder):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(folder) for f in fs) / 2**20

kind, path, tokenizer, seq_len, cache_dir = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
tok = load_tokenizer(tokenizer)
extra = {"chat_template": "chatml"} if kind == "chat" else {}
data = DataSection(kind=kind, path=path, seq_len=seq_len, eval_fraction=0.01, tokenizer=tokenizer, pack=True, **extra)
kwargs = {}
if "cache_dir" in inspect.signature(build_datasets).parameters:
    kwargs["cache_dir"] = cache_dir
before = status("VmHWM")
start = time.perf_counter()
train, eval_, stats = build_datasets(data, tok, **kwargs)
seconds = time.perf_counter() - start
peak, anon = status("VmHWM"), status("RssAnon")
h = hashlib.blake2b(digest_size=8)
dtypes = {}
for ds in (train, eval_):
    for key in ("input_ids", "labels", "position_ids", "document_ids"):
        rows = ds.rows[key]
        dtypes[key] = str(rows.dtype)
        for start_row in range(0, len(rows), 4096):
            chunk = rows[start_row : start_row + 4096]
            chunk = chunk.numpy() if hasattr(chunk, "numpy") else np.asarray(chunk)
            h.update(np.ascontiguousarray(chunk, dtype=np.int64).tobytes())
print(json.dumps({"peak_rss_mib": peak, "start_rss_mib": before, "rss_anon_mib": anon, "seconds": seconds,
                  "tokens": stats.train_tokens, "rows": stats.train_sequences + stats.eval_sequences,
                  "rows_hash": h.hexdigest(), "cache_dir_passed": "cache_dir" in kwargs,
                  "cache_mib": folder_mib(cache_dir), "row_dtypes": dtypes, "stats": stats.as_dict(),
                  "module": os.path.dirname(os.path.dirname(os.path.abspath(tracetrain.__file__)))}))
"""


def _text(rng: random.Random, lo: int, hi: int) -> str:
    """lo..hi words from WORDS, 14 to a line."""
    words = rng.choices(WORDS, k=rng.randint(lo, hi))
    return "\n".join(" ".join(words[i : i + 14]) for i in range(0, len(words), 14))


def _answer(rng: random.Random) -> str:
    """Mostly short to medium answers, one in twenty long (past seq_len for the byte tokenizer)."""
    return _text(rng, 200, 800) if rng.random() < 0.05 else _text(rng, 5, 120)


def conversation(rng: random.Random) -> dict:
    messages = [{"role": "system", "content": _text(rng, 5, 40)}] if rng.random() < 0.4 else []
    for _ in range(rng.randint(1, 3)):
        messages.append({"role": "user", "content": _text(rng, 3, 40)})
        messages.append({"role": "assistant", "content": _answer(rng)})
    return {"messages": messages}


def instruction(rng: random.Random) -> dict:
    return {
        "instruction": _text(rng, 4, 40),
        "context": _text(rng, 20, 300) if rng.random() < 0.4 else "",
        "response": _answer(rng),
        "category": rng.choice(CATEGORIES),
    }


def write_records(path: Path, mb: float, kind: str, seed: int = 0) -> tuple[int, int]:
    """A JSONL file of about `mb` MB of `kind` records; returns (bytes, records)."""
    rng = random.Random(seed)
    make = conversation if kind == "chat" else instruction
    target = int(mb * 1e6)
    written = records = 0
    with open(path, "w", encoding="utf-8") as f:
        while written < target:
            line = json.dumps(make(rng), ensure_ascii=False) + "\n"
            f.write(line)
            written += len(line.encode("utf-8"))
            records += 1
    return written, records


def measure(repo: Path, kind: str, data: Path, tokenizer: str, seq_len: int, cache: Path) -> dict:
    # cwd = repo: a `-c` child puts its working folder first on sys.path, ahead of PYTHONPATH.
    env = {**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, kind, str(data), tokenizer, str(seq_len), str(cache)],
        capture_output=True,
        text=True,
        env=env,
        cwd=repo,
    )
    if proc.returncode != 0:
        lines = (proc.stderr or proc.stdout).strip().splitlines()
        return {"error": lines[-1] if lines else f"exit status {proc.returncode}"}
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if Path(result["module"]).resolve() != repo.resolve():
        return {"error": f"imported tracetrain from {result['module']}, not {repo}"}
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kind", default="chat,instruction", help="chat, instruction or both (comma-separated)")
    ap.add_argument("--mb", type=float, default=40.0, help="JSONL size in MB")
    ap.add_argument("--tokenizers", default="byte,gpt2")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--repo", action="append", default=[], help="another checkout to measure (repeatable)")
    ap.add_argument("--out", default="tokenize_records.json", help="result file name under benchmarks/results")
    args = ap.parse_args()
    kinds = [k for k in args.kind.split(",") if k]
    for kind in kinds:
        if kind not in KINDS:
            ap.error(f"--kind {kind!r}: expected {' or '.join(KINDS)}")
    repos = [REPO] + [Path(r).resolve() for r in args.repo]
    for repo in repos[1:]:
        if not (repo / "tracetrain" / "__init__.py").is_file():
            ap.error(f"--repo {repo}: not a tracetrain checkout (no tracetrain/__init__.py)")
    tokenizers = [t for t in args.tokenizers.split(",") if t]
    if "gpt2" in tokenizers and not GPT2.is_file():
        print(f"skipping gpt2: {GPT2} not present")
        tokenizers.remove("gpt2")
    rows = []
    with tempfile.TemporaryDirectory(prefix="tokrecords-") as tmp:
        for kind in kinds:
            data = Path(tmp) / f"{kind}.jsonl"
            size, records = write_records(data, args.mb, kind)
            print(f"{kind}: {records:,} records, {size / 1e6:.1f} MB of JSONL")
            for tokenizer in tokenizers:
                spec = str(GPT2) if tokenizer == "gpt2" else tokenizer
                for i, repo in enumerate(repos):
                    cache = Path(tmp) / f"cache-{kind}-{tokenizer}-{i}"  # shared by the two builds only
                    cache.mkdir()
                    for build in BUILDS:
                        row = {
                            "kind": kind,
                            "data_mb": size / 1e6,
                            "records": records,
                            "tokenizer": tokenizer,
                            "build": build,
                            "repo": str(repo),
                        }
                        row.update(measure(repo, kind, data, spec, args.seq_len, cache))
                        rows.append(row)
                        print_row(row)
    print_agreement(rows)
    payload = {"env": environment(), "mb": args.mb, "seq_len": args.seq_len, "rows": rows}
    print(f"wrote {write_result(args.out, payload)}")


def print_row(r: dict) -> None:
    if not hasattr(print_row, "header"):
        print_row.header = True  # type: ignore[attr-defined]
        print(
            f"{'kind':<11} {'MB':>5} {'tokenizer':<9} {'build':<6} {'peak MiB':>9} {'start MiB':>9} "
            f"{'anon MiB':>9} {'s':>6} {'tokens':>11} {'rows':>7} {'cache MiB':>9} {'rows hash':<16} repo"
        )
    head = f"{r['kind']:<11} {r['data_mb']:>5.1f} {r['tokenizer']:<9} {r['build']:<6}"
    if "error" in r:
        print(f"{head} error: {r['error']}  {r['repo']}")
        return
    print(
        f"{head} {r['peak_rss_mib']:>9.0f} {r['start_rss_mib']:>9.0f} {r['rss_anon_mib']:>9.0f} "
        f"{r['seconds']:>6.1f} {r['tokens']:>11,} {r['rows']:>7,} {r['cache_mib']:>9.1f} {r['rows_hash']:<16} "
        f"{r['repo']}"
    )


def print_agreement(rows: list[dict]) -> None:
    """Whether every build (both builds, every repo) of a kind and tokenizer gave the same rows."""
    cases: dict[tuple[str, str], set[str]] = {}
    for r in rows:
        if "rows_hash" in r:
            cases.setdefault((r["kind"], r["tokenizer"]), set()).add(r["rows_hash"])
    for (kind, tokenizer), hashes in cases.items():
        verdict = "identical rows in every build" if len(hashes) == 1 else f"ROWS DIFFER: {', '.join(sorted(hashes))}"
        print(f"{kind} / {tokenizer}: {verdict}")


if __name__ == "__main__":
    main()
