"""Switches composed with several ranks (CPU, gloo): fp16 loss scaling with FSDP, TP and CP; activation
offload with FSDP and DDP; the pipeline under the real CLI.

- The trainer on 2 ranks with fp16 and dp_shard=2 / tp=2 / cp=2 gives the single-process losses (same
  global batch) within fp16 noise. These runs and the pipeline's start their ranks with launch_local
  (parallel_harness.cli_ranks); FSDP with activation offload runs under real torchrun.
- An inf in one rank's gradient shard makes every rank skip the step and back off the loss scale alike
  (without the agreement, rank 0 would update while rank 1 skipped, and their weights and scales part).
- Activation offload on FSDP / DDP ranks trains exactly like one process, and each rank offloads the
  same bytes as one process given that rank's rows (FSDP's gathered weights are not copied as activations).
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import cli_here
from helpers import read_metrics
from parallel_harness import cli_ranks, compose_drills

from tracetrain.parallel.launch import launch_local

ARGS = [
    "--train.steps=6",
    "--data.synthetic_examples=400",
    "--data.seq_len=64",
    "--model.n_layers=2",
    "--logging.log_interval=1",
    "--train.eval_interval=0",
    "--train.eval_generate=0",
    "--train.eval_batches=1",
    "--optim.warmup_steps=1",
    "--optim.lr=1e-3",
    "--logging.progress=false",
    "--train.precision=fp16",
]


def _losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir)[0]]


def _torchrun(tmp_path: Path, name: str | None, *overrides: str) -> subprocess.CompletedProcess:
    """The real CLI under torchrun, 2 ranks; without `name`, rank 0 picks the run directory's name."""
    run_name = [f"--train.run_name={name}"] if name else []
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        "tracetrain.cli",
        "train",
        *ARGS,
        *overrides,
        f"--train.output_dir={tmp_path}",
        *run_name,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc


def _two_ranks(tmp_path: Path, name: str, *overrides: str) -> None:
    """The real CLI on 2 ranks started by launch_local (the CLI's main in each, torchrun's variables)."""
    cli_ranks(2, "train", *ARGS, *overrides, f"--train.output_dir={tmp_path}", f"--train.run_name={name}")


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> dict[str, list[float]]:
    """{precision: losses} of the single-process runs the layouts are compared with (8 rows a step), run
    once for every test (in this process: the torchrun side is the multi-process one under test)."""
    out = tmp_path_factory.mktemp("one")
    for precision in ("fp16", "fp32"):
        cli_here(
            "train",
            *ARGS,
            "--train.micro_batch_size=8",
            f"--train.precision={precision}",
            f"--train.output_dir={out}",
            f"--train.run_name={precision}",
        )
    return {precision: _losses(out / precision) for precision in ("fp16", "fp32")}


@pytest.mark.parametrize(("layout", "rows_per_rank"), [("dp_shard", 4), ("tp", 8), ("cp", 8)])
def test_fp16_with_a_layout_matches_one_process(tmp_path, one_process, layout, rows_per_rank):
    _two_ranks(tmp_path, layout, f"--train.micro_batch_size={rows_per_rank}", f"--parallel.{layout}=2")
    got, one = _losses(tmp_path / layout), one_process["fp16"]
    assert len(got) == len(one) == 6
    # fp16 activations: summation order across shards moves the last bits (measured: <= 4e-5 at ~5.0
    # for FSDP, 1e-4 for TP and CP).
    assert max(abs(a - b) for a, b in zip(got, one)) < 1e-3
    assert got[-1] < got[0] - 0.3  # and it trains


INF_LAYOUTS = ["--parallel.dp_shard=2", "--parallel.tp=2", "--parallel.cp=2"]
OFFLOAD_LAYOUTS = ["--parallel.dp_shard=2", "--parallel.dp_replicate=2"]


@pytest.fixture(scope="module")
def drills(tmp_path_factory) -> dict:
    """Every layout's fp16 step with and without an inf on rank 1, and both data-parallel layouts with
    streamed activation offload against one process: one 2-rank job for both drills."""
    out = tmp_path_factory.mktemp("drills") / "drills.json"
    launch_local(compose_drills, 2, str(out), INF_LAYOUTS, [[layout] for layout in OFFLOAD_LAYOUTS], timeout_s=300)
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def found_inf(drills) -> dict:
    return drills["found_inf"]


@pytest.mark.parametrize("layout", INF_LAYOUTS)
def test_an_inf_on_one_rank_skips_the_step_on_every_rank(found_inf, layout):
    got = found_inf[layout]["inject"]
    assert got["changed"] == [0.0, 0.0]  # no rank updated its weights
    assert got["scale"][0] == got["scale"][1] == 2.0**16 * 0.5  # both backed off from the initial 2**16
    assert not got["finite"] and not got["diverged"]  # a skipped fp16 step, not a diverged run
    # Control: the same step without the inf updates every rank and keeps the scale.
    got = found_inf[layout]["control"]
    assert got["changed"] == [1.0, 1.0] and got["scale"] == [2.0**16, 2.0**16] and got["finite"]


@pytest.fixture(scope="module")
def offload_compared(drills) -> dict:
    return drills["offload"]


@pytest.mark.parametrize("layout", OFFLOAD_LAYOUTS)
def test_activation_offload_with_data_parallel_ranks(offload_compared, layout):
    got = offload_compared[layout]
    assert got["loss"] < 1e-5 and got["grad"] < 1e-5 and got["param"] < 1e-5, got
    for rank in got["per_rank"]:
        assert rank["tensors"] > 0  # something was offloaded
        assert (rank["bytes"], rank["tensors"]) == (rank["one_process_bytes"], rank["one_process_tensors"]), got


@pytest.fixture(scope="module")
def fsdp_offload_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """FSDP over 2 ranks with streamed activation offload, under torchrun with no run name (two tests below
    read it: the losses, and the one run directory rank 0 named)."""
    out = tmp_path_factory.mktemp("fsdp")
    proc = _torchrun(
        out,
        None,
        "--train.micro_batch_size=4",
        "--parallel.dp_shard=2",
        "--memory.activation_offload=streamed",
        "--memory.activation_offload_fraction=0.5",
        "--train.precision=fp32",
    )
    return out, proc


def test_activation_offload_with_fsdp_under_torchrun(fsdp_offload_run, one_process):
    (run,) = fsdp_offload_run[0].iterdir()
    assert max(abs(a - b) for a, b in zip(_losses(run), one_process["fp32"])) < 1e-5


def test_pipeline_on_two_ranks_matches_one_process(tmp_path, one_process):
    _two_ranks(
        tmp_path,
        "pp",
        "--train.micro_batch_size=8",
        "--parallel.pp=2",
        "--parallel.pp_microbatches=2",
        "--train.precision=fp32",
    )
    got, one = _losses(tmp_path / "pp"), one_process["fp32"]
    assert len(got) == len(one) == 6
    assert max(abs(a - b) for a, b in zip(got, one)) < 1e-4


def test_torchrun_needs_no_run_name(fsdp_offload_run):
    """Rank 0 picks the timestamped run directory and hands its name to the other ranks."""
    out, proc = fsdp_offload_run
    runs = list(out.iterdir())
    assert len(runs) == 1, runs  # one directory for the job, not one per rank
    assert (runs[0] / "metrics.jsonl").is_file() and (runs[0] / "logs" / "metrics_rank1.jsonl").is_file()
    assert f"run directory: {runs[0]}" in proc.stdout


def test_what_does_not_compose_yet_is_refused_with_its_reason():
    from tracetrain.config import load_config
    from tracetrain.errors import ConfigError
    from tracetrain.models.build import model_args_from_config
    from tracetrain.validate import validate

    def check(*overrides: str) -> None:
        cfg = load_config(None, ["--model.n_layers=2", *overrides])
        validate(cfg, model_args_from_config(cfg), 2)

    check("--parallel.dp_shard=2", "--train.precision=fp16")  # composes
    with pytest.raises(
        ConfigError, match=r"parallel.pp, train.precision: pipeline parallelism does not support fp16 loss scaling"
    ):
        check("--parallel.pp=2", "--train.precision=fp16")
    check("--parallel.tp=2", "--train.precision=fp16")
    check("--parallel.dp_shard=2", "--memory.activation_offload=save_on_cpu")
    with pytest.raises(
        ConfigError,
        match=r"'memory.optimizer_offload' is not supported together with several ranks yet: .*use parallel.fsdp_cpu_offload",
    ):
        check("--parallel.dp_shard=2", "--memory.optimizer_offload=true")
    check("--parallel.dp_shard=2", "--train.fp8=rowwise")
    with pytest.raises(ConfigError, match=r"'train.fp8' is not supported .*data parallelism \(FSDP, DDP\) only"):
        check("--parallel.tp=2", "--train.fp8=rowwise")
    check("--parallel.dp_replicate=2", "--memory.unified_memory=optimizer")  # managed DTensor moments
    check("--parallel.dp_shard=2", "--memory.unified_memory=optimizer")
    with pytest.raises(ConfigError, match=r"'memory.unified_memory' is not supported .*only the optimizer states"):
        check("--parallel.dp_replicate=2", "--memory.unified_memory=model")
    with pytest.raises(ConfigError, match=r"'memory.unified_memory' is not supported .*not checked"):
        check("--parallel.tp=2", "--memory.unified_memory=optimizer")
