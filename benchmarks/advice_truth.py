"""The advice-truth corpus (issue #28): loops with one known problem, each beside its fixed twin, timed
unprofiled and recorded profiled, so that the analyzer's predicted gains can be checked against what
fixing each cause really gives back.

    python3 benchmarks/advice_truth.py [--out DIR] [--cases a,b] [--steps 20]

On a 2-GPU machine (torch 2.11+, no internet) the whole matrix takes a few minutes:
- single-GPU cases (benchmarks/advice_truth_cases.py) run in one worker process on GPU 0;
- two-rank cases (benchmarks/advice_truth_dist.py) run in one `torchrun --nproc-per-node=2` worker.
A case that raises is recorded with its error and the matrix goes on; a worker that dies (a hang past
the NCCL timeout, a crash) is restarted on the cases after the one it died in.

Writes, under `--out` (default `$OUT`, else tests/data/advice_truth):
- `<case>/rank{R}.json.gz`: the problem's (or control's) trace, a warm-up step and 2 recorded steps,
  and `rank{R}.timing.json` beside it: the unprofiled median, the real step time the analyzer reads;
- `<case>/fixed/rank{R}.json.gz`: the fixed twin's trace;
- `truth.json`: per case and variant the unprofiled step times (median of `--steps`), the realized
  gain `(problem - fixed) / problem`, the cause, and device, torch version, commit and date.
Then prints the table. `tests/analyze/test_advice_truth.py` reads the corpus.

`--tiny` shrinks every model to a toy and runs on the CPU (gloo for the two-rank cases): a smoke test
of the script itself, not a corpus.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
DEFAULT_OUT = HERE.parent / "tests" / "data" / "advice_truth"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path(os.environ["OUT"]) if os.environ.get("OUT") else DEFAULT_OUT)
    p.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    p.add_argument("--steps", type=int, default=20, help="unprofiled steps timed per variant")
    p.add_argument("--budget-s", type=float, default=560, help="stop starting workers after this long")
    p.add_argument("--tiny", action="store_true", help="toy sizes on the CPU: a smoke test of the script")
    p.add_argument("--worker", choices=["single", "dist"], help=argparse.SUPPRESS)
    p.add_argument("--results", type=Path, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def all_cases() -> dict[str, list]:
    from advice_truth_cases import CASES as SINGLE
    from advice_truth_dist import CASES as DIST

    return {"single": list(SINGLE), "dist": list(DIST)}


def worker(args: argparse.Namespace) -> None:
    """Run the named cases of one kind in this process (under torchrun for "dist")."""
    import torch
    from advice_truth_common import Settings, run_case

    names = [n for n in args.cases.split(",") if n]
    cases = [c for c in all_cases()[args.worker] if c.name in names]
    if args.worker == "dist":
        import torch.distributed as dist
        from advice_truth_dist import setup, slowest

        s = setup()
        s.steps, s.tiny = args.steps, args.tiny
        for case in cases:
            run_case(case, s, args.out, args.results, rank=dist.get_rank(), gather=lambda t: slowest(t, s))
            dist.barrier()
        dist.destroy_process_group()
        return
    device = torch.device("cuda", 0) if torch.cuda.is_available() and not args.tiny else torch.device("cpu")
    s = Settings(device=device, steps=args.steps, tiny=args.tiny)
    for case in cases:
        run_case(case, s, args.out, args.results)


def launch(kind: str, names: list[str], args: argparse.Namespace, results: Path, deadline: float) -> dict:
    """Run workers of `kind` until every case has a result; a case a worker died in is marked failed."""
    failures: dict[str, str] = {}
    pending = list(names)
    attempt = 0
    while pending:
        if time.time() > deadline:
            failures.update(dict.fromkeys(pending, "not run: out of --budget-s"))
            break
        attempt += 1
        err = results / f"{kind}_{attempt}.stderr"
        cmd = [
            __file__,
            "--worker",
            kind,
            "--cases",
            ",".join(pending),
            "--results",
            str(results),
            "--out",
            str(args.out),
            "--steps",
            str(args.steps),
        ] + (["--tiny"] if args.tiny else [])
        if kind == "dist":
            cmd = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", *cmd]
        with err.open("w") as stderr:
            try:
                rc = subprocess.run(
                    [sys.executable, *cmd], stderr=stderr, timeout=deadline - time.time() + 60
                ).returncode
            except subprocess.TimeoutExpired:
                rc = -9
        pending = [n for n in pending if not (results / f"{n}.json").exists()]
        if pending:
            tail = err.read_text()[-2000:]
            print(f"{kind} worker exited {rc} during {pending[0]}:\n{tail}", flush=True)
            failures[pending.pop(0)] = f"worker exited {rc}: {tail}"
    return failures


def table(cases: dict) -> str:
    lines = [f"{'case':<22} {'problem ms':>11} {'fixed ms':>9} {'realized':>9} {'trace KiB':>10}  note"]
    for name, c in cases.items():
        v = c.get("variants", {})
        first = v.get("problem") or v.get("control") or {}
        fixed = v.get("fixed", {})
        gain = f"{c['realized_gain']:.0%}" if "realized_gain" in c else "-"
        fixed_ms = f"{fixed['median_ms']:.2f}" if fixed else "-"
        first_ms = f"{first['median_ms']:.2f}" if first else "-"
        note = (c.get("error") or "").splitlines()[0][:60] if c.get("error") else ""
        lines.append(f"{name:<22} {first_ms:>11} {fixed_ms:>9} {gain:>9} {first.get('trace_kib', 0):>10.0f}  {note}")
    return "\n".join(lines)


def environment(tiny: bool) -> dict:
    import torch
    from common import environment as facts

    env = facts() if not tiny else {**facts(), "device": "cpu (--tiny smoke run)"}
    return {**env, "num_gpus": torch.cuda.device_count()}


def main() -> None:
    args = parse_args()
    if args.worker:
        return worker(args)
    import torch

    start = time.time()
    wanted = {n for n in args.cases.split(",") if n}
    kinds = {k: [c.name for c in cs if not wanted or c.name in wanted] for k, cs in all_cases().items()}
    args.out.mkdir(parents=True, exist_ok=True)
    results = Path(tempfile.mkdtemp(prefix="advice_truth_"))
    failures: dict[str, str] = {}
    print(f"advice_truth: {sum(map(len, kinds.values()))} cases, results in {args.out}", flush=True)
    failures |= launch("single", kinds["single"], args, results, start + args.budget_s)
    if kinds["dist"] and torch.cuda.device_count() < 2 and not args.tiny:
        failures |= dict.fromkeys(kinds["dist"], "not run: needs 2 GPUs")
    else:
        failures |= launch("dist", kinds["dist"], args, results, start + args.budget_s)
    cases = {}
    for name in [*kinds["single"], *kinds["dist"]]:
        path = results / f"{name}.json"
        cases[name] = json.loads(path.read_text()) if path.exists() else {"case": name, "error": failures.get(name)}
    truth = {
        **environment(args.tiny),
        "steps_timed": args.steps,
        "wall_s": round(time.time() - start, 1),
        "cases": cases,
    }
    (args.out / "truth.json").write_text(json.dumps(truth, indent=1))
    print(table(cases))
    print(f"advice_truth: {time.time() - start:.0f} s; wrote {args.out / 'truth.json'}", flush=True)


if __name__ == "__main__":
    main()
