"""launch_local (parallel/launch.py): a start whose rendezvous port was taken meanwhile is retried on a new
port (seen in CI: a parallel test worker took the port between free_port() and rank 0's bind, and a whole
module of multi-process tests errored with EADDRINUSE)."""

from __future__ import annotations

import socket
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
