"""launch_local (parallel/launch.py): a start whose rendezvous port was taken meanwhile is retried on a new
port (seen in CI: a parallel test worker took the port between free_port() and rank 0's bind, and a whole
module of multi-process tests errored with EADDRINUSE). On Linux the ranks fork from the forkserver while the
caller's variables that libraries read as they load are those it started with, and then hold what a spawned
rank would: the caller's environment, stdout and stderr at the call, and the thread count they give."""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import pytest
import torch.multiprocessing as mp
from parallel_harness import rendezvous_and_count

from tracetrain.parallel import launch


def test_a_taken_rendezvous_port_is_retried_on_a_new_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        ports = [taken.getsockname()[1]]  # the first start gets a port in use
        real = launch.free_port
        monkeypatch.setattr(launch, "free_port", lambda: ports.pop() if ports else real())
        out = tmp_path / "sum.txt"
        launch.launch_local(rendezvous_and_count, 2, str(out), timeout_s=120)
    assert out.read_text() == "2" and not ports


def test_other_failures_are_not_retried(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    starts = []
    real = launch._launch_once
    monkeypatch.setattr(launch, "_launch_once", lambda *a: (starts.append(1), real(*a)))
    with pytest.raises(mp.ProcessRaisedException):
        launch.launch_local(rendezvous_and_count, 2, str(tmp_path / "no-such-dir" / "sum.txt"), timeout_s=120)
    assert len(starts) == 1


def rank_facts(out: str) -> None:
    """What a rank started with (rank 0 writes it), and a line from each rank on stdout and on stderr."""
    import torch

    rank = os.environ["RANK"]
    print(f"rank {rank} on stdout", flush=True)
    print(f"rank {rank} on stderr", file=sys.stderr, flush=True)
    if rank == "0":
        facts = {
            "parent": os.getppid(),
            "threads": torch.get_num_threads(),
            "test": os.environ.get("PYTEST_CURRENT_TEST"),
            "probe": os.environ.get("TRACETRAIN_LAUNCH_PROBE"),
            "env": os.environ.get("TRACETRAIN_LAUNCH_ENV"),
        }
        Path(out).write_text(json.dumps(facts))


def _facts(tmp_path: Path, name: str, **kw: object) -> dict:
    out = tmp_path / name
    launch.launch_local(rank_facts, 2, str(out), timeout_s=120, **kw)  # type: ignore[arg-type]
    return json.loads(out.read_text())


LINUX_ONLY = pytest.mark.skipif(sys.platform != "linux", reason="the forkserver start is Linux's")


@LINUX_ONLY
def test_ranks_fork_with_the_callers_environment_and_output(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    with capfd.disabled():  # the forkserver (if this test starts it) writes outside this test's capture
        assert launch.start_method() == "forkserver"
    # Variables read at run time, changed since the forkserver started: still forked, with the caller's.
    monkeypatch.delenv("PYTEST_CURRENT_TEST")  # set (for the test that ran) when the forkserver started
    monkeypatch.setenv("TRACETRAIN_LAUNCH_PROBE", "on")
    facts = _facts(tmp_path, "forked.json", env={"TRACETRAIN_LAUNCH_ENV": "given"})
    assert facts["parent"] != os.getpid()  # forked by the forkserver, not spawned from here
    assert facts["test"] is None and facts["probe"] == "on" and facts["env"] == "given"
    out, err = capfd.readouterr()
    assert all(f"rank {r} on stdout" in out and f"rank {r} on stderr" in err for r in (0, 1)), (out, err)


@LINUX_ONLY
def test_a_changed_environment_spawns_the_ranks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """OpenMP reads OMP_NUM_THREADS as it loads: a rank forked from a forkserver started without this value
    would run with the forkserver's thread count."""
    launch.start_method()  # the forkserver runs, started with the environment as it is now
    threads = 2 if os.environ.get("OMP_NUM_THREADS") == "1" else 1
    monkeypatch.setenv("OMP_NUM_THREADS", str(threads))
    assert launch.start_method() == "spawn"
    facts = _facts(tmp_path, "spawned.json")
    assert facts["parent"] == os.getpid() and facts["threads"] == threads
    monkeypatch.undo()
    assert launch.start_method() == "forkserver"
