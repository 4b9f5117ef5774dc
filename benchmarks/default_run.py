"""The README's first command, timed: `tracetrain train` with no arguments (the built-in default run), as
a fresh process, wall time including start-up and compilation, with the run's own summary.json.

  python3 benchmarks/default_run.py            # CPU or GPU, whatever `train.device = auto` picks

Writes benchmarks/results/default_run_<device>.json: wall seconds, the summary (held-out loss, exact
match of the held-out prompts, tokens/s), the CPU model and core count, torch version, commit, date.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, write_result  # noqa: E402


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "tracetrain.cli", "train", "--train.run_name=default"],
                              cwd=tmp, capture_output=True, text=True)
        wall_s = time.perf_counter() - start
        if proc.returncode != 0:
            sys.exit(f"tracetrain train failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
        summary = json.loads((Path(tmp) / "runs" / "default" / "summary.json").read_text())
    env = environment()
    result = {**env, "cpu": cpu_model(), "cpu_cores": os.cpu_count(), "wall_s": wall_s, "summary": summary,
              "command": "tracetrain train (no arguments), fresh process, from an empty folder"}
    print(f"default run: {wall_s:.1f} s wall on {env['device']} ({result['cpu']}, {os.cpu_count()} cores); "
          f"held-out loss {summary.get('eval_loss')}, exact match {summary.get('exact_match')}")
    name = env["device"].replace(" ", "-").replace("/", "-")
    out = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    print(f"wrote {write_result(f'default_run_{name}.json', result, out)}")


if __name__ == "__main__":
    main()
