"""Render plans to the terminal (rich tables and a unicode stacked bar) or to JSON-ready data.
Rendering never computes: it formats what `plan` and `search` returned."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from tracetrain.plan.core import Plan
from tracetrain.plan.memory import GIB

JSON_VERSION = 1
BAR_WIDTH = 64
# One colour per memory row, shared with the HTML page.
COLORS = {
    "weights": "#4e79a7",
    "gradients": "#f28e2b",
    "AdamW states": "#e15759",
    "AdamW temporaries": "#ff9da7",
    "autocast bf16 weight copies": "#76b7b2",
    "activations": "#59a14f",
    "logits / loss": "#edc948",
    "FSDP buffers": "#b07aa1",
    "embedding grad (dense)": "#9c755f",
    "NCCL buffers": "#86bcb6",
    "fragmentation": "#bab0ac",
    "CUDA context": "#d37295",
}


def memory_rows(p: Plan) -> list[tuple[str, float]]:
    """(row, bytes) of the peak phase, then fragmentation and context: what the device must hold."""
    m = p.memory
    return [*m.breakdown.items(), ("fragmentation", m.fragmentation_bytes), ("CUDA context", m.context_bytes)]


def unicode_bar(rows: list[tuple[str, float]], capacity: float, width: int = BAR_WIDTH) -> Text:
    """A stacked bar: one run of blocks per row, scaled to `capacity` (free space shaded)."""
    text = Text()
    used = 0
    total = max(capacity, sum(v for _, v in rows))
    for name, value in rows:
        cells = round(value / total * width)
        used += cells
        text.append("█" * cells, style=COLORS.get(name, "white"))
    text.append("░" * max(0, width - used), style="grey50")
    return text


def _memory_table(p: Plan) -> Table:
    m = p.memory
    t = Table(title=Text(f"Memory per GPU at {m.peak_phase} (stage {m.stage})", style="bold"), title_justify="left")
    for col in ("item", "GiB", "share"):
        t.add_column(col, justify="left" if col == "item" else "right")
    for name, value in memory_rows(p):
        t.add_row(
            Text("■ ", style=COLORS.get(name, "white")) + Text(name),
            f"{value / GIB:.2f}",
            f"{value / m.required_bytes:.0%}",
        )
    t.add_row(Text("required", style="bold"), f"{m.required_bytes / GIB:.2f}", "")
    t.add_row(Text("device"), f"{m.capacity_bytes / GIB:.2f}", "")
    # The verdict is the largest of the build, the load and the step (build_phase.py): both shown.
    t.add_row(Text("peak of the build / load"), f"{m.build_peak_bytes / GIB:.2f}", "")
    t.add_row(Text("peak of the step"), f"{m.step_peak_bytes / GIB:.2f}", "")
    for name, value in m.cpu_bytes.items():
        t.add_row(Text(f"host: {name}"), f"{value / GIB:.2f}", "")
    for name, value in m.managed_bytes.items():
        t.add_row(Text(f"managed: {name}"), f"{value / GIB:.2f}", "")
    return t


def _time_table(p: Plan) -> Table:
    t = Table(title=Text("Step time per GPU", style="bold"), title_justify="left")
    for col in ("kind", "ms", "share"):
        t.add_column(col, justify="left" if col == "kind" else "right")
    for name, value in sorted(p.time.breakdown.items(), key=lambda kv: -kv[1]):
        t.add_row(Text(name), f"{value * 1e3:.1f}", f"{value / p.step_s:.0%}")
    t.add_row(Text("step", style="bold"), f"{p.step_s * 1e3:.1f}", "")
    return t


def _summary(p: Plan) -> Text:
    i = p.input
    verdict = Text("fits" if p.fits else "does NOT fit", style="green" if p.fits else "bold red")
    mode: str = i.mode
    if i.mode == "lora":  # QLoRA and DoRA are LoRA variants the plan counts differently
        mode = "qlora (nf4 base)" if i.lora_base_quant == "nf4" else "lora"
        mode += " + dora" if i.lora_dora else ""
    return (
        Text(
            f"{i.num_gpus} x {i.hardware().name}, {p.layout()}, {mode} {i.precision}, micro-batch "
            f"{i.micro_batch} x {i.seq_len} tokens x {i.num_microbatches} accum, recompute {i.recompute}: "
        )
        + verdict
        + Text(f" — {p.tokens_per_s:,.0f} tokens/s, MFU {p.mfu:.1%}, step {p.step_s * 1e3:.0f} ms")
    )


def render_terminal(result: Plan | list[Plan], console: Console | None = None) -> None:
    """Print one plan (memory and time tables, stacked bar, advice) or a ranked search table."""
    console = console or Console()
    if isinstance(result, list):
        console.print(search_table(result))
        for n, p in enumerate(result, 1):
            console.print(Text(f"{n}. {p.reason}"))
        return
    console.print(_summary(result))
    console.print(unicode_bar(memory_rows(result), result.memory.capacity_bytes))
    console.print(_memory_table(result))
    console.print(_time_table(result))
    for line in result.advice:
        console.print(Text(f"• {line}"))


def search_table(rows: list[Plan]) -> Table:
    t = Table(title=Text("Layouts that fit, fastest first", style="bold"), title_justify="left")
    for col in ("#", "layout", "recompute", "mb x accum", "offload", "peak GiB", "tokens/s", "MFU"):
        t.add_column(col, justify="right" if col in ("#", "peak GiB", "tokens/s", "MFU") else "left")
    for n, p in enumerate(rows, 1):
        i = p.input
        off = (
            ",".join(
                x for x in ("opt" if i.optimizer_offload else "", "act" if i.activation_offload != "none" else "") if x
            )
            or "-"
        )
        t.add_row(
            str(n),
            p.layout(),
            i.recompute,
            f"{i.micro_batch} x {i.num_microbatches}",
            off,
            f"{p.peak_gib:.1f}",
            f"{p.tokens_per_s:,.0f}",
            f"{p.mfu:.1%}",
        )
    if not rows:
        t.add_row("-", "nothing fits", "", "", "", "", "", "")
    return t


def _finite(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _finite(dataclasses.asdict(value))
    return value


def render_json(result: Plan | list[Plan]) -> dict[str, Any]:
    """JSON-serialisable data: one plan, or the ranked rows of a search."""
    if isinstance(result, list):
        return {
            "kind": "tracetrain.plan_search",
            "version": JSON_VERSION,
            "rows": [_finite(p.to_dict()) for p in result],
        }
    return {"kind": "tracetrain.plan", "version": JSON_VERSION, **_finite(result.to_dict())}
