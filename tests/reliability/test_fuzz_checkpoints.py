"""Property-based fuzzing of what a resume reads (#29 item 5): checkpoint manifests, `trainer_state.pt`,
`optimizer.pt`, DCP metadata, a Hugging Face shard index and `metrics.jsonl`. Whatever they hold, loading
either succeeds (and an accepted optimizer state can take a step) or is one CheckpointError line: never
another exception, never a file outside the folders touched. Same profiles as tests/reliability/test_fuzz.py
(derandomized in CI; each test a few seconds, with a per-example deadline that a hang would pass)."""

from __future__ import annotations

import io
import json
import pickle
import shutil
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint.metadata as dcp_metadata
from helpers import _tiny
from helpers_fuzz import FEW, FUZZ, JSON_VALUES, _sandbox
from hypothesis import given, settings
from hypothesis import strategies as st

from tracetrain.errors import CheckpointError
from tracetrain.train.checkpoint import TrainState, latest_checkpoint, load_checkpoint, save_checkpoint
from tracetrain.train.manifest import verify_checkpoint, write_manifest
from tracetrain.train.resume import ResumePoint

pytestmark = pytest.mark.usefixtures("one_thread_torch")
# Each example saves and loads a checkpoint (tens of ms): half the examples of tests/reliability/test_fuzz.py.
CHECKS = settings(FUZZ, max_examples=max(FUZZ.max_examples // 2, 8), deadline=timedelta(seconds=10))
FEW_CHECKS = settings(FEW, deadline=timedelta(seconds=10))


def _one_line(error: CheckpointError) -> None:
    assert str(error).strip() and "\n" not in str(error).strip()


def _saved(root: Path) -> Path:
    model, opt = _tiny(1.0)
    return save_checkpoint(root, model, opt, TrainState(1, {}, {}, {"value": 1.0}), "", lora=False, keep_last=2)


def _reseal(folder: Path) -> None:
    (folder / "manifest.json").unlink(missing_ok=True)
    write_manifest(folder, 1)


# Values a forger reaches for: JSON-ish values, tensors of odd shapes and dtypes, huge and negative numbers.
TENSORS = st.sampled_from(
    [torch.zeros(()), torch.zeros(7), torch.zeros(4, 4), torch.zeros(2, dtype=torch.int64), torch.zeros(3, 3).bool()]
)
ODD = st.one_of(
    JSON_VALUES, TENSORS, st.sampled_from([float("nan"), float("inf"), -5, 10**15, (1, 2), (), b"x", 2**70])
)


def _paths(tree: Any, prefix: tuple = ()) -> list[tuple]:
    """Every key path of a nested dict/list (the places a mutation can land)."""
    out = [prefix]
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, (list, tuple)) else []
    for key, value in items:
        out += _paths(value, (*prefix, key))
    return out


def _set(tree: Any, path: tuple, value: Any) -> Any:
    """`tree` with the value at `path` replaced (tuples rebuilt); the root replaced when `path` is empty."""
    if not path:
        return value
    head, rest = path[0], path[1:]
    if isinstance(tree, tuple):
        return tuple(_set(v, rest, value) if i == head else v for i, v in enumerate(tree))
    tree[head] = _set(tree[head], rest, value)
    return tree


MUTATIONS = st.lists(st.tuples(st.integers(0, 10**6), ODD | st.just("DELETE")), min_size=1, max_size=3)


def _mutate(tree: Any, mutations: list[tuple[int, Any]]) -> Any:
    for pick, value in mutations:
        paths = _paths(tree)
        path = paths[pick % len(paths)]
        if value == "DELETE" and path and isinstance(_parent(tree, path), dict):
            del _parent(tree, path)[path[-1]]
        elif value != "DELETE":
            tree = _set(tree, path, value)
    return tree


def _parent(tree: Any, path: tuple) -> Any:
    for key in path[:-1]:
        tree = tree[key]
    return tree


@CHECKS
@given(st.sampled_from(["optimizer.pt", "trainer_state.pt"]), MUTATIONS)
def test_forged_pt_files_load_or_refuse_in_one_line(name, mutations):
    with _sandbox() as (work, _):
        path = _saved(work)
        raw = torch.load(path / name, weights_only=True)
        torch.save(_mutate(raw, mutations), path / name)
        _reseal(path)
        model, opt = _tiny()
        try:
            load_checkpoint(path, model, opt, lora=False)
        except CheckpointError as e:
            _one_line(e)
            return
        model(torch.ones(1, 4)).sum().backward()
        opt.step()  # an accepted state is a usable one


MANIFEST_PATHS = st.sampled_from(
    ["model.safetensors", "optimizer.pt", "../../sentinel/keep.txt", "/etc/hostname", "", ".", "a/../b", "x\x00"]
)
ENTRY = st.fixed_dictionaries(
    {"path": MANIFEST_PATHS | st.text(max_size=6), "bytes": JSON_VALUES, "sha256": st.text(max_size=3) | JSON_VALUES}
)


@CHECKS
@given(
    st.one_of(
        st.fixed_dictionaries({"format": JSON_VALUES, "step": JSON_VALUES, "files": st.lists(ENTRY, max_size=3)}),
        JSON_VALUES,
        st.just("[" * 5000),
    ),
    st.booleans(),
)
def test_manifests_verify_or_refuse_in_one_line(manifest, keep_real_files):
    with _sandbox() as (work, _):
        path = _saved(work)
        if keep_real_files and isinstance(manifest, dict) and isinstance(manifest.get("files"), list):
            manifest["files"] = json.loads((path / "manifest.json").read_text())["files"] + manifest["files"]
        text = manifest if isinstance(manifest, str) else json.dumps(manifest)
        (path / "manifest.json").write_text(text)
        try:
            verify_checkpoint(path)
        except CheckpointError as e:
            _one_line(e)
        try:
            assert latest_checkpoint(work) == path
        except CheckpointError as e:
            _one_line(e)


@CHECKS
@given(st.lists(JSON_VALUES.map(json.dumps) | st.sampled_from(['{"step": 1', "\udcff", "[" * 3000]), max_size=5))
def test_metrics_lines_are_kept_cut_or_refused_in_one_line(lines):
    with _sandbox() as (work, _):
        good = '{"kind": "train", "step": 1, "loss": 2.0}\n'
        (work / "metrics.jsonl").write_bytes((good + "\n".join(lines) + "\n").encode("utf-8", "surrogateescape"))
        try:
            ResumePoint(work, work).truncate_metrics(work, 1)
        except CheckpointError as e:
            _one_line(e)


# ---------------------------------------------------------------------------------------------------
# Sharded (DCP) metadata: every field of a real metadata file, replaced


class _Pickler(pickle.Pickler):
    """Pickles TensorProperties with whatever state a forger gives its __setstate__."""

    def __init__(self, file: io.BytesIO, state: Any) -> None:
        super().__init__(file)
        self.state = state

    def reducer_override(self, obj: object) -> Any:
        if isinstance(obj, dcp_metadata.TensorProperties) and self.state is not None:
            return (dcp_metadata.TensorProperties, (), self.state)
        return NotImplemented


DCP_VALUES = ODD | st.sampled_from([torch.Size([-1]), torch.Size([10**9, 4]), torch.Size([]), None, [], {}])
FIELDS = st.sampled_from(["size", "chunks", "properties", "offsets", "sizes", "relative_path", "offset", "length"])


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    from tracetrain.train.checkpoint import trainer_state_dict
    from tracetrain.train.sharded_checkpoint import save_sharded

    model, opt = _tiny(1.0)
    root = tmp_path_factory.mktemp("dcp")
    return save_sharded(root, 1, model, opt, trainer_state_dict(TrainState(1, {}, {}, {})), "", keep_last=2)


@FEW_CHECKS
@given(st.lists(st.tuples(FIELDS, st.integers(0, 100), DCP_VALUES), min_size=1, max_size=3), ODD | st.none())
def test_dcp_metadata_loads_or_refuses_in_one_line(sharded, replacements, properties_state):
    from tracetrain.train.sharded_checkpoint import load_sharded, read_metadata_file

    with _sandbox() as (work, _):
        path = work / sharded.name
        shutil.copytree(sharded, path)
        meta = read_metadata_file(path / "dcp" / ".metadata")
        places = [v for entry in meta.state_dict_metadata.values() for v in (entry, *getattr(entry, "chunks", []))]
        places += list(meta.storage_data.values())
        for field, pick, value in replacements:
            holders = [p for p in places if hasattr(p, field)]
            if holders:
                object.__setattr__(holders[pick % len(holders)], field, value)
        buffer = io.BytesIO()
        try:
            _Pickler(buffer, properties_state).dump(meta)
        except (pickle.PicklingError, RuntimeError, TypeError, AttributeError):
            return  # not a file anyone can write
        (path / "dcp" / ".metadata").write_bytes(buffer.getvalue())
        _reseal(path)
        model, opt = _tiny()
        try:
            load_sharded(path, model, opt)
        except CheckpointError as e:
            _one_line(e)


# ---------------------------------------------------------------------------------------------------
# Hugging Face shard index (`model.init_from`)


@FEW_CHECKS
@given(st.one_of(JSON_VALUES, st.dictionaries(st.text(max_size=30), MANIFEST_PATHS | JSON_VALUES, max_size=4)))
def test_hf_shard_index_loads_or_refuses_in_one_line(weight_map):
    from helpers import _hf_folder

    from tracetrain.models.hf import load_hf_weights

    with _sandbox() as (work, _):
        folder, model = _hf_folder(work)
        index = folder / "model.safetensors.index.json"
        real = json.loads(index.read_text())["weight_map"]
        mixed = {**real, **weight_map} if isinstance(weight_map, dict) else weight_map
        index.write_text(json.dumps({"weight_map": mixed}))
        try:
            load_hf_weights(model, folder)
        except CheckpointError as e:
            _one_line(e)
