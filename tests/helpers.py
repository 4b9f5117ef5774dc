"""Helpers that test files in several folders share (tests/<part>/test_*.py import them by name; pytest puts
tests/ on sys.path, pyproject.toml's `pythonpath`): the repository's paths, runs of the real CLI, the tiny
run configs, the browser check of HTML pages, waits on a running trainer and tiny checkpoints."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import cli_here

from tracetrain.config import load_config
from tracetrain.spec import resolve
from tracetrain.train.assemble import Assembly, assemble
from tracetrain.train.checkpoint import TrainState, load_checkpoint

TESTS = Path(__file__).resolve().parent  # tests/
REPO = TESTS.parent
DATA = TESTS / "data"  # committed fixtures: traces, HTA's test data, the advice-truth corpus, golden losses
SHARED_DATA = REPO.parent / "shared" / "data"  # the shared datasets beside the checkout (tests skip without them)

# ---------------------------------------------------------------------------------------------------
# Runs of the real CLI and their records


def _run(*overrides: str) -> Assembly:
    """A tiny two-layer run on the CPU, assembled as the trainer assembles it (spec, transform table)."""
    cfg = load_config(None, ["--model.n_layers=2", "--train.grad_clip=0", *overrides])
    return assemble(resolve(cfg, torch.device("cpu")))


def _rows(n: int, seq: int = 24, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 259, (n, seq), generator=g)
    labels = torch.randint(0, 259, (n, seq), generator=g)
    # Different numbers of target tokens per row, so per-micro-batch averaging would be wrong.
    for i in range(n):
        labels[i, : 3 + 5 * i] = -100
    doc = (torch.arange(seq) >= seq // 2).long().expand(n, seq).contiguous()
    pos = torch.cat([torch.arange(seq // 2), torch.arange(seq - seq // 2)]).expand(n, seq).contiguous()
    return {"input_ids": ids, "labels": labels, "position_ids": pos, "document_ids": doc}


def run_cli(*args: str, cwd=None, check: bool = True, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`tracetrain ARGS` in a fresh process; `env` adds to (not replaces) this process's environment."""
    full_env = {**os.environ, **env} if env else None
    proc = subprocess.run(
        [sys.executable, "-m", "tracetrain.cli", *args], capture_output=True, text=True, cwd=cwd, env=full_env
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"tracetrain {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


SMALL = [
    "--train.steps=24",
    "--train.micro_batch_size=8",
    "--data.synthetic_examples=600",
    "--data.seq_len=64",
    "--logging.log_interval=4",
    "--train.eval_interval=12",
    "--train.eval_batches=2",
    "--train.eval_generate=8",
    "--optim.warmup_steps=4",
]


def read_metrics(run_dir):
    """(train lines, eval lines during training); the final evaluation's line is left out."""
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return (
        [r for r in lines if r["kind"] == "train"],
        [r for r in lines if r["kind"] == "eval" and not r.get("final")],
    )


# ---------------------------------------------------------------------------------------------------
# Tiny runs (fault injection, export)

# The smallest run that still trains: one layer of width 16, one sequence of 32 tokens per step.
TINY = [
    "--train.micro_batch_size=1",
    "--data.synthetic_examples=100",
    "--data.seq_len=32",
    "--model.n_layers=1",
    "--model.dim=16",
    "--model.n_heads=2",
    "--model.n_kv_heads=2",
    "--model.ffn_dim=32",
    "--logging.log_interval=1",
    "--train.eval_interval=0",
    "--train.eval_generate=0",
    "--train.eval_batches=1",
    "--optim.warmup_steps=1",
]


def _wait_for(predicate, proc: subprocess.Popen, what: str) -> None:
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError(f"never saw {what} (exit status {proc.poll()})")


def _steps_logged(run_dir: Path) -> int:
    metrics = run_dir / "metrics.jsonl"
    return len(metrics.read_text().splitlines()) if metrics.exists() else 0


TINY_RUN = [
    "--train.steps=4",
    "--train.micro_batch_size=4",
    "--data.synthetic_examples=200",
    "--data.seq_len=64",
    "--train.eval_interval=0",
    "--train.eval_batches=1",
    "--train.eval_generate=0",
    "--optim.warmup_steps=1",
    "--logging.progress=false",
]


# A 3-step run of a tiny family checkpoint (model.init_from), for the Gemma and Phi end-to-end tests.
FAMILY_RUN = [
    "--train.steps=3",
    "--train.micro_batch_size=2",
    "--data.synthetic_examples=60",
    "--data.seq_len=32",
    "--train.eval_interval=0",
    "--train.eval_batches=1",
    "--train.eval_generate=0",
    "--optim.warmup_steps=1",
    "--logging.progress=false",
]


TINY_MODEL = ["--model.dim=64", "--model.n_layers=2", "--model.ffn_dim=128"]  # runs without model.init_from


def train_run(out: Path, name: str, *extra: str) -> Path:
    """A finished run, trained through the CLI's main in this process (test_train.py runs `train` for real)."""
    cli_here("train", *TINY_RUN, f"--train.output_dir={out}", f"--train.run_name={name}", *extra)
    return out / name


# ---------------------------------------------------------------------------------------------------
# HTML pages in a real browser


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    pytest.skip("headless Chromium is not installed (Debian package 'chromium'; .ci/run installs it)")


def render_in_browser(html_file: Path, tmp_path: Path) -> tuple[str, str]:
    """(DOM after scripts ran, browser log). Flags keep Chromium off the network and quiet."""
    cmd = [
        chromium(),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        "--disable-quic",
        f"--user-data-dir={tmp_path / 'profile'}",
        "--enable-logging=stderr",
        "--v=0",
        "--virtual-time-budget=2000",
        "--dump-dom",
        html_file.as_uri(),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout, proc.stderr


def console_errors(log: str) -> list[str]:
    return [line for line in log.splitlines() if "CONSOLE" in line and ("Uncaught" in line or "Error" in line)]


# ---------------------------------------------------------------------------------------------------
# Tiny checkpoints


def _tiny(step_value: float | None = None) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    if step_value is not None:
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(step_value)
    return model, opt


def _load(path: Path) -> TrainState:
    model, opt = _tiny()
    state = load_checkpoint(path, model, opt, lora=False)
    assert all(torch.all(p == state.counters["value"]) for p in model.parameters())
    return state


def _hf_folder(tmp_path: Path) -> tuple[Path, torch.nn.Module]:
    from tracetrain.models.hf import write_hf_weights
    from tracetrain.models.llama import ModelArgs, Transformer

    args = ModelArgs(dim=16, n_layers=1, n_heads=2, n_kv_heads=2, ffn_dim=32, vocab_size=32, max_seq_len=16)
    model = Transformer(args)
    write_hf_weights(model, args, tmp_path, torch.float32, max_shard_bytes=2048)  # several shards and an index
    assert (tmp_path / "model.safetensors.index.json").is_file()
    return tmp_path, model
