"""Start a job of N local processes without torchrun (tests, benchmarks, notebooks).

Each process gets the environment torchrun would give it (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT), so the code under test starts exactly as it does under torchrun:
`dist.init_distributed(...)`. If one process raises, the others are terminated and the error is
re-raised here; a job running past `timeout_s` is terminated with TimeoutError.

How the processes start (`start_method`): a spawned process is a fresh interpreter that imports torch before
`fn` starts, seconds of CPU per rank. On Linux the ranks fork instead from multiprocessing's forkserver, a
fresh interpreter started once per calling process that has imported PRELOAD, so they start with torch
imported (on a CI machine of 2 cores, the modules of 2- and 4-rank test jobs ran in about half the time).
A forked rank holds nothing of the caller's state either: it gets `fn`, `args`, sys.path, the working
directory, stdout and stderr as they are at the call, and the caller's environment, because it forks only
while that is the environment the forkserver started with (libraries read some variables once, as they
load: OpenMP's and MKL's thread counts). After a change the ranks are spawned.
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

# Variables that say what the caller is doing at the moment and that nothing reads as it loads: a rank
# takes them from the call, and a change to them is no change of environment (pytest sets
# PYTEST_CURRENT_TEST for every test; counting it would spawn every test's ranks but the first's).
PER_CALL_VARIABLES = ("PYTEST_CURRENT_TEST",)


def start_method() -> str:
    """How ranks start now: "forkserver" on Linux while this process's environment (but for
    PER_CALL_VARIABLES) is the one the forkserver started with, else "spawn".

    The forkserver is multiprocessing's own, one per process, and the first call starts it with PRELOAD. If
    other code started it before, its environment is taken to be the one at the first call here, and ranks
    import what it did not preload themselves."""
    if not _forkserver_available():
        return "spawn"
    return "forkserver" if _without_per_call(os.environ) == _forkserver_environ() else "spawn"


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
    return _without_per_call(os.environ)


def _without_per_call(environ: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in environ.items() if k not in PER_CALL_VARIABLES}


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
    env: dict[str, str | None],
    std_fds: tuple[int, int] | None,
) -> None:
    if std_fds is not None:
        for fd, target in zip(std_fds, (1, 2), strict=True):
            os.dup2(fd, target)
            os.close(fd)
    for name, value in env.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
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
    rank_env = {**{name: os.environ.get(name) for name in PER_CALL_VARIABLES}, **env}
    std_fds = (_CallersFd(1), _CallersFd(2)) if method == "forkserver" else None  # spawned: inherited
    ctx = mp.start_processes(
        _entry,
        args=(fn, world_size, free_port(), args, rank_env, std_fds),
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
