"""Per-step losses of tiny CPU runs, one per transform, data kind and 2-rank gloo layout, bitwise equal
to tests/data/golden_losses.json (recorded from the real trainer by `python3 tests/golden_losses.py
--write`). A refactor of the build path or the training step must leave these unchanged (issue #17)."""

import json

import pytest
import torch
from golden_losses import BASE, GOLDEN_PATH, all_cases, cpu_fingerprint, losses

GOLDEN = json.loads(GOLDEN_PATH.read_text())


def _major_minor(version: str) -> tuple[str, ...]:
    return tuple(version.split(".")[:2])


def test_golden_file_covers_every_case():
    assert GOLDEN["base"] == BASE, "the shared overrides changed since the file was written"
    assert set(GOLDEN["cases"]) == set(all_cases()), "regenerate: python3 tests/golden_losses.py --write"
    for name, extra in all_cases().items():
        assert GOLDEN["cases"][name]["overrides"] == extra, f"{name}: overrides changed since the file was written"


@pytest.mark.parametrize("case", list(all_cases()))
def test_losses_are_bitwise_golden(case, one_thread_torch):
    if _major_minor(torch.__version__) != _major_minor(GOLDEN["torch"]):
        pytest.skip(f"golden losses recorded with torch {GOLDEN['torch']}, this is {torch.__version__}: "
                    "numerics may differ across torch versions")
    expected = GOLDEN["cases"][case]["losses"]
    got = losses(case)
    where = f"recorded at {GOLDEN['commit']} on {GOLDEN['cpu']}, this is {cpu_fingerprint()}"
    if cpu_fingerprint() == GOLDEN["cpu"]:
        assert got == expected, f"{case}: losses differ from the golden file ({where}):\ngot      {got}\nexpected {expected}"
    else:
        assert got == pytest.approx(expected, rel=1e-4, abs=0), (
            f"{case}: losses differ from the golden file beyond 1e-4 ({where}):\ngot      {got}\nexpected {expected}")
