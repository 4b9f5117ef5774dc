"""The user-facing docs stay true to the repository: the generated config reference, the README's test
command (what CI runs), every file the README names, the screenshot, and every result file the
performance page cites."""

import re
import shlex

from helpers import REPO

from tracetrain.config import reference_markdown

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
    assert ["python3", "-m", "pip", "install", "-e", ".", "pytest", "hypothesis", "pytest-xdist"] in bare_steps
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
