"""The user-facing docs stay true to the repository: the generated config reference, the README's test
command (what CI runs), every file the README names, the screenshot, and every result file the
performance page cites."""

import re
import shlex
from pathlib import Path

from tracetrain.config import reference_markdown

REPO = Path(__file__).resolve().parents[1]
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
    # The second of the README's two commands installs and runs the tests; CI runs the same steps.
    lines = [line for line in README.splitlines() if line.startswith("python3 -m pip install") and "pytest" in line]
    assert len(lines) == 1, lines
    ci_lines = (REPO / ".ci" / "run").read_text().splitlines()
    ci = [shlex.split(line) for line in ci_lines if line.startswith("python3 ")]
    for part in lines[0].split("&&"):
        words = shlex.split(part)
        assert any(line[: len(words)] == words or _without_quiet(line) == words for line in ci), part


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
