"""Start a job of N local processes without torchrun (tests, benchmarks, notebooks).

Each process gets the environment torchrun would give it (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT), so the code under test starts exactly as it does under torchrun:
`dist.init_distributed(...)`. If one process raises, the others are terminated and the error is
re-raised here; a job running past `timeout_s` is terminated with TimeoutError.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(
    local_rank: int, fn: Callable[..., Any], world_size: int, port: int, args: tuple, env: dict[str, str]
) -> None:
    os.environ.update(env)
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
    """Run `fn(*args)` in `world_size` fresh processes (spawned, importable `fn`) and wait for all.

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
    ctx = mp.start_processes(
        _entry, args=(fn, world_size, free_port(), args, env), nprocs=world_size, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=0.5):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
            raise TimeoutError(f"local job of {world_size} processes ran past {timeout_s:.0f} s")
