"""The longest context a run's settings fit, and the settings that would fit a context that does not.

Every memory item is affine in the tokens of a micro-batch (memory.py), so "does `data.seq_len = s`
fit" is monotone in s and a bisection over multiples of `multiple` finds the longest. Each candidate is
resolved again from the config (`plan_input_from_config`): what `auto` decides depends on the length
(the tiled norm + MLP switches on from 64k tokens per micro-batch, and compile off with it), so the
plan at each length is the run `tracetrain train` would execute at that length.

`LONG_CONTEXT_REMEDIES` are the memory switches for long sequences: the tiled norm + MLP alone (no block
recomputed; compile off with it), the same with every block's saved tensors streamed to the host (no block
recomputed: the fastest at 64k tokens on an 80 GB H100, llama3.1-8b LoRA, measured 5,241 tok/s against
4,036 with full recomputation and offload; it needs the host memory of every block's activations), then
full recomputation, and rows that each add to that one. With the
streamed offload the host becomes the limit while GPU memory is left over; the report then also fits
`memory.activation_offload_fraction`, keeping the last blocks' inputs on the GPU (`_with_offload_fraction`),
so both memories hold block inputs. `fitting_remedy` returns, of the rows under which a length fits, the
one the planner predicts fastest (a row that saves more memory usually costs more time, but not always:
at llama3.1-8b LoRA 32k on an H100 the tiled MLP alone plans 7,095 tok/s against 6,047 with every block
recomputed): what the pre-flight line (train/oom.py) prints; `tracetrain plan
--longest-context` prints the longest length under each row.
"""

from __future__ import annotations

from dataclasses import dataclass

from tracetrain.config import Config, parse_override
from tracetrain.plan.core import Plan, plan
from tracetrain.plan.mapping import plan_input_from_config

GIB = 2**30
DEFAULT_MULTIPLE = 1024
SEARCH_LIMIT = 1 << 24  # tokens: the model section's max_seq_len limit

# Each row is a set of switches (`fitting_remedy` takes the fastest planned that fits); the report lists
# them in this order, each where it reaches further than the rows above.
LONG_CONTEXT_REMEDIES: tuple[tuple[str, ...], ...] = (
    ("--memory.tiled_mlp=on",),
    ("--memory.tiled_mlp=on", "--memory.activation_offload=streamed"),
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
        m, i = self.plan.memory, self.plan.input
        host = (
            f", host {m.host_bytes_per_node / GIB:.1f} of {m.host_capacity_bytes / GIB:.0f} GiB"
            if m.host_bytes_per_node
            else ""
        )
        fraction = ""
        if i.activation_offload == "streamed" and i.activation_offload_fraction < 1:
            fraction = f" with --memory.activation_offload_fraction={i.activation_offload_fraction:.4g}"
        return (
            f"longest data.seq_len {self.seq_len:,} (micro-batch {i.micro_batch}){fraction}: planned "
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
    changes.update(parse_override(o) for o in overrides)
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
    fit_offload_fraction: bool = False,
) -> LongestContext:
    """Bisection over data.seq_len = k * multiple, 1 <= k <= limit / multiple (module docstring).
    `fit_offload_fraction`: where the run offloads (streamed) and a length does not fit, also try keeping
    the last blocks' inputs on the GPU (`_with_offload_fraction`)."""

    def at(k: int) -> Plan:
        p = plan_at(cfg, k * multiple, gpu, num_gpus, overrides, host_memory_gib, hardware)
        if fit_offload_fraction and not p.fits and p.input.activation_offload == "streamed":
            return _with_offload_fraction(cfg, k * multiple, gpu, num_gpus, overrides, host_memory_gib, hardware) or p
        return p

    lo, hi = 0, limit // multiple  # invariant: lo fits (or is 0), everything above hi does not
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if at(mid).fits else (lo, mid - 1)
    if lo == limit // multiple:
        return LongestContext(lo * multiple, multiple, at(lo), "search limit")
    above = at(lo + 1).memory
    gpu_short = above.required_bytes > above.capacity_bytes
    return LongestContext(lo * multiple, multiple, at(lo) if lo else None, "GPU memory" if gpu_short else "host memory")


def _with_offload_fraction(
    cfg: Config,
    seq_len: int,
    gpu: str,
    num_gpus: int,
    overrides: tuple[str, ...],
    host_memory_gib: float | None,
    hardware: dict[str, object] | None,
) -> Plan | None:
    """The plan at `seq_len` with the smallest `memory.activation_offload_fraction` (k of n_layers blocks
    offloaded, the other block inputs kept on the GPU) at which the GPU fits, if the host then fits too;
    else None. The GPU's need falls as k grows and the host's rises: the first k that fits the GPU leaves
    the host the least to hold."""
    n = plan_at(cfg, seq_len, gpu, num_gpus, overrides, host_memory_gib, hardware).input.model.n_layers

    def gpu_fits(p: Plan) -> bool:
        return p.memory.required_bytes <= p.memory.capacity_bytes

    def with_k(k: int) -> Plan:
        row = (*overrides, f"--memory.activation_offload_fraction={k / n}")
        return plan_at(cfg, seq_len, gpu, num_gpus, row, host_memory_gib, hardware)

    lo, hi = 1, n - 1  # the smallest k whose GPU memory fits
    if n < 2 or not gpu_fits(with_k(hi)):
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if gpu_fits(with_k(mid)) else (mid + 1, hi)
    p = with_k(lo)
    return p if p.fits else None


def fitting_remedy(
    cfg: Config,
    seq_len: int,
    gpu: str,
    num_gpus: int = 1,
    host_memory_gib: float | None = None,
    hardware: dict[str, object] | None = None,
) -> tuple[tuple[str, ...], Plan] | None:
    """Of the `LONG_CONTEXT_REMEDIES` rows under which `seq_len` fits, the one with the most planned
    tokens/s (the first of equals), with its plan; None if none fits. Rows whose switches the config
    already has are skipped (they would change nothing); the offload row may come with the
    `memory.activation_offload_fraction` that fits (`_with_offload_fraction`)."""
    best: tuple[tuple[str, ...], Plan] | None = None
    for row in LONG_CONTEXT_REMEDIES:
        changed = tuple(o for o in row if not _already(cfg, o))
        if not changed:
            continue
        p = plan_at(cfg, seq_len, gpu, num_gpus, row, host_memory_gib, hardware)
        if not p.fits and p.input.activation_offload == "streamed":
            p = _with_offload_fraction(cfg, seq_len, gpu, num_gpus, row, host_memory_gib, hardware) or p
            if p.fits:
                changed += (f"--memory.activation_offload_fraction={p.input.activation_offload_fraction:.4g}",)
        if p.fits and (best is None or p.tokens_per_s > best[1].tokens_per_s):
            best = changed, p
    return best


def remedy_text(switches: tuple[str, ...], p: Plan) -> str:
    """A `fitting_remedy` as the pre-flight line and `tracetrain plan` say it ("It fits with <switches>
    (planned ...)"), with the host memory an offloading one needs."""
    host = p.memory.host_bytes_per_node / GIB
    host_part = f" and {host:.1f} GiB of host memory" if host >= 0.05 else ""
    return (
        f"It fits with {' '.join(switches)} (planned {p.memory.required_bytes / GIB:.1f} GiB per GPU{host_part}, "
        f"{p.tokens_per_s:,.0f} tokens/s)."
    )


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
            found = longest_context(cfg, gpu, num_gpus, row, hardware=hardware, fit_offload_fraction=True)
            if found.seq_len > best:  # a row that buys nothing (its switch already 'auto'-on) is not shown
                lines.append(f"with {' '.join(changed)}: {found.line()}")
                best = found.seq_len
    return lines
