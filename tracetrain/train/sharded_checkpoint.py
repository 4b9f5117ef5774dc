"""Sharded checkpoints with torch.distributed.checkpoint (DCP): save on one layout, load on any other.

Every rank writes only its own shards of the model and of the optimizer states, in parallel; the
checkpoint's metadata records each tensor's global shape and which slice each file holds, keyed by
the plain model's parameter names (`layers.3.mlp.up_proj.weight`, optimizer states as
`state.layers.3.mlp.up_proj.weight.exp_avg`). Loading asks the *current* layout's state dict
(DTensors of this mesh, or plain tensors in a single process) to be filled, and DCP reads whichever
slices overlap: dp_shard=4 -> dp_shard=2 x tp=2, -> pp=2, -> one process without a process group.

Layout of one checkpoint, `RUN_DIR/checkpoints/step_00000100/` (mirrors train/checkpoint.py):
  dcp/                       .metadata + one __<rank>_0.distcp file per rank (model and optimizer)
  trainer_state_rank<R>.pt   that rank's step, scheduler, loader position, RNG states (torch.save)
  config.toml                the resolved config the run was started with
  manifest.json              written last by rank 0: every file's size and sha256 (train/manifest.py)
Atomic and verified like the single-process checkpoints: every rank writes into the hidden folder rank 0
created (`checkpoints/.tmp-step_...@HOST@PID`, its name broadcast), the ranks meet at a barrier, rank 0
fsyncs, writes the manifest and renames the folder into place, then prunes old ones.

DCP reads `.metadata` with plain pickle, which runs whatever code a crafted file names. Every load here
goes through `SafeFileSystemReader`, whose unpickler admits only the classes DCP's metadata is made of,
and a load planner that reads DCP's non-tensor items with `weights_only=True`.
"""

from __future__ import annotations

import io
import math
import pickle
import re
import warnings
from pathlib import Path
from typing import IO, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch import nn
from torch.distributed.checkpoint import CheckpointException, FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from tracetrain.errors import CheckpointError
from tracetrain.progress import Progress, watch_bytes
from tracetrain.safe_load import load_pt
from tracetrain.train.checkpoint import SAVE_MARGIN_BYTES, check_checkpoint, publish, tensor_bytes
from tracetrain.train.manifest import check_free_space, fsync_path, remove_stale, staging, temp_dir_for, write_manifest


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _fsync_tree(path: Path) -> None:
    for p in sorted(path.rglob("*"), reverse=True):  # files first, then their folders
        fsync_path(p)
    fsync_path(path)


def sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """{"model": ..., "optim": ...}: this rank's shards under plain-model names (DTensors when sharded)."""
    if optimizer is None:
        return {"model": get_model_state_dict(model, options=StateDictOptions())}
    model_sd, optim_sd = get_state_dict(model, optimizer, options=StateDictOptions())
    return {"model": model_sd, "optim": optim_sd}


def _shared_temp_dir(final: Path) -> Path:
    """Rank 0 names the hidden folder after itself (so a later run can tell when it is stale) and
    creates it; every rank learns the name from rank 0."""
    name = [temp_dir_for(final).name if _rank() == 0 else ""]
    if dist.is_initialized():
        dist.broadcast_object_list(name, src=0)
    return final.with_name(name[0])


def save_sharded(
    run_dir: Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    trainer_state: dict[str, Any],
    config_toml: str,
    keep_last: int,
    progress: Progress | None = None,
) -> Path:
    """Save a checkpoint collectively (every rank calls this); returns the checkpoint folder.

    `model` is `ParallelModel.module` (plain-model names), `trainer_state` this rank's small state.
    `progress` (rank 0's console) hears the bytes of the shards written so far, against the total.
    """
    root = run_dir / "checkpoints"
    final = root / f"step_{step:08d}"
    rank = _rank()
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        remove_stale(root)
    _barrier()
    state = sharded_state(model, optimizer)
    # Global shapes (DTensor.shape): every rank computes the same total and takes the same decision.
    total_bytes = tensor_bytes(state)
    check_free_space(root, final.name, total_bytes + SAVE_MARGIN_BYTES)
    tmp = _shared_temp_dir(final)
    with staging(tmp, final.name, owner=rank == 0):
        _barrier()  # the folder exists
        # DCP reports nothing while it writes: the shards' growing files are the progress (every rank's,
        # on a filesystem the ranks share; this rank's own otherwise).
        with watch_bytes(progress, f"saving checkpoint at step {step}", tmp / "dcp", total_bytes):
            dcp.save(state, checkpoint_id=str(tmp / "dcp"))
        torch.save(trainer_state, tmp / f"trainer_state_rank{rank}.pt")
        if rank == 0:
            (tmp / "config.toml").write_text(config_toml)
        _barrier()  # every rank's files are written
        if rank == 0:
            _fsync_tree(tmp)
            write_manifest(tmp, step)
    if rank == 0:
        publish(tmp, final, keep_last)
    _barrier()  # nobody returns before the checkpoint is in place
    return final


# ----------------------------------------------------------------------------------------------------
# Loading: metadata without code execution

# What DCP's `.metadata` pickle is made of: the dataclasses and enum of dcp's metadata module, the
# filesystem's storage index, torch.Size and dtypes, a layout helper, paths and plain containers.
_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "slice"),
}
_PATH_MODULES = ("pathlib", "pathlib._local")
_PATH_CLASSES = ("PosixPath", "PurePosixPath", "PureWindowsPath")


class _MetadataUnpickler(pickle.Unpickler):
    """Refuses every global outside the allowlist (a crafted file could otherwise name `os.system`)."""

    def __init__(self, file: IO[bytes], path: str) -> None:
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if module == dcp_metadata.__name__:
            obj = getattr(dcp_metadata, name, None)
            if isinstance(obj, type) and obj.__module__ == module:
                return obj
        elif module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        elif (module, name) in _METADATA_CLASSES or (module in _PATH_MODULES and name in _PATH_CLASSES):
            return super().find_class(module, name)
        raise CheckpointError(
            f"{self.path}: refusing to load {module}.{name} (a DCP metadata file holds only "
            "torch.distributed.checkpoint metadata classes, sizes, dtypes and containers)"
        )


def read_metadata_file(path: Path) -> dcp_metadata.Metadata:
    """Unpickle a DCP `.metadata` file with the allowlist; one CheckpointError line if it is not one."""
    with open(path, "rb") as f:
        return _unpickle_metadata(f, str(path))


def _unpickle_metadata(f: IO[bytes], path: str) -> dcp_metadata.Metadata:
    try:
        metadata = _MetadataUnpickler(f, path).load()
    except CheckpointError:
        raise
    # RuntimeError: TensorProperties.__setstate__ refusing a memory-format code; RecursionError: nesting.
    except (
        pickle.UnpicklingError,
        EOFError,
        ValueError,
        TypeError,
        AttributeError,
        IndexError,
        KeyError,
        RuntimeError,
        RecursionError,
    ) as e:
        raise CheckpointError(
            f"{path}: not a readable DCP metadata file ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else 'truncated'})"
        ) from None
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise CheckpointError(f"{path}: not a DCP metadata file (holds a {type(metadata).__name__})")
    _check_metadata(metadata, path)
    return metadata


def _sizes(value: Any, rank: int | None = None) -> bool:
    """A torch.Size of non-negative ints (of `rank` dims when given)."""
    ints = isinstance(value, torch.Size) and all(type(n) is int and n >= 0 for n in value)
    return ints and (rank is None or len(value) == rank)


def _check_tensor_entry(fqn: str, entry: Any, path: str) -> None:
    """A tensor's entry: a dtype, a size, and chunks inside it that cover it exactly once (DCP writes each
    element once; a forged list that leaves elements out would leave them at their initial values)."""
    size: Any = getattr(entry, "size", None)
    if not isinstance(getattr(getattr(entry, "properties", None), "dtype", None), torch.dtype) or not _sizes(size):
        raise CheckpointError(f"{path}: tensor {fqn!r} has no valid dtype and size")
    covered = 0
    for chunk in entry.chunks if isinstance(entry.chunks, list) else [None]:
        offsets: Any = getattr(chunk, "offsets", None)
        sizes: Any = getattr(chunk, "sizes", None)
        if not (_sizes(offsets, len(size)) and _sizes(sizes, len(size))) or any(
            o + n > d for o, n, d in zip(offsets, sizes, size, strict=True)
        ):
            raise CheckpointError(f"{path}: tensor {fqn!r} has a chunk outside its size {tuple(size)}")
        covered += math.prod(sizes)
    if covered != math.prod(size):
        raise CheckpointError(f"{path}: the chunks of tensor {fqn!r} hold {covered} of its {math.prod(size)} elements")


def _check_metadata(metadata: dcp_metadata.Metadata, path: str) -> None:
    """What DCP's loader takes on trust: every entry's sizes and chunks, and storage files that are plain
    names inside the checkpoint's `dcp/` folder (a `../` path would read a file from elsewhere)."""
    entries, storage = metadata.state_dict_metadata, metadata.storage_data
    if not isinstance(entries, dict) or not isinstance(storage, dict):
        raise CheckpointError(f"{path}: not a DCP metadata file (its tables are not dicts)")
    for fqn, entry in entries.items():
        if isinstance(entry, dcp_metadata.TensorStorageMetadata):
            _check_tensor_entry(fqn, entry, path)
        elif not isinstance(entry, dcp_metadata.BytesStorageMetadata):
            raise CheckpointError(f"{path}: entry {fqn!r} is a {type(entry).__name__}, not tensor or bytes metadata")
    for info in storage.values():
        name, offset, length = (getattr(info, k, None) for k in ("relative_path", "offset", "length"))
        if not isinstance(name, str) or not re.fullmatch(r"[\w.-]+", name) or name.startswith("."):
            raise CheckpointError(f"{path}: storage file {name!r} is not a file name inside {Path(path).parent}")
        if type(offset) is not int or type(length) is not int or offset < 0 or length < 0:
            raise CheckpointError(f"{path}: storage of {name!r} has offset {offset!r} and length {length!r}")


class SafeFileSystemReader(FileSystemReader):
    """FileSystemReader whose `read_metadata` uses the allowlist unpickler (torch 2.11 and 2.13)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        rank = kwargs.get("rank")
        path: Any
        if hasattr(self, "_get_metadata_path"):  # newer torch: also rank-local `__<rank>.metadata` files
            path = self._get_metadata_path(rank)
        else:
            path = self.fs.concat_path(self.path, ".metadata")
        with self.fs.create_stream(path, "rb") as f:
            metadata = _unpickle_metadata(f, str(path))  # type: ignore[arg-type]  # a binary stream (IOBase in the stubs)
        # As FileSystemReader does: tag the metadata with this load's id.
        storage_meta = getattr(metadata, "storage_meta", None) or dcp_metadata.StorageMeta()
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata


class _SafeLoadPlanner(DefaultLoadPlanner):
    """DCP stores non-tensor values (optimizer hyper-parameters) with torch.save and reads them back with
    `weights_only=False`; these bytes must first load with `weights_only=True` (tensors and plain values)."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        data = value.read()
        try:
            torch.load(io.BytesIO(data), weights_only=True)
        except Exception as e:
            raise CheckpointError(
                f"DCP item {read_item.dest_index.fqn}: holds something other than tensors and "
                f"plain values ({type(e).__name__})"
            ) from None
        super().load_bytes(read_item, io.BytesIO(data))


def _checkpoint_error_in(e: BaseException) -> CheckpointError | None:
    """Our own error raised inside DCP comes back wrapped in its CheckpointException."""
    for exc, _trace in getattr(e, "failures", {}).values():
        if isinstance(exc, CheckpointError):
            return exc
    return None


def load_sharded(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """Verify, then load model (and optimizer) shards for the current layout in place; return the trainer
    state (`data_fingerprint` is "" for checkpoints saved before it existed; `train_state_from_dict` checks it).

    Works on any layout, including a single process without a process group. The trainer state is
    this rank's when the checkpoint has one, else rank 0's (the layout changed): loader position and
    scheduler are layout-independent, per-rank RNG streams then restart from rank 0's.
    """
    metadata_file = path / "dcp" / ".metadata"
    if not metadata_file.is_file():
        raise CheckpointError(f"{path} is not a sharded checkpoint ({metadata_file} is missing)")
    check_checkpoint(path)
    read_metadata_file(metadata_file)  # fail here, with one line, before DCP logs its own traceback
    state = sharded_state(model, optimizer)
    try:
        with warnings.catch_warnings():  # one process without a process group is an intended use
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
            dcp.load(state, storage_reader=SafeFileSystemReader(str(path / "dcp")), planner=_SafeLoadPlanner())
    except (CheckpointException, RuntimeError, ValueError, KeyError) as e:
        if (inner := _checkpoint_error_in(e)) is not None:
            raise inner from None
        lines = [ln for ln in str(e).splitlines() if ln.strip() and not ln.startswith((" ", "Traceback"))]
        first = lines[-1] if isinstance(e, CheckpointException) and lines else (lines[0] if lines else type(e).__name__)
        raise CheckpointError(f"{path / 'dcp'}: the sharded checkpoint does not fit the model ({first})") from None
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    own = path / f"trainer_state_rank{_rank()}.pt"
    raw = load_pt(own if own.is_file() else path / "trainer_state_rank0.pt")
    if isinstance(raw, dict):  # anything else is refused by train_state_from_dict, naming the file
        raw.setdefault("data_fingerprint", "")
    return raw
