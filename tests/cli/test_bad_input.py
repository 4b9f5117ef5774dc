"""Every bad input ends in one line `error: ...` naming the key, file or value, exit status 2, no traceback,
and no run directory (issue #15, items 10 and 11). Most cases run the real `main` in this process (an escaped
exception fails the test with its traceback); the pipe cases run real subprocesses."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import traces_gen as gen
from helpers import REPO

from tracetrain.cli import main
from tracetrain.config import load_config
from tracetrain.errors import CheckpointError, ConfigError
from tracetrain.models.build import model_args_from_config
from tracetrain.models.hf import load_hf_config
from tracetrain.train.runtime import resolve_device
from tracetrain.validate import validate_run

# A small, otherwise valid run: if a check failed to fire, it would train for seconds, not minutes.
SMALL = ["--train.steps=4", "--optim.warmup_steps=1", "--data.synthetic_examples=64", "--data.seq_len=32",
         "--train.micro_batch_size=4", "--logging.progress=false", "--train.eval_generate=0"]
# A tiny Llama config.json (the shape of tests/models/test_hf_interop.py's TINY), 128 positions of context.
HF_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
             "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "vocab_size": 100, "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}


def expect_error(capsys: pytest.CaptureFixture, argv: list[str], *fragments: str) -> str:
    """Run the CLI; it must exit 2 with exactly one stderr line `error: ...` holding every fragment."""
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 2, f"exit {code}\nstdout: {out}\nstderr: {err}"
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for fragment in fragments:
        assert fragment in lines[0]
    assert "Traceback" not in out + err
    return lines[0]


def train_error(capsys, tmp_path: Path, args: list[str], *fragments: str) -> str:
    """`tracetrain train` refused before any run directory exists."""
    runs = tmp_path / "runs"
    line = expect_error(capsys, ["train", *SMALL, *args, f"--train.output_dir={runs}"], *fragments)
    assert not runs.exists(), f"a refused run left {list(runs.iterdir())}"
    return line


def hf_dir(tmp_path: Path, **changes) -> Path:
    """A checkpoint folder holding only config.json (enough for every check before the weights load)."""
    folder = tmp_path / "hf"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**HF_CONFIG, **changes}))
    return folder


# ----------------------------------------------------------------------------------------------------
# Config files

def test_config_file_not_utf8(capsys, tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_bytes(b"[optim]\nlr = 3e-4  # caf\xe9 (Latin-1)\n")
    train_error(capsys, tmp_path, ["--config", str(bad)],
                f"{bad}: line 2: byte 0xe9 is not UTF-8 text (TOML files must be saved as UTF-8)")


@pytest.mark.parametrize("make, fragment", [
    (lambda p: p.mkdir(), "is a directory; give a .toml file"),
    (lambda p: None, "does not exist"),
    (lambda p: p.write_text("[optim\n"), "not valid TOML"),
    (lambda p: p.write_text("[bogus]\nx = 1\n"), "unknown config section 'bogus'; known: checkpoint, data"),
], ids=["directory", "missing", "invalid-toml", "unknown-section"])
def test_config_file_read_errors(capsys, tmp_path, make, fragment):
    path = tmp_path / "run.toml"
    make(path)
    train_error(capsys, tmp_path, ["--config", str(path)], str(path), fragment)


# ----------------------------------------------------------------------------------------------------
# Config values

@pytest.mark.parametrize("override, fragments", [
    ("--optim.lr=1e39", ["config key 'optim.lr': 1e+39 is out of range; it must be <= 1"]),
    ("--optim.lr=inf", ["config key 'optim.lr': inf is not a finite number"]),
    ("--optim.eps=nan", ["config key 'optim.eps': nan is not a finite number"]),
    ("--model.init_std=-inf", ["config key 'model.init_std': -inf is not a finite number"]),
    ("--train.grad_clip=1e400", ["config key 'train.grad_clip': inf is not a finite number"]),  # overflows to inf
    ("--data.path=my.jsonl", ["config key 'data.path': 'my.jsonl' is ignored with data.kind = 'synthetic'",
                              "set data.kind to one of", "instruction", "text"]),
    ("--data.eval_path=held.jsonl", ["config key 'data.eval_path': 'held.jsonl' is ignored"]),
    ("--optim.warmup_steps=4", ["config key 'optim.warmup_steps': 4 is not shorter than the run "
                                "(4 steps from train.steps); set it below 4"]),
    ("--train.device=banana", ["config key 'train.device': 'banana' is not allowed; use 'auto', 'cpu'"]),
])
def test_bad_config_values(capsys, tmp_path, override, fragments):
    train_error(capsys, tmp_path, [override], *fragments)


@pytest.mark.parametrize("toml_text, override, line", [
    ("[train]\nsteps = 4\n", "--optim.lr=banana", "error: config key 'optim.lr': 'banana' is not a number"),
    ("[train]\nsteps = 4\n", "--optim.lr=5", "error: config key 'optim.lr': 5.0 is out of range; it must be <= 1"),
    ("[train]\nsteps = 4\n", "--train.stepz=3", "error: unknown config key 'train.stepz' (did you mean 'train.steps'?)"),
    ('[optim]\nlr = "x"\n', "--train.steps=3", "error: {toml}: config key 'optim.lr': 'x' is not a number"),
], ids=["not-a-number", "out-of-range", "unknown-key", "the-files-own"])
def test_a_bad_override_is_not_blamed_on_the_config_file(capsys, tmp_path, toml_text, override, line):
    """A bad value given on the command line was reported as the --config file's ('run.toml: config key
    'optim.lr': 'banana' ...'), a key the file does not hold; the file's own bad values still name it."""
    toml = tmp_path / "run.toml"
    toml.write_text(toml_text)
    assert train_error(capsys, tmp_path, ["--config", str(toml), override]) == line.format(toml=toml)


def test_explicit_warmup_longer_than_a_short_run(capsys, tmp_path):
    """A warmup the user set (50 steps) is refused for a 10-step run instead of never reaching the peak lr."""
    runs = tmp_path / "runs"
    expect_error(capsys, ["train", "--train.steps=10", "--optim.warmup_steps=50", f"--train.output_dir={runs}"],
                 "'optim.warmup_steps': 50 is not shorter than the run (10 steps", "--optim.warmup_steps=1")
    assert not runs.exists()


def test_short_run_with_warmup_unset_trains_with_a_share_of_it(capsys, tmp_path):
    """Unset, the warm-up is min(50, 10% of the steps): a 20-step run warms up for 2, and says so once."""
    runs = tmp_path / "runs"
    args = [a for a in SMALL if not a.startswith(("--optim.warmup_steps", "--train.steps"))]
    assert main(["train", *args, "--train.steps=20", "--train.eval_interval=0", "--checkpoint.save_final=false",
                 "--train.run_name=r", f"--train.output_dir={runs}"]) == 0
    out = capsys.readouterr().out
    assert out.count("warm-up: 2 steps (10% of 20; optim.warmup_steps not set)") == 1, out
    rows = [json.loads(line) for line in (runs / "r" / "metrics.jsonl").read_text().splitlines()]
    lrs = [r["lr"] for r in rows if "lr" in r]
    assert len(lrs) == 20
    assert lrs[0] == pytest.approx(0.5e-3) and lrs[1] == pytest.approx(1e-3)  # 2 warm-up steps, then the peak
    assert lrs[2] == lrs[1] > lrs[3]  # then the decay starts


# Files named by the user are checked before any setting: each case below also asks for a warmup as long
# as the run (and a CUDA device), which would be refused too; the missing file must be the error named.
SETTING_ERRORS = ["--optim.warmup_steps=50", "--train.steps=4"]


def _named_file_cases(tmp: Path) -> dict[str, tuple[list[str], str]]:
    data = tmp / "rows.jsonl"
    data.write_text('{"instruction": "a", "response": "b"}\n' * 8)
    (tmp / "no_tok").mkdir()
    inst = ["--data.kind=instruction", f"--data.path={data}"]
    chat = ["--data.kind=chat", f"--data.path={data}"]
    return {
        "data.path": (["--data.kind=instruction", f"--data.path={tmp / 'missing.jsonl'}"],
                      f"data file {tmp / 'missing.jsonl'} does not exist (config key 'data.path')"),
        "data.eval_path": ([*inst, f"--data.eval_path={tmp / 'held.jsonl'}"],
                           f"data file {tmp / 'held.jsonl'} does not exist (config key 'data.eval_path')"),
        "data.tokenizer file": ([f"--data.tokenizer={tmp / 'tok.json'}"],
                                f"tokenizer file {tmp / 'tok.json'} does not exist (config key 'data.tokenizer')"),
        "data.tokenizer folder": ([f"--data.tokenizer={tmp / 'no_tok'}"],
                                  f"tokenizer file {tmp / 'no_tok' / 'tokenizer.json'} does not exist"),
        "model.init_from missing": ([f"--model.init_from={tmp / 'ckpt'}"],
                                    f"checkpoint folder {tmp / 'ckpt'} does not exist (config key 'model.init_from')"),
        "model.init_from a file": ([f"--model.init_from={data}"],
                                   f"{data} is a file, not a Hugging Face checkpoint folder"),
        "model.init_from no config.json": ([f"--model.init_from={tmp / 'no_tok'}"],
                                           f"checkpoint folder {tmp / 'no_tok'} has no config.json, so it is not a "
                                           "Hugging Face checkpoint folder (config key 'model.init_from')"),
        "chat template": ([*chat, f"--data.chat_template={tmp / 't.jinja'}"],
                          f"chat template file {tmp / 't.jinja'} does not exist (config key 'data.chat_template')"),
    }


@pytest.mark.parametrize("case", ["data.path", "data.eval_path", "data.tokenizer file", "data.tokenizer folder",
                                  "model.init_from missing", "model.init_from a file",
                                  "model.init_from no config.json", "chat template"])
def test_missing_named_file_is_reported_before_settings(capsys, tmp_path, case):
    args, fragment = _named_file_cases(tmp_path)[case]
    train_error(capsys, tmp_path, [*args, *SETTING_ERRORS, "--train.device=cuda"], fragment)


@pytest.mark.parametrize(
    "data, key",
    [('path = "gone.jsonl"', "data.path"), ('[[data.sources]]\npath = "gone.jsonl"', "data.sources[0].path")],
    ids=["path", "sources"],
)
def test_missing_data_file_named_in_a_config_file_comes_first(capsys, tmp_path, data, key):
    """The README's case: a config file naming a missing data file, and a short run (warmup set above it)."""
    toml = tmp_path / "run.toml"
    toml.write_text(f'[optim]\nwarmup_steps = 50\n[train]\nsteps = 20\n[data]\nkind = "instruction"\n{data}\n')
    train_error(capsys, tmp_path, ["--config", str(toml)], f"data file gone.jsonl does not exist (config key '{key}')")


@pytest.mark.parametrize("skip", ["false", "true"])
def test_chat_template_needing_a_token_the_tokenizer_lacks(capsys, tmp_path, skip):
    """Mistral's template ends answers with eos_token, which the byte tokenizer has no text for: every row
    failed alike, blamed on the data ('eos_token' is undefined), or with skip_bad_lines every row skipped."""
    rows = tmp_path / "chat.jsonl"
    rows.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                             {"role": "assistant", "content": "yo"}]}) + "\n")
    expect_error(capsys, ["data", "--data.kind=chat", f"--data.path={rows}", "--data.chat_template=mistral",
                          f"--data.skip_bad_lines={skip}"],
                 "built-in template 'mistral' uses eos_token, which tokenizer byte does not have",
                 "(built-in: chatml, llama-3)")


@pytest.mark.parametrize("args, fragment", [
    (["--data.path={rows}", "--data.eval_path={rows}"], "config key 'data.eval_path': '{rows}' is data.path too, so "
                                                        "the held-out rows would be training rows"),
    (["--data.path={rows}", "--data.eval_path=./rows.jsonl"], "'./rows.jsonl' is data.path too"),
    (["--data.path=hf:nosuch/set", "--data.eval_path=hf:nosuch/set", "--data.eval_split=train"],
     "'hf:nosuch/set' is data.path too (split 'train' for both)"),
    # Another split of the same dataset is held-out data: not refused (it is then looked up, and not cached here).
    (["--data.path=hf:nosuch/set", "--data.eval_path=hf:nosuch/set"], "is not in the local Hugging Face cache"),
], ids=["same-file", "two-spellings", "same-split", "other-split"])
def test_eval_path_that_is_the_training_data(capsys, tmp_path, monkeypatch, args, fragment):
    """Held-out rows that are the training rows made every evaluation look better than it was, silently."""
    monkeypatch.chdir(tmp_path)
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"instruction": "a", "response": "b"}\n' * 20)
    train_error(capsys, tmp_path, ["--data.kind=instruction", "--data.template=plain",
                                   *(a.format(rows=rows) for a in args)], fragment.format(rows=rows))


# ----------------------------------------------------------------------------------------------------
# Devices and output files

@pytest.mark.parametrize("extra", [["eval"], ["generate", "--prompt", "hi"]], ids=["eval", "generate"])
def test_bad_device_flag(capsys, tmp_path, extra):
    # Checked before the run is even looked for: the run directory given here does not exist.
    expect_error(capsys, [*extra, str(tmp_path / "no-run"), "--device", "banana"],
                 "--device: 'banana' is not allowed; use 'auto', 'cpu', 'cuda' or 'cuda:N'")


def test_eval_output_into_a_directory(capsys, tmp_path):
    # Checked before the run is looked for (and before its answers are generated).
    expect_error(capsys, ["eval", str(tmp_path / "no-run"), "--output", str(tmp_path)],
                 f"--output {tmp_path}: is a directory")


@pytest.mark.parametrize("name, fragment", [
    ("folder", "data file {p} is a folder; name a file (--prompts-file)"),
    ("missing.jsonl", "data file {p} does not exist (--prompts-file)"),
])
def test_generate_prompts_file_that_is_not_a_file(capsys, tmp_path, name, fragment):
    # Checked before the run is looked for (the run given here does not exist); a folder was reported as
    # missing, under "config key '--prompts-file'".
    (tmp_path / "folder").mkdir()
    prompts = tmp_path / name
    expect_error(capsys, ["generate", str(tmp_path / "no-run"), "--prompts-file", str(prompts)],
                 fragment.format(p=prompts))


def test_eval_of_a_run_whose_data_file_moved(capsys, tmp_path):
    """The run's data.path (relative to where it trained) is gone: the line says the path came from the run's
    config.toml and how to point eval at the file, before the evaluation runs (it read like a mistyped flag)."""
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"instruction": f"say {i}", "response": str(i)}) + "\n" for i in range(40)))
    runs = tmp_path / "runs"
    assert main(["train", *SMALL, "--data.kind=instruction", f"--data.path={data}", "--data.template=plain",
                 "--train.run_name=r", f"--train.output_dir={runs}"]) == 0
    capsys.readouterr()
    data.unlink()
    line = expect_error(capsys, ["eval", str(runs / "r")], f"data file {data} does not exist (config key 'data.path')",
                        "as the run's", "config.toml names it", "pass --data.path=FILE")
    assert str(runs / "r" / "checkpoints") in line


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("extra", [["eval"], ["generate", "--prompt", "hi"]], ids=["eval", "generate"])
def test_device_cuda_without_a_gpu_names_the_flag(capsys, tmp_path, extra):
    # It named "config key 'train.device'", which the command line did not set.
    runs = tmp_path / "runs"
    assert main(["train", *SMALL, "--train.run_name=r", f"--train.output_dir={runs}"]) == 0
    capsys.readouterr()
    line = expect_error(capsys, [*extra, str(runs / "r"), "--device", "cuda"],
                        "--device: 'cuda' but no CUDA GPU is visible to PyTorch")
    assert "train.device" not in line


@pytest.mark.parametrize("args, given", [([], "neither was given"), (["--prompt", "a", "--prompts-file", "p.jsonl"],
                                                                       "both were given")], ids=["neither", "both"])
def test_generate_needs_one_source_of_prompts(capsys, tmp_path, args, given):
    # With no prompt at all it said "..., not both".
    expect_error(capsys, ["generate", str(tmp_path / "no-run"), *args],
                 f"generate needs --prompt TEXT (repeatable) or --prompts-file FILE.jsonl ({given})")


def test_resolve_device_names_bad_specs():
    with pytest.raises(ConfigError, match=re.escape("config key 'train.device': 'banana' is not allowed")):
        resolve_device("banana")
    with pytest.raises(ConfigError, match="--device: 'cuda:x' is not allowed"):
        resolve_device("cuda:x", "--device")
    assert resolve_device("cpu").type == "cpu"


@pytest.fixture(scope="module")
def trace(tmp_path_factory) -> Path:
    return gen.write(gen.gemm_heavy(steps=1), tmp_path_factory.mktemp("trace") / "t.json.gz")


@pytest.mark.parametrize("names", [["t.json.gz", "t.json.gz"], [".", "t.json.gz"], [".", "./t.json.gz"]],
                         ids=["file-twice", "folder-and-file", "two-spellings"])
def test_analyze_the_same_trace_twice(capsys, trace, monkeypatch, names):
    """Read twice, one trace was analysed as two ranks (`analyze t.json.gz t.json.gz`: '2 rank(s)')."""
    monkeypatch.chdir(trace.parent)
    expect_error(capsys, ["analyze", *names], "t.json.gz: the same trace is named twice (directly or through its "
                                              "folder); each file is one rank, so name it once")


@pytest.mark.parametrize("flag", ["--html", "--json"])
@pytest.mark.parametrize("where, fragment", [
    ("dir", "is a directory; give the path of a file to write"),
    ("missing/report.out", "does not exist; create it first"),
    ("file/report.out", "is not a folder"),
])
def test_analyze_output_paths(capsys, tmp_path, trace, flag, where, fragment):
    (tmp_path / "dir").mkdir()
    (tmp_path / "file").write_text("")
    target = tmp_path / where
    expect_error(capsys, ["analyze", str(trace), flag, str(target)], f"{flag} {target}", fragment)


@pytest.mark.parametrize("where, fragment", [
    ("dir", "is a directory; give the path of a file to write"),
    ("missing/page.html", "does not exist; create it first"),
    ("file/page.html", "is not a folder"),
])
def test_report_out_paths(capsys, tmp_path, where, fragment):
    """`report --out` is checked like analyze's files (it was an IsADirectoryError traceback)."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"kind": "train", "step": 1, "loss": 2.0}) + "\n")
    (tmp_path / "dir").mkdir()
    (tmp_path / "file").write_text("")
    target = tmp_path / where
    expect_error(capsys, ["report", str(run), "--out", str(target)], f"--out {target}", fragment)


@pytest.mark.parametrize("out, fragment", [
    ("file", "--out {tmp}/file: is a file; name a folder for tuned.toml and tune/"),
    ("file/sub", "--out {tmp}/file/sub: is inside {tmp}/file, which is a file"),
    ("dir", "--out {tmp}/dir: {tmp}/dir/tuned.toml is a folder; tune writes tuned.toml there"),
])
def test_tune_out_that_cannot_hold_its_files(capsys, tmp_path, out, fragment):
    """Refused before the first trial (a file was a NotADirectoryError traceback; a tuned.toml folder
    failed only after every trial had run)."""
    (tmp_path / "file").write_text("keep")
    (tmp_path / "dir" / "tuned.toml").mkdir(parents=True)
    expect_error(capsys, ["tune", "--out", str(tmp_path / out), "--max-trials", "0", "--budget-min", "0.1"],
                 fragment.format(tmp=tmp_path))
    assert (tmp_path / "file").read_text() == "keep" and not (tmp_path / "dir" / "tune").exists()


def test_data_stats_json_checked_before_the_data_is_read(capsys, tmp_path):
    # The data file named here is missing: the output file's error comes first, before any (long) data build.
    args = ["data", "--data.kind=instruction", f"--data.path={tmp_path / 'gone.jsonl'}"]
    expect_error(capsys, [*args, "--stats-json", str(tmp_path)], f"--stats-json {tmp_path}: is a directory")
    expect_error(capsys, [*args, "--stats-json", str(tmp_path / "no" / "s.json")], "does not exist; create it first")


def test_plan_html_into_a_directory(capsys, tmp_path):
    expect_error(capsys, ["plan", "--html", str(tmp_path)], f"--html {tmp_path}: is a directory")


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux /proc (a place no one can create files)")
def test_analyze_output_write_failure_is_one_line(capsys, trace):
    """A place that passes the checks but refuses the write (here /proc, even for root) ends in one line too."""
    expect_error(capsys, ["analyze", str(trace), "--json", "/proc/tracetrain-report.json"],
                 "--json /proc/tracetrain-report.json: cannot write it (")


def test_analyze_output_paths_still_work(capsys, tmp_path, trace):
    assert main(["analyze", str(trace), "--json", str(tmp_path / "r.json")]) == 0
    assert json.loads((tmp_path / "r.json").read_text())["kind"] == "tracetrain.analysis"


# ----------------------------------------------------------------------------------------------------
# Hugging Face config.json (model.init_from)

@pytest.mark.parametrize("key, value, fragment", [
    ("hidden_size", "64", 'hidden_size = "64" is not allowed; it must be a positive integer'),
    ("hidden_size", 64.0, "hidden_size = 64.0 is not allowed; it must be a positive integer"),
    ("hidden_size", True, "hidden_size = true is not allowed"),
    ("hidden_size", -64, "hidden_size = -64 is not allowed"),
    ("num_hidden_layers", "2", 'num_hidden_layers = "2" is not allowed'),
    ("num_attention_heads", 0, "num_attention_heads = 0 is not allowed"),
    ("num_key_value_heads", 2.5, "num_key_value_heads = 2.5 is not allowed"),
    ("intermediate_size", [128], "intermediate_size = [128] is not allowed"),
    ("vocab_size", None, "required key 'vocab_size' is missing"),
    ("max_position_embeddings", "128", 'max_position_embeddings = "128" is not allowed'),
    ("rms_norm_eps", "tiny", 'rms_norm_eps = "tiny" is not allowed; it must be a positive number'),
    ("rope_theta", False, "rope_theta = false is not allowed"),
    ("tie_word_embeddings", "false", 'tie_word_embeddings = "false" is not allowed; it must be true or false'),
    ("architectures", "LlamaForCausalLM", "'architectures' must be a list"),
])
def test_hf_config_bad_shape_fields(capsys, tmp_path, key, value, fragment):
    folder = hf_dir(tmp_path, **{key: value})
    # `plan` reads the shape and nothing else; `train` reaches the same load_hf_config.
    expect_error(capsys, ["plan", f"--model.init_from={folder}"], f"{folder / 'config.json'}: {fragment}")


@pytest.mark.parametrize("make, what", [
    (lambda p: p.mkdir(), "has no config.json, so it is not a Hugging Face checkpoint folder"),
    (lambda p: None, "does not exist"),
], ids=["no-config-json", "missing"])
def test_plan_init_from_that_is_not_a_checkpoint(capsys, tmp_path, make, what):
    # `plan` reads only the shape; it said "<folder>/config.json does not exist", naming no key.
    folder = tmp_path / "ckpt"
    make(folder)
    expect_error(capsys, ["plan", f"--model.init_from={folder}"],
                 f"checkpoint folder {folder} {what} (config key 'model.init_from')")


def test_hf_config_not_an_object_or_not_utf8(tmp_path):
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match=r"config.json: expected a JSON object"):
        load_hf_config(folder)
    (folder / "config.json").write_bytes(b'{"model_type": "llama\xff"}')
    with pytest.raises(CheckpointError, match=r"config.json: not UTF-8 text"):
        load_hf_config(folder)


# ----------------------------------------------------------------------------------------------------
# Checks that need the model's shape (tracetrain/validate.py)

def test_lora_rank_larger_than_the_layer(capsys):
    # tiny preset: dim 128, 2 KV heads of 32 -> k_proj and v_proj are 128 -> 64.
    expect_error(capsys, ["plan", "--train.mode=lora", "--lora.rank=65"],
                 "config key 'lora.rank': 65 is larger than the k_proj layer it adapts (128 -> 64 features); "
                 "it must be <= 64")


def test_lora_rank_checks_only_the_targeted_layers():
    cfg = load_config(None, ["--train.mode=lora", "--lora.rank=64"])
    validate_run(cfg, model_args_from_config(cfg))  # the largest rank that fits k_proj
    cfg = load_config(None, ["--train.mode=lora", "--lora.rank=100", "--lora.targets=['q_proj', 'o_proj']"])
    validate_run(cfg, model_args_from_config(cfg))  # 128 -> 128 layers only
    cfg = load_config(None, ["--train.mode=lora", "--lora.rank=129", "--lora.targets=['all-linear']"])
    with pytest.raises(ConfigError, match=re.escape("'lora.rank': 129 is larger than the k_proj layer")):
        validate_run(cfg, model_args_from_config(cfg))
    cfg = load_config(None, ["--lora.rank=1000"])  # full fine-tuning: the LoRA section is unused
    validate_run(cfg, model_args_from_config(cfg))


def test_seq_len_beyond_the_checkpoint_context(capsys, tmp_path):
    folder = hf_dir(tmp_path)
    expect_error(capsys, ["plan", f"--model.init_from={folder}", "--data.seq_len=256"],
                 "config key 'data.seq_len': 256 is longer than the context of model.init_from",
                 "(max_position_embeddings = 128); use data.seq_len <= 128")
    cfg = load_config(None, [f"--model.init_from={folder}", "--data.seq_len=128"])
    validate_run(cfg, model_args_from_config(cfg))  # the full context is fine


@pytest.mark.parametrize("args, hf_changes, fragment", [
    (["--train.mode=lora", "--lora.rank=65"], {}, "'lora.rank': 65 is larger than the k_proj layer"),
    (["--model.init_from={hf}", "--data.seq_len=256"], {}, "'data.seq_len': 256 is longer than the context"),
    (["--model.init_from={hf}"], {"hidden_size": "64"}, 'hidden_size = "64" is not allowed'),
], ids=["lora-rank", "seq-len", "hf-shape"])
def test_train_refuses_model_shape_errors(capsys, tmp_path, args, hf_changes, fragment):
    """The same checks stop `tracetrain train`, before its run directory is created."""
    hf = hf_dir(tmp_path, **hf_changes)
    train_error(capsys, tmp_path, [a.format(hf=hf) for a in args], fragment)


# ----------------------------------------------------------------------------------------------------
# Output piped to a reader that quits (`tracetrain presets | head -1`)

@pytest.mark.parametrize("args", [["presets"], ["config", "--reference"], ["config"]])
def test_closed_stdout_ends_quietly(args):
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the command writes a byte: every write gets EPIPE
    try:
        proc = subprocess.run([sys.executable, "-m", "tracetrain.cli", *args], stdout=write_end,
                              stderr=subprocess.PIPE, text=True, cwd=REPO, timeout=120)
    finally:
        os.close(write_end)
    assert proc.stderr == ""  # no traceback, no "Exception ignored ... BrokenPipeError"
    assert proc.returncode == 1  # the Python docs' (and rich's) status for a closed stdout


def test_head_reads_the_first_line():
    shell = f"{sys.executable} -m tracetrain.cli config --reference | head -1"
    proc = subprocess.run(["bash", "-c", shell], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.stdout == "### [model]\n" and proc.stderr == "" and proc.returncode == 0
