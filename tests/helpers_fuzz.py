"""Hypothesis settings and strategies the fuzz tests share (tests/reliability/test_fuzz*.py).

Examples are derived from the test's name (derandomize), so a run is repeatable and CI sees the same
inputs; the `fuzz` profile is what CI runs. HYPOTHESIS_PROFILE=fuzz-long
(FUZZ_EXAMPLES=N) draws fresh examples to hunt for more."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

_COMMON = {"derandomize": True, "deadline": None, "suppress_health_check": list(HealthCheck), "database": None}
settings.register_profile("fuzz", max_examples=40, **_COMMON)
# Fresh random examples on each run, as many as FUZZ_EXAMPLES: for hunting, not for CI.
settings.register_profile(
    "fuzz-long", max_examples=int(os.environ.get("FUZZ_EXAMPLES", "1000")), **{**_COMMON, "derandomize": False}
)
FUZZ = settings.get_profile(os.environ.get("HYPOTHESIS_PROFILE", "fuzz"))
FEW = settings(FUZZ, max_examples=max(FUZZ.max_examples // 4, 8))  # examples that each run a command


@contextlib.contextmanager
def _sandbox() -> Iterator[tuple[Path, Path]]:
    """(work folder, a sentinel folder beside it); the sentinel's files must come out unchanged."""
    with tempfile.TemporaryDirectory() as tmp:
        work, sentinel = Path(tmp) / "work", Path(tmp) / "sentinel"
        work.mkdir()
        sentinel.mkdir()
        (sentinel / "keep.txt").write_text("keep")
        before = sorted((p.name, p.stat().st_mtime_ns, p.read_bytes()) for p in sentinel.iterdir())
        yield work, sentinel
        after = sorted((p.name, p.stat().st_mtime_ns, p.read_bytes()) for p in sentinel.iterdir())
        assert after == before, "a file outside the run was touched"


JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(10**20), 10**20)
    | st.floats(allow_nan=False)
    | st.text(max_size=8)
    | st.sampled_from(["<s>", "</s>", "a", "missing"]),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(["content", "__type", "x"]), inner, max_size=2)
    ),
    max_leaves=5,
)
