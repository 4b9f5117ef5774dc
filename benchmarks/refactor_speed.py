"""Step time of the same runs built by two source trees: this checkout and an older one (issue #17: the
GPU speed rows must stay unchanged within noise after the assembly refactor).

Each (case, tree) runs in its own process (fresh GPU memory, fresh compile caches), trees alternating
within a case so that drift on a shared GPU hits both alike; each row is the median of `--steps` timed
steps after `--warmup` (benchmarks/common.py `bench_train_step` of that tree: the trainer's build path
and `train_step` on random full-length rows). Writes benchmarks/results/refactor_speed_<gpu>.json.

  git archive ee12c4c tracetrain benchmarks | tar -x -C .carry/old     # the older tree, carried
  python3 benchmarks/refactor_speed.py --old .carry/old --cases llama3.2-1b-full,llama2-7b-lora
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, write_result  # noqa: E402  # after the sys.path line

REPO = Path(__file__).resolve().parents[1]
CASES = {
    "llama3.2-1b-full": ["--model.preset=llama3.2-1b", "--train.mode=full"],
    "llama2-7b-lora": ["--model.preset=llama2-7b", "--train.mode=lora"],
}
CHILD = """
import json, sys
sys.path.insert(0, sys.argv[1] + "/benchmarks")
from common import bench_train_step
from tracetrain.config import load_config
cfg = load_config(None, json.loads(sys.argv[2]))
r = bench_train_step(cfg, int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]))
print("RESULT " + json.dumps({k: r[k] for k in ("step_s_median", "step_s_all", "tokens_per_s", "mfu", "peak_gib")}))
"""


def run(tree: Path, overrides: list[str], batch: int, seq: int, warmup: int, steps: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    proc = subprocess.run([sys.executable, "-c", CHILD, str(tree), json.dumps(overrides), str(batch), str(seq),
                           str(warmup), str(steps)], capture_output=True, text=True, env=env, cwd=tree)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        return {"error": (proc.stderr or proc.stdout)[-800:]}
    return json.loads(line[len("RESULT "):])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", required=True, help="folder holding the older tracetrain/ and benchmarks/")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    a = ap.parse_args()
    rows = []
    for case in a.cases.split(","):
        overrides = [*CASES[case], f"--data.seq_len={a.seq}", "--data.pack=false", "--train.precision=bf16"]
        got = {}
        for tree_name, tree in (("new", REPO), ("old", Path(a.old).resolve())):
            got[tree_name] = run(tree, overrides, a.batch, a.seq, a.warmup, a.steps)
            rows.append({"case": case, "tree": tree_name, **got[tree_name]})
            print(f"{case} {tree_name}: {got[tree_name].get('tokens_per_s', got[tree_name].get('error'))}", flush=True)
        if "tokens_per_s" in got["new"] and "tokens_per_s" in got["old"]:
            ratio = got["new"]["tokens_per_s"] / got["old"]["tokens_per_s"]
            rows.append({"case": case, "new_over_old_tokens_per_s": ratio})
            print(f"{case}: new / old tokens/s = {ratio:.3f}", flush=True)
    out = os.environ.get("OUT")
    env = environment()
    path = write_result(f"refactor_speed_{env['device'].replace(' ', '-')}.json",
                        {"env": env, "old_tree": a.old, "rows": rows}, Path(out) if out else None)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
