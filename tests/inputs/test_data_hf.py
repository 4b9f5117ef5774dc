"""`data.path = "hf:NAME"`: a Hugging Face dataset read from a local cache, offline.

The caches are made here, in a temporary HF_HOME, in the layouts the libraries write: the Hub cache of
`huggingface-cli download --repo-type dataset NAME` (snapshots/<commit>/ + refs/main) and the datasets
cache of a `datasets.load_dataset(NAME)` run online (<owner>___<name>/default/0.0.0/<hash>/). The real
command runs in a fresh process (the libraries read HF_HOME when imported), with the Hub endpoint
pointed at a closed port: nothing may reach the network.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO

pytest.importorskip("datasets", reason="hf: paths need the datasets package (in the dev extra)")
pytestmark = pytest.mark.slow  # each test runs the command in a fresh interpreter (HF_HOME is read at import)
ROOT = REPO
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def alpaca_rows(n: int) -> list[dict[str, str]]:
    return [
        {"instruction": f"Add {i} and 1.", "input": "" if i % 2 else f"{i}", "output": f"{i + 1}"} for i in range(n)
    ]


def hub_cache(home: Path, repo: str, splits: dict[str, list[dict[str, str]]]) -> None:
    """The layout `huggingface-cli download --repo-type dataset REPO` leaves: parquet files in a snapshot."""
    import datasets

    folder = home / "hub" / f"datasets--{repo.replace('/', '--')}"
    data = folder / "snapshots" / COMMIT / "data"
    data.mkdir(parents=True)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(COMMIT)
    for split, rows in splits.items():
        datasets.Dataset.from_list(rows).to_parquet(str(data / f"{split}-00000-of-00001.parquet"))


def prepared_cache(home: Path, repo: str, rows: list[dict[str, str]], tmp: Path) -> None:
    """The layout `datasets.load_dataset(REPO)` prepares online: Arrow files under <owner>___<name>/default/."""
    code = f"""
import json, shutil
from pathlib import Path
import datasets
from datasets.packaged_modules.json.json import Json
Path({str(tmp / "rows.jsonl")!r}).write_text("".join(json.dumps(r) + "\\n" for r in {rows!r}))
name = {repo!r}.split("/")[1]
builder = Json(dataset_name=name, data_files={{"train": {str(tmp / "rows.jsonl")!r}}}, hash="abc123")
builder.download_and_prepare()
src = Path(builder.cache_dir)
dst = Path(datasets.config.HF_DATASETS_CACHE) / {repo!r}.replace("/", "___") / "default" / "0.0.0" / "abc123"
dst.parent.mkdir(parents=True)
shutil.move(src, dst)
info = json.loads((dst / "dataset_info.json").read_text())
(dst / "dataset_info.json").write_text(json.dumps({{**info, "config_name": "default"}}))
"""
    subprocess.run([sys.executable, "-c", code], env=_env(home), check=True, capture_output=True)


def _env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE"))}
    return {**env, "HF_HOME": str(home), "HF_ENDPOINT": "http://127.0.0.1:9", "PYTHONPATH": str(ROOT)}


def tracetrain(home: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "tracetrain.cli", *args]
    return subprocess.run(cmd, env=_env(home), cwd=cwd, capture_output=True, text=True, timeout=300)


def data_stats(home: Path, tmp: Path, *overrides: str) -> dict:
    out = tmp / "stats.json"
    result = tracetrain(
        home, "data", "--data.kind=instruction", "--data.seq_len=256", f"--stats-json={out}", *overrides, cwd=tmp
    )
    assert result.returncode == 0, result.stderr
    return json.loads(out.read_text())


def test_hub_cache_snapshot_loads_offline(tmp_path: Path) -> None:
    home = tmp_path / "hf"
    hub_cache(home, "acme/tiny-alpaca", {"train": alpaca_rows(40), "test": alpaca_rows(6)})
    stats = data_stats(home, tmp_path, "--data.path=hf:acme/tiny-alpaca", "--data.eval_fraction=0")
    assert stats["format"] == "alpaca (auto: instruction/input/output)"
    assert stats["train"]["examples"] == 40 and stats["bad_rows_skipped"] == 0
    # The held-out data from the same dataset's other split.
    stats = data_stats(
        home,
        tmp_path,
        "--data.path=hf:acme/tiny-alpaca",
        "--data.eval_path=hf:acme/tiny-alpaca",
        "--data.eval_split=test",
    )
    assert (stats["train"]["examples"], stats["eval"]["examples"]) == (40, 6)


def test_prepared_datasets_cache_loads_offline(tmp_path: Path) -> None:
    home = tmp_path / "hf"
    prepared_cache(home, "acme/prepared", alpaca_rows(30), tmp_path)
    stats = data_stats(home, tmp_path, "--data.path=hf:acme/prepared", "--data.eval_fraction=0")
    assert stats["train"]["examples"] == 30
    assert not (home / "hub").exists()  # read from the prepared Arrow files, not downloaded


def test_not_cached_says_how_to_get_it_in_one_line(tmp_path: Path) -> None:
    home = tmp_path / "hf"
    home.mkdir()
    result = tracetrain(home, "data", "--data.kind=instruction", "--data.path=hf:acme/absent", cwd=tmp_path)
    assert result.returncode != 0
    line = result.stderr.strip()
    assert "\n" not in line and "Traceback" not in line
    assert "'acme/absent' is not in the local Hugging Face cache" in line
    assert "datasets.load_dataset('acme/absent')" in line
    assert "huggingface-cli download --repo-type dataset acme/absent" in line
    assert "data.path" in line


def test_missing_split_is_one_line(tmp_path: Path) -> None:
    home = tmp_path / "hf"
    hub_cache(home, "acme/one-split", {"train": alpaca_rows(10)})
    result = tracetrain(
        home,
        "data",
        "--data.kind=instruction",
        "--data.path=hf:acme/one-split",
        "--data.split=validation",
        cwd=tmp_path,
    )
    assert result.returncode != 0
    assert result.stderr.count("\n") == 1 and "validation" in result.stderr and "Traceback" not in result.stderr


def test_changed_dataset_is_a_new_cache_entry(tmp_path: Path) -> None:
    """The token cache's key hashes the dataset's Arrow files: new rows are never mistaken for the old ones."""
    code = """
import sys
from tracetrain.config import load_config
from tracetrain.data import build_datasets, load_tokenizer
cfg = load_config(None, ["--data.kind=instruction", "--data.path=hf:acme/changing", "--data.seq_len=256"])
train, _, stats = build_datasets(cfg.data, load_tokenizer("byte", ""), cache_dir=sys.argv[1])
print(stats.examples_read)
"""
    home = tmp_path / "hf"
    hub_cache(home, "acme/changing", {"train": alpaca_rows(12)})
    run = lambda: subprocess.run(  # noqa: E731
        [sys.executable, "-c", code, str(tmp_path / "cache")], env=_env(home), capture_output=True, text=True
    )
    first = run()
    assert first.stdout.split() == ["12"], first.stderr
    shutil.rmtree(home)
    hub_cache(home, "acme/changing", {"train": alpaca_rows(20)})
    assert run().stdout.split() == ["20"]
    assert len(list((tmp_path / "cache").iterdir())) == 2
