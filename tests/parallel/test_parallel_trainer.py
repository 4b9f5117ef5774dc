"""`tracetrain train` on 2 ranks (CPU, gloo): the trainer's own loop with multi-rank layouts gives the
single-process run's losses, and resumes from its sharded checkpoints. The FSDP run and its resume run
under real torchrun; the TP and CP runs on ranks started by launch_local (parallel_harness.cli_ranks)."""

import json
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import cli_here
from helpers import read_metrics
from parallel_harness import cli_ranks

ARGS = [
    "--train.steps=4",
    "--data.synthetic_examples=400",
    "--data.seq_len=64",
    "--model.n_layers=2",
    "--logging.log_interval=1",
    "--train.eval_interval=0",
    "--train.eval_generate=0",
    "--train.eval_batches=1",
    "--optim.warmup_steps=1",
    "--optim.lr=1e-4",
    "--logging.progress=false",
]


def torchrun(nproc: int, *args: str) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "-m",
        "tracetrain.cli",
        "train",
        *args,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise AssertionError(f"torchrun failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def losses(run_dir):
    return [r["loss"] for r in read_metrics(run_dir)[0]]


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    """The single-process run every layout is compared with (in this process: torchrun is what is tested)."""
    out = tmp_path_factory.mktemp("ref")
    cli_here("train", *ARGS, "--train.micro_batch_size=8", f"--train.output_dir={out}", "--train.run_name=one")
    return out / "one"


@pytest.fixture(scope="module")
def reference(reference_run):
    return losses(reference_run)


@pytest.fixture(scope="module")
def reference_eval(reference_run):
    return json.loads((reference_run / "summary.json").read_text())["eval_loss"]


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    """FSDP over 2 ranks with sharded checkpoints at steps 2 and 4: the fsdp2 layout's losses, the resume
    and the single-process eval and export below all read this one run (none of them changes it)."""
    out = tmp_path_factory.mktemp("fsdp")
    torchrun(
        2,
        *ARGS,
        "--parallel.dp_shard=2",
        "--train.micro_batch_size=4",
        f"--train.output_dir={out}",
        "--train.run_name=r",
        "--checkpoint.interval=2",
        "--checkpoint.keep_last=3",
    )
    return out / "r"


@pytest.mark.parametrize(
    "layout", [["--parallel.dp_shard=2"], ["--parallel.tp=2"], ["--parallel.cp=2"]], ids=["fsdp2", "tp2", "cp2"]
)
def test_layouts_match_the_single_process_losses(request, tmp_path, reference, reference_eval, layout):
    # Same global batch: 8 rows per step, split over the data-parallel ranks (or shared under TP / CP).
    per_rank = 4 if "--parallel.dp_shard=2" in layout else 8
    if per_rank == 4:
        run = request.getfixturevalue("fsdp_run")  # this layout's run, with checkpoints (they change no loss)
    else:
        cli_ranks(
            2,
            "train",
            *ARGS,
            *layout,
            f"--train.micro_batch_size={per_rank}",
            f"--train.output_dir={tmp_path}",
            "--train.run_name=r",
        )
        run = tmp_path / "r"
    got = losses(run)
    assert len(got) == 4
    assert got == pytest.approx(reference, rel=1e-4)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 2
    assert "eval_loss" in summary
    if per_rank == 8:  # the same held-out batches (of micro_batch_size rows) as the single process
        # TP: vocabulary-sharded loss; CP: each rank scores its sequence chunks and the sums are added.
        assert summary["eval_loss"] == pytest.approx(reference_eval, rel=1e-4)
    assert (run / "logs" / "rank1.log").is_file()


def test_sharded_checkpoint_resumes_exactly(fsdp_run, tmp_path):
    run = tmp_path / "r"
    shutil.copytree(fsdp_run, run)  # resume a copy: the other tests read the run as it finished
    first = losses(run)
    shutil.rmtree(run / "checkpoints" / "step_00000004")
    assert (run / "checkpoints" / "step_00000002" / "dcp").is_dir()
    torchrun(2, "--resume", str(run))
    assert losses(run) == first


def test_sharded_checkpoint_evaluates_and_exports_in_one_process(fsdp_run, tmp_path):
    # Saved by 2 FSDP ranks; `eval` and `export` gather the shards in a single process (no process group).
    run = fsdp_run
    assert (run / "checkpoints" / "step_00000004" / "dcp" / ".metadata").is_file()
    distributed = json.loads((run / "summary.json").read_text())["eval_loss"]
    single = json.loads(cli_here("eval", str(run), "--device=cpu").stdout)
    # The 2-rank run's final eval and the gathered model's eval see the same weights and batches.
    assert single["checkpoint"].endswith("step_00000004")
    assert single["eval_loss"] == pytest.approx(distributed, rel=1e-4)
    cli_here("export", str(run), "--hf", str(tmp_path / "hf"))
    from safetensors.torch import load_file

    exported = {}
    for f in (tmp_path / "hf").glob("*.safetensors"):
        exported.update(load_file(str(f)))
    from tracetrain.inference import load_trained

    model = load_trained(run, "cpu").model
    assert "model.layers.1.mlp.up_proj.weight" in exported
    for name, t in model.state_dict().items():
        if name.endswith("rope_inv_freq"):
            continue
        key = name if name.startswith("lm_head") else "model." + name
        assert torch.equal(exported[key], t.to(exported[key].dtype)), name  # export writes the HF dtype
