"""Forged checkpoints (issue #29 item 4): a checkpoint folder, an HF `init_from` folder or a DCP metadata file
from someone else is read with `weights_only=True` and an allowlist, so no code runs; these tests hold the
rest of the promise: whatever it holds, loading it is one CheckpointError naming the file and the key,
never a traceback from torch's `load_state_dict`, `setstate` or DCP, and never a silent wrong run."""

from __future__ import annotations

import io
import json
import pickle
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint.metadata as dcp_metadata
from conftest import cli_here
from helpers import TINY, _hf_folder, _tiny

from tracetrain.errors import CheckpointError
from tracetrain.train.checkpoint import TrainState, load_checkpoint, save_checkpoint, trainer_state_dict
from tracetrain.train.manifest import write_manifest

pytestmark = pytest.mark.usefixtures("one_thread_torch")


def _reseal(folder: Path, step: int = 1) -> None:
    """A forger writes a manifest that matches the forged files: only the checks below can catch them."""
    (folder / "manifest.json").unlink(missing_ok=True)
    write_manifest(folder, step)


def _forge(path: Path, file: str, change: Callable[[Any], Any]) -> None:
    """Apply `change` to a saved .pt file (it edits in place, or returns a replacement), then reseal."""
    raw = torch.load(path / file, weights_only=True)
    out = change(raw)
    torch.save(raw if out is None else out, path / file)
    _reseal(path)


def _saved(tmp_path: Path) -> Path:
    model, opt = _tiny(1.0)
    return save_checkpoint(tmp_path, model, opt, TrainState(1, {}, {}, {}), "", lora=False, keep_last=2)


def _drop(key: str) -> Callable[[dict], None]:
    def apply(raw: dict) -> None:
        del raw[key]

    return apply


def _each_state(change: Callable[[dict], Any]) -> Callable[[dict], None]:
    def apply(raw: dict) -> None:
        for entry in raw["state"].values():
            change(entry)

    return apply


OPTIMIZER_FORGERIES = {
    "a_list": (lambda raw: [1], "not an optimizer state"),
    "state_an_int": (lambda raw: raw.update(state=5), "'state' is int, not dict"),
    "groups_an_int": (lambda raw: raw.update(param_groups=5), "'param_groups' is int, not list"),
    "lr_a_string": (lambda raw: raw["param_groups"][0].update(lr="x"), r"'param_groups\[0\].lr' is str, not float"),
    "betas_an_int": (lambda raw: raw["param_groups"][0].update(betas=5), r"'param_groups\[0\].betas' is int"),
    "lr_infinite": (lambda raw: raw["param_groups"][0].update(lr=float("inf")), "not a finite number"),
    "params_renumbered": (lambda raw: raw["param_groups"][0].update(params=[0, 1, 2, 9]), "must number the parameters"),
    "entry_an_int": (lambda raw: raw.update(state={0: 5}), "state entry 0 is not a parameter's state"),
    "entry_of_no_parameter": (lambda raw: raw["state"].update({"a": {}}), "state entry 'a' is not"),
    "moment_missing": (_each_state(lambda e: e.pop("exp_avg_sq")), "state entry 0 holds"),
    "moment_of_another_shape": (_each_state(lambda e: e.update(exp_avg=torch.zeros(7))), "has shape"),
    "moment_a_number": (_each_state(lambda e: e.update(exp_avg=5)), "'state.0.exp_avg' is 5, not a tensor"),
    "moment_of_integers": (_each_state(lambda e: e.update(exp_avg=e["exp_avg"].long())), "torch.int64 tensor"),
    "step_a_string": (_each_state(lambda e: e.update(step="x")), "'state.0.step' is 'x'"),
}


@pytest.mark.parametrize("change, fragment", OPTIMIZER_FORGERIES.values(), ids=OPTIMIZER_FORGERIES.keys())
def test_forged_optimizer_state_is_one_line(tmp_path, change, fragment):
    path = _saved(tmp_path)
    _forge(path, "optimizer.pt", change)
    model, opt = _tiny()
    with pytest.raises(CheckpointError, match=f"optimizer.pt: .*{fragment}"):
        load_checkpoint(path, model, opt, lora=False)


TRAINER_STATE_FORGERIES = {
    "no_step": (_drop("step"), "'step' is NoneType, not int"),
    "no_scheduler": (_drop("scheduler"), "'scheduler' is NoneType, not dict"),
    "rng_an_int": (lambda raw: raw.update(rng=5), "'rng' is not a dict"),
    "rng_empty": (lambda raw: raw.update(rng={}), "'rng' is not a dict"),
    "torch_rng_a_string": (lambda raw: raw["rng"].update(torch="x"), "'rng' is not a random state"),
    "torch_rng_floats": (lambda raw: raw["rng"].update(torch=torch.zeros(3)), "'rng' is not a random state"),
    "python_rng_short": (lambda raw: raw["rng"].update(python=(3, (1, 2), None)), "'rng' is not a random state"),
    "skipped_steps_a_string": (lambda raw: raw["counters"].update(skipped_steps="x"), "'counters.skipped_steps'"),
    "fingerprint_an_int": (lambda raw: raw.update(data_fingerprint=5), "'data_fingerprint' is int"),
}


@pytest.mark.parametrize("change, fragment", TRAINER_STATE_FORGERIES.values(), ids=TRAINER_STATE_FORGERIES.keys())
def test_forged_trainer_state_is_one_line_and_the_rng_is_untouched(tmp_path, change, fragment):
    path = _saved(tmp_path)
    _forge(path, "trainer_state.pt", change)
    model, opt = _tiny()
    before = torch.get_rng_state(), random.getstate()
    with pytest.raises(CheckpointError, match=f"trainer_state.pt: {fragment}"):
        load_checkpoint(path, model, opt, lora=False)
    assert torch.equal(torch.get_rng_state(), before[0]) and random.getstate() == before[1]


def test_legacy_checkpoint_without_rng_loads_with_a_note(tmp_path, capsys):
    path = _saved(tmp_path)
    _forge(path, "trainer_state.pt", _drop("rng"))
    (path / "manifest.json").unlink()  # saved before manifests and random states were
    model, opt = _tiny()
    state = load_checkpoint(path, model, opt, lora=False)
    assert state.step == 1 and state.rng is None
    assert "has no random state (saved by an older tracetrain)" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------
# The schedule and the data position, checked against the resuming run's own (through the real CLI)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("forged")
    cli_here("train", *TINY, "--train.steps=2", f"--train.output_dir={out}", "--train.run_name=r")
    return out / "r"


RUN_FORGERIES = {
    "scheduler_of_another_kind": (lambda raw: raw.update(scheduler={"x": 1}), "'scheduler' lacks 'base_lrs'"),
    "scheduler_method_replaced": (
        lambda raw: raw["scheduler"].update(step=5),
        "'scheduler' has an unknown entry 'step'",
    ),
    "last_epoch_a_string": (lambda raw: raw["scheduler"].update(last_epoch="x"), "'scheduler.last_epoch' is str"),
    "lr_lambdas_an_int": (lambda raw: raw["scheduler"].update(lr_lambdas=5), "'scheduler.lr_lambdas' is int"),
    "loader_of_another_kind": (lambda raw: raw.update(loader={"x": 1}), "'loader' lacks"),
    "loader_shuffle_a_string": (lambda raw: raw["loader"].update(shuffle="x"), "'loader.shuffle' is str, not bool"),
}


@pytest.mark.parametrize("change, fragment", RUN_FORGERIES.values(), ids=RUN_FORGERIES.keys())
def test_forged_schedule_or_data_position_is_one_line_on_resume(tiny_run, tmp_path, change, fragment):
    run = tmp_path / "r"
    shutil.copytree(tiny_run, run)
    (ckpt,) = (run / "checkpoints").iterdir()
    _forge(ckpt, "trainer_state.pt", change)
    _reseal(ckpt, 2)
    proc = cli_here("train", "--resume", str(run), "--train.steps=3", check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert f"error: {ckpt}: {fragment}" in proc.stderr.strip().splitlines()[-1]


# ---------------------------------------------------------------------------------------------------
# Sharded (DCP) checkpoints: the metadata's contents, not only its classes


def _sharded(tmp_path: Path) -> Path:
    from tracetrain.train.sharded_checkpoint import save_sharded

    model, opt = _tiny(1.0)
    state = trainer_state_dict(TrainState(1, {}, {}, {}))
    return save_sharded(tmp_path, 1, model, opt, state, "", keep_last=2)


class _Forger(pickle.Pickler):
    """Pickles DCP metadata with each TensorProperties' state replaced by `state` (what its __setstate__ gets)."""

    def __init__(self, file: io.BytesIO, state: object) -> None:
        super().__init__(file)
        self.state = state

    def reducer_override(self, obj: object) -> Any:
        if isinstance(obj, dcp_metadata.TensorProperties) and self.state is not None:
            return (dcp_metadata.TensorProperties, (), self.state)
        return NotImplemented


def _first_tensor(meta: dcp_metadata.Metadata) -> Any:
    return next(v for v in meta.state_dict_metadata.values() if isinstance(v, dcp_metadata.TensorStorageMetadata))


CONTIGUOUS = dcp_metadata._MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT
DCP_FORGERIES = {
    "properties_bad_memory_format": (None, (torch.float32, torch.strided, False, 7, False), "RuntimeError: Invalid"),
    "properties_dtype_a_string": (None, ("x", torch.strided, False, CONTIGUOUS, False), "has no valid dtype and size"),
    "properties_short_state": (None, (torch.float32,), "not enough values to unpack"),
    "size_negative": (
        lambda m: setattr(_first_tensor(m), "size", torch.Size([-5, 4])),
        None,
        "no valid dtype and size",
    ),
    "chunks_missing": (lambda m: setattr(_first_tensor(m), "chunks", []), None, "hold 0 of its 16 elements"),
    "chunk_outside": (
        lambda m: setattr(_first_tensor(m).chunks[0], "offsets", torch.Size([10**9, 0])),
        None,
        "has a chunk outside its size",
    ),
    "tables_not_dicts": (lambda m: setattr(m, "storage_data", None), None, "its tables are not dicts"),
    "storage_outside_the_folder": (
        lambda m: [setattr(v, "relative_path", "../../x.distcp") for v in m.storage_data.values()],
        None,
        "storage file '../../x.distcp' is not a file name inside",
    ),
    "storage_length_negative": (
        lambda m: [setattr(v, "length", -1) for v in m.storage_data.values()],
        None,
        r"has offset \d+ and length -1",
    ),
}


@pytest.mark.parametrize("mutate, state, fragment", DCP_FORGERIES.values(), ids=DCP_FORGERIES.keys())
def test_forged_dcp_metadata_contents_are_one_line(tmp_path, mutate, state, fragment):
    from tracetrain.train.sharded_checkpoint import load_sharded, read_metadata_file

    path = _sharded(tmp_path)
    meta = read_metadata_file(path / "dcp" / ".metadata")
    if mutate:
        mutate(meta)
    buffer = io.BytesIO()
    _Forger(buffer, state).dump(meta)
    (path / "dcp" / ".metadata").write_bytes(buffer.getvalue())
    _reseal(path)
    model, opt = _tiny()
    with pytest.raises(CheckpointError, match=f"dcp/.metadata: .*{fragment}"):
        load_sharded(path, model, opt)


# ---------------------------------------------------------------------------------------------------
# Hugging Face `model.init_from` folders: the shard index


def _first(weight_map: dict) -> str:
    return next(iter(weight_map))


WEIGHT_MAP_FORGERIES = {
    "a_list": (lambda wm: [1, 2], "'weight_map' is list, not an object"),
    "null": (lambda wm: None, "'weight_map' is NoneType"),
    "a_number_for_a_file": (lambda wm: {**wm, _first(wm): 5}, "'weight_map' names 5 for"),
    "a_list_for_a_file": (lambda wm: {**wm, _first(wm): ["a"]}, r"'weight_map' names \['a'\] for"),
    "a_path_elsewhere": (
        lambda wm: {**wm, _first(wm): "../x.safetensors"},
        "'weight_map' names '../x.safetensors' for",
    ),
    "an_absolute_path": (lambda wm: {**wm, _first(wm): "/etc/passwd"}, "'weight_map' names '/etc/passwd' for"),
    "the_folder_itself": (lambda wm: {**wm, _first(wm): "."}, "'weight_map' names '[.]' for"),
}


@pytest.mark.parametrize("change, fragment", WEIGHT_MAP_FORGERIES.values(), ids=WEIGHT_MAP_FORGERIES.keys())
def test_hf_index_with_a_malformed_weight_map_is_one_line(tmp_path, change, fragment):
    from tracetrain.models.hf import load_hf_weights

    folder, model = _hf_folder(tmp_path)
    index = folder / "model.safetensors.index.json"
    raw = json.loads(index.read_text())
    index.write_text(json.dumps({**raw, "weight_map": change(raw["weight_map"])}))
    with pytest.raises(CheckpointError, match=f"model.safetensors.index.json: {fragment}"):
        load_hf_weights(model, folder)
