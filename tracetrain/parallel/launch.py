"""Start a job of N local processes without torchrun (tests, benchmarks, notebooks).

Each process gets the environment torchrun would give it (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT), so the code under test starts exactly as it does under torchrun:
`dist.init_distributed(...)`. If one process raises, the others are terminated and the error is
re-raised here; a job running past `timeout_s` is terminated with TimeoutError.

How the processes start (`start_method`): a spawned process is a fresh interpreter that imports torch before
`fn` starts, seconds of CPU per rank. On Linux the ranks fork instead from multiprocessing's forkserver, a
fresh interpreter started once per calling process that has imported PRELOAD, so they start with torch
imported (alone on a machine of 2 cores, tests/parallel/test_sharded_init.py took 11 s instead of 22 s).
A forked rank holds nothing of the caller's state either: it gets `fn`, `args`, sys.path, the working
directory, the environment, stdout and stderr as they are at the call. Variables that libraries read once,
as they load (LOAD_TIME_PREFIXES: OpenMP's thread count, torch's settings, ...), a forked rank has as the
forkserver started; so ranks fork only while the caller's are the same, and are spawned after a change.
"""

from __future__ import annotations

import functools
import os
import socket
import sys
import time
from collections.abc import Callable, Mapping
from multiprocessing import reduction
from typing import Any

import torch.multiprocessing as mp

# What the forkserver imports once, so that every rank forks with it loaded: torch, its distributed
# package, and the modules a rank assembles a run with (train/assemble.py: the model, the layouts and
# torch._dynamo, about 1.5 s of CPU after torch). Importing them starts no thread that forking breaks
# (OpenMP's pool starts at the first parallel op, in the rank). A module left out is imported by the rank
# itself, as a spawned rank does. Not "__main__" (multiprocessing's default): a script's top level stays
# out of the forkserver.
PRELOAD = ("torch", "torch.distributed", "tracetrain.train.assemble")

# Variables read as a library loads, by the interpreter and the libraries in the forkserver after PRELOAD:
# the loader and glibc, OpenMP (GNU, Intel), MKL, oneDNN, OpenBLAS and numpy, torch, triton, CUDA, sympy,
# tqdm; and the locale. A variable of another name is read when the code that uses it runs, so a rank that
# is given the caller's value at the call behaves as a spawned one; such variables (the ones MLflow and
# inductor set in the caller as they run, under pytest PYTEST_CURRENT_TEST) do not stop the forking.
LOAD_TIME_PREFIXES = (
    "PYTHON", "LD_", "MALLOC_", "GLIBC_", "LANG", "LC_", "OMP_", "GOMP_", "KMP_", "MKL_", "DNNL_", "ONEDNN_",
    "OPENBLAS_", "GOTO", "NPY_", "NUMPY_", "TORCH", "PYTORCH", "TRITON", "CUDA", "NVIDIA_", "SYMPY", "TQDM_",
)  # fmt: skip


def start_method() -> str:
    """How ranks start now: "forkserver" on Linux while this process's LOAD_TIME_PREFIXES variables are
    those the forkserver started with, else "spawn".

    The forkserver is multiprocessing's own, one per process, and the first call starts it with PRELOAD. If
    other code started it before, its environment is taken to be the one at the first call here, and ranks
    import what it did not preload themselves."""
    if not _forkserver_available():
        return "spawn"
    return "forkserver" if _load_time(os.environ) == _load_time(_forkserver_environ()) else "spawn"


@functools.cache
def _forkserver_available() -> bool:
    if not sys.platform.startswith("linux") or "forkserver" not in mp.get_all_start_methods():
        return False  # elsewhere forking after system frameworks load is unsafe (macOS), or impossible
    mp.set_forkserver_preload(list(PRELOAD))
    return True


@functools.cache
def _forkserver_environ() -> dict[str, str]:
    from multiprocessing import forkserver

    forkserver.ensure_running()
    return dict(os.environ)


def _load_time(environ: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in environ.items() if k.startswith(LOAD_TIME_PREFIXES)}


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _CallersFd:
    """One of the caller's file descriptors, sent to a forked rank as it starts: it would otherwise write to
    the forkserver's stdout and stderr (under pytest, the captured output of the test that started it)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple:
        return _received_fd, (reduction.DupFd(self.fd),)  # DupFd works while a process is being started


def _received_fd(dup: Any) -> int:
    return dup.detach()


def _entry(
    local_rank: int,
    fn: Callable[..., Any],
    world_size: int,
    port: int,
    args: tuple,
    environ: dict[str, str],
    unset: list[str],
    std_fds: tuple[int, int] | None,
) -> None:
    if std_fds is not None:
        for fd, target in zip(std_fds, (1, 2), strict=True):
            os.dup2(fd, target)
            os.close(fd)
    for name in unset:
        os.environ.pop(name, None)
    os.environ.update(environ)
    os.environ.update(
        RANK=str(local_rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    fn(*args)


def launch_local(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 300.0, env: dict[str, str] | None = None
) -> None:
    """Run `fn(*args)` in `world_size` fresh processes (importable `fn`; `start_method` says how they
    start), with this process's environment plus `env` and the rank variables, and wait for all.

    The rendezvous port is one that was free a moment before rank 0 binds it; another process (a parallel
    test worker, any socket's ephemeral port) can take it in between, and rank 0's store then fails with
    EADDRINUSE before `fn` has done anything. Such a start is retried on a new port (up to
    PORT_ATTEMPTS times); any other failure is re-raised at once."""
    for attempt in range(PORT_ATTEMPTS):
        try:
            _launch_once(fn, world_size, args, timeout_s, env or {})
            return
        except mp.ProcessRaisedException as e:
            if "EADDRINUSE" not in str(e) or attempt == PORT_ATTEMPTS - 1:
                raise


PORT_ATTEMPTS = 3


def _launch_once(fn: Callable[..., Any], world_size: int, args: tuple, timeout_s: float, env: dict[str, str]) -> None:
    method = start_method()
    environ = {**os.environ, **env}
    if method == "forkserver":  # what the caller has removed since the forkserver started, and its output
        unset = [name for name in _forkserver_environ() if name not in environ]
        std_fds: tuple[_CallersFd, _CallersFd] | None = (_CallersFd(1), _CallersFd(2))
    else:  # spawned: the caller's already
        unset, std_fds = [], None
    ctx = mp.start_processes(
        _entry,
        args=(fn, world_size, free_port(), args, environ, unset, std_fds),
        nprocs=world_size,
        join=False,
        start_method=method,
    )
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=0.5):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
            raise TimeoutError(f"local job of {world_size} processes ran past {timeout_s:.0f} s")
