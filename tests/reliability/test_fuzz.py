"""Property-based fuzzing (#29 item 5): hostile config text, overrides, chat templates, tokenizer folders,
traces and command lines. Whatever the input, tracetrain either accepts it or refuses it with one line
and a non-zero exit: never a traceback, never a file touched outside the folders it was given.

Examples are derived from the test's name (derandomize), so a run is repeatable and CI sees the same
inputs; the `fuzz` profile keeps the whole file near a minute on two cores. HYPOTHESIS_PROFILE=fuzz-long
(FUZZ_EXAMPLES=N) draws fresh examples to hunt for more."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import cli_here
from helpers_fuzz import FEW, FUZZ, JSON_VALUES, _sandbox
from hypothesis import given
from hypothesis import strategies as st

from tracetrain.config import load_config
from tracetrain.data.chat import ChatTemplate, tokenize_conversation
from tracetrain.data.tokenizer import ByteTokenizer, load_tokenizer
from tracetrain.errors import TracetrainError


def _refused_in_one_line(proc) -> None:
    """The promise: exit 0, or a non-zero exit with exactly one line on stderr and no traceback."""
    assert "Traceback" not in proc.stderr, proc.stderr
    if proc.returncode != 0:
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert lines and (len(lines) == 1 or lines[0].startswith("usage:")), proc.stderr


# ---------------------------------------------------------------------------------------------------
# Values: TOML literals, some valid, many hostile


SCALARS = st.one_of(
    st.integers(min_value=-(10**30), max_value=10**30),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.text(max_size=20),
    st.sampled_from(["", "all", "byte", "tiny", "cpu", "cuda:9", "lora", "../..", "/dev/zero", "\x00", "\ud800"]),
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6,
)
KEYS = st.sampled_from(
    [
        "train.steps",
        "train.seed",
        "train.device",
        "train.run_name",
        "train.output_dir",
        "train.epochs",
        "train.mode",
        "train.precision",
        "model.preset",
        "model.n_layers",
        "model.dim",
        "model.vocab_size",
        "model.num_experts",
        "optim.lr",
        "optim.warmup_steps",
        "data.kind",
        "data.path",
        "data.seq_len",
        "data.tokenizer",
        "data.chat_template",
        "profile.ranks",
        "profile.start_step",
        "lora.rank",
        "checkpoint.interval",
        "nosuch.key",
        "train.nosuch",
    ]
)


def _toml_literal(value: object) -> str:
    """A TOML-ish spelling of `value`: json.dumps is valid TOML for most scalars and arrays, and not for
    the rest (NaN, objects, surrogates), which is the point."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


@FUZZ
@given(st.lists(st.tuples(KEYS, VALUES), max_size=4))
def test_overrides_are_accepted_or_one_config_error(pairs):
    overrides = [f"--{key}={_toml_literal(value)}" for key, value in pairs]
    try:
        load_config(None, overrides)
    except TracetrainError as e:
        assert "\n" not in str(e).strip()


TOML_PIECES = st.sampled_from(
    [
        "[train]\n",
        "[model]\n",
        "[[data.sources]]\n",
        "[data]\n",
        "steps = ",
        "n_layers = ",
        "lr = ",
        "path = ",
        '"x"',
        "1",
        "1e400",
        "-5",
        "inf",
        "nan",
        "[",
        "]",
        "{",
        "}",
        "=",
        "\n",
        "'''",
        '"""',
        "\\u0000",
        "\x00",
        "# c\n",
        "a.b.c = 1\n",
        "[[a]]\n",
        "0x1F",
        "1979-05-27T07:32:00Z",
        "[[[[[[[[[[",
        "9" * 5000,
        "[train]\nsteps = " + "9" * 5000 + "\n",
        "a = " + "[" * 5000 + "]" * 5000 + "\n",
        "b = " + "{c = " * 3000,
    ]
)


# First lines that each broke the reader once (a traceback, or memory until the kernel stepped in).
TOML_HEADS = st.sampled_from(
    ["", "[train]\nsteps = " + "9" * 5000 + "\n", "a = " + "[" * 5000 + "]" * 5000 + "\n", "b = " + "{c = " * 3000]
)


@FUZZ
@given(TOML_HEADS, st.lists(TOML_PIECES | st.text(max_size=10), max_size=12), st.binary(max_size=8))
def test_config_file_text_is_accepted_or_one_config_error(head, pieces, tail):
    with _sandbox() as (work, _):
        path = work / "c.toml"
        path.write_bytes((head + "".join(pieces)).encode("utf-8", "surrogatepass") + tail)
        try:
            load_config(path)
        except TracetrainError as e:
            assert str(path) in str(e) and "\n" not in str(e).strip()


# ---------------------------------------------------------------------------------------------------
# Chat templates

JINJA_PIECES = st.sampled_from(
    [
        "{{ ",
        " }}",
        "{% ",
        " %}",
        "for m in messages",
        "endfor",
        "if",
        "endif",
        "generation",
        "endgeneration",
        "m.content",
        "m['role']",
        "messages[0]",
        "range(",
        ")",
        "10**9",
        "9**9**9",
        "'x' * ",
        "1/0",
        "~",
        "+",
        "namespace(a=1)",
        "raise_exception('no')",
        "|tojson",
        "|length",
        "|center(10**10)",
        "loop.index",
        "macro f(n)",
        "endmacro",
        "f(n+1)",
        "f(0)",
        "'\\ud800'",
        "bos_token",
        "eos_token",
        "add_generation_prompt",
        "set ns = namespace(s='x')",
        "set ns.s = ns.s ~ ns.s",
        "'{:>99999999}'.format(1)",
        "().__class__",
        "cycler",
        "joiner",
        "lipsum(10**6)",
        "x",
        "\n",
    ]
)
# Whole statements that each broke a render once; the fuzzer splices them among the pieces above.
JINJA_SNIPPETS = st.sampled_from(
    [
        "{{ 1/0 }}",
        "{{ 1 % 0 }}",
        "{{ '\\ud800' }}",
        "{% macro f(n) %}{{ f(n+1) }}{% endmacro %}{{ f(0) }}",
        "{{ 'x' * 10**10 }}",
        "{{ 2 ** 10**9 }}",
        "{{ 'a' | center(10**10) }}",
        "{% generation %}{% endgeneration %}",
        "{% for m in messages %}{{ m.content }}{% endfor %}",
        "{{ messages | tojson }}",
        "{{ '%99999999999d' % 1 }}",
    ]
)
CONVERSATION = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"}]


@FUZZ
@given(st.lists(JINJA_PIECES | JINJA_SNIPPETS, max_size=16), st.booleans())
def test_chat_templates_render_or_refuse_in_one_line(pieces, train_on_prompt):
    template = ChatTemplate("fuzz.jinja", "".join(pieces))
    try:
        tokenize_conversation(template, ByteTokenizer(), CONVERSATION, train_on_prompt)
    except TracetrainError as e:
        assert "fuzz.jinja" in str(e) or "message" in str(e)
        assert "\n" not in str(e).strip()


# ---------------------------------------------------------------------------------------------------
# Tokenizer folders


def _tokenizer_json(path: Path) -> None:
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<s>", "</s>")])
    tok.save(str(path))


# Token ids near the edges of the five-token vocabulary, and the wrong types seen in the wild.
TOKEN_IDS = st.integers(-2, 7) | st.sampled_from([5.5, True, 10**20, "4", None])
ID_FIELD = TOKEN_IDS | st.lists(TOKEN_IDS, max_size=3) | JSON_VALUES
TOKENIZER_KEYS = st.sampled_from(
    ["bos_token", "eos_token", "pad_token", "add_bos_token", "chat_template", "eos_token_id"]
)


@FUZZ
@given(
    st.dictionaries(TOKENIZER_KEYS, JSON_VALUES, max_size=4),
    st.dictionaries(st.just("eos_token_id"), ID_FIELD, max_size=1),
    st.sampled_from([b"", b"{{ messages }}", b"\xff\xfe", b"{% for %}"]),
)
def test_tokenizer_folders_load_or_refuse_in_one_line(config, generation, jinja):
    with _sandbox() as (work, _):
        _tokenizer_json(work / "tokenizer.json")
        (work / "tokenizer_config.json").write_text(json.dumps(config))
        (work / "generation_config.json").write_text(json.dumps(generation))
        if jinja:
            (work / "chat_template.jinja").write_bytes(jinja)
        try:
            tok = load_tokenizer(str(work))
        except TracetrainError as e:
            assert "\n" not in str(e).strip()
            return
        assert all(0 <= i < tok.vocab_size for i in (tok.eos_id, tok.bos_id, tok.pad_id, *tok.stop_ids))


# ---------------------------------------------------------------------------------------------------
# Traces (`tracetrain analyze`)

NUMBERS = st.one_of(st.integers(-(10**20), 10**20), st.floats(allow_nan=False), st.sampled_from([1e308, -1, 0]))
EVENT = st.fixed_dictionaries(
    {"ph": st.sampled_from(["X", "B", "E", "i", "M", "f", 5]), "ts": NUMBERS, "dur": NUMBERS},
    optional={
        "name": st.text(max_size=8) | st.integers(),
        "cat": st.sampled_from(["kernel", "cpu_op", "gpu_memcpy", "user_annotation", "cuda_runtime", None, 3]),
        "pid": st.integers(-2, 3) | st.text(max_size=3),
        "tid": st.integers(-2, 3),
        "args": st.dictionaries(
            st.sampled_from(["device", "stream", "correlation", "External id", "Input Dims"]), JSON_VALUES, max_size=3
        ),
    },
)
TRACE = st.fixed_dictionaries(
    {"traceEvents": st.lists(EVENT, max_size=8)},
    optional={
        "deviceProperties": st.lists(
            st.dictionaries(st.sampled_from(["name", "id", "totalGlobalMem"]), JSON_VALUES, max_size=3), max_size=2
        )
    },
)


@FEW
@given(TRACE | JSON_VALUES)
def test_traces_are_analyzed_or_refused_in_one_line(trace):
    with _sandbox() as (work, _):
        path = work / "rank0.json"
        path.write_text(json.dumps(trace))
        _refused_in_one_line(cli_here("analyze", str(path), check=False, cwd=work))


# ---------------------------------------------------------------------------------------------------
# Command lines

COMMANDS = st.sampled_from(["plan", "data", "analyze", "generate", "eval", "export", "report", "presets", "nosuch"])
ARGS = st.sampled_from(
    [
        "--config",
        "--show",
        "--seed",
        "--gpus",
        "--top",
        "--gpu-memory-gib",
        "--max-new-tokens",
        "--temperature",
        "--stop",
        "--prompt",
        "--hf",
        "--peft",
        "--output",
        "--json",
        "--html",
        "--stats-json",
        "--device-name",
        "--search",
        "--help",
        "-h",
        "inf",
        "nan",
        "-1",
        "0",
        "1e20",
        "1e23",
        "",
        "x",
        "\x00",
        "../sentinel/keep.txt",
        "SENTINEL/keep.txt",
        "SENTINEL",
        "/dev/zero",
        "--model.n_layers=1000000000",
        "--train.steps=0",
        "--data.seq_len=-1",
        '--profile.ranks=["x"]',
        "--nosuch.key=1",
        "--train.seed=1e23",
    ]
)


# Command lines that each ended in a traceback once; random arguments are appended to them.
HUGE = "1" + "0" * 20
KNOWN = st.sampled_from(
    [("data", ["--show", HUGE]), ("generate", ["x", "--prompt", "a", "--seed", HUGE]), ("plan", []), ("data", [])]
)


@FEW
@given(COMMANDS, st.lists(ARGS, max_size=5), KNOWN | st.just(None))
def test_command_lines_run_or_refuse_in_one_line(command, args, known):
    with _sandbox() as (work, sentinel):
        if known is not None:
            command, args = known[0], known[1] + args
        argv = [a.replace("SENTINEL", str(sentinel)) for a in args]
        if command in ("plan", "data"):
            argv.append("--data.synthetic_examples=16")  # keeps an accepted `data` quick
        proc = cli_here(command, *argv, check=False, cwd=work)
        if "-h" in argv or "--help" in argv:
            return
        _refused_in_one_line(proc)
