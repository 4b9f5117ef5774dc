"""The user-facing docs stay true to the repository: the generated config reference, the README's test
command (what CI runs), every file the README names, the screenshot, and every result file the
performance page cites. Across README.md and every docs/*.md: each config key named exists (with the
values it is said to take), each `tracetrain <command> --flag` and benchmark flag exists, each repository
path, file, link and test named exists, and the transform table is the code's."""

import dataclasses
import glob
import re
import shlex
import textwrap
import tomllib
import typing
from pathlib import Path

from helpers import REPO

from tracetrain.cli import build_parser
from tracetrain.config import Config, reference_markdown
from tracetrain.config_fields import check_value, field_choices
from tracetrain.errors import ConfigError
from tracetrain.train.assemble import TRANSFORMS

README = (REPO / "README.md").read_text(encoding="utf-8")
REFERENCE_MARKER = "Generated from the code with `tracetrain config --reference`"


def test_config_reference_doc_is_current():
    doc = (REPO / "docs" / "config.md").read_text(encoding="utf-8")
    assert REFERENCE_MARKER in doc
    block = doc.split(REFERENCE_MARKER, 1)[1].split("\n", 1)[1]  # drop the rest of the marker's line
    block = block.split("\n## ", 1)[0]
    assert block.strip() == reference_markdown().strip(), "regenerate with: tracetrain config --reference"
    assert "(docs/config.md)" in README


def test_readme_test_command_is_what_ci_runs():
    # The second of the README's two commands installs and runs the tests. CI runs its parts in order, word
    # for word, in a fresh virtual environment whose python3 is first on PATH, without pip's cache (so it
    # gets the releases a user gets); then a second fresh one installs the package bare and runs pytest.
    lines = [line for line in README.splitlines() if line.startswith("python3 -m pip install") and "pytest" in line]
    assert len(lines) == 1, lines
    ci_lines = (REPO / ".ci" / "run").read_text().splitlines()
    assert any(line.startswith("export ") and "PIP_NO_CACHE_DIR=1" in line.split() for line in ci_lines)
    full, bare = _venv_step(ci_lines, "full"), _venv_step(ci_lines, "bare")
    # The system python3 only creates the environments.
    assert all(not line.startswith("python3 ") or " -m venv " in line for line in ci_lines[: full[0]])
    full_steps = [shlex.split(line) for line in ci_lines[full[0] : bare[0]] if line.startswith("python3 ")]
    at = 0
    for part in lines[0].split("&&"):
        words = shlex.split(part)
        found = [i for i, line in enumerate(full_steps) if i >= at and (line == words or _without_quiet(line) == words)]
        assert found, f"{part.strip()!r} is not in .ci/run's full step after the previous part"
        at = found[0] + 1
    bare_steps = [_without_quiet(shlex.split(line)) for line in ci_lines[bare[0] :] if line.startswith("python3 ")]
    assert ["python3", "-m", "pip", "install", "-e", ".", "pytest", "hypothesis", "pytest-xdist", "pytest-timeout"] in bare_steps
    assert any(line[:3] == ["python3", "-m", "pytest"] for line in bare_steps)


def _venv_step(ci_lines: list[str], name: str) -> tuple[int, str]:
    """(line index, bin folder) of `python3 -m venv DIR/name`; the next line puts DIR/name/bin first on PATH."""
    venv = [i for i, line in enumerate(ci_lines) if line.startswith("python3 -m venv ") and line.endswith(f'/{name}"')]
    assert len(venv) == 1, f".ci/run creates no {name} virtual environment"
    i = venv[0]
    folder = shlex.split(ci_lines[i])[-1]
    assert ci_lines[i + 1].startswith(f'export PATH="{folder}/bin:'), ci_lines[i + 1]
    return i, folder


def _without_quiet(words: list[str]) -> list[str]:
    return [w for w in words if w not in ("-q", "--disable-pip-version-check")] if "pip" in words else words


def test_files_the_readme_names_exist():
    named = set(
        re.findall(
            r"(?<![\w/.])((?:configs|docs|tests/data|benchmarks/results)/[\w./-]+\.(?:toml|md|png|gz|json))", README
        )
    )
    assert {"configs/tiny-synthetic.toml", "docs/performance.md", "docs/img/analyze-report.png"} <= named
    missing = sorted(p for p in named if not (REPO / p).is_file())
    assert not missing, missing


def test_screenshot_is_a_small_png():
    data = (REPO / "docs" / "img" / "analyze-report.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert 10_000 < len(data) < 300_000


def test_performance_page_cites_only_committed_results():
    doc = (REPO / "docs" / "performance.md").read_text(encoding="utf-8")
    cited = set(re.findall(r"`([\w.+-]+\.json)`", doc))
    assert len(cited) >= 10
    missing = sorted(name for name in cited if not (REPO / "benchmarks" / "results" / name).is_file())
    assert not missing, missing


# ---------------------------------------------------------------------------------------------------
# Every doc: config keys, commands and flags, paths, links, tests and the transform table exist.

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SECTIONS = {f.name: f.default_factory for f in dataclasses.fields(Config)}  # section name -> its class
FENCE = re.compile(r"^ *```(\w*)\n(.*?)^ *```", re.M | re.S)
SPAN = re.compile(r"`([^`\n]+(?:\n[^`\n]+)?)`")  # inline code, at most across one line break
FILE_NAMES = {p.name for root in ("benchmarks", "tests", "tracetrain", "configs") for p in (REPO / root).rglob("*")}

# Dotted names that look like config keys and are not, each with what it is.
NOT_KEYS = {"model.generate": "transformers' generate method (README)"}
# Paths in other projects' repositories, named as their sources.
EXTERNAL = {
    "docs/float8.md": "torchtitan's (docs/planner.md)",
    "docs/source/workflows/training.md": "torchao's (docs/planner.md)",
    "docs/performance-summary.md": "Megatron-Bridge's (docs/planner.md)",
    "benchmarks/llama3_h100_202412_torchtitan.md": "torchtitan's (docs/planner.md)",
}
# Where a script writes a result that is not committed yet, and why.
NOT_YET = {"benchmarks/results/tune_check_2gpu_<gpu>.json": "tune_check.py --gpus 2 not run yet (docs/tune.md's table)"}
# Bare file names of what a run, an export, a profile or a Hugging Face folder holds: not repository files.
RUN_FILES = {
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "summary.json",
    "manifest.json",
    "data_stats.json",
    "spec.json",
    "meta.json",
    "report.json",
    "tracetrain_export.json",
    "rank0.json.gz",
    "rank1.json.gz",
    "before.json.gz",
    "after.json.gz",
}


@dataclasses.dataclass(frozen=True)
class Doc:
    path: Path
    text: str
    code: list[tuple[int, str, str]]  # (offset, language, text) of fenced blocks and inline spans

    def where(self, offset: int) -> str:
        return f"{self.path.relative_to(REPO)}:{self.text.count(chr(10), 0, offset) + 1}"


def _read(path: Path) -> Doc:
    text = path.read_text(encoding="utf-8")
    code = [(m.start(2), m.group(1), m.group(2)) for m in FENCE.finditer(text)]
    prose = FENCE.sub(lambda m: " " * len(m.group(0)), text)
    code += [(m.start(1), "", m.group(1)) for m in SPAN.finditer(prose)]
    return Doc(path, text, code)


READ = [_read(p) for p in DOCS]


def _fails(problems: list[str], what: str) -> None:
    assert not problems, f"{len(problems)} {what}:\n" + "\n".join(problems)


def _key_problem(key: str, value: str | None) -> str | None:
    """Why `section.key` (set to `value`, a TOML literal or a command-line word) is not in the config."""
    section, name = key.split(".", 1)
    fields = {f.name: f for f in dataclasses.fields(SECTIONS[section])}
    if name not in fields:
        return f"no config key {key!r}"
    if value is None or "<" in value:
        return None
    word = value.strip("'\"")
    choices = field_choices(SECTIONS[section], name)
    if choices and word not in choices:
        return f"{key} = {value}: not one of {', '.join(choices)}"
    if typing.get_type_hints(SECTIONS[section])[name] is bool and word not in ("true", "false"):
        return f"{key} = {value}: not true or false"
    return None


KEY = re.compile(
    r"(?:(?<=--)|(?<![\w./-]))(" + "|".join(SECTIONS) + r")\.([a-z_][a-z0-9_]*)\b(?![(\w])"
    r"(?:\s*!?=\s*(\"[^\"]*\"|'[^']*'|[\w.+-]+))?"
)
EXTENSIONS = {"md", "toml", "json", "jsonl", "py", "safetensors"}


def _toml_problems(doc: Doc, offset: int, block: str) -> list[str]:
    """A TOML block's sections and keys exist and its values pass the key's own checks."""
    problems = []
    for section, body in tomllib.loads(textwrap.dedent(block)).items():
        head = re.search(rf"^[ \t]*\[+{section}[].]", block, re.M)
        at = offset + (head.start() if head else 0)
        if section not in SECTIONS:
            problems.append(f"{doc.where(at)}: no config section [{section}]")
            continue
        fields = {f.name: f for f in dataclasses.fields(SECTIONS[section])}
        for name, value in body.items():
            line = re.compile(rf"^[ \t]*{re.escape(name)}[ \t]*=", re.M).search(block, at - offset)
            where = doc.where(offset + line.start() if line else at)
            if name not in fields:
                problems.append(f"{where}: no config key '{section}.{name}'")
                continue
            try:
                check_value(f"{section}.{name}", fields[name], value, SECTIONS[section])
            except ConfigError as e:
                problems.append(f"{where}: {e}")
    return problems


def test_config_keys_the_docs_name_exist_with_the_values_they_give():
    problems = []
    for doc in READ:
        for m in KEY.finditer(doc.text):
            key = f"{m.group(1)}.{m.group(2)}"
            if m.group(2) in EXTENSIONS or key in NOT_KEYS:
                continue
            if why := _key_problem(key, m.group(3)):
                problems.append(f"{doc.where(m.start())}: {why}")
        problems += [
            p for offset, lang, block in doc.code if lang == "toml" for p in _toml_problems(doc, offset, block)
        ]
    used = {f"{m.group(1)}.{m.group(2)}" for doc in READ for m in KEY.finditer(doc.text)}
    problems += [f"NOT_KEYS names {k!r}, which no doc mentions any more" for k in NOT_KEYS if k not in used]
    _fails(problems, "config keys or values the docs name that the config does not have")


def _commands() -> dict[str, set[str]]:
    parser, _ = build_parser()
    (sub,) = [a for a in parser._actions if a.choices and "train" in a.choices]
    return {name: {o for a in p._actions for o in a.option_strings} for name, p in sub.choices.items()}


COMMAND = re.compile(
    r"\btracetrain(?:\.cli)? ([a-z][\w-]*)|\b(benchmarks/[\w/]+\.py)|-m (tracetrain(?:\.(?!cli\b)\w+)+)"
)
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)(?![\w.-])")


def test_commands_and_flags_the_docs_show_exist():
    commands, problems = _commands(), []
    for doc in READ:
        for offset, _, block in doc.code:
            for m in COMMAND.finditer(block.replace("\\\n", " ")):
                # The command's own words: up to a comment, a pipe, the next command or the line's end.
                rest = re.split(r"\s#|[|;&`\n]|\btracetrain |\btorchrun ", block.replace("\\\n", " ")[m.end() :])[0]
                flags = FLAG.findall(rest)
                if m.group(1):
                    sub = m.group(1)
                    if sub not in commands:
                        problems.append(f"{doc.where(offset)}: no subcommand 'tracetrain {sub}'")
                        continue
                    problems += [
                        f"{doc.where(offset)}: tracetrain {sub} has no {f}" for f in flags if f not in commands[sub]
                    ]
                    continue
                script = REPO / m.group(2) if m.group(2) else REPO / (m.group(3).replace(".", "/") + ".py")
                if not script.is_file():
                    problems.append(f"{doc.where(offset)}: no {script.relative_to(REPO)}")
                    continue
                source = script.read_text(encoding="utf-8")
                missing = [f for f in flags if f'"{f}"' not in source]
                problems += [f"{doc.where(offset)}: {script.relative_to(REPO)} has no {f}" for f in missing]
    _fails(problems, "commands or flags the docs show that do not exist")


ROOTED = re.compile(
    r"(?<![\w./-])((?:benchmarks|tests|docs|configs)/[\w./{},*<>+-]*[\w*>}/]|tracetrain/[\w/{},*<>.-]*(?:\.py|/))"
)
IN_PACKAGE = re.compile(
    r"(?<![\w./-])((?:train|models|plan|parallel|memory|kernels|data|profile|tune)/[\w/{},.]+\.py)\b"
)
BARE = re.compile(r"(?<![\w./<-])([A-Za-z0-9][\w+*-]*\.(?:py|json\.gz|json))\b(?!\.gz)")


def _expand(path: str) -> list[str]:
    """Brace alternatives (`{a,b}`), placeholders (`<gpu>`) as wildcards."""
    if m := re.search(r"\{([^{}]*)\}", path):
        return [q for alt in m.group(1).split(",") for q in _expand(path[: m.start()] + alt + path[m.end() :])]
    return [re.sub(r"<[^>]*>", "*", path)]


def _exists(path: str, root: Path = REPO) -> bool:
    return all(glob.glob(str(root / p)) for p in _expand(path.rstrip(".,")))


def test_paths_the_docs_name_exist():
    problems = []
    for doc in READ:
        for m in ROOTED.finditer(doc.text):
            path = m.group(1).rstrip(".,")
            if path not in EXTERNAL and path not in NOT_YET and not _exists(path):
                problems.append(f"{doc.where(m.start())}: no {path}")
        for m in IN_PACKAGE.finditer(doc.text):
            if not _exists(m.group(1), REPO / "tracetrain"):
                problems.append(f"{doc.where(m.start())}: no tracetrain/{m.group(1)}")
        for m in BARE.finditer(doc.text):
            name = m.group(1)
            pattern = re.compile(re.escape(name).replace(r"\*", ".*") + "$")
            if name not in RUN_FILES and not any(pattern.match(f) for f in FILE_NAMES):
                problems.append(f"{doc.where(m.start())}: no file named {name} in the repository")
    texts = "".join(doc.text for doc in READ)
    problems += [
        f"{what} names {p!r}, which no doc mentions"
        for what, names in (("EXTERNAL", EXTERNAL), ("NOT_YET", NOT_YET))
        for p in names
        if p not in texts
    ]
    _fails(problems, "paths the docs name that do not exist")


def _anchors(doc: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"^#+ (.+)$", FENCE.sub("", doc.read_text(encoding="utf-8")), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_links_between_the_docs_resolve():
    problems = []
    for doc in READ:
        for m in re.finditer(r"\]\(([^)\s]+)\)", doc.text):
            target, _, anchor = m.group(1).partition("#")
            if re.match(r"\w+://", target):
                continue
            path = (doc.path.parent / target).resolve() if target else doc.path
            if not path.exists():
                problems.append(f"{doc.where(m.start())}: link to {m.group(1)}: no such file")
            elif anchor and anchor not in _anchors(path):
                problems.append(f"{doc.where(m.start())}: link to {m.group(1)}: no such heading")
    _fails(problems, "links that do not resolve")


def test_tests_the_docs_name_exist():
    sources = "\n".join(p.read_text(encoding="utf-8") for p in (REPO / "tests").rglob("*.py"))
    defined = set(re.findall(r"^\s*def (test_\w+)", sources, re.M))
    problems = []
    for doc in READ:
        for m in re.finditer(r"(?<![\w/.])(test_\w+)\b(?!\.py)", doc.text):
            if not any(name.startswith(m.group(1)) for name in defined):
                problems.append(f"{doc.where(m.start())}: no test {m.group(1)}")
    _fails(problems, "tests the docs name that do not exist")


def test_architecture_transform_table_is_the_code_s():
    doc = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\| \d+a? \| (\w+) \|", doc, re.M)
    assert rows == [t.name for t in TRANSFORMS], "docs/architecture.md's transform table is not TRANSFORMS"
