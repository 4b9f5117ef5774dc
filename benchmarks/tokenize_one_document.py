"""Peak host memory of tokenising one large document: tinyshakespeare repeated to about 40 MB with no
`<|endoftext|>` line, built into rows as `train` builds them (`build_datasets`), each code version in a
fresh Python process (the child and the columns of tokenize_memory.py).

Before pieces, the whole document went to the Hugging Face tokenizer in one call; now it goes a piece of
about 1 MB at a time (data/tokenizer.py). Equal row hashes mean bit-identical training data.

  python3 benchmarks/tokenize_one_document.py [--mb 40] [--tokenizers gpt2,byte] [--repo PATH]...

`--repo` (repeatable) measures another checkout too, e.g. `git archive HEAD tracetrain | tar -x -C DIR`.
Run it from outside the checkout (`cd /tmp && python3 /path/to/benchmarks/...`): `python -c` puts the
current folder first on sys.path, ahead of the PYTHONPATH that selects each checkout.
Writes benchmarks/results/tokenize_one_document.json.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, write_result
from tokenize_memory import GPT2, measure, print_row

REPO = Path(__file__).resolve().parents[1]
SHAKESPEARE = REPO.parent / "shared" / "data" / "tinyshakespeare.txt"


def write_document(path: Path, mb: float) -> int:
    """tinyshakespeare repeated (a blank line between copies) to at least `mb` MB; returns its bytes."""
    text = SHAKESPEARE.read_text(encoding="utf-8").rstrip("\n") + "\n\n"
    copies = -(-int(mb * 1e6) // len(text.encode("utf-8")))
    path.write_text(text * copies, encoding="utf-8")
    return path.stat().st_size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=40.0, help="document size in MB")
    ap.add_argument("--tokenizers", default="gpt2,byte")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--repo", action="append", default=[], help="another checkout to measure (repeatable)")
    args = ap.parse_args()
    repos = [REPO] + [Path(r).resolve() for r in args.repo]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "one_document.txt"
        size = write_document(corpus, args.mb)
        for tokenizer in [t for t in args.tokenizers.split(",") if t]:
            spec = str(GPT2) if tokenizer == "gpt2" else tokenizer
            for repo in repos:
                row = {"layout": "one", "corpus_mb": size / 1e6, "tokenizer": tokenizer, "repo": str(repo)}
                row.update(measure(repo, corpus, spec, args.seq_len))
                rows.append(row)
                print_row(row)
    write_result("tokenize_one_document.json", {"env": environment(), "seq_len": args.seq_len, "rows": rows})


if __name__ == "__main__":
    main()
