"""Axis ticks of the HTML pages (profile/analyze/svg.py, used by the run page and the profile report):
round 1-2-5 x 10^k values, never quarters of the data's range."""

import itertools
import math
import re

import pytest

from tracetrain.profile.analyze.svg import log_ticks, nice_step, nice_ticks, time_axis
from tracetrain.train.report_charts import Series, chart


def is_round(step: float) -> bool:
    """1, 2 or 5 times a power of ten."""
    mantissa = step / 10 ** math.floor(math.log10(step) + 1e-9)
    return any(math.isclose(mantissa, m, rel_tol=1e-6) for m in (1, 2, 5, 10))


def assert_round_ticks(ticks: list[float], lo: float, hi: float, max_ticks: int) -> None:
    assert 2 <= len(ticks) <= max_ticks + 1, ticks
    assert all(lo - 1e-9 <= t <= hi + 1e-9 for t in ticks), (ticks, lo, hi)
    steps = {round(b - a, 12) for a, b in itertools.pairwise(ticks)}
    assert len(steps) == 1, ticks  # evenly spaced
    step = steps.pop()
    assert is_round(step), ticks
    assert all(math.isclose(t / step, round(t / step), abs_tol=1e-6) for t in ticks), ticks  # multiples of it
    assert all(len(repr(t)) <= 12 for t in ticks), ticks  # 0.3, not 0.30000000000000004


@pytest.mark.parametrize(
    "lo, hi",
    [(1, 600), (0.8, 603.2), (2.13, 4.71), (0, 1e-3), (3e-5, 1.2e-3), (12345, 9.8e6), (4.4, 4.6), (-3.7, 2.2), (1, 20)],
)
def test_nice_ticks_are_round_even_and_inside(lo, hi):
    assert_round_ticks(nice_ticks(lo, hi, 6), lo, hi, 6)


def test_nice_ticks_of_a_range_of_steps():
    # The run page's step axis, which drew 150.8, 300.5, ... (quarters of 1..600) before.
    assert nice_ticks(1, 600, 6) == [100, 200, 300, 400, 500, 600]
    assert nice_ticks(0.1, 0.7, 6) == [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7]
    assert nice_step(603.2 - 0.8, 6) == 200


@pytest.mark.parametrize(
    "lo, hi, expected",
    [
        (1e-3, 10, [1e-3, 1e-2, 0.1, 1.0, 10.0]),  # decades
        (0.05, 9.8, [0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0]),  # 1-2-5 within two decades
        (3.3, 30, [5.0, 10.0, 20.0]),
        (1e-3, 1e4, [1e-3, 0.1, 10.0, 1000.0]),  # every other decade
        (2.13, 4.71, [2.5, 3.0, 3.5, 4.0, 4.5]),  # inside one decade: round linear values
    ],
)
def test_log_ticks(lo, hi, expected):
    ticks = log_ticks(lo, hi, 6)
    assert ticks == pytest.approx(expected)
    assert all(lo <= t <= hi for t in ticks)


def test_profile_time_axis_uses_the_same_spacing():
    labels = re.findall(r'class="tick"[^>]*>([^<]+)<', time_axis(3.7e6, 0, 700, 10))
    assert labels == ["0.0 s", "0.5 s", "1.0 s", "1.5 s", "2.0 s", "2.5 s", "3.0 s", "3.5 s"]


def test_loss_chart_has_round_ticks_and_a_log_drawing():
    loss = [(float(s), 10.0 * 0.97**s) for s in range(1, 601)]
    page = chart("Loss", [Series("train loss", "#000", loss)], "step", log_toggle=True)
    lin, log = re.findall(r'<svg class="chart (lin|log)"', page)
    assert (lin, log) == ("lin", "log") and 'type="checkbox" class="logscale"' in page
    lin_svg, log_svg = page.split('<svg class="chart log"')
    x_ticks = [float(t) for t in re.findall(r'class="xtick"[^>]*>([^<]+)<', lin_svg)]
    assert x_ticks == [100, 200, 300, 400, 500, 600]
    y_lin = [float(t) for t in re.findall(r'class="ytick"[^>]*>([^<]+)<', lin_svg)]
    assert_round_ticks(y_lin, 0, 10.5, 6)
    # 10 * 0.97^600 = 1.2e-7 .. 9.7: every other decade, written short.
    assert re.findall(r'class="ytick"[^>]*>([^<]+)<', log_svg) == ["1e-06", "0.0001", "0.01", "1"]
    # Equal ratios are equal distances on the log drawing: the decades' tick rows are evenly spaced.
    ys = [float(y) for y in re.findall(r'class="ytick" x="[^"]+" y="([^"]+)"', log_svg)]
    gaps = {round(b - a, 0) for a, b in itertools.pairwise(ys)}
    assert len(gaps) == 1, ys


def test_no_log_drawing_for_values_at_or_below_zero():
    page = chart("Loss", [Series("x", "#000", [(1.0, 0.0), (2.0, 1.0)])], "step", log_toggle=True)
    assert 'class="chart log"' not in page and "logscale" not in page
