"""Shared fixtures. Real datasets live in ../shared/data beside the checkout; tests that need them skip
with a reason when it is absent."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import warnings
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


def cli_here(*args: str, cwd: str | Path | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """`tracetrain ARGS` through the command's own `main` in this process, returned as `run_cli` returns a
    subprocess: the same parsing, checks and library calls, without the seconds a fresh interpreter spends
    importing torch. stdout and stderr are captured; warnings, filtered as a fresh interpreter filters
    them, are written at the start of stderr as it would print them; an argparse exit is the return code.
    Tests that need a process of their own (signals, a lock held by another PID, torchrun, a fresh
    interpreter) use test_train.run_cli, and every subcommand keeps at least one real subprocess test."""
    from tracetrain.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.ExitStack() as stack:
        stack.enter_context(contextlib.chdir(cwd or os.getcwd()))
        stack.enter_context(contextlib.redirect_stdout(out))
        stack.enter_context(contextlib.redirect_stderr(err))
        caught = stack.enter_context(warnings.catch_warnings(record=True))
        _default_warning_filters()
        try:
            code = main(list(args))
        except SystemExit as e:  # argparse: usage errors (2) and --help (0)
            code = e.code if isinstance(e.code, int) else 2
    stderr = "".join(warnings.formatwarning(w.message, w.category, w.filename, w.lineno) for w in caught)
    proc = subprocess.CompletedProcess(["tracetrain", *args], code, out.getvalue(), stderr + err.getvalue())
    if check and code != 0:
        raise AssertionError(f"tracetrain {' '.join(args)} failed ({code}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def _default_warning_filters() -> None:
    """The warning filters of a fresh interpreter (no -W, no PYTHONWARNINGS): pytest's own are replaced."""
    warnings.resetwarnings()
    warnings.simplefilter("default")
    for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
        warnings.simplefilter("ignore", category)
    warnings.filterwarnings("default", category=DeprecationWarning, module="__main__")


def shared_file(rel: str) -> Path:
    path = SHARED_DATA / rel
    if not path.exists():
        pytest.skip(f"{path} not present (the shared data folder sits beside the checkout)")
    return path


@pytest.fixture(scope="module")
def one_thread_torch():
    """Tiny matmuls gain nothing from a second thread, and on a busy machine its spin-waits cost seconds."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


# The tiny GQA model the generation and KV-offload tests decode with (3 layers, 2 KV heads for 4 query heads).
GEN_ARGS_KW = dict(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=97)


@pytest.fixture(scope="module")
def gen_model(one_thread_torch):
    """That model in eval mode, seeded, with torch on one thread for the whole module."""
    from tracetrain.models.llama import ModelArgs, Transformer

    torch.manual_seed(0)
    return Transformer(ModelArgs(**GEN_ARGS_KW)).eval()
