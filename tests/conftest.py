"""Shared fixtures. Real datasets live in ../shared/data beside the checkout; tests that need them skip
with a reason when it is absent."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


def shared_file(rel: str) -> Path:
    path = SHARED_DATA / rel
    if not path.exists():
        pytest.skip(f"{path} not present (the shared data folder sits beside the checkout)")
    return path
