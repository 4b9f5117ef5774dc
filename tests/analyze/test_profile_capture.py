"""The profiled window is labelled with the trainer's step numbers: a capture of start_step=S,
num_steps=N holds exactly `ProfilerStep#S` .. `ProfilerStep#S+N-1`, also when a resumed run starts
inside or just before the window (the trainer's loop calls step_begin/step_end with 0-based steps)."""

import gzip
import json
import re
from pathlib import Path

import pytest
import torch

from tracetrain.config import ProfileSection
from tracetrain.profile.capture import ProfileCapture


def captured_steps(tmp_path: Path, start_step: int, num_steps: int, first: int, last: int) -> list[int]:
    """Run steps first..last (0-based, as the loop does) under a capture; the step numbers in the trace."""
    cfg = ProfileSection(enabled=True, start_step=start_step, num_steps=num_steps, analyze=False)
    cap = ProfileCapture(cfg, tmp_path, torch.device("cpu"))
    x = torch.randn(32, 32)
    for step in range(first, last + 1):
        cap.step_begin(step)
        with cap.phase("forward"):
            x = torch.tanh(x @ x)
        cap.step_end(step)
    out = cap.finish(lambda note: None)
    if "trace" not in out:
        return []
    with gzip.open(out["trace"], "rt") as f:
        names = {e.get("name", "") for e in json.load(f)["traceEvents"]}
    return sorted(int(m.group(1)) for n in names if (m := re.fullmatch(r"ProfilerStep#(\d+)", n)))


@pytest.mark.parametrize(
    ("start_step", "num_steps", "first", "last", "expected"),
    [
        (1, 2, 0, 4, [1, 2]),  # the window opens on the first step: no warm-up step before it
        (3, 2, 0, 6, [3, 4]),
        (5, 3, 3, 9, [5, 6, 7]),  # resumed after step 3 (runs steps 4..10)
        (5, 3, 5, 9, [6, 7]),  # resumed after step 5: the window's rest
    ],
)
def test_trace_labels_are_the_trainers_step_numbers(tmp_path, start_step, num_steps, first, last, expected):
    assert captured_steps(tmp_path, start_step, num_steps, first, last) == expected
