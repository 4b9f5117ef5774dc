"""The run directory on disk: claimed atomically, locked for the run's life, root files replaced atomically.

One process per run directory. A fresh directory is claimed with an exclusive `mkdir` (or, when it already
exists and is empty, by creating `RUN/.lock` with O_EXCL), so two runs started together with one
`train.run_name` cannot share it: exactly one wins. The winner, and every later `--resume`, holds an
exclusive `flock` on `RUN/.lock` until it exits; the file names the holder (PID and host) so that a refused
process can say who has it. The kernel drops a flock when its holder dies, even under kill -9, so a .lock
file left behind never blocks a resume. The file itself is never deleted: unlinking a lock file lets a
third process lock a fresh inode while the second still holds the old one.
Under torchrun only rank 0 locks: the other ranks are part of the same run.
A directory left by a start that never finished a step (killed in its setup, or a torchrun job whose
setup failed: the ranks' logs stay) holds no result; a new start of the same name takes it over once its
lock is free.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path

from tracetrain.errors import TracetrainError
from tracetrain.train.manifest import fsync_path

LOCK_NAME = ".lock"


@dataclass
class RunLock:
    """A run directory this process holds. `fd` None: not locked (a torchrun rank other than 0)."""

    path: Path
    fd: int | None
    created: bool  # this process made the directory, so it may remove it again if setup fails

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the only descriptor drops the flock
            self.fd = None


def open_no_follow(path: Path, flags: int) -> int:
    """os.open with O_NOFOLLOW: a file of the run directory that is a symbolic link (a run folder copied from
    someone else, `.lock -> ~/.bashrc`) is refused with one line instead of written through."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise TracetrainError(
                f"{path} is a symbolic link; tracetrain writes only real files inside a run directory "
                "(remove the link and try again)"
            ) from None
        raise


def atomic_write_text(path: Path, text: str) -> None:
    """Replace `path` with `text` so that a reader (or a crash) sees the old file or the new, never a mix:
    write a temporary sibling (created exclusively, never through a link), fsync it, rename it over `path`,
    fsync the folder. A failed write (disk full) removes the temporary file and raises."""
    if path.is_symlink():
        open_no_follow(path, os.O_RDONLY)  # raises the one-line refusal
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)  # a leftover of an earlier process with this PID (unlink never follows a link)
    fd = open_no_follow(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        with open(fd, "w", closefd=True) as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_path(path.parent)


def _holder(fd: int) -> str:
    """'PID 123 on host h' from the lock file (empty while the holder is still writing it)."""
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return f"PID {info['pid']} on host {info['host']}"
    except (ValueError, KeyError):
        return "another process (PID not yet written)"


def in_use_error(run_dir: Path, holder: str) -> TracetrainError:
    """The one line refusing a run directory another process holds."""
    return TracetrainError(
        f"run directory {run_dir} is in use by {holder} (lock file {run_dir / LOCK_NAME}); "
        "wait for that run to end or stop it, then try again"
    )


def lock_holder(run_dir: Path) -> str | None:
    """Who holds `run_dir`'s lock ('PID 123 on host h'), or None when nobody does (or it has no lock file).
    It only looks: a shared lock taken and dropped at once, which fails while a run holds its exclusive one."""
    try:
        fd = open_no_follow(run_dir / LOCK_NAME, os.O_RDONLY)
    except (OSError, TracetrainError):
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _holder(fd)
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def _lock(run_dir: Path, fd: int, created: bool) -> RunLock:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        raise in_use_error(run_dir, holder) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname()}).encode(), 0)
    return RunLock(run_dir, fd, created)


def lock_run_dir(run_dir: Path) -> RunLock:
    """Lock an existing run directory (resume), or refuse with one line naming the process that holds it."""
    return _lock(run_dir, open_no_follow(run_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT), created=False)


def claim_new_run_dir(run_dir: Path) -> RunLock | None:
    """Create and lock a fresh run directory; None if it exists with content or another process claimed it
    first. The directory and its parent are fsynced, so a claimed directory survives a crash."""
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    created = True
    try:
        run_dir.mkdir()  # exclusive: of two processes, one gets FileExistsError
    except FileExistsError:
        if not run_dir.is_dir():
            return None
        if any(run_dir.iterdir()):
            return _take_over_unstarted(run_dir)
        created = False  # made empty beforehand (by the user, or by another rank of this job)
    try:
        # O_EXCL decides between processes that both found the directory empty.
        fd = open_no_follow(run_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_EXCL)
    except FileExistsError:
        return None
    lock = _lock(run_dir, fd, created)
    fsync_path(run_dir)
    fsync_path(run_dir.parent)
    return lock


# Everything a single-process run writes into its directory before its first step.
SETUP_FILES = frozenset(
    {LOCK_NAME, "config.toml", "data_stats.json", "spec.json", "metrics.jsonl", "tensorboard", "profile"}
)


# What a start that never finished a step leaves when it dies before it can clean up: SIGKILL, or a torchrun
# job stopped or failed in its setup (its directory is claimed before setup, so that the ranks log into
# it): the files a setup writes, their temporary siblings (`atomic_write_text` cut short) and the ranks'
# logs/; no metrics row, no checkpoint.
UNSTARTED_FILES = SETUP_FILES | {"logs"}


def _left_by_setup(name: str) -> bool:
    temporary = re.fullmatch(r"\.(.+)\.tmp-\d+", name)
    return name in UNSTARTED_FILES or (temporary is not None and temporary.group(1) in SETUP_FILES)


def _take_over_unstarted(run_dir: Path) -> RunLock | None:
    """Claim a directory left by a start that never finished a step: nothing in it is a result (a new start
    writes its files anew and appends to the ranks' logs), and refusing it would leave the name unusable,
    also to `--resume auto` (no checkpoint: a fresh start). None for any other directory, and while a live
    process holds its lock (a start in progress, or the winner of two starts at once)."""
    metrics = run_dir / "metrics.jsonl"
    if not all(_left_by_setup(p.name) for p in run_dir.iterdir()) or (metrics.exists() and os.lstat(metrics).st_size):
        return None
    fd = open_no_follow(run_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return _lock(run_dir, fd, created=True)  # may remove it again if this start fails too


def discard_unstarted(lock: RunLock) -> None:
    """Remove a run directory whose setup failed, if this process created it and it holds nothing but the
    files this process's setup writes (never a directory someone else made or wrote into)."""
    names = {p.name for p in lock.path.iterdir()} if lock.path.is_dir() else set()
    lock.release()
    if lock.created and names <= SETUP_FILES:
        shutil.rmtree(lock.path, ignore_errors=True)
