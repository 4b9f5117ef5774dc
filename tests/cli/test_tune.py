"""`tracetrain tune` end to end on the CPU: the real command on the built-in default config, each trial a
real `tracetrain train` process. One tune (module fixture) is shared: its files, then a rerun that
resumes it, the numerics guard judged again with --allow, and Ctrl-C on a rerun that has a trial to run."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
from conftest import cli_here
from helpers import REPO, console_errors, render_in_browser

from tracetrain.config import load_config

# The default run with less generated data (the data build runs in every trial), smaller micro-batches
# and a short window; measured: the baseline, the --try change, the second seed the guard asks for and
# one planner candidate (--max-trials 2), well inside the budget on an idle 2-core machine.
SMALL = ["--data.synthetic_examples=300", "--train.micro_batch_size=4", "--steps", "10", "--warmup-steps", "1"]
SMALL += ["--max-trials", "2"]
DIVERGE = "optim.lr=0.9"  # a change that changes the loss far beyond two seeds' spread: refused
BUDGET_MIN = 2.0


def _env() -> dict[str, str]:
    # One thread per trial: the model is tiny, and two threads spin against the test run's other workers.
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


def _tune(out: Path, *extra: str, budget: float = BUDGET_MIN) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "tracetrain.cli", "tune", "--out", str(out), "--budget-min", str(budget)]
    return subprocess.run([*cmd, *SMALL, *extra], capture_output=True, text=True, env=_env(), timeout=600)


def _ledger(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "tune" / "trials.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    out = tmp_path_factory.mktemp("tune")
    start = time.monotonic()
    proc = _tune(out, "--try", DIVERGE)
    return out, proc, time.monotonic() - start


def test_tune_writes_tuned_toml_and_the_report_within_its_budget(tuned):
    out, proc, seconds = tuned
    assert proc.returncode == 0, proc.stderr[-2000:]
    # The budget bounds the trials; the command's start-up (imports, the planner) and the files come on top.
    assert seconds < BUDGET_MIN * 60 + 40, seconds
    cfg = load_config(out / "tuned.toml")  # loads as a config: every key valid
    text = (out / "tuned.toml").read_text()
    assert "tuned by `tracetrain tune`" in text
    changed = [line for line in text.splitlines() if line.startswith("# tune:")]
    for line in changed:
        assert "tokens/s" in line  # each changed key says its measured gain
    assert cfg.train.steps == 600  # the user's run, not the trial window
    page = (out / "tune" / "report.html").read_text()
    records = _ledger(out)
    assert records[0]["label"] == "baseline" and records[0]["status"] == "ok"
    assert records[0]["measurement"]["tokens_per_s"] > 0 and len(records[0]["measurement"]["step_s_all"]) >= 10
    for rec in records:
        assert rec["label"] in page.replace("&#x27;", "'")
    assert "predicted gain" in page and "measured gain" in page and "planner error" in page
    assert proc.stdout.count("\n[") >= 2  # progress: one line per trial


def test_the_report_renders_in_chromium(tuned, tmp_path):
    out, _, _ = tuned
    dom, log = render_in_browser(out / "tune" / "report.html", tmp_path)
    assert not console_errors(log), console_errors(log)
    assert 'aria-label="gain per trial"' in dom and "<rect" in dom
    assert dom.count("<tr") >= len(_ledger(out)) + 1  # every measured trial, and the table's head


def test_the_numerics_guard_refuses_a_change_of_the_loss(tuned):
    out, _, _ = tuned
    records = {r["label"]: r for r in _ledger(out)}
    assert "baseline, second seed" in records  # measured once, when the guard first needed it
    base = records["baseline"]["measurement"]["loss"]
    seed = records["baseline, second seed"]["measurement"]["loss"]
    diverged = records[DIVERGE]["measurement"]["loss"]
    assert abs(diverged - base) > abs(seed - base)
    assert "refused: loss differs" in (out / "tune" / "report.html").read_text()
    assert tomllib.loads((out / "tuned.toml").read_text()).get("optim", {}).get("lr") is None


def test_a_rerun_skips_recorded_trials_and_allow_accepts_the_change(tuned, tmp_path):
    out, _, _ = tuned
    again = tmp_path / "again"
    shutil.copytree(out, again)
    before = _ledger(again)
    # A budget too small for any new trial (the recorded ones say how long one takes): only the ledger. No
    # trial starts, so the command runs in this process (cli_here); the fixture's tune is the real process.
    proc = cli_here(
        "tune",
        "--out",
        str(again),
        "--budget-min",
        "0.05",
        *SMALL,
        "--try",
        DIVERGE,
        "--allow",
        "numerics",
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("(recorded earlier)") >= len(before)
    assert [r["key"] for r in _ledger(again)] == [r["key"] for r in before]  # nothing measured again
    assert "allowed by --allow numerics" in (again / "tune" / "report.html").read_text()


def test_ctrl_c_keeps_what_was_measured(tuned, tmp_path):
    out, _, _ = tuned
    again = tmp_path / "again"
    shutil.copytree(out, again)
    lines = (again / "tune" / "trials.jsonl").read_text().splitlines()
    (again / "tune" / "trials.jsonl").write_text("\n".join(lines[:2]) + "\n")  # leave trials to run
    (again / "tuned.toml").unlink()
    cmd = [sys.executable, "-m", "tracetrain.cli", "tune", "--out", str(again), "--budget-min", "5", *SMALL]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env())
    seen = []
    for line in proc.stdout:  # the recorded trials come back at once; then a new trial starts
        seen.append(line)
        if "candidates from" in line:
            break
    time.sleep(1.5)
    proc.send_signal(signal.SIGINT)
    rest = proc.communicate(timeout=120)[0]
    assert proc.returncode == 130, "".join(seen) + rest
    assert "interrupted" in rest
    assert (again / "tuned.toml").is_file() and load_config(again / "tuned.toml")
    assert "interrupted (Ctrl-C)" in (again / "tune" / "report.html").read_text()
    assert len(_ledger(again)) == 2  # the stopped trial is not recorded: a rerun measures it


def test_tuned_toml_puts_changed_keys_under_their_comment_first_in_their_section(tmp_path):
    from tracetrain.config import from_dict
    from tracetrain.tune.output import tuned_text, write_tuned

    raw = {"data": {"kind": "instruction", "sources": [{"path": "a.jsonl", "weight": 2.0}]}, "train": {"steps": 50}}
    changes = {"data.num_workers": 2, "train.micro_batch_size": 8, "memory.recompute": "selective"}
    comments = {"data.num_workers": "tune: data workers 2 measured +12.0% tokens/s"}
    text = tuned_text(raw, changes, comments, ["header line"])
    expected = from_dict(
        {
            **raw,
            "data": {**raw["data"], "num_workers": 2},
            "train": {"steps": 50, "micro_batch_size": 8},
            "memory": {"recompute": "selective"},
        }
    )
    write_tuned(tmp_path / "tuned.toml", text, expected)
    lines = (tmp_path / "tuned.toml").read_text().splitlines()
    assert lines[0] == "# header line"
    at = lines.index("num_workers = 2")
    assert lines[at - 1] == "# tune: data workers 2 measured +12.0% tokens/s"
    assert at < next(i for i, line in enumerate(lines) if line.startswith(("sources", "[[data.sources]]")))
    assert tomllib.loads("\n".join(lines))["data"]["sources"] == [{"path": "a.jsonl", "weight": 2.0}]


def test_bad_tune_flags_are_one_line_errors(tmp_path):
    proc = cli_here("tune", "--out", str(tmp_path), "--allow", "fp4", check=False)  # the CLI's main, this process
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("error: --allow fp4: not a kind tune knows; allowed: fp8, fp16, numerics")
    assert "Traceback" not in proc.stderr
    import tracetrain
    from tracetrain.errors import ConfigError

    for kwargs, words in (
        ({"measured_steps": 5}, "--steps 5: the median needs at least 10"),
        ({"budget_min": 0.0}, "--budget-min 0.0: must be above 0"),
        ({"max_memory_gib": -1.0}, "--max-memory -1.0: must be above 0"),
        # a --try the config refuses: named before the baseline runs, not a traceback or a silent drop
        ({"tries": ["data.num_worker=4"]}, "--try data.num_worker=4: unknown config key 'data.num_worker'"),
        ({"tries": ["optim.lr=-1"]}, "--try optim.lr=-1: config key 'optim.lr': -1.0 is out of range"),
    ):
        with pytest.raises(ConfigError, match=re.escape(words)):
            tracetrain.tune(out_dir=tmp_path, **kwargs)
    assert not (tmp_path / "tune").exists()  # refused before anything was written


def test_two_ranks_measure_the_planners_layouts_under_torchrun(tmp_path):
    """`--gpus 2` on the CPU: every trial runs as 2 gloo ranks (torchrun), the baseline shards the data
    over them (FSDP), the next candidate is another of the planner's layouts, and both files are written."""
    out = tmp_path / "two"
    proc = _tune(out, "--gpus", "2", "--max-trials", "1", budget=3.0)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    records = _ledger(out)
    assert [r["status"] for r in records] == ["ok", "ok"], records
    assert records[1]["label"].startswith("layout ") and records[1]["label"] != "layout fsdp2"
    runs = out / "tune" / "runs"
    for rec in records:
        assert json.loads((runs / rec["key"] / "spec.json").read_text())["world_size"] == 2
    base = load_config(runs / records[0]["key"] / "config.toml").parallel
    tried = load_config(runs / records[1]["key"] / "config.toml").parallel
    assert (base.dp_shard, base.dp_replicate) == (2, 1)
    assert (tried.dp_replicate, tried.dp_shard, tried.zero_stage, tried.tp, tried.cp) != (1, 2, 3, 1, 1)
    assert records[1]["label"] in (out / "tune" / "report.html").read_text()
    tuned = load_config(out / "tuned.toml").parallel  # a config for the 2 GPUs it was measured on
    assert tuned.dp_replicate * tuned.dp_shard * tuned.tp * tuned.pp * tuned.cp == 2


def test_layout_candidates_are_distinct_layouts_and_never_combined():
    from tracetrain.config import from_dict
    from tracetrain.tune.session import _knobs
    from tracetrain.tune.space import Planner, build_candidates, layout_changes

    cfg = from_dict({"parallel": {"dp_shard": 2}})
    planner = Planner.of(cfg, "h100-sxm", 2, None)
    assert planner.base is not None and planner.base.layout() == "fsdp2"
    layouts = layout_changes(planner, cuda=False, top=10)
    labels = [c.label for c in layouts]
    assert len(layouts) >= 2 and len(set(labels)) == len(labels) and "layout fsdp2" not in labels
    for c in layouts:  # the CPU offloading to itself is not a candidate
        assert c.change_dict.get("memory.activation_offload", "none") == "none"
        assert not c.change_dict.get("parallel.fsdp_cpu_offload", False)
    first = build_candidates(planner, [], cuda=False, allow=())
    assert [c.source for c in first[: len(layout_changes(planner, cuda=False))]] == ["layout"] * min(3, len(layouts))
    assert _knobs(layouts[0].change_dict) & _knobs(layouts[1].change_dict)  # alternatives: never merged
    planned = planner.predict(layouts[0].change_dict)[1]  # the planner plans both GPUs; a trial measures one
    assert planned is not None and layouts[0].predicted_tokens_per_s == pytest.approx(planned.tokens_per_s / 2)


def test_recompute_pointwise_is_a_gpu_candidate_of_compiled_lora_runs_with_the_planners_memory():
    from tracetrain.config import from_dict
    from tracetrain.tune.space import Planner, knob_changes, make_candidate

    lora = from_dict({"train": {"mode": "lora"}, "lora": {"targets": ["all-linear"]}})
    labels = {label for label, _, _ in knob_changes(lora, True, ())}
    assert "recompute pointwise on" in labels
    assert "recompute pointwise on" not in {label for label, _, _ in knob_changes(lora, False, ())}  # the CPU
    for cfg in (from_dict({}), lora.replace({"train.compile": "off"})):  # no adapters; blocks not compiled
        assert not any(label.startswith("recompute pointwise") for label, _, _ in knob_changes(cfg, True, ()))
    planner = Planner.of(lora, "h100-sxm", 1, None)
    c = make_candidate(planner, "recompute pointwise on", {"memory.recompute_pointwise": "on"}, "", "what-if")
    assert c is not None and planner.base is not None and c.predicted_peak_gib is not None
    assert c.predicted_peak_gib < planner.base.memory.peak_bytes / 2**30
    qlora = lora.replace({"lora.base_quant": "nf4"})  # on by default there: the what-if turns it off
    assert "recompute pointwise off" in {label for label, _, _ in knob_changes(qlora, True, ())}
