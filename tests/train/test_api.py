"""The Python API: `tracetrain.train(config, data=..., callbacks=[...])` trains like the command line,
returns the trained model, validates a config made or changed in Python, and takes the user's rows."""

import dataclasses
import json
import re

import pytest
import torch

import tracetrain
from tracetrain.config import load_config
from tracetrain.errors import ConfigError
from tracetrain.train.api import write_rows
from tracetrain.train.assemble import build_model

TINY = ["--train.steps=6", "--train.micro_batch_size=4", "--data.seq_len=256", "--data.template=plain",
        "--logging.log_interval=2", "--train.eval_interval=3", "--train.eval_generate=2", "--train.eval_batches=1",
        "--optim.warmup_steps=1", "--logging.progress=false", "--model.n_layers=1"]
ROWS = [{"instruction": f"What is {i} plus {i}?", "response": str(2 * i)} for i in range(120)]


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple] = []

    def on_step(self, step, metrics):
        self.events.append(("step", step, metrics["loss"]))

    def on_eval(self, step, metrics):
        self.events.append(("eval", step, metrics["eval_loss"]))

    def on_save(self, step, path):
        self.events.append(("save", step, path.name))


def test_train_with_rows_and_callbacks_returns_the_trained_model(tmp_path):
    rec = Recorder()
    result = tracetrain.train(None, data=ROWS, callbacks=[rec], run_name="api",
                              overrides=["--data.kind=instruction", f"--train.output_dir={tmp_path}", *TINY])
    assert result.run_dir == tmp_path / "api" and result.signum is None
    kinds = [(e[0], e[1]) for e in rec.events]
    assert kinds == [("step", 2), ("eval", 3), ("step", 4), ("step", 6), ("eval", 6), ("save", 6)]
    # Metrics seen by the callback are those written to metrics.jsonl.
    logged = [json.loads(x) for x in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rec.events[0][2] == next(r["loss"] for r in logged if r.get("step") == 2 and "loss" in r)
    # The returned model is the trained one: it equals the final checkpoint, not a fresh init.
    cfg = load_config(result.run_dir / "config.toml")
    fresh = build_model(cfg, torch.device("cpu"))
    trained = dict(result.model.named_parameters())
    assert any(not torch.equal(p, trained[n]) for n, p in fresh.named_parameters())
    assert result.tokenizer is not None
    # The rows were written once, by content, and the run's config points at them (resumable).
    data_file = tmp_path / "datasets" / cfg.data.path.rsplit("/", 1)[-1]
    assert cfg.data.path == str(data_file) and len(data_file.read_text().splitlines()) == len(ROWS)


def test_a_config_changed_in_python_is_validated(tmp_path):
    cfg = load_config(None, [f"--train.output_dir={tmp_path}"])
    with pytest.raises(ConfigError, match=r"optim.lr.*out of range"):
        cfg.replace({"optim.lr": 5.0})
    with pytest.raises(ConfigError, match=r"unknown config key 'optim.learning_rate'"):
        cfg.replace({"optim.learning_rate": 1e-4})
    bad = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, lr=5.0))  # bypasses replace()
    with pytest.raises(ConfigError, match=r"optim.lr"):
        tracetrain.train(bad)
    assert not list(tmp_path.iterdir())  # refused before any run directory exists
    assert cfg.replace({"optim.lr": 1e-4}).optim.lr == 1e-4


def test_rows_need_a_data_kind_that_reads_them(tmp_path):
    with pytest.raises(ConfigError, match=r"data.kind' is 'synthetic'"):
        tracetrain.train(None, data=ROWS, overrides=[f"--train.output_dir={tmp_path}"])
    with pytest.raises(ConfigError, match=r"data.path: row 1 is a str"):
        tracetrain.train(None, data=[ROWS[0], "not a row"],
                         overrides=["--data.kind=instruction", f"--train.output_dir={tmp_path}"])


@pytest.mark.parametrize("kwargs, fragment", [
    ({"data": ROWS, "overrides": ["--optim.lr=banana"]}, "config key 'optim.lr': 'banana' is not a number"),
    ({"data": ROWS, "overrides": ["--model.preset=huge"]}, "config key 'model.preset': 'huge' is not a preset"),
    ({"data": ROWS, "overrides": ["--train.mode=lora", "--lora.rank=1000"]}, "config key 'lora.rank': 1000 is larger"),
    ({"data": "rows.jsonl"}, "data= takes rows (a list of dicts of fields), not a str; a data file goes in config "
                             "key 'data.path'"),
    ({"data": ROWS, "eval_data": ROWS[0]}, "eval_data= takes rows (a list of dicts of fields), not a dict; a data "
                                           "file goes in config key 'data.eval_path'"),
], ids=["bad-value", "bad-preset", "model-shape", "data-a-path", "eval-data-one-row"])
def test_a_refused_call_writes_no_rows(tmp_path, kwargs, fragment):
    """Rows are written only once the config passed every check: a refused call leaves the output folder
    as it was (the rows' file was written first, then the config refused; a string or a dict was read as
    rows of characters or keys: 'row 0 is a str')."""
    overrides = ["--data.kind=instruction", f"--train.output_dir={tmp_path}", *kwargs.pop("overrides", [])]
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        tracetrain.train(None, overrides=overrides, **kwargs)
    assert not list(tmp_path.iterdir())


def test_rows_are_written_once_by_content(tmp_path):
    a = write_rows(ROWS, tmp_path, "instruction", "data.path")
    stamp = a.stat().st_mtime_ns
    assert write_rows(list(ROWS), tmp_path, "instruction", "data.path") == a and a.stat().st_mtime_ns == stamp
    assert write_rows(ROWS[:10], tmp_path, "instruction", "data.path") != a
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary files left
