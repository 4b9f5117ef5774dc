"""Sharded (DCP) checkpoints: save on 4 ranks with dp_shard=4, resume on the same layout (exactly), on
dp_shard=2 x tp=2, on pp=2 x dp_shard=2, and in a single process without a process group.

"loaded vs saved" compares every parameter and every AdamW state (step, exp_avg, exp_avg_sq) gathered
to full tensors: resharding must be exact (0.0). "resumed vs straight" runs steps 3-4 after the load and
compares with the run that never stopped: exact on the same layout, within 1e-6 (fp32 summation order)
on another.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from parallel_harness import assemble_tiny, dcp_drill, full_state, global_batches, run_step, state_diff, tiny_config

from tracetrain.parallel.launch import launch_local
from tracetrain.train.sharded_checkpoint import load_sharded


@pytest.fixture(scope="module")
def drill(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("dcp")
    launch_local(dcp_drill, 4, str(run_dir), timeout_s=300)
    return run_dir


def test_resume_on_same_layout_is_exact(drill: Path) -> None:
    r = json.loads((drill / "dcp_results.json").read_text())
    assert r["same_layout_loaded_vs_saved"] == 0.0
    assert r["same_layout_resumed_vs_straight"] == 0.0
    assert r["same_layout_trainer_state_step"] == 2


def test_sharded_save_reports_bytes_written_against_the_total(drill: Path) -> None:
    """DCP says nothing while it writes; rank 0's console hears the shards' bytes on disk (progress.watch_bytes)."""
    r = json.loads((drill / "dcp_results.json").read_text())
    reports = r["save_progress_reports"]
    assert reports, "no progress report during the sharded save"
    done, total = reports[-1]
    assert total >= r["save_tensor_bytes"] > 0  # weights and AdamW states, every rank's shards
    assert done == total  # the last report, after the save: complete
    assert all(0 <= d <= total for d, _ in reports)


@pytest.mark.parametrize("layout", ["fsdp2_tp2", "pp2_fsdp2"])
def test_resume_on_another_layout(drill: Path, layout: str) -> None:
    r = json.loads((drill / "dcp_results.json").read_text())
    assert r[f"{layout}_loaded_vs_saved"] == 0.0
    assert r[f"{layout}_resumed_vs_straight"] <= 1e-6


def test_load_in_one_process(drill: Path) -> None:
    ref = torch.load(drill / "dcp_reference.pt", weights_only=True)
    path = Path(ref["checkpoint"])
    assert sorted(p.name for p in path.iterdir()) == ["config.toml", "dcp", "manifest.json",
                                                      *(f"trainer_state_rank{r}.pt" for r in range(4))]
    run = assemble_tiny(tiny_config(["--train.seed=123"]))
    model, opt = run.module, run.optimizer
    assert opt is not None
    assert load_sharded(path, model, opt)["step"] == 2
    assert state_diff(full_state(model, opt), ref["saved"]) == 0.0
    steps = [global_batches(tiny_config([]), 4, 1, seed=s) for s in range(4)]
    for batches in steps[2:]:
        run_step(run, batches)
    assert state_diff(full_state(model, opt), ref["straight"]) <= 1e-6
