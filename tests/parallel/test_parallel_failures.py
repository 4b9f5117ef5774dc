"""Failure behaviour and a multi-node rehearsal, with real process boundaries.

Failure drills start 2 plain processes (no launcher that would stop the others for us): rank 1 raises,
hangs, or exits hard at step 2 while rank 0 keeps issuing all-reduces, with parallel.timeout_s = 5.
Every rank must end, non-zero, within the timeout plus start-up, and the logs must say which rank
failed and why. The three drills run concurrently.

Multi-node rehearsal: two torchrun agents (--nnodes=2, one process each, c10d rendezvous on this host)
run the smoke job (2 data-parallel steps); both ranks must agree with each other and with one process.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import TESTS
from parallel_harness import global_batches, reference_of, tiny_config, train_and_record

from tracetrain.parallel.launch import PORT_ATTEMPTS, free_port

TIMEOUT_S = 5
MODES = ("raise", "hang", "exit")


def _port_was_taken(output: str) -> bool:
    """The rendezvous port, free a moment before, was taken before rank 0 (or the agent) bound it: such a
    start failed before anything under test ran, and starts again on a new port (as launch_local does)."""
    return "EADDRINUSE" in output or "address already in use" in output.lower()


def _start_drill(mode: str, run_dir: Path) -> list[subprocess.Popen]:
    port = free_port()
    code = (
        f"import sys; sys.path.insert(0, {str(TESTS)!r}); from parallel_harness import failure_drill; "
        f"failure_drill({mode!r}, {str(run_dir)!r}, {TIMEOUT_S})"
    )
    procs = []
    for rank in range(2):
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    return procs


@pytest.fixture(scope="module")
def drills(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Run the three drills at once; note when each process ended (polled), and kill any still running
    after 180 s (a hang: the tests then fail on its return code and end time). A drill whose rendezvous
    port was taken meanwhile is started again on a new one (up to PORT_ATTEMPTS starts)."""
    root = tmp_path_factory.mktemp("drills")
    running = {mode: _start_drill(mode, root / mode) for mode in MODES}
    starts = dict.fromkeys(MODES, 1)
    ended: dict[tuple[str, int], float] = {}
    output: dict[tuple[str, int], str] = {}
    deadline = time.monotonic() + 180
    while len(ended) < 2 * len(MODES) and time.monotonic() < deadline:
        for mode, procs in running.items():
            for rank, p in enumerate(procs):
                if (mode, rank) not in ended and p.poll() is not None:
                    ended[mode, rank] = time.monotonic()
                    output[mode, rank] = p.communicate()[0]
            if starts[mode] < PORT_ATTEMPTS and any(_port_was_taken(output.get((mode, r), "")) for r in range(2)):
                for rank, p in enumerate(procs):
                    if output.pop((mode, rank), None) is None:  # still running (the other rank waits on the port)
                        p.kill()
                        p.communicate()
                    ended.pop((mode, rank), None)
                shutil.rmtree(root / mode, ignore_errors=True)
                running[mode] = _start_drill(mode, root / mode)
                starts[mode] += 1
        time.sleep(0.1)
    out = {}
    for mode, procs in running.items():
        for rank, p in enumerate(procs):
            if (mode, rank) not in output:
                p.kill()
                output[mode, rank] = p.communicate(timeout=30)[0]
        injected = root / mode / "injected_at"
        out[mode] = {
            "codes": [p.returncode for p in procs],
            "output": [output[mode, r] for r in range(2)],
            "injected_at": float(injected.read_text()) if injected.is_file() else None,
            "ended_at": [ended.get((mode, r)) for r in range(2)],
            "logs": [(root / mode / "logs" / f"rank{r}.log").read_text() for r in range(2)],
        }
    return out


@pytest.mark.parametrize("mode", MODES)
def test_a_failing_rank_ends_every_rank(drills: dict, mode: str) -> None:
    d = drills[mode]
    assert all(code != 0 for code in d["codes"]), d["codes"]
    # Measured from the injected failure, not from start-up (which depends on the machine's load): every
    # rank ends within the collective timeout plus the watchdog's reaction and teardown; a hang never ends
    # and is killed at 180 s.
    assert d["injected_at"] is not None and None not in d["ended_at"], d
    assert max(d["ended_at"]) - d["injected_at"] < TIMEOUT_S + 30, d["ended_at"]


def test_failure_messages_name_the_rank_and_cause(drills: dict) -> None:
    raised = drills["raise"]["logs"]
    assert "rank 1 failed" in raised[1] and "ValueError: injected failure" in raised[1]
    assert "rank 0: stopping because rank 1 failed: ValueError: injected failure" in raised[0]
    hung = drills["hang"]["logs"]
    # Rank 0 times out in its all-reduce; rank 1 (the hung one) stops and says where it was stuck,
    # or its own watchdog reports the stall first.
    assert "Timed out" in hung[0] or "stopping because rank 1 made no progress" in hung[0]
    assert ("last made progress" in hung[1] and "at step 2" in hung[1]) or "made no progress" in hung[1]
    exited = drills["exit"]["logs"]
    # Rank 1 vanished mid-collective: rank 0 names it (its heartbeat stopped), not itself as the failed one.
    assert "rank 1 is gone" in exited[0] and "Connection" in exited[0] and "rank 0 failed" not in exited[0]


def _torchrun_node(node_rank: int, port: int, out: Path) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=2",
        f"--node_rank={node_rank}",
        "--nproc-per-node=1",
        "--rdzv_backend=c10d",
        f"--rdzv_endpoint=127.0.0.1:{port}",
        "--rdzv_id=rehearsal",
        "-m",
        "tracetrain.train.smoke",
        "--out",
        str(out),
        "--steps=2",
    ]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_two_torchrun_agents_agree_with_one_process(tmp_path: Path) -> None:
    for _ in range(PORT_ATTEMPTS):  # a port free a moment ago can be taken before the agent binds it
        port = free_port()
        nodes = [_torchrun_node(r, port, tmp_path) for r in range(2)]
        outputs = [n.communicate(timeout=180)[0] for n in nodes]
        if not any(_port_was_taken(o) for o in outputs):
            break
    assert [n.returncode for n in nodes] == [0, 0], outputs[0][-2000:] + outputs[1][-2000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["world_size"] == 2 and ranks[0]["losses"] == ranks[1]["losses"]
    assert ranks[0]["param_checksum"] == ranks[1]["param_checksum"]
    assert any("ranks agree" in o for o in outputs)
    cfg = tiny_config(["--parallel.dp_shard=2"])
    single = train_and_record(reference_of(cfg), [global_batches(cfg, 4, 1, seed=s) for s in range(2)])
    assert ranks[0]["losses"] == pytest.approx(single["losses"], abs=1e-5)
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == ["rank0.log", "rank1.log"]
