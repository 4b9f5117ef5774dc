"""Switches composed with several ranks (CPU, gloo): fp16 loss scaling with FSDP.

- The trainer under torchrun with fp16 and dp_shard=2 gives the single-process losses (same global
  batch) within fp16 noise.
- An inf in one rank's gradient shard makes every rank skip the step and back off the loss scale alike
  (without the agreement, rank 0 would update while rank 1 skipped, and their weights and scales part).
"""

import json
import subprocess
import sys
from pathlib import Path

from tracetrain.parallel.launch import launch_local

from parallel_harness import fp16_found_inf_drill
from test_train import read_metrics, run_cli

ARGS = ["--train.steps=6", "--data.synthetic_examples=400", "--data.seq_len=64", "--model.n_layers=2",
        "--logging.log_interval=1", "--train.eval_interval=0", "--train.eval_generate=0", "--train.eval_batches=1",
        "--optim.warmup_steps=1", "--optim.lr=1e-3", "--logging.progress=false", "--train.precision=fp16"]


def _losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir)[0]]


def test_fp16_with_fsdp_matches_one_process(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "tracetrain.cli",
           "train", *ARGS, "--train.micro_batch_size=4", "--parallel.dp_shard=2", f"--train.output_dir={tmp_path}",
           "--train.run_name=fsdp"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    run_cli("train", *ARGS, "--train.micro_batch_size=8", f"--train.output_dir={tmp_path}", "--train.run_name=one")
    fsdp, one = _losses(tmp_path / "fsdp"), _losses(tmp_path / "one")
    assert len(fsdp) == len(one) == 6
    # fp16 activations: summation order across shards moves the last bits (measured: <= 4e-5 at ~5.0).
    assert max(abs(a - b) for a, b in zip(fsdp, one)) < 1e-3
    assert fsdp[-1] < fsdp[0] - 0.3  # and it trains


def test_an_inf_on_one_rank_skips_the_step_on_every_rank(tmp_path):
    out = tmp_path / "inject.json"
    launch_local(fp16_found_inf_drill, 2, str(out), True, timeout_s=200)
    got = json.loads(out.read_text())
    assert got["changed"] == [0.0, 0.0]  # no rank updated its weights
    assert got["scale"][0] == got["scale"][1] == 2.0**16 * 0.5  # both backed off from the initial 2**16
    assert not got["finite"] and not got["diverged"]  # a skipped fp16 step, not a diverged run
    # Control: the same step without the inf updates every rank and keeps the scale.
    launch_local(fp16_found_inf_drill, 2, str(out), False, timeout_s=200)
    got = json.loads(out.read_text())
    assert got["changed"] == [1.0, 1.0] and got["scale"] == [2.0**16, 2.0**16] and got["finite"]


def test_what_does_not_compose_yet_is_refused_with_its_reason():
    import pytest

    from tracetrain.config import load_config
    from tracetrain.errors import ConfigError
    from tracetrain.models.build import model_args_from_config
    from tracetrain.validate import validate

    def check(*overrides: str) -> None:
        cfg = load_config(None, ["--model.n_layers=2", *overrides])
        validate(cfg, model_args_from_config(cfg), 2)

    check("--parallel.dp_shard=2", "--train.precision=fp16")  # composes
    with pytest.raises(ConfigError, match=r"parallel.pp, train.precision: pipeline parallelism does not support fp16 loss scaling"):
        check("--parallel.pp=2", "--train.precision=fp16")
    with pytest.raises(ConfigError, match=r"train.precision.*tested with data parallelism \(FSDP\) only"):
        check("--parallel.tp=2", "--train.precision=fp16")
    with pytest.raises(ConfigError, match=r"memory.activation_offload.*not tested with sharded blocks"):
        check("--parallel.dp_shard=2", "--memory.activation_offload=save_on_cpu")
