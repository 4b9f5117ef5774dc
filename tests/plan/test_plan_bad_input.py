"""`tracetrain plan` on bad input (issue #20, planner item 4): each case ends in one stderr line
`error: ...` and exit status 2, or in a real answer. Run through the real command line
(`python -m tracetrain.cli plan ...`), as a user would."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys

import pytest
from helpers import REPO

from tracetrain.config import load_config
from tracetrain.parallel.pipeline import split_layers
from tracetrain.plan import plan_input_from_config
from tracetrain.plan.params import stage_params

# Llama-3.1-405B's shape (126 layers) on the 70B preset's vocabulary and context.
SHAPE_405B = ["--model.preset=llama3-70b", "--model.dim=16384", "--model.n_layers=126", "--model.n_heads=128",
              "--model.n_kv_heads=8", "--model.ffn_dim=53248"]


def run_plan(*args: str, subprocess_run: bool = False) -> subprocess.CompletedProcess:
    """`tracetrain plan ARGS`: through the CLI's own `main` in this process (a subprocess costs seconds of
    imports per call), or as a real subprocess (checked once, for the first case)."""
    if subprocess_run:
        return subprocess.run([sys.executable, "-m", "tracetrain.cli", "plan", *args], capture_output=True,
                              text=True, timeout=300, cwd=REPO)
    from tracetrain.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(["plan", *args])
        except SystemExit as e:  # argparse errors
            code = e.code if isinstance(e.code, int) else 2
    return subprocess.CompletedProcess(["plan", *args], code, out.getvalue(), err.getvalue())


def expect_error(*args: str, fragment: str, subprocess_run: bool = False) -> None:
    proc = run_plan(*args, subprocess_run=subprocess_run)
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2, proc.stdout[-1000:] + proc.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr


@pytest.mark.parametrize(("args", "fragment"), [
    (["--gpus", "0"], "--gpus 0: must be at least 1"),  # was ZeroDivisionError
    (["--gpus", "-4"], "--gpus -4: must be at least 1"),  # was a plan with -23,994 tokens/s
    (["--gpus", "-4", "--search"], "--gpus -4: must be at least 1"),
    (["--gpu-memory-gib", "0"], "--gpu-memory-gib 0.0: must be above 0"),  # was silently ignored
    (["--gpus-per-node", "0"], "--gpus-per-node 0: must be at least 1"),
    (["--gpu", "a100", "--train.fp8=rowwise"], "A100 has none"),  # was ZeroDivisionError
    (["--gpus", "4", "--parallel.tp=2"], "layout (dp_replicate x dp_shard x tp x pp x cp) uses 2 GPUs"),
    (["--gpu", "b300"], "unknown GPU 'b300'; known: h100-sxm"),  # was a traceback
    (["--gpu", "b300", "--search", "--gpus", "2"], "unknown GPU 'b300'"),  # was "no layout fits"
])
def test_bad_plan_input_is_one_line(args, fragment):
    expect_error(*args, fragment=fragment, subprocess_run=args == ["--gpus", "0"])


def test_gpu_memory_override_is_used(tmp_path):
    out = tmp_path / "plan.json"
    proc = run_plan("--gpu-memory-gib", "20", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(out.read_text())["memory"]["capacity_bytes"] == 20 * 2**30


def test_uneven_pipeline_split_is_planned_as_the_trainer_splits(tmp_path):
    # 126 layers over 8 stages: parallel/pipeline.py gives the first 6 stages 16 blocks, the last 2 15.
    out = tmp_path / "plan.json"
    pipeline = ["--parallel.pp=8", "--train.grad_accum_steps=8", "--parallel.pp_microbatches=8"]
    proc = run_plan(*SHAPE_405B, *pipeline, "--gpus", "8", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(out.read_text())
    assert got["memory"]["stage"] == 0 and got["time"]["tokens_per_s"] > 0  # stage 0: the most blocks
    inp = plan_input_from_config(load_config(None, SHAPE_405B + pipeline), 8, "h100-sxm")
    blocks = [stage_params(inp, s).num_blocks for s in range(8)]
    assert blocks == [len(stage) for stage in split_layers(126, 8)] == [16] * 6 + [15] * 2
    # interleaved: 16 stages of 8 or 7 blocks, rank r holding stages r and r + 8
    interleaved = inp.replace(pp_schedule="interleaved_1f1b", pp_virtual_stages=2)
    assert [stage_params(interleaved, s).num_blocks for s in (0, 5, 6, 7)] == [16, 16, 15, 15]


def test_more_stages_than_layers_is_one_line():
    expect_error("--model.n_layers=4", "--parallel.pp=8", "--gpus", "8", "--train.grad_accum_steps=8",
                 "--parallel.pp_microbatches=8", fragment="pipeline stages need at least that many layers")
