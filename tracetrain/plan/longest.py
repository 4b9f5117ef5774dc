"""The longest context a run's settings fit, and the settings that would fit a context that does not.

Every memory item is affine in the tokens of a micro-batch (memory.py), so "does `data.seq_len = s`
fit" is monotone in s and a bisection over multiples of `multiple` finds the longest. Each candidate is
resolved again from the config (`plan_input_from_config`): what `auto` decides depends on the length
(the tiled norm + MLP switches on from 64k tokens per micro-batch, and compile off with it), so the
plan at each length is the run `tracetrain train` would execute at that length.

`LONG_CONTEXT_REMEDIES` are the memory switches for long sequences, cheapest in speed first; each row
adds to the one before. `fitting_remedy` returns the first row under which a length fits: what the
pre-flight line (train/oom.py) and `tracetrain plan --longest-context` print.
"""

from __future__ import annotations

from dataclasses import dataclass

from tracetrain.config import Config
from tracetrain.plan.core import Plan, plan
from tracetrain.plan.mapping import plan_input_from_config

GIB = 2**30
DEFAULT_MULTIPLE = 1024
SEARCH_LIMIT = 1 << 24  # tokens: the model section's max_seq_len limit

# Cumulative: each row keeps the switches of the rows above it.
LONG_CONTEXT_REMEDIES: tuple[tuple[str, ...], ...] = (
    ("--memory.recompute=full",),
    ("--memory.recompute=full", "--memory.tiled_mlp=on", "--train.compile=auto"),
    (
        "--memory.recompute=full",
        "--memory.tiled_mlp=on",
        "--train.compile=auto",
        "--memory.activation_offload=streamed",
    ),
)


@dataclass(frozen=True)
class LongestContext:
    """The longest `data.seq_len` (a multiple of `multiple`) that the planner fits, 0 if none does."""

    seq_len: int
    multiple: int
    plan: Plan | None  # at seq_len (None when nothing fits)
    limited_by: str  # what the next multiple runs out of: "GPU memory", "host memory" or "search limit"

    def line(self) -> str:
        if self.plan is None:
            return f"no data.seq_len (multiple of {self.multiple}) fits: {self.limited_by}"
        m = self.plan.memory
        host = (
            f", host {m.host_bytes_per_node / GIB:.1f} of {m.host_capacity_bytes / GIB:.0f} GiB"
            if m.host_bytes_per_node
            else ""
        )
        return (
            f"longest data.seq_len {self.seq_len:,} (micro-batch {self.plan.input.micro_batch}): planned "
            f"{m.required_bytes / GIB:.1f} of {m.capacity_bytes / GIB:.1f} GiB{host}; "
            f"{self.seq_len + self.multiple:,} runs out of {self.limited_by}"
        )


def plan_at(
    cfg: Config,
    seq_len: int,
    gpu: str,
    num_gpus: int = 1,
    overrides: tuple[str, ...] = (),
    host_memory_gib: float | None = None,
    hardware: dict[str, object] | None = None,
) -> Plan:
    """The plan of `cfg` with `data.seq_len = seq_len` and `overrides`, resolved again (module docstring).
    `hardware`: PlanInput fields of the machine (gpu_memory_gib, gpus_per_node, ...) as `tracetrain plan`
    flags set them."""
    changes: dict[str, object] = {"data.seq_len": seq_len}
    for o in overrides:
        key, value = o.removeprefix("--").split("=", 1)
        changes[key] = value
    inp = plan_input_from_config(cfg.replace(changes), num_gpus, gpu)
    extra = dict(hardware or {})
    if host_memory_gib is not None:
        extra["host_memory_gib"] = host_memory_gib
    return plan(inp.replace(**extra) if extra else inp)


def longest_context(
    cfg: Config,
    gpu: str,
    num_gpus: int = 1,
    overrides: tuple[str, ...] = (),
    *,
    multiple: int = DEFAULT_MULTIPLE,
    host_memory_gib: float | None = None,
    hardware: dict[str, object] | None = None,
    limit: int = SEARCH_LIMIT,
) -> LongestContext:
    """Bisection over data.seq_len = k * multiple, 1 <= k <= limit / multiple (module docstring)."""

    def at(k: int) -> Plan:
        return plan_at(cfg, k * multiple, gpu, num_gpus, overrides, host_memory_gib, hardware)

    lo, hi = 0, limit // multiple  # invariant: lo fits (or is 0), everything above hi does not
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if at(mid).fits else (lo, mid - 1)
    if lo == limit // multiple:
        return LongestContext(lo * multiple, multiple, at(lo), "search limit")
    above = at(lo + 1).memory
    gpu_short = above.required_bytes > above.capacity_bytes
    return LongestContext(lo * multiple, multiple, at(lo) if lo else None, "GPU memory" if gpu_short else "host memory")


def fitting_remedy(
    cfg: Config,
    seq_len: int,
    gpu: str,
    num_gpus: int = 1,
    host_memory_gib: float | None = None,
    hardware: dict[str, object] | None = None,
) -> tuple[tuple[str, ...], Plan] | None:
    """The first `LONG_CONTEXT_REMEDIES` row under which `seq_len` fits, with its plan; None if none does.
    Rows whose switches the config already has are skipped (they would change nothing)."""
    for row in LONG_CONTEXT_REMEDIES:
        changed = tuple(o for o in row if not _already(cfg, o))
        if not changed:
            continue
        p = plan_at(cfg, seq_len, gpu, num_gpus, row, host_memory_gib, hardware)
        if p.fits:
            return changed, p
    return None


def _already(cfg: Config, override: str) -> bool:
    key, value = override.removeprefix("--").split("=", 1)
    section, name = key.split(".")
    return str(getattr(getattr(cfg, section), name)) == value


def longest_context_report(
    cfg: Config, gpu: str, num_gpus: int = 1, hardware: dict[str, object] | None = None
) -> list[str]:
    """`tracetrain plan --longest-context`: the longest data.seq_len with the config's settings, then with
    each row of LONG_CONTEXT_REMEDIES that changes something, one line each."""
    found = longest_context(cfg, gpu, num_gpus, hardware=hardware)
    lines, best = ["with these settings: " + found.line()], found.seq_len
    for row in LONG_CONTEXT_REMEDIES:
        changed = tuple(o for o in row if not _already(cfg, o))
        if changed:
            found = longest_context(cfg, gpu, num_gpus, row, hardware=hardware)
            if found.seq_len > best:  # a row that buys nothing (its switch already 'auto'-on) is not shown
                lines.append(f"with {' '.join(changed)}: {found.line()}")
                best = found.seq_len
    return lines
