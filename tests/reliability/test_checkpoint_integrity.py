"""Checkpoints a user can trust, part 2: no code runs on load, every visible checkpoint is complete,
corruption is caught (manifest sha256 + full tensor set), failed saves leave nothing, errors are one line.

The kill -9 loop forks the test process: the child (only) is made to SIGKILL itself at the N-th
filesystem operation of a save-with-rotation and a same-step re-save, for every N."""

from __future__ import annotations

import errno
import io
import json
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import cli_here
from helpers import _load, _tiny
from parallel_harness import assemble_tiny, tiny_config
from safetensors.torch import load_file, save_file

import tracetrain.train.checkpoint as ckpt_mod
from tracetrain.config import load_config, to_toml
from tracetrain.errors import CheckpointError
from tracetrain.inference import find_checkpoint, load_trained
from tracetrain.safe_load import load_pt, read_safetensors
from tracetrain.spec import resolve
from tracetrain.train.assemble import assemble, build_model
from tracetrain.train.checkpoint import (
    TrainState,
    latest_checkpoint,
    list_checkpoints,
    load_weights,
    save_checkpoint,
    trainable_state_dict,
)
from tracetrain.train.manifest import remove_stale, verify_checkpoint, write_manifest
from tracetrain.train.sharded_checkpoint import load_sharded, save_sharded

pytestmark = pytest.mark.usefixtures("one_thread_torch")

RUN = [
    "--train.steps=4",
    "--train.micro_batch_size=2",
    "--data.synthetic_examples=120",
    "--data.seq_len=32",
    "--model.n_layers=2",
    "--model.dim=64",
    "--model.ffn_dim=128",
    "--model.n_heads=4",
    "--model.n_kv_heads=2",
    "--logging.log_interval=1",
    "--train.eval_interval=0",
    "--train.eval_generate=0",
    "--train.eval_batches=1",
    "--optim.warmup_steps=1",
    "--checkpoint.interval=2",
    "--checkpoint.keep_last=3",
]


def _save(
    run: Path,
    step: int,
    value: float | None = None,
    keep_last: int = 5,
    built: tuple[torch.nn.Module, torch.optim.Optimizer] | None = None,
) -> Path:
    model, opt = built or _tiny(float(step if value is None else value))
    state = TrainState(step, {}, {}, {"value": int(step if value is None else value)})
    return save_checkpoint(run, model, opt, state, "", lora=False, keep_last=keep_last)


def _flip_byte(path: Path, offset_from_end: int = 3) -> None:
    data = bytearray(path.read_bytes())
    data[-offset_from_end] ^= 0xFF
    path.write_bytes(bytes(data))


def _hidden(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("."))


# ----------------------------------------------------------------------------------------------------
# Manifest, verification, resume fallback


def test_manifest_lists_every_file_with_size_and_sha256(tmp_path):
    path = _save(tmp_path, 1)
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["step"] == 1
    listed = {f["path"]: f for f in manifest["files"]}
    assert sorted(listed) == ["config.toml", "model.safetensors", "optimizer.pt", "trainer_state.pt"]
    import hashlib

    for name, entry in listed.items():
        assert entry["bytes"] == (path / name).stat().st_size
        assert entry["sha256"] == hashlib.sha256((path / name).read_bytes()).hexdigest()
    assert verify_checkpoint(path) is True


@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.pt"])
def test_flipped_byte_is_caught_and_resume_takes_the_newest_that_verifies(tmp_path, capsys, name):
    _save(tmp_path, 1)
    newest = _save(tmp_path, 2)
    _flip_byte(newest / name)  # same size: only the sha256 can tell
    with pytest.raises(CheckpointError, match=rf"{name}: sha256 differs from the manifest"):
        _load(newest)
    assert latest_checkpoint(tmp_path).name == "step_00000001"
    assert _load(latest_checkpoint(tmp_path)).step == 1
    err = capsys.readouterr().err
    assert f"note: skipped checkpoint step_00000002: {newest / name}: sha256 differs" in err


def test_truncated_file_and_broken_manifest_are_not_listed(tmp_path):
    first, second, third = (_save(tmp_path, s) for s in (1, 2, 3))
    (second / "model.safetensors").write_bytes((second / "model.safetensors").read_bytes()[:-10])
    (third / "manifest.json").write_text("{not json")
    assert list_checkpoints(tmp_path) == [first]
    with pytest.raises(CheckpointError, match=r"model.safetensors: \d+ bytes, the manifest records \d+"):
        _load(second)
    with pytest.raises(CheckpointError, match=r"manifest.json: not a valid checkpoint manifest"):
        _load(third)
    assert latest_checkpoint(tmp_path) == first


def test_missing_tensor_is_named_even_when_the_manifest_matches(tmp_path):
    path = _save(tmp_path, 1)
    weights = load_file(str(path / "model.safetensors"))
    del weights["1.weight"]
    save_file(weights, str(path / "model.safetensors"))
    (path / "manifest.json").unlink()
    write_manifest(path, 1)  # a re-sealed folder (or a buggy writer): the tensor set is checked on its own
    with pytest.raises(CheckpointError, match=r"model.safetensors: missing tensor\(s\) 1.weight"):
        _load(path)


def test_lora_adapters_only_expects_every_adapter(tmp_path):
    model = build_model(tiny_config(["--train.mode=lora", "--lora.targets=['q_proj', 'v_proj']"]), torch.device("cpu"))
    adapters = {k: v.contiguous() for k, v in trainable_state_dict(model, lora=True).items()}
    dropped = sorted(adapters)[0]
    del adapters[dropped]
    save_file(adapters, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=rf"missing tensor\(s\) {dropped.replace('.', '[.]')}"):
        load_weights(tmp_path / "model.safetensors", model, lora=True)


def test_legacy_checkpoint_without_manifest(tmp_path, capsys):
    path = _save(tmp_path, 1)
    (path / "manifest.json").unlink()  # as written by tracetrain before manifests
    assert list_checkpoints(tmp_path) == []
    assert latest_checkpoint(tmp_path) == path  # nothing newer: used, and said to be unverified
    assert _load(path).step == 1
    assert "has no manifest.json (saved by an older tracetrain): it is loaded unverified" in capsys.readouterr().err
    newer = _save(tmp_path, 2)
    assert latest_checkpoint(tmp_path) == newer
    (path / "model.safetensors").write_bytes((path / "model.safetensors").read_bytes()[:40])
    with pytest.raises(
        CheckpointError,
        match=r"model.safetensors: not a readable safetensors file "
        r"\(Error while deserializing header: .*\); it is truncated",
    ):
        _load(path)


def test_trainer_state_keeps_the_data_fingerprint_and_tolerates_its_absence(tmp_path):
    model, opt = _tiny(1.0)
    path = save_checkpoint(
        tmp_path,
        model,
        opt,
        TrainState(1, {}, {}, {"value": 1}, data_fingerprint="abc123"),
        "",
        lora=False,
        keep_last=2,
    )
    assert _load(path).data_fingerprint == "abc123"
    raw = torch.load(path / "trainer_state.pt", weights_only=True)
    del raw["data_fingerprint"]  # a checkpoint from before the field existed
    torch.save(raw, path / "trainer_state.pt")
    (path / "manifest.json").unlink()
    write_manifest(path, 1)
    assert _load(path).data_fingerprint == ""


# ----------------------------------------------------------------------------------------------------
# One-line errors for unreadable files


@pytest.mark.parametrize("damage", ["truncated", "empty", "header"])
def test_unreadable_safetensors_is_one_line(tmp_path, damage):
    file = tmp_path / "w.safetensors"
    save_file({"a": torch.ones(64)}, str(file))
    data = file.read_bytes()
    file.write_bytes(
        {"truncated": data[: len(data) // 2], "empty": b"", "header": data[:8] + b"\xff" + data[9:]}[damage]
    )
    with pytest.raises(CheckpointError) as e:
        read_safetensors(file)
    assert str(e.value).startswith(f"{file}: not a readable safetensors file") and "\n" not in str(e.value)


def test_hf_weights_with_a_truncated_file_is_one_line(tmp_path):
    from tracetrain.models.hf import load_hf_weights

    model = build_model(tiny_config([]), torch.device("cpu"))
    save_file({"model.embed_tokens.weight": torch.ones(4)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "model.safetensors").write_bytes((tmp_path / "model.safetensors").read_bytes()[:20])
    with pytest.raises(CheckpointError, match=r"model.safetensors: not a readable safetensors file"):
        load_hf_weights(model, tmp_path)


@pytest.mark.parametrize("damage", ["truncated", "empty", "evil"])
def test_unreadable_pt_is_one_line_without_the_unsafe_hint(tmp_path, damage):
    file = tmp_path / "x.pt"
    torch.save({"t": torch.ones(100), "n": 3}, file)
    if damage == "evil":
        torch.save({"e": _Evil(str(tmp_path / "marker"))}, file)
    else:
        file.write_bytes(file.read_bytes()[: len(file.read_bytes()) // 2] if damage == "truncated" else b"")
    with pytest.raises(CheckpointError) as e:
        load_pt(file, mmap=damage == "truncated")
    msg = str(e.value)
    assert msg.startswith(f"{file}: ") and "\n" not in msg and "weights_only" not in msg
    assert not (tmp_path / "marker").exists()
    if damage == "evil":
        assert "unsupported GLOBAL posix.system" in msg


class _Evil:
    """Unpickling this runs `touch MARKER`."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


# ----------------------------------------------------------------------------------------------------
# DCP metadata: no code execution


def _sharded(run: Path, step: int = 2) -> tuple[Path, torch.nn.Module, torch.optim.Optimizer]:
    cfg = tiny_config([])
    built = assemble_tiny(cfg)
    model, opt = built.module, built.optimizer
    path = save_sharded(run, step, model, opt, {"step": step}, "# config\n", keep_last=3)
    return path, model, opt


def _plant_evil_metadata(ckpt: Path, marker: Path) -> None:
    """Replace dcp/.metadata and re-seal the manifest, as someone handing out a crafted checkpoint would."""
    (ckpt / "dcp" / ".metadata").write_bytes(pickle.dumps(_Evil(str(marker))))
    (ckpt / "manifest.json").unlink()
    write_manifest(ckpt, int(ckpt.name.split("_")[1]))


def test_crafted_dcp_metadata_does_not_run(tmp_path):
    path, model, opt = _sharded(tmp_path)
    assert load_sharded(path, model, opt)["step"] == 2  # the real metadata passes the allowlist
    assert load_sharded(path, model, opt)["data_fingerprint"] == ""
    marker = tmp_path / "marker"
    _plant_evil_metadata(path, marker)
    with pytest.raises(CheckpointError) as e:
        load_sharded(path, model, opt)
    assert str(e.value) == (
        f"{path / 'dcp' / '.metadata'}: refusing to load posix.system (a DCP metadata file "
        "holds only torch.distributed.checkpoint metadata classes, sizes, dtypes and containers)"
    )
    assert not marker.exists()


def test_crafted_dcp_item_does_not_run(tmp_path):
    """DCP stores non-tensor values (the optimizer's hyper-parameters) as torch.save bytes and would read
    them with weights_only=False: point one item at a crafted pickle appended to the shard file."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    from tracetrain.train.sharded_checkpoint import read_metadata_file

    path, model, opt = _sharded(tmp_path)
    metadata = read_metadata_file(path / "dcp" / ".metadata")
    index = next(i for i in metadata.storage_data if i.fqn.startswith("optim.param_groups"))
    shard = path / "dcp" / metadata.storage_data[index].relative_path
    marker = tmp_path / "marker"
    buffer = io.BytesIO()
    torch.save(_Evil(str(marker)), buffer)  # as DCP writes its bytes items
    evil = buffer.getvalue()
    offset = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(evil)
    metadata.storage_data[index] = _StorageInfo(shard.name, offset, len(evil))
    (path / "dcp" / ".metadata").write_bytes(pickle.dumps(metadata))
    (path / "manifest.json").unlink()
    write_manifest(path, 2)
    with pytest.raises(CheckpointError, match=rf"^DCP item {index.fqn}: holds something other than tensors"):
        load_sharded(path, model, opt)
    assert not marker.exists()


def test_crafted_dcp_metadata_fails_eval_and_resume_with_one_line(tmp_path):
    # `eval` and the resume through the CLI's main in this process (conftest.cli_here): both commands have
    # real-process tests (test_cli_runs.py, test_checkpoint.py); a load that ran the planted call would
    # touch the marker here as well.
    run = tmp_path / "r"
    run.mkdir()
    cfg = load_config(None, RUN + [f"--train.output_dir={tmp_path}", "--train.run_name=r"])
    (run / "config.toml").write_text(to_toml(cfg))
    built = assemble(resolve(cfg, torch.device("cpu")))
    model, opt = built.module, built.optimizer
    path = save_sharded(run, 2, model, opt, {"step": 2}, to_toml(cfg), keep_last=3)
    marker = tmp_path / "marker"
    _plant_evil_metadata(path, marker)
    for args in (["eval", str(run)], ["train", "--resume", str(run), "--train.steps=8"]):
        proc = cli_here(*args, check=False)
        assert proc.returncode == 2, proc.stderr
        assert (
            proc.stderr.strip().splitlines()[-1] == f"error: {path / 'dcp' / '.metadata'}: refusing to load "
            "posix.system (a DCP metadata file holds only torch.distributed.checkpoint metadata classes, sizes, "
            "dtypes and containers)"
        )
        assert "Traceback" not in proc.stderr
        assert not marker.exists()


# ----------------------------------------------------------------------------------------------------
# Eval / resume through the CLI on a real run


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> Path:
    """A real run with checkpoints at steps 2 and 4, through the CLI's main in this process (as are the
    eval and resume calls below; the crafted-metadata test above runs both commands as processes)."""
    out = tmp_path_factory.mktemp("runs")
    cli_here("train", *RUN, f"--train.output_dir={out}", "--train.run_name=r")
    assert [p.name for p in list_checkpoints(out / "r")] == ["step_00000002", "step_00000004"]
    return out / "r"


def test_eval_skips_a_corrupt_newest_checkpoint_and_refuses_it_by_name(trained_run, tmp_path):
    run = tmp_path / "r"
    shutil.copytree(trained_run, run)
    newest = run / "checkpoints" / "step_00000004"
    _flip_byte(newest / "model.safetensors")
    proc = cli_here("eval", str(run))
    assert json.loads(proc.stdout)["checkpoint"] == str(run / "checkpoints" / "step_00000002")
    assert f"note: skipped checkpoint step_00000004: {newest / 'model.safetensors'}: sha256 differs" in proc.stderr
    proc = cli_here("eval", str(newest), check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        f"error: {newest / 'model.safetensors'}: sha256 differs from the manifest "
        "(the file is corrupt or was modified after the save)"
    )


def test_resume_falls_back_to_the_newest_checkpoint_that_verifies(trained_run, tmp_path):
    run = tmp_path / "r"
    shutil.copytree(trained_run, run)
    newest = run / "checkpoints" / "step_00000004"
    _flip_byte(newest / "optimizer.pt")
    proc = cli_here("train", "--resume", str(run), "--train.steps=6")
    assert f"note: skipped checkpoint step_00000004: {newest / 'optimizer.pt'}: sha256 differs" in proc.stderr
    assert f"resumed from {run / 'checkpoints' / 'step_00000002'} at step 2" in proc.stdout + proc.stderr
    assert verify_checkpoint(run / "checkpoints" / "step_00000006")


def test_eval_of_a_checkpoint_missing_a_layer_names_the_tensor(trained_run, tmp_path):
    run = tmp_path / "r"
    shutil.copytree(trained_run, run)
    ckpt = run / "checkpoints" / "step_00000004"
    weights = load_file(str(ckpt / "model.safetensors"))
    dropped = [k for k in weights if k.startswith("layers.1.")]
    for k in dropped:
        del weights[k]
    save_file(weights, str(ckpt / "model.safetensors"))
    (ckpt / "manifest.json").unlink()  # a legacy folder: loads only after the full tensor-set check
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\) layers\.1\."):
        load_trained(ckpt, "cpu")
    assert load_trained(run / "checkpoints" / "step_00000002", "cpu").checkpoint.name == "step_00000002"
    assert find_checkpoint(run).name == "step_00000002"  # the newest with a manifest is preferred


# ----------------------------------------------------------------------------------------------------
# Temporary folders, disk space


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_stale_temporary_folders_of_dead_processes_are_removed(tmp_path):
    root = tmp_path / "checkpoints"
    host, dead = socket.gethostname(), _dead_pid()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        names = {
            "dead_tmp": f".tmp-step_00000005@{host}@{dead}",
            "dead_trash": f".trash-step_00000001@{host}@{dead}@0",
            "live": f".tmp-step_00000007@{host}@{sleeper.pid}",
            "other_host": f".tmp-step_00000008@elsewhere@{dead}",
            "unowned": ".tmp-step_00000009-123",
        }
        for name in names.values():
            (root / name).mkdir(parents=True)
            (root / name / "model.safetensors").write_bytes(b"x" * 1000)
        _save(tmp_path, 1)
        assert _hidden(tmp_path) == sorted([names["live"], names["other_host"], names["unowned"]])
    finally:
        sleeper.kill()
        sleeper.wait()
    assert remove_stale(root) == [root / names["live"]]


def test_failed_write_removes_the_temporary_folder(tmp_path, monkeypatch):
    _save(tmp_path, 1)

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckpt_mod, "save_file", disk_full)  # the write fails as on a full disk
    with pytest.raises(CheckpointError) as e:
        _save(tmp_path, 2)
    assert str(e.value).startswith(f"disk full while saving checkpoint step_00000002 into {tmp_path / 'checkpoints'} (")
    assert _hidden(tmp_path) == [] and [p.name for p in list_checkpoints(tmp_path)] == ["step_00000001"]


@pytest.fixture
def small_disk(tmp_path):
    """A real 2 MiB tmpfs (root only); skipped with the reason where mounting is not permitted."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.strip() or proc.returncode}): needs root")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=True)


# 4096: the weights (~3 MB) do not fit, safetensors fails ("No space left on device"); 1024: the weights
# (~1.2 MB) fit, the optimizer state does not, torch.save fails ("unexpected pos").
@pytest.mark.parametrize("vocab", [4096, 1024], ids=["weights-overflow", "optimizer-overflow"])
def test_full_disk_on_a_real_tmpfs(small_disk, monkeypatch, vocab):
    cfg = tiny_config([f"--model.vocab_size={vocab}"])
    built = assemble_tiny(cfg)
    model, opt = built.module, built.optimizer
    model(torch.zeros(1, 4, dtype=torch.long)).sum().backward()
    opt.step()  # AdamW's states exist from the first step on
    root = small_disk / "checkpoints"
    with pytest.raises(
        CheckpointError,
        match=rf"^not enough disk space in {root} for checkpoint step_00000001: "
        r"needs about \d+ bytes, \d+ free$",
    ):
        save_checkpoint(small_disk, model, opt, TrainState(1, {}, {}, {}), "", lora=False, keep_last=2)
    # The estimate can be beaten (another process fills the disk meanwhile): then the write itself fails.
    monkeypatch.setattr(ckpt_mod, "check_free_space", lambda *a: None)
    monkeypatch.setattr("tracetrain.train.sharded_checkpoint.check_free_space", lambda *a: None)
    for save in (
        lambda: save_checkpoint(small_disk, model, opt, TrainState(1, {}, {}, {}), "", lora=False, keep_last=2),
        lambda: save_sharded(small_disk, 1, model, opt, {"step": 1}, "", keep_last=2),
    ):
        with pytest.raises(CheckpointError, match=rf"^disk full while saving checkpoint step_00000001 into {root} "):
            save()
        assert list(root.iterdir()) == []  # nothing left behind: the disk is free again


# ----------------------------------------------------------------------------------------------------
# kill -9 at every filesystem operation of a save with rotation and a same-step re-save

_KILL_POINTS = [
    ("os", "rename"),
    ("os", "unlink"),
    ("os", "rmdir"),
    ("os", "mkdir"),
    ("os", "fsync"),
    ("shutil", "rmtree"),
    ("torch", "save"),
]


def _die_at(n: int) -> None:
    """In a forked child: SIGKILL this process right before its n-th filesystem operation."""
    calls = [0]

    def wrap(fn):
        def killer(*args, **kwargs):
            calls[0] += 1
            if calls[0] == n:
                os.kill(os.getpid(), signal.SIGKILL)
            return fn(*args, **kwargs)

        return killer

    modules = {"os": os, "shutil": shutil, "torch": torch}
    for mod, name in _KILL_POINTS:
        setattr(modules[mod], name, wrap(getattr(modules[mod], name)))
    ckpt_mod.save_file = wrap(ckpt_mod.save_file)


@pytest.mark.slow  # 44 forked saves: ~11 s on a busy 2-core machine
def test_kill_9_at_every_step_of_save_rotation_and_resave(tmp_path, monkeypatch):
    # The children are forked: on a GPU machine the parent's CUDA context (the saved RNG states touch it)
    # cannot be used in a forked child, so the saves here keep to CPU state; what is tested is the files.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    template = tmp_path / "template"
    _save(template, 1, keep_last=2)
    _save(template, 2, keep_last=2)
    n, kills = 1, 0
    while True:
        run = tmp_path / f"run{n}"
        shutil.copytree(template, run)
        # Built before the fork: autograd's worker threads (on a GPU machine) cannot run in a forked child.
        step3, step3_again = _tiny(3.0), _tiny(33.0)
        pid = os.fork()
        if pid == 0:  # child: step 3 (rotation drops step 1), then step 3 again with other values
            try:
                _die_at(n)
                _save(run, 3, keep_last=2, built=step3)
                _save(run, 3, value=33, keep_last=2, built=step3_again)
                os._exit(0)
            except BaseException:
                import traceback

                traceback.print_exc()  # shown by pytest as the test's captured stderr
                os._exit(1)
        _, status = os.waitpid(pid, 0)
        if os.WIFEXITED(status):
            assert os.WEXITSTATUS(status) == 0, f"kill point {n}: the child failed"
            break
        assert os.WTERMSIG(status) == signal.SIGKILL
        kills += 1
        visible = [p for p in (run / "checkpoints").iterdir() if p.name.startswith("step_")]
        assert visible, f"kill point {n}: no checkpoint left"
        for ckpt in visible:  # every visible folder is complete and loads
            assert verify_checkpoint(ckpt), f"kill point {n}: {ckpt.name} has no manifest"
            assert _load(ckpt).step == int(ckpt.name.split("_")[1])
        latest = latest_checkpoint(run)
        assert _load(latest).step in (2, 3)
        _save(run, 4, keep_last=2)  # the next save clears what the dead process left
        assert _hidden(run) == [], f"kill point {n}"
        n += 1
    assert kills >= 20  # every operation of both saves was a kill point
