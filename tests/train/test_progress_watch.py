"""`progress.watch_bytes`: progress for writers that report nothing themselves (the sharded checkpoint's DCP
save), read from the size of the files they write; and the sharded save reporting through it."""

from __future__ import annotations

import time
from pathlib import Path

from tracetrain.progress import folder_bytes, watch_bytes


def test_watch_bytes_reports_growth_while_files_are_written(tmp_path: Path):
    calls: list[tuple[str, int, int | None, str]] = []
    folder = tmp_path / "dcp"
    folder.mkdir()
    with watch_bytes(lambda *a: calls.append(a), "saving", folder, total=4000, every_s=0.02):
        for i in range(4):
            (folder / f"shard{i}").write_bytes(b"x" * 1000)
            time.sleep(0.08)  # several polls per file
    done = [c[1] for c in calls]
    assert all(c[0] == "saving" and c[2] == 4000 and c[3] == "bytes" for c in calls)
    assert done == sorted(done) and len(set(done)) >= 3  # it moved while the block ran, never backwards
    assert done[-1] == 4000 == folder_bytes(folder)  # the last report: all of it, after the block
    assert any(0 < d < 4000 for d in done)  # and partial counts while the files were being written


def test_watch_bytes_without_a_console_does_nothing(tmp_path: Path):
    with watch_bytes(None, "saving", tmp_path, total=10):
        (tmp_path / "f").write_bytes(b"abc")
    assert folder_bytes(tmp_path) == 3
