"""`tracetrain data`: statistics of the data exactly as training builds it, and examples with their trained
tokens marked, for every data kind."""

import io
import itertools
import json
import re

import numpy as np
import pytest
from conftest import cli_here
from helpers import run_cli
from rich.console import Console

from tracetrain.config import load_config
from tracetrain.data import build_datasets, load_tokenizer
from tracetrain.data.inspect import inspect_data, length_histogram, render_plain, render_terminal

SYNTH = ["--data.synthetic_examples=300", "--data.seq_len=64"]
MARKED = re.compile("⟦(.*?)⟧", re.S)


def _instruction_file(tmp_path, bad_line: bool = False):
    rows = [{"instruction": f"Say {w}.", "response": f"{w} {w}"} for w in ("one", "two", "three", "four", "five")]
    rows.append({"instruction": "Count.", "response": " ".join(["many"] * 40)})  # longer than seq_len 64
    lines = [json.dumps(r) for r in rows]
    if bad_line:
        lines.insert(2, "{not json")
    path = tmp_path / "inst.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_cli_plain_output_marks_trained_tokens(tmp_path):
    proc = run_cli("data", *SYNTH, "--show", "3", "--stats-json", str(tmp_path / "s.json"))
    out = proc.stdout  # not a terminal: trained spans are wrapped in ⟦ ⟧
    examples = out.split("--- synthetic: ")[1:]
    assert len(examples) == 3
    from tracetrain.data.synthetic import generate_examples

    for block, (prompt, response) in zip(examples, generate_examples(300, 1234)):
        assert MARKED.findall(block) == [response + "<|eos|>"]  # the answer and EOS, never the prompt
        assert block.split("\n", 1)[1].startswith("<|bos|>" + prompt)
    stats = json.loads((tmp_path / "s.json").read_text())
    assert sum(b["count"] for b in stats["train"]["length_histogram"]) == stats["train"]["examples"]
    assert stats["train"]["examples"] + stats["eval"]["examples"] == 300
    assert re.search(r"examples\s+285 train / 15 eval", out) and "train example lengths (tokens)" in out


def test_stats_match_what_training_builds():
    cfg = load_config(None, SYNTH)
    _, _, built = build_datasets(cfg.data, load_tokenizer(cfg.data.tokenizer))
    stats = inspect_data(cfg).stats
    assert stats["train"]["tokens"] == built.train_tokens
    assert stats["train"]["trained_tokens"] == built.train_target_tokens
    assert stats["train"]["examples"] == built.train_examples and stats["eval"]["examples"] == built.eval_examples
    assert stats["train"]["rows"] == built.train_sequences
    assert stats["train"]["trained_share"] == pytest.approx(built.train_target_tokens / built.train_tokens)


def test_instruction_json_counts_bad_rows_truncation_and_masks(tmp_path):
    path = _instruction_file(tmp_path, bad_line=True)
    args = [
        "--data.kind=instruction",
        f"--data.path={path}",
        "--data.seq_len=64",
        "--data.skip_bad_lines=true",
        "--data.eval_fraction=0",
        "--data.template=plain",
    ]
    proc = cli_here("data", *args, "--show", "2", "--json", "--stats-json", str(tmp_path / "s.json"))
    shown = json.loads(proc.stdout)
    assert [ex["trained_text"] for ex in shown] == ["one one<|eos|>", "two two<|eos|>"]
    assert [ex["where"] for ex in shown] == [f"{path}:1", f"{path}:2"]
    assert shown[0]["text"] == "Say one.\none one"  # the templated example
    assert shown[0]["num_trained"] == len("one one") + 1 and shown[0]["trained_spans"] == ["one one<|eos|>"]
    stats = json.loads((tmp_path / "s.json").read_text())
    assert (stats["bad_rows_skipped"], stats["truncated"], stats["dropped"]) == (1, 1, 0)
    assert re.search(r"bad rows skipped\s+1", proc.stderr)  # statistics on stderr with --json


def test_text_kind_trains_every_token_but_bos(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("First document here.\n<|endoftext|>\nSecond one, a little longer.\n")
    report = inspect_data(
        load_config(None, ["--data.kind=text", f"--data.path={corpus}", "--data.seq_len=32", "--data.eval_fraction=0"]),
        num_examples=2,
    )
    assert [ex.trained_text for ex in report.examples] == [
        "First document here.\n<|eos|>",
        "Second one, a little longer.\n<|eos|>",
    ]
    assert all(ex.num_trained == ex.num_tokens - 1 for ex in report.examples)
    assert report.stats["train"]["trained_tokens"] < report.stats["train"]["tokens"]


def test_chat_kind_with_builtin_template_on_bytes(tmp_path):
    path = tmp_path / "chat.jsonl"
    conv = [
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": "See you."},
    ]
    path.write_text(json.dumps({"messages": conv}) + "\n" + json.dumps({"messages": conv[:2]}) + "\n")
    report = inspect_data(
        load_config(
            None,
            [
                "--data.kind=chat",
                f"--data.path={path}",
                "--data.tokenizer=byte",
                "--data.chat_template=chatml",
                "--data.eval_fraction=0",
                "--data.seq_len=256",
            ],
        ),
        1,
    )
    assert report.examples[0].trained_spans == ["Hello!<|im_end|>", "See you.<|im_end|>"]
    assert report.examples[0].text.startswith("<|im_start|>user\nHi there<|im_end|>")


def test_on_the_fly_rows_give_the_same_statistics():
    ahead = inspect_data(load_config(None, [*SYNTH, "--data.pack=false"])).stats
    fly = inspect_data(load_config(None, [*SYNTH, "--data.pack=false", "--data.tokenize=on_the_fly"])).stats
    for key in ("examples", "rows", "tokens", "trained_tokens", "length_histogram"):
        assert fly["train"][key] == ahead["train"][key], key


def test_terminal_rendering_highlights_trained_tokens():
    report = inspect_data(load_config(None, SYNTH), num_examples=1)
    buf = io.StringIO()
    render_terminal(report, Console(file=buf, force_terminal=True, color_system="standard", width=100))
    answer = report.examples[0].trained_spans[0]
    assert f"\x1b[1;30;42m{answer}\x1b[0m" in buf.getvalue()  # bold black on green
    assert "⟦" not in buf.getvalue() and "⟦" in render_plain(report)


def test_length_histogram_bins_cover_every_example():
    lengths = np.array([3, 3, 4, 10, 57, 64])
    bins = length_histogram(lengths, num_bins=5)
    assert bins[0]["lo"] == 3 and bins[-1]["hi"] == 64 and sum(b["count"] for b in bins) == 6
    assert all(a["hi"] + 1 == b["lo"] for a, b in itertools.pairwise(bins))
    assert length_histogram(np.array([7, 7])) == [{"lo": 7, "hi": 7, "count": 2}]
    assert length_histogram(np.array([], dtype=np.int64)) == []


@pytest.mark.parametrize(
    "args, message",
    [
        (["--show", "-1"], "error: --show -1: must be >= 0"),
        (["--data.kind=instruction"], "error: config key 'data.path' is required when data.kind = 'instruction'"),
        (["--data.kind=instruction", "--data.path=nope.jsonl"], "error: data file nope.jsonl does not exist"),
    ],
)
def test_user_mistakes_are_one_line_errors(args, message):
    # The first case as a real process (its exit status and stderr), the others through main in this one.
    run = run_cli if args == ["--show", "-1"] else cli_here
    proc = run("data", *args, check=False)
    assert proc.returncode == 2 and proc.stderr.startswith(message) and len(proc.stderr.strip().splitlines()) == 1


def test_on_the_fly_tokenisation_reports_a_count():
    calls = []
    inspect_data(
        load_config(None, [*SYNTH, "--data.pack=false", "--data.tokenize=on_the_fly"]),
        progress=lambda what, done, total: calls.append((what, done, total)),
    )
    assert calls[0] == ("building data", 0, None)
    counts = [(done, total) for what, done, total in calls if what == "tokenizing rows"]
    assert counts and counts[0] == (256, 285) and all(a[0] < b[0] for a, b in itertools.pairwise(counts))
