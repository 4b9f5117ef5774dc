"""What makes a checkpoint folder trustworthy: its manifest, and the life cycle of its temporary folders.

A checkpoint is visible (`checkpoints/step_NNNNNNNN/`) only once it is complete. Every save writes into
a hidden temporary folder, writes `manifest.json` LAST (each file's relative path, size and sha256, and
the step), fsyncs it and the folder, then renames the folder into place. A folder that must go away
(rotation by `checkpoint.keep_last`, or the old copy of a step saved again) is first renamed aside to a
hidden `.trash-...` name and only then deleted, so a kill -9 at any instant leaves every visible
`step_*` folder complete. Hidden folders carry their owner (`@HOST@PID`) in their name; the next save
removes those whose process is dead on this host.

Loaders trust a folder only after `verify_checkpoint`: every listed file present with its size and
sha256. Folders written by tracetrain versions before manifests ("legacy") have no manifest.json: they
are used only when named explicitly or when a run has nothing newer, with a note that they are unverified.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import itertools
import json
import os
import re
import shutil
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

from tracetrain.errors import CheckpointError

MANIFEST = "manifest.json"
STEP_DIR = re.compile(r"^step_(\d{8})$")
# `.tmp-step_00000100@host@1234` (a save in progress) or `.trash-step_00000100@host@1234@2` (being deleted).
_HIDDEN_DIR = re.compile(r"^\.(tmp|trash)-step_\d{8}@(?P<host>[^@]+)@(?P<pid>\d+)(@\d+)?$")
_HASH_CHUNK_BYTES = 8 << 20
_trash_ids = itertools.count()
# Folders this process already hashed, keyed by their manifest's identity: resume verifies the newest
# checkpoint and then loads it; a 100 GB checkpoint is hashed once, not twice.
_verified: dict[Path, tuple[int, int, int]] = {}
_noted: set[str] = set()


def note(message: str) -> None:
    """One console line (stderr) about a checkpoint the user should know about; each said once."""
    if message not in _noted:
        _noted.add(message)
        print(f"note: {message}", file=sys.stderr, flush=True)


def step_of(folder: Path) -> int | None:
    m = STEP_DIR.match(folder.name)
    return int(m.group(1)) if m else None


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(folder: Path, step: int) -> None:
    """List every file of `folder` (already written and fsynced) in its manifest; fsync it and the folder."""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)
    entries = [
        {"path": p.relative_to(folder).as_posix(), "bytes": p.stat().st_size, "sha256": sha256_file(p)} for p in files
    ]
    path = folder / MANIFEST
    path.write_text(json.dumps({"format": 1, "step": step, "files": entries}, indent=1) + "\n")
    fsync_path(path)
    fsync_path(folder)


# A manifest lists a few files per rank: a megabyte is thousands of ranks. A larger one is not ours.
_MANIFEST_MAX_BYTES = 16 << 20


def _entry_ok(entry: dict) -> bool:
    """A file of the folder (a relative path without `..`: a manifest never names a file elsewhere), its
    size in bytes and its sha256 in hex."""
    path, size, digest = entry["path"], entry["bytes"], entry["sha256"]
    parts = path.split("/") if isinstance(path, str) else [""]
    inside = path == path.strip() and "\x00" not in path and all(p not in ("", ".", "..") for p in parts)
    whole = isinstance(size, int) and not isinstance(size, bool) and size >= 0
    return inside and whole and isinstance(digest, str) and re.fullmatch(r"[0-9a-f]{64}", digest) is not None


def _read_manifest(folder: Path) -> dict:
    path = folder / MANIFEST
    try:
        if path.stat().st_size > _MANIFEST_MAX_BYTES:
            raise ValueError("larger than 16 MiB")
        manifest = json.loads(path.read_text())
        step = manifest["step"]
        ok = isinstance(step, int) and not isinstance(step, bool) and all(_entry_ok(f) for f in manifest["files"])
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, RecursionError) as e:
        raise CheckpointError(f"{path}: not a valid checkpoint manifest ({type(e).__name__})") from None
    if not ok:
        raise CheckpointError(f"{path}: not a valid checkpoint manifest (wrong field types, or a path outside it)")
    if step_of(folder) is not None and manifest["step"] != step_of(folder):
        raise CheckpointError(f"{path}: records step {manifest['step']}, the folder is {folder.name}")
    return manifest


def _check_sizes(folder: Path, manifest: dict) -> None:
    for entry in manifest["files"]:
        file = folder / entry["path"]
        if not file.is_file():
            raise CheckpointError(f"checkpoint {folder} is incomplete: {entry['path']} is missing")
        if file.stat().st_size != entry["bytes"]:
            raise CheckpointError(
                f"{file}: {file.stat().st_size} bytes, the manifest records {entry['bytes']} (truncated or overwritten)"
            )


def is_legacy(folder: Path) -> bool:
    """A step folder written before manifests existed (no manifest.json at all)."""
    return folder.is_dir() and not (folder / MANIFEST).exists()


def looks_complete(folder: Path) -> bool:
    """Cheap check for listings: a readable manifest whose files all exist with their recorded sizes."""
    try:
        _check_sizes(folder, _read_manifest(folder))
    except CheckpointError:
        return False
    return True


def verify_checkpoint(folder: Path) -> bool:
    """Check every file against the manifest (sizes and sha256); True when verified, False for a legacy
    folder (no manifest: the caller checks what it can and says it is unverified). Raises CheckpointError
    naming the first file that does not match."""
    if is_legacy(folder):
        return False
    manifest_stat = (folder / MANIFEST).stat()
    key, identity = folder.resolve(), (manifest_stat.st_ino, manifest_stat.st_mtime_ns, manifest_stat.st_size)
    if _verified.get(key) == identity:
        return True
    manifest = _read_manifest(folder)
    _check_sizes(folder, manifest)
    for entry in manifest["files"]:
        if sha256_file(folder / entry["path"]) != entry["sha256"]:
            raise CheckpointError(
                f"{folder / entry['path']}: sha256 differs from the manifest "
                "(the file is corrupt or was modified after the save)"
            )
    _verified[key] = identity
    return True


# ----------------------------------------------------------------------------------------------------
# Temporary and trash folders


def _owner() -> str:
    return f"{socket.gethostname()}@{os.getpid()}"


def temp_dir_for(final: Path) -> Path:
    """The hidden folder a save of `final` is written into, named after this process."""
    return final.with_name(f".tmp-{final.name}@{_owner()}")


def discard(folder: Path) -> None:
    """Delete a folder so that no half-deleted copy is ever visible: rename it aside, then remove it."""
    trash = folder.with_name(f".trash-{folder.name}@{_owner()}@{next(_trash_ids)}")
    os.rename(folder, trash)
    shutil.rmtree(trash, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def remove_stale(root: Path) -> list[Path]:
    """Remove the `.tmp-*` / `.trash-*` folders left by dead processes of this host; returns them.
    Folders of live processes, of other hosts (a shared filesystem), or without an owner are kept."""
    removed = []
    host = socket.gethostname()
    for p in sorted(root.iterdir()) if root.is_dir() else []:
        m = _HIDDEN_DIR.match(p.name)
        if not m or m.group("host") != host or not p.is_dir():
            continue
        pid = int(m.group("pid"))
        if pid != os.getpid() and _pid_alive(pid):
            continue
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p)
    return removed


# ----------------------------------------------------------------------------------------------------
# Disk space


def check_free_space(root: Path, name: str, needed_bytes: int) -> None:
    """Refuse to start a save that cannot fit: a full disk would also break every later save and resume."""
    free_bytes = shutil.disk_usage(root).free
    if needed_bytes > free_bytes:
        raise CheckpointError(
            f"not enough disk space in {root} for checkpoint {name}: needs about "
            f"{needed_bytes} bytes, {free_bytes} free"
        )


def _is_disk_full(error: BaseException) -> bool:
    pending: list[BaseException] = [error]
    while pending:
        e = pending.pop()
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        # torch.save's zip writer and safetensors report a full disk in their own words.
        if "unexpected pos" in str(e) or "No space left on device" in str(e):
            return True
        pending += [x for x in (e.__cause__, e.__context__) if x is not None]
        pending += [exc for exc, _ in getattr(e, "failures", {}).values()]  # DCP's CheckpointException
    return False


@contextlib.contextmanager
def staging(tmp: Path, name: str, *, owner: bool = True) -> Iterator[Path]:
    """Create `tmp` for writing checkpoint `name` (the `owner`: one rank of several); on any error remove
    it again (a failed save must not leave up to a whole checkpoint behind). A full disk becomes one
    CheckpointError line."""
    if owner:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    try:
        yield tmp
    except BaseException as e:
        if owner:
            shutil.rmtree(tmp, ignore_errors=True)
        if not isinstance(e, (KeyboardInterrupt, SystemExit)) and _is_disk_full(e):
            free_bytes = shutil.disk_usage(tmp.parent).free
            raise CheckpointError(
                f"disk full while saving checkpoint {name} into {tmp.parent} ({free_bytes} "
                "bytes free); the partial save was removed, earlier checkpoints are intact"
            ) from None
        raise
