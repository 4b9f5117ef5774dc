"""Bounded work on untrusted input (#29 item 3-4): hostile chat templates, config files and model shapes are
each refused with one line naming the file or key, quickly and without growing memory."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
from conftest import cli_here

from tracetrain.config import load_config
from tracetrain.data.chat_templates import TemplateLimitExceeded, render
from tracetrain.errors import ConfigError

CONV = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"}]
CHAT = "{% for m in messages %}{{ m.content }}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}"


def _one_line(proc, *fragments: str) -> str:
    assert proc.returncode != 0, proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def _chat_data(tmp_path: Path, template: str | bytes, *extra: str):
    data = tmp_path / "chat.jsonl"
    data.write_text((json.dumps({"messages": CONV}) + "\n") * 3)
    path = tmp_path / "hostile.jinja"
    path.write_bytes(template if isinstance(template, bytes) else template.encode("utf-8", "surrogatepass"))
    args = ["--data.kind=chat", f"--data.path={data}", "--data.tokenizer=byte", f"--data.chat_template={path}"]
    return cli_here("data", *args, "--data.eval_fraction=0", *extra, check=False)


HOSTILE = {
    "nested_loops": (
        "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
        "steps to render",
    ),
    "huge_range": ("{% for i in range(10**12) %}{% endfor %}", "limit"),
    "recursion": ("{% macro f(n) %}{{ f(n+1) }}{% endmacro %}{{ f(0) }}", "recurses too deeply"),
    "huge_string": ("{{ 'x' * 10**10 }}", "limit"),
    "doubling": (
        "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
        "limit",
    ),
    "huge_power": ("{{ 2 ** (10 ** 9) }}", "limit"),
    "padding": ("{{ 'a' | center(10**10) }}", "limit"),
    "format_width": ("{{ '{:>9999999999}'.format(1) }}", "limit"),
    "division_by_zero": ("{{ 1/0 }}", "division by zero"),
    "lone_surrogate": (CHAT + "{{ '\\ud800' }}", "lone surrogate"),
}


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_template_is_one_line_naming_the_file(tmp_path, name):
    source, fragment = HOSTILE[name]
    start = time.monotonic()
    _one_line(_chat_data(tmp_path, source), "hostile.jinja", fragment)
    assert time.monotonic() - start < 30  # nested range(100000) loops ran forever


def test_template_not_utf8(tmp_path):
    _one_line(_chat_data(tmp_path, b"\xff\xfe{{ x }}"), "hostile.jinja", "not UTF-8", "data.chat_template")


@pytest.mark.parametrize(
    "source",
    [
        "{% for m in messages %}{{ m.content }}{% generation %}{% endgeneration %}{% endfor %}",
        "{% for m in messages %}{{ m.content }}{% endfor %}"
        "{% if add_generation_prompt %}{% generation %}x{% endgeneration %}{% endif %}",
    ],
    ids=["empty_block", "block_never_rendered"],
)
def test_generation_blocks_that_mark_nothing_are_refused(tmp_path, source):
    # Both trained with loss 0.0000 and `train_target_tokens: 0` before.
    _one_line(_chat_data(tmp_path, source), "hostile.jinja", "marks nothing", "masked")


def test_bounded_render_leaves_real_templates_alone():
    text, spans = render(CHAT, {}, CONV * 200, track=True)
    assert text.count("Hello!") == 400 and len(spans) == 400


def test_render_limit_is_an_exception_of_its_own():
    with pytest.raises(TemplateLimitExceeded, match="1,000,000 steps"):
        render("{% for i in range(2000) %}{% for j in range(2000) %}{% endfor %}{% endfor %}", {}, CONV)


# ---------------------------------------------------------------------------------------------------
# Config files and shapes


def test_config_from_a_device_is_refused(capsys):
    with pytest.raises(ConfigError, match="/dev/zero is not a regular file"):
        load_config("/dev/zero")  # read until memory ran out (12 GB) before


def test_config_file_too_large(tmp_path):
    path = tmp_path / "big.toml"
    path.write_bytes(b"# " + b"x" * (5 << 20) + b"\n")
    with pytest.raises(ConfigError, match=re.escape("big.toml is larger than 4 MiB")):
        load_config(path)


def test_deeply_nested_toml_file_and_override(tmp_path):
    path = tmp_path / "deep.toml"
    path.write_text("a = " + "[" * 50_000 + "]" * 50_000)
    with pytest.raises(ConfigError, match=re.escape("deep.toml: arrays or tables nested too deeply")):
        load_config(path)
    with pytest.raises(ConfigError, match=r"override '--train.steps=\[\[.*characters\)': arrays or tables nested"):
        load_config(None, ["--train.steps=" + "[" * 50_000 + "]" * 50_000])


def test_toml_integer_of_thousands_of_digits(tmp_path):
    path = tmp_path / "digits.toml"
    path.write_text("[train]\nsteps = " + "9" * 6000 + "\n")
    with pytest.raises(ConfigError, match=re.escape("digits.toml: not readable TOML")):
        load_config(path)


def test_plan_refuses_a_billion_layers_before_allocating():
    start = time.monotonic()
    _one_line(cli_here("plan", "--model.n_layers=1000000000", check=False), "model.n_layers", "<= 1024")
    assert time.monotonic() - start < 20  # grew to 13 GB before


def test_hf_config_with_a_million_layers(tmp_path):
    from tracetrain.errors import CheckpointError
    from tracetrain.models.hf import load_hf_config

    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_hidden_layers": 1_000_000,
        "intermediate_size": 128,
        "vocab_size": 256,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        CheckpointError, match=r"config.json: n_layers = 1000000 is out of range \(allowed: 1 to 1,024\)"
    ):
        load_hf_config(tmp_path)


# ---------------------------------------------------------------------------------------------------
# Option values: no inf, empty or absurd value where it means nothing


@pytest.mark.parametrize(
    "args, fragment",
    [
        (("plan", "--gpu-memory-gib", "inf"), "--gpu-memory-gib inf: must be above 0 and finite"),
        (("generate", "x", "--prompt", "a", "--stop", ""), "--stop '': a stop string must not be empty"),
        (("generate", "x", "--prompt", "a", "--temperature=inf"), "--temperature inf: must be >= 0 and finite"),
        (("generate", "x", "--prompt", "a", "--max-new-tokens=10000000000"), "must be from 0 to 1,048,576"),
        (("profile", '--profile.ranks=["x"]'), "config key 'profile.ranks': 'x' is not allowed"),
        (("profile", "--train.steps=5"), "end at step 14, past train.steps (5)"),
    ],
    ids=["gpu_memory_inf", "empty_stop", "temperature_inf", "max_new_tokens", "profile_ranks", "profile_window"],
)
def test_meaningless_option_values_are_refused_up_front(tmp_path, args, fragment):
    # Before: accepted (inf GiB spare, empty completions, no trace and exit 0).
    _one_line(cli_here(*args, f"--train.output_dir={tmp_path}", check=False, cwd=tmp_path), fragment)
    assert not any(tmp_path.iterdir())  # refused before any run folder was made


@pytest.mark.parametrize(
    "config, kwargs, fragment",
    [
        (5, {}, "not int"),
        ({"train": 5}, {}, "config section 'train' must be a dict"),
        ([{"train": {}}], {}, "not list"),
        (None, {"callbacks": 5}, "callbacks must be a list"),
    ],
    ids=["int", "section_int", "list", "callbacks_int"],
)
def test_api_rejects_wrong_types_with_one_message(config, kwargs, fragment):
    import tracetrain

    with pytest.raises(ConfigError, match=fragment):
        tracetrain.train(config, **kwargs)  # AttributeError / TypeError tracebacks before


@pytest.mark.parametrize(
    "args, fragment",
    [
        (
            ("data", "--show", "1" + "0" * 20, "--data.synthetic_examples=16"),
            "--show 100000000000000000000: must be >= 0 and <= 1,000,000",
        ),
        (("generate", "x", "--prompt", "a", "--seed", "1" + "0" * 23), "must be from 0 to 2**63 - 1"),
    ],
    ids=["data_show", "generate_seed"],
)
def test_huge_integer_options(tmp_path, args, fragment):
    _one_line(cli_here(*args, check=False, cwd=tmp_path), fragment)  # islice / manual_seed tracebacks before


# ---------------------------------------------------------------------------------------------------
# Tokenizer folders and traces


def _tokenizer_folder(folder: Path, generation: dict) -> Path:
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<s>", "</s>")])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text("{}")
    (folder / "generation_config.json").write_text(json.dumps(generation))
    return folder


@pytest.mark.parametrize("eos", [5.5, -1, 7, [4, 99], True])
def test_tokenizer_eos_token_id_must_be_an_id_of_the_vocabulary(tmp_path, eos):
    from tracetrain.data.tokenizer import load_tokenizer
    from tracetrain.errors import DataError

    _tokenizer_folder(tmp_path, {"eos_token_id": eos})
    # TypeError, OverflowError or an eos id past the embedding before.
    with pytest.raises(DataError, match=r"generation_config.json: eos_token_id .* must be a token id from 0 to 4"):
        load_tokenizer(str(tmp_path))


def test_tokenizer_chat_template_jinja_not_utf8(tmp_path):
    from tracetrain.data.tokenizer import load_tokenizer
    from tracetrain.errors import DataError

    _tokenizer_folder(tmp_path, {"eos_token_id": 4})
    (tmp_path / "chat_template.jinja").write_bytes(b"\xff\xfe{{ x }}")
    with pytest.raises(DataError, match=re.escape("chat_template.jinja is not UTF-8")):
        load_tokenizer(str(tmp_path))


def _kernel(**fields) -> dict:
    event = {"ph": "X", "name": "k", "cat": "kernel", "ts": 0, "dur": 10, "pid": 0, "tid": 7}
    return {**event, "args": {"device": 0, "stream": 7}, **fields}


def test_trace_with_an_absurd_duration_is_dropped_with_a_note(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": [_kernel(dur=1e308), _kernel(ts=20)]}))
    proc = cli_here("analyze", str(path), "--json", str(tmp_path / "r.json"))
    assert "dropped 1 events" in proc.stdout + proc.stderr
    assert "e+307" not in proc.stdout and "0000000000000000" not in proc.stdout  # 1e308 s printed before


def test_trace_device_name_not_a_string_and_deep_nesting(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": [_kernel()], "deviceProperties": [{"id": 0, "name": 5}]}))
    cli_here("analyze", str(path))  # AttributeError: 'int' object has no attribute 'lower' before
    path.write_text('{"traceEvents": ' + "[" * 100_000 + "]" * 100_000 + "}")
    _one_line(cli_here("analyze", str(path), check=False), "t.json: not a readable JSON trace (nested too deeply)")


# ---------------------------------------------------------------------------------------------------
# Forged trainer state


@pytest.mark.parametrize(
    "step, fragment",
    [
        (-5, "step -5 is not allowed"),
        (10**15, "step 1000000000000000 is not allowed"),
        (2, "step 2 does not match its folder"),
        (1e15, "'step' is float, not int"),
        ("1", "'step' is str, not int"),
    ],
    ids=["negative", "huge", "other_folder", "float", "string"],
)
def test_forged_checkpoint_step_is_refused(tmp_path, step, fragment):
    import torch
    from helpers import _load, _tiny

    from tracetrain.errors import CheckpointError
    from tracetrain.train.checkpoint import TrainState, save_checkpoint
    from tracetrain.train.manifest import write_manifest

    model, opt = _tiny(1.0)
    path = save_checkpoint(tmp_path, model, opt, TrainState(1, {}, {}, {"value": 1}), "", lora=False, keep_last=2)
    raw = torch.load(path / "trainer_state.pt", weights_only=True)
    raw["step"] = step  # accepted on resume before: a run "resumed" at step -5 or 1e15
    torch.save(raw, path / "trainer_state.pt")
    (path / "manifest.json").unlink()
    write_manifest(path, 1)
    with pytest.raises(CheckpointError, match=f"trainer_state.pt: {fragment}"):
        _load(path)


# ---------------------------------------------------------------------------------------------------
# `tracetrain report` over damaged run files

GOOD_LINES = '{"kind": "train", "step": 1, "loss": 2.0, "lr": 0.1}\n{"kind": "eval", "step": 1, "eval_loss": 2.0}\n'


@pytest.mark.parametrize(
    "damage, fragment",
    [
        ({"metrics.jsonl": GOOD_LINES + '{"loss": 1.0}\n' + GOOD_LINES}, "metrics.jsonl:3: not a metrics record"),
        ({"metrics.jsonl": GOOD_LINES + "5\n" + GOOD_LINES}, "metrics.jsonl:3: not a metrics record"),
        ({"metrics.jsonl": GOOD_LINES.encode() + b"\xff\xfe\n"}, "metrics.jsonl:3: byte 0xff is not UTF-8"),
        ({"config.toml": "x = [\n"}, "config.toml: not valid TOML"),
    ],
    ids=["no_step", "bare_number", "not_utf8", "config_toml"],
)
def test_report_of_damaged_run_files_is_one_line(tmp_path, damage, fragment):
    run = tmp_path / "r"
    run.mkdir()
    (run / "metrics.jsonl").write_text(GOOD_LINES)
    for name, content in damage.items():
        (run / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    _one_line(cli_here("report", str(run), check=False), fragment)  # KeyError, AttributeError, ... before


@pytest.mark.parametrize("summary", ["5", "[1, 2]", '{"world_size": "x"}', "{not json", "\udcff"])
def test_report_draws_the_page_without_a_malformed_summary(tmp_path, summary):
    run = tmp_path / "r"
    run.mkdir()
    (run / "metrics.jsonl").write_text(GOOD_LINES)
    (run / "summary.json").write_bytes(summary.encode("utf-8", "surrogateescape"))
    cli_here("report", str(run))
    assert (run / "report.html").is_file()


@pytest.mark.parametrize("text", ["[" * 100_000 + "]" * 100_000, '{"a": ' + "9" * 5000 + "}"], ids=["deep", "digits"])
def test_deeply_nested_or_huge_number_json_in_folders_is_one_line(tmp_path, text):
    from tracetrain.data.tokenizer import load_tokenizer
    from tracetrain.errors import CheckpointError, DataError
    from tracetrain.models.hf import load_hf_config

    _tokenizer_folder(tmp_path, {"eos_token_id": 4})
    (tmp_path / "tokenizer_config.json").write_text(text)
    with pytest.raises(DataError, match=r"tokenizer_config.json: (JSON nested too deeply|not readable JSON)"):
        load_tokenizer(str(tmp_path))  # RecursionError / ValueError tracebacks before
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(CheckpointError, match=r"config.json: (JSON nested too deeply|not readable JSON)"):
        load_hf_config(tmp_path)


@pytest.mark.parametrize(
    "name, text, fragment",
    [
        ("rows.jsonl", '{"instruction": "a\\ud800", "response": "b"}\n', "rows.jsonl:1: text with a lone surrogate"),
        ("rows.json", '[{"instruction": "a\\udc00", "response": "b"}]', "rows.json: row 0: text with a lone surrogate"),
        (
            "rows.jsonl",
            '{"instruction": "a", "response": "b", "n": ' + "9" * 5000 + "}\n",
            "rows.jsonl:1: not readable",
        ),
    ],
    ids=["surrogate_jsonl", "surrogate_json_array", "digits"],
)
def test_data_rows_with_lone_surrogates_or_huge_numbers(tmp_path, name, text, fragment):
    path = tmp_path / name
    path.write_text(text + '{"instruction": "x", "response": "y"}\n' if name.endswith("l") else text)
    args = ["--data.kind=instruction", f"--data.path={path}", "--data.tokenizer=byte", "--data.eval_fraction=0"]
    _one_line(cli_here("data", *args, check=False), fragment)  # UnicodeEncodeError / ValueError before


@pytest.mark.parametrize(
    "content, fragment",
    [
        (b'{"prompt": "\xff"}\n', "p.jsonl:1: not UTF-8 text"),
        (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n", "p.jsonl:1: JSON nested too deeply"),
        (b'{"prompt": "a", "max_new_tokens": 100000000000}\n', "p.jsonl:1: 'max_new_tokens' must be an integer"),
        (b'{"prompt": "a", "stop": ["x", ""]}\n', "p.jsonl:1: 'stop' must be a non-empty string"),
    ],
    ids=["not_utf8", "nested", "max_new_tokens", "empty_stop"],
)
def test_prompt_files_are_read_or_refused_in_one_line(tmp_path, content, fragment):
    from tracetrain.config import DataSection
    from tracetrain.data.prompts import read_prompts_jsonl
    from tracetrain.errors import DataError

    path = tmp_path / "p.jsonl"
    path.write_bytes(content)
    with pytest.raises(DataError, match=fragment):
        read_prompts_jsonl(path, DataSection())
