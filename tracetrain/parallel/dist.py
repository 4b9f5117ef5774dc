"""Process-group start-up from torchrun's environment, per-rank logs, and a watchdog that ends the job.

`init_distributed` reads what `torchrun` (or any launcher that sets RANK / WORLD_SIZE / LOCAL_RANK /
MASTER_ADDR / MASTER_PORT) exports, pins the rank to its GPU and creates the default process group with
`parallel.timeout_s` as the collective timeout: NCCL on GPUs (with gloo alongside for CPU tensors,
which DCP and CPU offload use), gloo on CPU.

Failure handling. A rank that raises, dies or hangs must not leave the others waiting forever:
- `failure_guard` wraps a rank's work. On an exception it posts "rank R failed: <error>" to the
  rendezvous store (first failure wins) and re-raises, so this rank exits with its traceback.
- `Watchdog` is a daemon thread on every rank. It polls the store once a second; when a peer posted a
  failure it logs "stopping: rank R failed: ..." and ends this rank with `os._exit(1)`: the main
  thread may be blocked inside a collective that will never complete. It also ends the rank, with a
  stack dump, when the training loop made no `beat()` for `timeout_s` (a hang outside collectives;
  evaluations and checkpoint saves are not steps and are not timed so, `between_steps`), and when the
  store itself disappears (the launcher or rank 0 died). At each poll it counts up this rank's
  heartbeat in the store.
- A rank stuck in a collective whose peer died without a word (kill -9, the OOM killer) gets an error at
  once (gloo: the connection closed) or at the collective timeout; the NCCL watchdog aborts the process.
  The guard then looks for the peers whose heartbeat stopped, and posts "rank R is gone" naming them
  (`PeerGone`), not this rank's own "failed": the survivors all name the dead rank.
torchrun additionally stops the surviving workers of a job when one of them exits with an error.
"""

from __future__ import annotations

import datetime
import faulthandler
import logging
import os
import re
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from tracetrain.errors import OutOfMemory, PeerGone

log = logging.getLogger("tracetrain")

_FAILURE_KEY = "tracetrain/failure"
_FAILURE_COUNT_KEY = "tracetrain/failure_count"
_ALIVE_KEY = "tracetrain/alive/"  # + rank: the heartbeat its watchdog counts up at each poll


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the job."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1


def env_world_size() -> int:
    """WORLD_SIZE as a launcher exported it (1 when started as a plain process)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_distributed(timeout_s: int, device_type: str) -> DistInfo:
    """Join the job described by the launcher's environment; a plain process is a job of one.

    `device_type` is "cuda" or "cpu". On CUDA each rank is pinned to GPU LOCAL_RANK before the
    process group is created (NCCL binds communicators to the current device).
    """
    world_size = env_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if world_size == 1:
        return DistInfo(0, 1, 0, device)
    if not dist.is_initialized():
        backend = "cuda:nccl,cpu:gloo" if device_type == "cuda" else "gloo"
        dist.init_process_group(
            backend=backend,
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=device if device_type == "cuda" else None,
        )
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, device)


def shutdown(watchdog: Watchdog | None = None) -> None:
    """End the job cleanly: stop the watchdog, wait for every rank, destroy the process group.

    The watchdog stops before the barrier, so that no rank mistakes rank 0's normal exit (which takes
    the store with it when no agent hosts it) for a failure.
    """
    if watchdog is not None:
        watchdog.stop()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def setup_rank_logging(run_dir: Path | None, rank: int, level: int = logging.INFO) -> logging.Logger:
    """Log to RUN_DIR/logs/rank{R}.log on every rank; rank 0 also logs to the console (stderr).

    Returns the "tracetrain" logger. Safe to call again (handlers are replaced, not added).
    """
    for handler in list(log.handlers):
        log.removeHandler(handler)
        handler.close()
    fmt = logging.Formatter(f"%(asctime)s rank{rank} %(levelname)s %(message)s")
    if run_dir is not None:
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        file_handler = logging.FileHandler(run_dir / "logs" / f"rank{rank}.log")
        file_handler.setFormatter(fmt)
        log.addHandler(file_handler)
    if rank == 0:
        console = logging.StreamHandler(sys.stderr)
        console.setFormatter(fmt)
        log.addHandler(console)
    log.setLevel(level)
    log.propagate = False
    return log


def _flush_logs() -> None:
    for handler in log.handlers:
        handler.flush()


class Watchdog:
    """Ends this rank when a peer failed, the store vanished, or this rank stopped making progress."""

    def __init__(self, rank: int, stall_s: float, poll_s: float = 1.0) -> None:
        self.rank, self.stall_s, self.poll_s = rank, stall_s, poll_s
        self.world_size = dist.get_world_size()
        self.store = dist.distributed_c10d._get_default_store()  # the rendezvous store every rank shares
        self._posted: str | None = None  # the failure this rank posted itself (its own thread skips it)
        self._last_beat = time.monotonic()
        self._where = "start-up"
        self._beating = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tracetrain-watchdog", daemon=True)

    def start(self) -> Watchdog:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def beat(self, where: str) -> None:
        """The loop is alive at `where` (e.g. "step 12"). Stall detection starts with the first beat."""
        self._last_beat, self._where, self._beating = time.monotonic(), where, True

    def idle(self) -> None:
        """This rank stopped stepping (it handles an error): no stall check from now on, while heartbeats
        and the other ranks' failures are still watched."""
        self._beating = False

    @contextmanager
    def between_steps(self, where: str) -> Iterator[None]:
        """A phase of the loop that is not a step (an evaluation, a checkpoint save, the end of the run): no
        stall check while it runs. Its length grows with the model, the evaluation set and the disk, not
        with a step, so `timeout_s` without a beat would end a healthy job. A rank that hangs in it is found
        as in a step: the others wait for it in the phase's collectives (FSDP's gathers, the save's
        barriers) until the collective timeout, and post that failure, which ends it."""
        beating, self._beating, self._where = self._beating, False, where
        try:
            yield
        finally:
            self._last_beat, self._beating, self._where = time.monotonic(), beating, f"after {where}"

    def report(self, message: str) -> bool:
        """Post this rank's failure for the others; False when another rank failed first."""
        try:
            first = self.store.add(_FAILURE_COUNT_KEY, 1) == 1
            if first:
                self._posted = message
                self.store.set(_FAILURE_KEY, message)
            return first
        except Exception:  # the store is gone: there is no one left to tell
            return False

    def peer_failure(self) -> str | None:
        """The failure another rank posted, if any."""
        try:
            if self.store.check([_FAILURE_KEY]):
                posted = self.store.get(_FAILURE_KEY).decode()
                return None if self._is_own(posted) else posted
        except Exception:
            return None
        return None

    def _is_own(self, posted: str) -> bool:
        return posted == self._posted or posted.startswith(f"rank {self.rank} ")

    def gone_peers(self) -> list[int]:
        """The ranks whose heartbeat stands still over three polls: their process is gone (kill -9, the OOM
        killer, a lost node), while a live rank's watchdog counts on even when its main thread is blocked.
        Read with add(key, 0), which never waits for a key that a rank dead before its first poll never
        wrote. Empty when the store is gone too."""
        keys = [f"{_ALIVE_KEY}{r}" for r in range(self.world_size) if r != self.rank]
        try:
            before = [self.store.add(k, 0) for k in keys]
            time.sleep(3 * self.poll_s)
            after = [self.store.add(k, 0) for k in keys]
        except Exception:
            return []
        return [int(k.removeprefix(_ALIVE_KEY)) for k, b, a in zip(keys, before, after, strict=True) if a == b]

    def _end(self, message: str, dump_stacks: bool = False) -> None:
        log.error(message)
        if dump_stacks:
            for handler in log.handlers:
                stream = getattr(handler, "stream", None)
                if stream is not None:
                    faulthandler.dump_traceback(file=stream, all_threads=True)
        _flush_logs()
        print(f"[tracetrain] {message}", file=sys.stderr, flush=True)
        os._exit(1)  # the main thread may sit in a collective that never returns

    def _end_out_of_memory(self, posted: str) -> None:
        # Another rank ran out of memory: rank 0 prints its one line, the others end quietly (no stacks).
        if self.rank == 0:
            print(f"error: {posted}", file=sys.stderr, flush=True)
        _flush_logs()
        os._exit(2)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.store.add(f"{_ALIVE_KEY}{self.rank}", 1)
                posted = self.store.get(_FAILURE_KEY).decode() if self.store.check([_FAILURE_KEY]) else None
            except Exception as e:
                if self._stop.is_set():
                    return
                self._end(
                    f"rank {self.rank}: stopping: lost the rendezvous store ({type(e).__name__}); the "
                    f"launcher or rank 0 has died (this rank last made progress at {self._where})"
                )
                return
            stalled_s = time.monotonic() - self._last_beat
            if posted is not None and self._is_own(posted):
                posted = None
            if posted is not None and OutOfMemory.MARK in posted:
                self._end_out_of_memory(posted)
            if posted is not None:
                # Say where this rank was: when it is the one that hung, this is the diagnosis.
                self._end(
                    f"rank {self.rank}: stopping because {posted} (this rank last made progress "
                    f"{stalled_s:.1f} s ago, at {self._where})",
                    dump_stacks=stalled_s > 2 * self.poll_s,
                )
            if self._beating and stalled_s > self.stall_s:
                message = (
                    f"rank {self.rank} made no progress for {stalled_s:.0f} s (> parallel.timeout_s = "
                    f"{self.stall_s:.0f}); last seen at {self._where}"
                )
                self.report(message)
                self._end(message, dump_stacks=True)


def report_out_of_memory(watchdog: Watchdog | None, error: OutOfMemory) -> None:
    """Post this rank's OOM line for the others (rank 0 prints it if it did not run out itself), without a
    traceback anywhere, and linger two polls so that they read it before this process (maybe the store's
    host) exits. Rank 0 prints its own line first: once another rank has exited, torchrun may end this
    one at any moment. The caller then raises `error`; the CLI prints nothing more (`quiet`)."""
    if watchdog is None:
        return
    if watchdog.rank == 0:
        print(f"error: {error}", file=sys.stderr, flush=True)
    else:  # its log file only: the console is rank 0's
        log.error(str(error))
    error.quiet = True
    watchdog.report(str(error))
    watchdog.stop()
    time.sleep(2.5 * watchdog.poll_s)
    _flush_logs()


@contextmanager
def failure_guard(watchdog: Watchdog | None, rank: int) -> Iterator[None]:
    """Run a rank's work; on an error, tell the other ranks (via the store) before re-raising. An error out
    of torch.distributed (a collective, a barrier, a save) while a peer's heartbeat stopped is that peer's
    death, not this rank's failure: `PeerGone`, one line naming the dead ranks, is posted and raised."""
    try:
        yield
    except BaseException as e:
        if watchdog is None:
            raise
        if isinstance(e, OutOfMemory):  # already told to the others, as one line (report_out_of_memory)
            watchdog.stop()
            raise
        watchdog.idle()  # the wait for a peer's heartbeat below is not a stall of this rank
        cause = watchdog.peer_failure()
        gone = watchdog.gone_peers() if cause is None and _out_of_torch_distributed(e) else []
        cause = cause or watchdog.peer_failure()  # a peer's own report, if one came meanwhile, says more
        if cause is not None:
            log.error(f"rank {rank}: stopping because {cause} (this rank then saw {type(e).__name__}: {e})")
            watchdog.stop()
            _flush_logs()
            raise
        if gone:
            error = PeerGone(_gone_message(gone, rank, e))
            log.error(str(error))  # the rank's log; rank 0's console too, so its CLI prints no second line
            error.quiet = rank == 0
        else:
            log.exception(f"rank {rank} failed")
        watchdog.report(str(error) if gone else f"rank {rank} failed: {type(e).__name__}: {e}")
        # Linger for two polls: without an agent, rank 0's process hosts the store the others read this
        # report from.
        watchdog.stop()
        time.sleep(2.5 * watchdog.poll_s)
        _flush_logs()
        if gone:
            raise error from e
        raise


def _out_of_torch_distributed(error: BaseException) -> bool:
    """The error came out of torch.distributed (a collective, a barrier, DCP): a peer may have died."""
    marker = f"{os.sep}torch{os.sep}distributed{os.sep}"
    return any(marker in frame.filename for frame in traceback.extract_tb(error.__traceback__))


def _gone_message(gone: list[int], rank: int, error: BaseException) -> str:
    ranks = ", ".join(str(r) for r in gone)
    # gloo's "[.../pair.cc:537] Read error [10.0.0.2]:50899: Connection reset by peer. This is typically...":
    # the words after the source location, to the first full stop.
    said = re.sub(r"^\[[^\]]*\]\s*", "", (str(error).splitlines() or [""])[0]).split(". ")[0][:200]
    return (
        f"rank {ranks} {'is' if len(gone) == 1 else 'are'} gone: the process ended without a word (killed: "
        f"kill -9, the OOM killer, a lost node) while rank {rank} waited for it in a collective "
        f"({type(error).__name__}: {said})"
    )
