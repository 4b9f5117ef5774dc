"""What stops a run early, and how the run survives it: signals and errors after the first step.

Two ways a run ends before its last step, both leaving a checkpoint to resume from:
- a signal (SIGINT from Ctrl-C, SIGTERM from a scheduler, SIGHUP from a closed terminal) sets a flag; the
  loop saves at the next step boundary and the CLI exits with 128 + the FIRST signal's number (130, 143,
  129), whatever signals follow;
- an error (the reader of stdout quit, a user callback raised, the disk filled up while logging, a tracker
  that let an exception escape) is caught at the top of the loop; the run saves an interruption checkpoint
  of the steps done so far, then ends with one line naming the cause (`RunStopped`, exit status 1).
Under torchrun a signal stops every rank at the same step boundary (`StopFlag.agreed`), and the ranks save
one checkpoint together; ranks that got different signals before that boundary (SIGINT on one, SIGTERM on
another) all take the largest number, so that every rank exits with one status and summary.json names it.
An error saves only in single-process runs: a save is collective, and a rank that failed cannot lead one
(parallel/dist.py's failure_guard stops the other ranks instead; the last periodic checkpoint stays).
A data worker ignores these signals (data/loader.py): the run's process decides, and ends its workers.
"""

from __future__ import annotations

import contextlib
import errno
import os
import select
import signal
import sys
from typing import Any

from tracetrain.errors import TracetrainError

# The signals that mean "stop, but keep the work": Ctrl-C, a scheduler's stop, a closed terminal.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class RunStopped(TracetrainError):
    """An error stopped the run after its first step; the steps done were saved (the message says where)."""

    exit_code = 1  # not 2: the config was fine, the run was stopped by its surroundings


class CallbackError(TracetrainError):
    """A user callback (`train(..., callbacks=[...])`) raised; the message names it and its error."""


class StopFlag:
    """SIGINT/SIGTERM/SIGHUP set a flag; the loop saves a checkpoint at the next step boundary. Further
    signals are ignored, so that a second Ctrl-C cannot cut the save in half (the first of them says how to
    stop at once anyway: kill -9). With `hold`, they stay ignored after the run returns, until the process
    exits: the exit status then says the first signal even when a second lands during the exit (the CLI).
    Without it (the Python API) the previous handlers come back, so a notebook can be interrupted again."""

    def __init__(self, hold: bool = False) -> None:
        self.signum: int | None = None
        self.warned = False
        self.hold = hold
        self.pid = os.getpid()
        self.previous = {s: signal.getsignal(s) for s in STOP_SIGNALS}
        for s in self.previous:
            signal.signal(s, self._handle)

    @property
    def name(self) -> str | None:
        return signal.Signals(self.signum).name if self.signum else None

    def _handle(self, signum: int, frame: Any) -> None:
        if os.getpid() != self.pid:
            # A forked child (a DataLoader worker) inherits the handler; Ctrl-C reaches the whole process
            # group. The run's own process decides and speaks; a worker ignores the signal, silently.
            return
        name = signal.Signals(signum).name
        if self.signum is None:
            self.signum = signum
            _say(f"{name} received: finishing this step, then saving a checkpoint\n")
        elif not self.warned:
            self.warned = True
            _say(f"{name} ignored: saving a checkpoint first; to stop now without it: kill -9 {os.getpid()}\n")

    def agreed(self, distributed: bool) -> bool:
        """Whether the run stops at this step boundary. Under torchrun the save is collective, so every rank
        must stop at the same step; yet a signal can reach one rank only (a worker killed alone), or reach
        the ranks on either side of a boundary (torchrun forwards SIGTERM to its workers one by one). So at
        every boundary the ranks take the largest signal number any of them holds, and every rank adopts it,
        whether it got none or another one (SIGINT here, SIGTERM there): all ranks then exit with one status,
        the one rank 0's summary names. The decision is the reduced value alone: a signal that lands during
        the reduction (its handler runs when the call returns) was not sent, so the other ranks go on; this
        rank stops with them at the next boundary, not alone at this one. A CPU tensor: gloo carries it, in
        an NCCL job too (parallel/dist.py), without waiting for the device; 4 bytes and one round trip a
        step."""
        if not distributed:
            return self.signum is not None
        import torch
        import torch.distributed as dist

        flag = torch.tensor([self.signum or 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        agreed = int(flag.item())
        if agreed and self.signum is None:
            name = signal.Signals(agreed).name
            _say(f"another rank received {name}: finishing this step, then saving a checkpoint\n")
        if agreed:
            self.signum = agreed
        return agreed != 0

    def restore(self) -> None:
        if self.hold and self.signum is not None:
            # Ignored by the OS, not by a Python handler: the interpreter resets its own handlers to the
            # default (die by the signal, status -2) while it shuts down, but leaves SIG_IGN in place.
            for s in self.previous:
                signal.signal(s, signal.SIG_IGN)
            return
        for s, handler in self.previous.items():
            signal.signal(s, handler)


def _say(text: str) -> None:
    """os.write: safe inside a signal handler (no buffered stream that may be mid-write). A closed stderr
    (SIGHUP: the terminal is gone) must not raise out of the handler into whatever the loop was doing."""
    with contextlib.suppress(OSError):
        os.write(2, text.encode())


def stdout_reader_gone() -> bool:
    """True when stdout is a pipe whose reading end is closed (`tracetrain presets | head -1`)."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # replaced by a non-file object (tests capturing output)
        return False
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return any(events & select.POLLERR for _, events in poller.poll(0))


def silence_stdout() -> None:
    """Point stdout at devnull: the interpreter flushes it once more at exit, which would fail again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def describe(error: BaseException) -> str:
    """The cause of a stop, in words a user can act on."""
    if isinstance(error, BrokenPipeError) or (isinstance(error, OSError) and error.errno == errno.EIO):
        return "the output was closed (the reader of stdout quit, or the terminal went away)"
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
        where = f" writing {error.filename}" if error.filename else ""
        return f"the disk is full{where} ({error.strerror})"
    if isinstance(error, TracetrainError):
        return str(error)
    return f"{type(error).__name__}: {error}"
