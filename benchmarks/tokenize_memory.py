"""Peak host memory of tokenising a large text corpus (issue #18 part 4): the text data path as `train`
builds it (`build_datasets`), each case in a fresh Python process so that its peak is its own.

The corpus is generated here from a fixed word list (seeded), never committed: `docs` is many documents
separated by `<|endoftext|>` lines, `one` is a single document of the same size (no separators).

Columns: peak RSS (VmHWM: everything resident, file-backed pages of the memory-mapped token arrays
included), anonymous RSS at the end (RssAnon: what the process holds that the kernel cannot drop),
build seconds, tokens, rows, and a hash of the four row arrays, so that the rows of two code versions
can be compared (equal hash = bit-identical training data).

  python3 benchmarks/tokenize_memory.py [--mb 40] [--tokenizers byte,gpt2] [--layouts docs,one]
                                        [--seq-len 1024] [--repo PATH]...

`--repo` (repeatable) measures other checkouts too, e.g. an exported older commit, in the same table.
Writes benchmarks/results/tokenize_memory.json.
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
from common import environment, write_result  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
GPT2 = REPO.parent / "shared" / "data" / "gpt2_tokenizer.json"
WORDS = (
    "the of and to in is was that for on as with by he at from his an were are which this be or has had "
    "not but first one their its new after who they have her she two been other when there all during into "
    "school time may years more most only over city some world would where later up such used many can state "
    "about national out known university united then made river ancient orbit quartz Zürich naïve 3.14 1984"
).split()

# Runs in the child: build the data as the trainer does, report the peak before anything else reads the rows.
CHILD = r"""
import hashlib, inspect, json, sys, tempfile, time
import numpy as np
from tracetrain.config import DataSection
from tracetrain.data import build_datasets, load_tokenizer

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024  # kB -> MiB

path, tokenizer, seq_len = sys.argv[1], sys.argv[2], int(sys.argv[3])
tok = load_tokenizer(tokenizer)
data = DataSection(kind="text", path=path, seq_len=seq_len, eval_fraction=0.01, tokenizer=tokenizer)
kwargs = {}
if "cache_dir" in inspect.signature(build_datasets).parameters:
    kwargs["cache_dir"] = tempfile.mkdtemp(prefix="tokcache-")
start = time.perf_counter()
train, eval_, stats = build_datasets(data, tok, **kwargs)
seconds = time.perf_counter() - start
peak, anon = status("VmHWM"), status("RssAnon")
h = hashlib.blake2b(digest_size=8)
for ds in (train, eval_):
    for key in ("input_ids", "labels", "position_ids", "document_ids"):
        rows = ds.rows[key]
        for start_row in range(0, len(rows), 4096):
            h.update(np.ascontiguousarray(rows[start_row : start_row + 4096].numpy()).tobytes())
print(json.dumps({"peak_rss_mib": peak, "rss_anon_mib": anon, "seconds": seconds, "tokens": stats.train_tokens,
                  "rows": stats.train_sequences + stats.eval_sequences, "rows_hash": h.hexdigest()}))
"""


def write_corpus(path: Path, mb: float, layout: str, seed: int = 0) -> int:
    """A text corpus of about `mb` MB: many documents (`docs`) or one (`one`); returns its size in bytes."""
    rng = random.Random(seed)
    target = int(mb * 1e6)
    written = 0
    with open(path, "w", encoding="utf-8") as f:
        while written < target:
            words = rng.choices(WORDS, k=rng.randint(100, 3000))
            lines = [" ".join(words[i : i + 14]) for i in range(0, len(words), 14)]
            text = "\n".join(lines) + ("\n<|endoftext|>\n" if layout == "docs" else "\n\n")
            f.write(text)
            written += len(text.encode("utf-8"))
    return written


def measure(repo: Path, corpus: Path, tokenizer: str, seq_len: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(corpus), tokenizer, str(seq_len)], capture_output=True, text=True, env=env
    )
    if proc.returncode != 0:
        return {"error": (proc.stderr or proc.stdout).strip().splitlines()[-1]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=40.0, help="corpus size in MB")
    ap.add_argument("--tokenizers", default="byte,gpt2")
    ap.add_argument("--layouts", default="docs,one")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--repo", action="append", default=[], help="another checkout to measure (repeatable)")
    ap.add_argument("--out", default="tokenize_memory.json", help="result file name under benchmarks/results")
    args = ap.parse_args()
    repos = [REPO] + [Path(r).resolve() for r in args.repo]
    tokenizers = [t for t in args.tokenizers.split(",") if t]
    if "gpt2" in tokenizers and not GPT2.is_file():
        print(f"skipping gpt2: {GPT2} not present")
        tokenizers.remove("gpt2")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for layout in args.layouts.split(","):
            corpus = Path(tmp) / f"corpus_{layout}.txt"
            size = write_corpus(corpus, args.mb, layout)
            for tokenizer in tokenizers:
                spec = str(GPT2) if tokenizer == "gpt2" else tokenizer
                for repo in repos:
                    row = {"layout": layout, "corpus_mb": size / 1e6, "tokenizer": tokenizer, "repo": str(repo)}
                    row.update(measure(repo, corpus, spec, args.seq_len))
                    rows.append(row)
                    print_row(row)
    write_result(args.out, {"env": environment(), "seq_len": args.seq_len, "rows": rows})


def print_row(r: dict) -> None:
    if not hasattr(print_row, "header"):
        print_row.header = True  # type: ignore[attr-defined]
        print(f"{'layout':<6} {'MB':>5} {'tokenizer':<9} {'peak MiB':>9} {'anon MiB':>9} {'s':>6} "
              f"{'tokens':>11} {'rows':>7} {'rows hash':<16} repo")
    if "error" in r:
        print(f"{r['layout']:<6} {r['corpus_mb']:>5.1f} {r['tokenizer']:<9} error: {r['error']}  {r['repo']}")
        return
    print(f"{r['layout']:<6} {r['corpus_mb']:>5.1f} {r['tokenizer']:<9} {r['peak_rss_mib']:>9.0f} "
          f"{r['rss_anon_mib']:>9.0f} {r['seconds']:>6.1f} {r['tokens']:>11,} {r['rows']:>7,} "
          f"{r['rows_hash']:<16} {r['repo']}")


if __name__ == "__main__":
    main()
