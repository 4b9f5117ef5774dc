"""The README runs as written. Every fenced block of README.md is classified: a block marked
`<!-- runnable -->` on the line before its fence (invisible on GitHub) runs here on the CPU, word for
word, in a temporary folder with this checkout's code (`tracetrain` is `python -m tracetrain.cli`);
every other block is listed in NOT_RUNNABLE with the reason. The tour and the config-error example run
each command's words, as bash splits them, through the CLI's `main` in this process (conftest.cli_here):
every subcommand they use has a real-process test of its own (test_cli_runs.py, test_export.py,
test_run_report.py, test_data_command.py, test_output_places.py, test_bad_input.py), and the first planner
example and the Python snippet here run in fresh processes (the search example in this one). A new block fails the test until it is
marked or listed, and a marked block fails it if it does not run.

What the tour, the planner examples and the Python snippet print is checked against what the README
says beside them: the plan's verdict and memory against the hardware table, the profile's captured
steps against the window the README names."""

import gzip
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import cli_here
from helpers import REPO

README = (REPO / "README.md").read_text(encoding="utf-8")
MARK = "<!-- runnable -->"
TIMEOUT_S = 900  # a guard against a hang only: a loaded 2-core machine is slow

# Blocks that cannot run on this CPU machine, by how they begin, and why.
NOT_RUNNABLE = {
    "# 1. install and run the built-in default": "installs from PyPI; CI runs command 2 (.ci/run), and "
    "benchmarks/default_run.py times command 1's full 600-step run",
    "mkdir -p data/gsm8k": "downloads from GitHub (curl)",
    "# LoRA on your own instruction data": "needs a local Mistral-7B checkpoint and the reader's my.jsonl",
    "tracetrain data --config configs/chat-lora.toml": "needs a local chat model folder (the config's paths)",
    "# 4 GPUs, parameters": "torchrun over 4 to 16 GPUs, with the reader's my.toml",
    "# Llama-3-70B LoRA on 2 GPUs": "torchrun over 2 GPUs of 140 GiB (measured by benchmarks/scale_large.py)",
    "tracetrain profile --config my.toml": "the reader's my.toml (the tour runs the same window on the default run)",
    "tracetrain analyze runs/<run>/profile": "placeholders (<run>, before/after traces) for the reader's traces",
    "tracetrain tune my.toml": "the reader's my.toml; tests/cli/test_tune.py runs `tracetrain tune` on the default run",
    "pip install 'tracetrain[mlflow]'": "installs from PyPI; the reader's my.toml",
    "runs/<name>/": "a folder listing, not a command",
    "MLFLOW_ALLOW_FILE_STORE=true mlflow ui": "a server that runs until stopped; tests/train/test_tracking_mlflow.py starts "
    "mlflow ui on a run's store and checks it serves",
}


@dataclass(frozen=True)
class Block:
    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    runnable: bool


def readme_blocks() -> list[Block]:
    blocks, lines = [], README.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("```"):
            end = lines.index("```", i + 1)
            runnable = i > 0 and lines[i - 1].strip() == MARK
            blocks.append(Block(i + 1, lines[i][3:].strip(), "\n".join(lines[i + 1 : end]) + "\n", runnable))
            i = end
        i += 1
    return blocks


BLOCKS = readme_blocks()


def runnable(starts: str) -> Block:
    found = [b for b in BLOCKS if b.runnable and b.text.startswith(starts)]
    assert len(found) == 1, f"README.md: one runnable block should begin with {starts!r}, found {len(found)}"
    return found[0]


def commands(block: Block) -> list[str]:
    """A shell block's commands, one per logical line (continuations joined, comments dropped)."""
    joined = block.text.replace("\\\n", " ")
    return [line for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def sh(command: str, cwd: Path) -> subprocess.CompletedProcess:
    """Run one README command as written, with `tracetrain` being this checkout's CLI."""
    script = f'tracetrain() {{ {shlex.quote(sys.executable)} -m tracetrain.cli "$@"; }}\n{command}'
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(["bash", "-c", script], cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)


def words(command: str) -> list[str]:
    """The arguments bash passes to `tracetrain` for one README command line: its own quoting, comments and
    expansions, without starting Python."""
    assert command.startswith("tracetrain "), command
    script = f'tracetrain() {{ printf "%s\\0" "$@"; }}\n{command}'
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60, check=True)
    return proc.stdout.split("\0")[:-1]


def here(command: str, cwd: Path) -> subprocess.CompletedProcess:
    """One README command, as bash splits it, through the CLI's `main` in this process."""
    return cli_here(*words(command), cwd=cwd, check=False)


def ok(command: str, proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, f"README command failed: {command}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def workdir(tmp: Path) -> Path:
    """A folder like a fresh clone's root for what the blocks read (configs/), without its runs."""
    shutil.copytree(REPO / "configs", tmp / "configs")
    return tmp


# ---------------------------------------------------------------------------------------- classification


def test_every_block_is_runnable_or_says_why_not():
    assert len(BLOCKS) >= 10
    for block in BLOCKS:
        listed = [key for key in NOT_RUNNABLE if block.text.startswith(key)]
        where = f"README.md:{block.line}"
        assert block.runnable or listed, f"{where}: mark the block {MARK} or list it in NOT_RUNNABLE with why"
        assert not (block.runnable and listed), f"{where}: marked {MARK} and listed as not runnable"
        if block.runnable:
            transcript = block.lang == "" and block.text.startswith("$ ")
            assert block.lang in ("bash", "python") or transcript, f"{where}: a runnable block is bash or python"
    stale = [key for key in NOT_RUNNABLE if not any(b.text.startswith(key) for b in BLOCKS)]
    assert not stale, f"NOT_RUNNABLE names blocks the README no longer has: {stale}"


# ---------------------------------------------------------------------------------------- the tour


@pytest.fixture(scope="module")
def tour(tmp_path_factory) -> dict[str, str]:
    """Every command of the tour, in order, in one folder; each one's standard output."""
    cwd = workdir(tmp_path_factory.mktemp("tour"))
    out = {}
    for command in commands(runnable("tracetrain train")):
        out[command] = ok(command, here(command, cwd))
    out["cwd"] = str(cwd)
    return out


def tour_output(tour: dict[str, str], subcommand: str) -> str:
    return next(text for command, text in tour.items() if command.startswith(f"tracetrain {subcommand} "))


def test_the_tour_runs_and_leaves_what_it_says(tour):
    cwd = Path(tour["cwd"])
    for name in ("first", "second"):
        assert (cwd / "runs" / name / "summary.json").is_file()
    assert (cwd / "out" / "first-hf" / "config.json").is_file()
    assert "eval_loss" in tour_output(tour, "eval") or "loss" in tour_output(tour, "eval")
    assert "llama3-8b" in tour_output(tour, "presets")
    assert "optim.lr" in tour_output(tour, "config") or "`lr`" in tour_output(tour, "config")


def test_profile_captures_the_steps_the_readme_names(tour):
    command = next(c for c in tour if c.startswith("tracetrain profile "))
    start = int(re.search(r"--profile.start_step=(\d+)", command).group(1))
    count = int(re.search(r"--profile.num_steps=(\d+)", command).group(1))
    window = list(range(start, start + count))
    said = re.search(r"# capture steps (\d+)-(\d+)", command)
    assert said and [int(said.group(1)), int(said.group(2))] == [window[0], window[-1]], command
    prose = re.search(r"profiler on for steps (\d+) to (\d+)", README)
    assert prose and [int(prose.group(1)), int(prose.group(2))] == [window[0], window[-1]]
    (trace,) = Path(tour["cwd"]).glob("runs/*/profile/rank0.json.gz")
    with gzip.open(trace, "rt") as f:
        names = {e.get("name", "") for e in json.load(f)["traceEvents"]}
    labelled = sorted(int(m.group(1)) for n in names if (m := re.fullmatch(r"ProfilerStep#(\d+)", n)))
    assert labelled == window
    printed = [int(n) for n in re.findall(r"ProfilerStep#(\d+)", tour[command])]
    assert printed == window, "the analysis prints the trainer's step numbers"


# ---------------------------------------------------------------------------------------- the planner


def table_cell(model: str, training: str, column: str) -> str:
    """A cell of the README's hardware table by its row (model, training) and column heading's start."""
    lines = [line for line in README.splitlines() if line.startswith("| model | training |")]
    header = [h.strip() for h in lines[0].strip("|").split("|")]
    col = next(i for i, h in enumerate(header) if h.startswith(column))
    for line in README.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[:2] == [model, training]:
            return cells[col]
    raise AssertionError(f"no row {model} / {training} in the README's hardware table")


def plan_verdict(stdout: str) -> tuple[bool, float, int]:
    """(fits, required GiB, tokens/s) from `tracetrain plan` without --search: its headline follows the
    block of the spec's decisions ("decided (on a CUDA GPU):" and one indented line each)."""
    lines = stdout.splitlines()
    assert lines[0].startswith("decided ("), lines[0]
    head = next(line for line in lines[1:] if not line.startswith("  "))
    fits = ": fits" in head
    assert fits or "does NOT fit" in head, head
    tokens = int(re.search(r"([\d,]+) tokens/s", head).group(1).replace(",", ""))
    gib = float(re.search(r"required\s*\S\s*([\d.]+)", stdout).group(1))
    return fits, gib, tokens


def cell_numbers(cell: str) -> tuple[int, int]:
    """(GiB, tokens/s) from a cell such as '44 GiB, 17,123' or 'ZeRO-2 8: 69 GiB, 98,065'."""
    m = re.search(r"(\d+) GiB, ([\d,]+)$", cell)
    assert m, cell
    return int(m.group(1)), int(m.group(2).replace(",", ""))


@pytest.fixture(scope="module")
def plan_runs(tmp_path_factory) -> dict[str, str]:
    """The first command in a fresh process (`tracetrain plan`'s real process), the search in this one."""
    cwd = tmp_path_factory.mktemp("plan")
    first, *rest = commands(runnable("tracetrain plan "))
    return {first: ok(first, sh(first, cwd)), **{command: ok(command, here(command, cwd)) for command in rest}}


def test_the_plan_example_agrees_with_the_table(plan_runs, tour):
    single = [c for c in plan_runs if "--search" not in c]
    assert single and "--gpu h100-sxm" in single[0] and "--train.mode=lora" in single[0]
    gib, tokens = cell_numbers(table_cell("Llama-3-8B", "LoRA", "1 \u00d7 H100"))
    fits, required, planned = plan_verdict(plan_runs[single[0]])
    assert fits and round(required) == gib, (required, gib)
    assert abs(planned - tokens) <= 0.02 * tokens, (planned, tokens)  # planned at an earlier commit
    # The tour's plan is the same run on the default GPU (an H100 SXM without a GPU here).
    tour_plan = tour_output(tour, "plan")
    assert plan_verdict(tour_plan) == (fits, required, planned)


def test_the_search_example_ranks_the_tables_layout_first(plan_runs):
    search = [c for c in plan_runs if "--search" in c]
    assert search and "--gpu h200 --gpus 8" in search[0] and "--train.mode=full" in search[0]
    cell = table_cell("Llama-3-8B", "full", "8 \u00d7 H200")
    assert cell.startswith("ZeRO-2 8:"), cell
    top = re.search(r"│\s+1 │ (\S+)", plan_runs[search[0]])
    assert top and top.group(1) == "zero2x8", plan_runs[search[0]][:2000]
    words = plan_runs[search[0]].split()  # the top layout's overrides (plan/mapping.py writes every layout key)
    assert "--parallel.dp_shard=8" in words and "--parallel.zero_stage=2" in words


# ---------------------------------------------------------------------------------------- the rest


def test_the_config_error_example_prints_what_it_shows(tmp_path):
    block = runnable("$ tracetrain train --optim.lr=-1")
    command, *expected = block.text.splitlines()
    proc = here(command[2:], workdir(tmp_path))
    assert proc.returncode != 0
    assert (proc.stdout + proc.stderr).strip().splitlines() == expected
    assert not (tmp_path / "runs").exists()  # refused before anything starts


def test_the_python_snippet_runs_as_pasted(tmp_path):
    block = runnable("import tracetrain")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-c", block.text],
        cwd=workdir(tmp_path),
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    ok("the Python snippet", proc)
    printed = proc.stdout.strip().splitlines()  # the trainer's progress lines, the callback's and the last print
    steps = [int(m.group(1)) for line in printed if (m := re.fullmatch(r"(\d+) \d+\.\d+(e-?\d+)?", line))]
    last = int(re.search(r"--train.steps=(\d+)", block.text).group(1))
    assert steps and steps[-1] == last  # the callback saw the run's last step
    eval_loss, run_dir = printed[-1].split()
    assert float(eval_loss) > 0 and (tmp_path / run_dir / "summary.json").is_file()
