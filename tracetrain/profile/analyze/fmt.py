"""Number formatting shared by the terminal and HTML renderers (plain strings, no markup)."""

from __future__ import annotations

import math
import re

# Terminal control in untrusted trace strings: ANSI CSI sequences (`ESC [ ... m`, 8-bit `\x9b ... m`),
# OSC sequences (`ESC ] ... BEL`, which can set titles or hyperlinks), other `ESC x` escapes, and any
# remaining C0/C1 control character except newline and tab.
_TERMINAL_CONTROL = re.compile(
    r"(?:\x1b\[|\x9b)[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?|\x1b[@-_]|[\x00-\x08\x0b-\x1f\x7f-\x9f]"
)


def duration(us: float | None) -> str:
    """12.3 s / 45.6 ms / 789 µs."""
    if us is None or not math.isfinite(us):
        return "—"
    if abs(us) >= 1e6:
        return f"{us / 1e6:.2f} s"
    if abs(us) >= 1e3:
        return f"{us / 1e3:.2f} ms"
    return f"{us:.1f} µs"


def percent(fraction: float | None, digits: int = 1) -> str:
    if fraction is None or not math.isfinite(fraction):
        return "—"
    return f"{100 * fraction:.{digits}f}%"


def nbytes(value: float | None) -> str:
    if value is None:
        return "—"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(value) >= scale:
            return f"{value / scale:.1f} {unit}"
    return f"{value:.0f} B"


def number(value: float | None, digits: int = 1, suffix: str = "") -> str:
    if value is None or not math.isfinite(value):
        return "—"
    return f"{value:,.{digits}f}{suffix}"


def count(value: float | None, suffix: str = "") -> str:
    """A large count with an SI prefix: 9.12 G, 24.8 M, 512."""
    if value is None or not math.isfinite(value):
        return "—"
    for prefix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.3g} {prefix}{suffix}"
    return f"{value:.0f}" + (f" {suffix}" if suffix else "")


def signed(value: float | None, unit: str) -> str:
    """A delta with its sign, in the metric's unit."""
    if value is None:
        return "—"
    sign = "+" if value > 0 else "-" if value < 0 else "±"
    magnitude = abs(value)
    body = {
        "us": duration(magnitude),
        "fraction": f"{100 * magnitude:.1f} pt",
        "tflops": f"{magnitude:.1f} TFLOP/s",
    }.get(unit, f"{magnitude:,.1f}")
    return sign + body


def in_unit(amount: float | None, unit: str) -> str:
    """An amount in its unit: µs durations, fractions as percent, TFLOP/s, plain counts."""
    if unit == "us":
        return duration(amount)
    if unit == "fraction":
        return percent(amount)
    if unit == "tflops":
        return number(amount, 1, " TFLOP/s")
    return number(amount, 1)


def relative(a: float | None, b: float | None) -> str:
    """b relative to a, e.g. -12.5%."""
    if a is None or b is None or a == 0:
        return "—"
    return f"{100 * (b / a - 1):+.1f}%"


def printable(text: str) -> str:
    """`text` without terminal escape sequences or control characters (kernel and op names come from
    the trace, written by another program: an ANSI colour or cursor code in one must not reach the
    terminal)."""
    return _TERMINAL_CONTROL.sub("", text)
