"""One self-contained HTML page for a plan (or a search): inline CSS, inline SVG, a small inline script,
no network. Every string is escaped; the embedded JSON cannot close its <script> element.

The interactive section recomputes the memory bars when micro-batch, sequence length, tensor
parallelism, recomputation or activation offload change. It does not port the formulas a second
time: `slider_model` exports, for every (tp, recompute, offload) choice, the memory model's items as
affine coefficients (bytes = const + per_token x tokens, which memory.py guarantees) and which items
each phase holds. The script only evaluates them, takes the largest phase, and adds fragmentation and
context exactly as `plan_memory` does; tests/plan/test_plan_html.py runs it under node against Python.
"""

from __future__ import annotations

import html
import json
from typing import Any

from tracetrain.plan import memory as mem
from tracetrain.plan.core import Plan
from tracetrain.plan.memory import GIB
from tracetrain.plan.report import COLORS, memory_rows

WIDTH, BAR_H = 760, 26
RECOMPUTE = ("none", "selective", "full")
OFFLOAD = ("none", "streamed")


def esc(text: object) -> str:
    return html.escape(str(text), quote=True)


def _tp_choices(p: Plan) -> list[tuple[int, dict[str, int]]]:
    """TP degrees for the slider with the layout each implies: the GPU count stays fixed when the
    data-parallel shards can give way, otherwise (single GPU) each TP degree adds GPUs."""
    i = p.input
    out = []
    for tp in (1, 2, 4, 8):
        if i.model.n_heads % tp or i.model.n_kv_heads % tp:
            continue
        rest = i.num_gpus // (i.pp * i.cp * i.dp_replicate)
        if i.num_gpus > 1:
            if rest % tp:
                continue
            out.append((tp, {"tp": tp, "dp_shard": rest // tp, "num_gpus": i.num_gpus}))
        else:
            out.append((tp, {"tp": tp, "num_gpus": tp * i.pp * i.cp * i.dp_replicate * i.dp_shard}))
    return out


def slider_model(p: Plan) -> dict[str, Any]:
    """Affine memory coefficients of `p.input` for every slider choice of tp x recompute x offload."""
    i = p.input
    tables: dict[str, Any] = {}
    for tp, layout in _tp_choices(p):
        for rc in RECOMPUTE:
            for off in OFFLOAD:
                inp = i.replace(recompute=rc, activation_offload=off, **layout)
                tokens = mem.tokens_per_microbatch(inp)
                model = mem.memory_model(inp, tokens, inp.seq_len)
                tables[f"{tp}|{rc}|{off}"] = {
                    "items": {n: [a.const, a.per_token, a.per_token_seq] for n, a in model.items.items()},
                    "phases": model.phases,
                }
    return {
        "capacity": i.hardware().memory_bytes,
        "fragmentation": mem.FRAGMENTATION[i.expandable_segments],
        "context": mem.CUDA_CONTEXT_BYTES,
        "display": mem.DISPLAY,
        "colors": COLORS,
        "tables": tables,
        "start": {
            "mb": i.micro_batch,
            "seq": i.seq_len,
            "tp": i.tp,
            "recompute": i.recompute,
            "offload": i.activation_offload if i.activation_offload in OFFLOAD else "none",
        },
    }


# Evaluates the exported coefficients (the same arithmetic as memory.plan_memory). Pure: node tests it.
JS_MODEL = r"""
function evalMemory(model, tp, recompute, offload, mb, seq) {
  const t = model.tables[tp + "|" + recompute + "|" + offload];
  if (!t) return null;
  const tokens = mb * seq;
  const at = (name) => t.items[name][0] + tokens * (t.items[name][1] + t.items[name][2] * seq);
  let best = null, bestBytes = -1;
  for (const [phase, names] of Object.entries(t.phases)) {
    const bytes = names.reduce((s, n) => s + at(n), 0);
    if (bytes > bestBytes) { best = phase; bestBytes = bytes; }
  }
  const rows = {};
  for (const n of t.phases[best]) {
    const key = model.display[n] || n;
    rows[key] = (rows[key] || 0) + at(n);
  }
  const list = Object.entries(rows).filter(([k, v]) => v > 0);
  const frag = model.fragmentation * bestBytes;
  list.push(["fragmentation", frag], ["CUDA context", model.context]);
  const required = bestBytes + frag + model.context;
  return {phase: best, peak: bestBytes, required: required, rows: list, fits: required <= model.capacity};
}
"""

JS_UI = r"""
function gib(b) { return (b / 1073741824).toFixed(1) + " GiB"; }
const ENTITIES = {"&": "&amp;", "<": "&lt;", ">": "&gt;", "\"": "&quot;", "'": "&#39;"};
function escapeText(s) { return String(s).replace(/[&<>"']/g, c => ENTITIES[c]); }
function barSvg(model, res) {
  const W = 760, H = 26, total = Math.max(model.capacity, res.required);
  let x = 0, out = "";
  for (const [name, bytes] of res.rows) {
    const w = bytes / total * W;
    out += '<rect x="' + x.toFixed(1) + '" y="0" width="' + w.toFixed(1) + '" height="' + H + '" fill="' +
           (model.colors[name] || "#999") + '"><title>' + escapeText(name + ": " + gib(bytes)) + '</title></rect>';
    x += w;
  }
  const cap = model.capacity / total * W;
  out += '<line x1="' + cap.toFixed(1) + '" x2="' + cap.toFixed(1) + '" y1="0" y2="' + H +
         '" stroke="#000" stroke-width="2"/>';
  return '<svg viewBox="0 0 ' + W + ' ' + H + '" width="' + W + '" height="' + H + '" role="img">' + out + '</svg>';
}
function update() {
  const model = JSON.parse(document.getElementById("plan-model").textContent);
  const get = (id) => document.getElementById(id);
  const mb = 2 ** Number(get("s-mb").value), seq = 256 * 2 ** Number(get("s-seq").value);
  const tps = Object.keys(model.tables).map(k => k.split("|")[0]).filter((v, i, a) => a.indexOf(v) === i);
  const tp = tps[Number(get("s-tp").value)];
  const rc = ["none", "selective", "full"][Number(get("s-rc").value)];
  const off = get("s-off").checked ? "streamed" : "none";
  get("v-mb").textContent = mb; get("v-seq").textContent = seq; get("v-tp").textContent = tp;
  get("v-rc").textContent = rc;
  const res = evalMemory(model, tp, rc, off, mb, seq);
  get("live-bar").innerHTML = barSvg(model, res);
  get("live-text").textContent = (res.fits ? "fits: " : "does not fit: ") + gib(res.required) + " of " +
    gib(model.capacity) + " (peak at " + res.phase + ")";
}
document.addEventListener("DOMContentLoaded", () => {
  const model = JSON.parse(document.getElementById("plan-model").textContent);
  const tps = Object.keys(model.tables).map(k => k.split("|")[0]).filter((v, i, a) => a.indexOf(v) === i);
  const s = model.start, set = (id, v) => { document.getElementById(id).value = v; };
  document.getElementById("s-tp").max = tps.length - 1;
  set("s-mb", Math.round(Math.log2(s.mb))); set("s-seq", Math.max(0, Math.round(Math.log2(s.seq / 256))));
  set("s-tp", Math.max(0, tps.indexOf(String(s.tp)))); set("s-rc", ["none", "selective", "full"].indexOf(s.recompute));
  document.getElementById("s-off").checked = s.offload === "streamed";
  for (const el of document.querySelectorAll("#sliders input")) el.addEventListener("input", update);
  update();
});
"""

_CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:24px auto;max-width:1000px;color:#222;padding:0 12px}
h1{font-size:22px}h2{font-size:17px;margin-top:28px;border-bottom:1px solid #ddd}
table{border-collapse:collapse;margin:8px 0 16px;font-size:13px}
th,td{border-bottom:1px solid #eee;padding:3px 8px;text-align:left}td.n{text-align:right}
.legend span{margin-right:12px;white-space:nowrap}.legend i{display:inline-block;width:11px;height:11px;margin-right:4px}
#sliders label{display:block;margin:4px 0}#sliders input[type=range]{width:260px;vertical-align:middle}
.bad{color:#b00020;font-weight:600}.good{color:#2a7d2a;font-weight:600}
"""


def memory_svg(p: Plan) -> str:
    """The stacked memory bar of one GPU (required bytes), with the device capacity marked."""
    rows = memory_rows(p)
    total = max(p.memory.capacity_bytes, p.memory.required_bytes)
    x, parts = 0.0, []
    for name, value in rows:
        w = value / total * WIDTH
        parts.append(
            f'<rect x="{x:.1f}" y="0" width="{w:.1f}" height="{BAR_H}" fill="{COLORS.get(name, "#999")}">'
            f"<title>{esc(name)}: {value / GIB:.2f} GiB</title></rect>"
        )
        x += w
    cap = p.memory.capacity_bytes / total * WIDTH
    parts.append(f'<line x1="{cap:.1f}" x2="{cap:.1f}" y1="0" y2="{BAR_H}" stroke="#000" stroke-width="2"/>')
    legend = "".join(
        f'<span><i style="background:{COLORS.get(n, "#999")}"></i>{esc(n)} {v / GIB:.1f} GiB</span>' for n, v in rows
    )
    return (
        f'<svg viewBox="0 0 {WIDTH} {BAR_H}" width="{WIDTH}" height="{BAR_H}" role="img" '
        f'aria-label="memory per GPU">{"".join(parts)}</svg><div class="legend">{legend}</div>'
    )


def time_svg(p: Plan) -> str:
    rows = sorted(p.time.breakdown.items(), key=lambda kv: -kv[1])
    top = max((v for _, v in rows), default=1.0) or 1.0
    parts = []
    for n, (name, value) in enumerate(rows):
        y, w = n * 22, value / top * (WIDTH - 400)  # leave room for the longest label
        parts.append(
            f'<text x="0" y="{y + 14}" font-size="12">{esc(name)}</text>'
            f'<rect x="240" y="{y + 3}" width="{w:.1f}" height="16" fill="#4e79a7"/>'
            f'<text x="{245 + w:.1f}" y="{y + 15}" font-size="12">{value * 1e3:.1f} ms '
            f"({value / p.step_s:.0%})</text>"
        )
    return (
        f'<svg viewBox="0 0 {WIDTH} {len(rows) * 22}" width="{WIDTH}" height="{len(rows) * 22}" role="img" '
        f'aria-label="step time">{"".join(parts)}</svg>'
    )


def _sliders(p: Plan) -> str:
    model = json.dumps(slider_model(p)).replace("</", "<\\/")
    return (
        "<h2>What if</h2><p>Memory bars recomputed from the same model for other settings "
        "(with one GPU, each TP degree adds GPUs; otherwise the data-parallel shards give way).</p>"
        '<div id="sliders">'
        '<label>micro-batch <input id="s-mb" type="range" min="0" max="6" step="1"> <b id="v-mb"></b></label>'
        '<label>sequence length <input id="s-seq" type="range" min="0" max="8" step="1"> <b id="v-seq"></b></label>'
        '<label>tensor parallel <input id="s-tp" type="range" min="0" max="3" step="1"> <b id="v-tp"></b></label>'
        '<label>recompute <input id="s-rc" type="range" min="0" max="2" step="1"> <b id="v-rc"></b></label>'
        '<label><input id="s-off" type="checkbox"> stream activations to the host</label></div>'
        '<div id="live-bar"></div><p id="live-text"></p>'
        f'<script type="application/json" id="plan-model">{model}</script>'
        f"<script>{JS_MODEL}{JS_UI}</script>"
    )


def _table(headers: list[str], rows: list[list[str]], numeric: set[int]) -> str:
    head = "".join(f"<th>{esc(h)}</th>" for h in headers)
    body = "".join(
        "<tr>" + "".join(f"<td{' class=n' if j in numeric else ''}>{esc(c)}</td>" for j, c in enumerate(r)) + "</tr>"
        for r in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


def _plan_body(p: Plan) -> str:
    i, m = p.input, p.memory
    verdict = '<span class="good">fits</span>' if p.fits else '<span class="bad">does not fit</span>'
    head = (
        f"<p>{i.num_gpus} x {esc(i.hardware().name)}, {esc(p.layout())}, {esc(i.mode)} {esc(i.precision)}, "
        f"micro-batch {i.micro_batch} x {i.seq_len} tokens x {i.num_microbatches}, recompute {esc(i.recompute)}: "
        f"{verdict} — {p.tokens_per_s:,.0f} tokens/s, MFU {p.mfu:.1%}</p>"
    )
    mem_rows = [[n, f"{v / GIB:.2f}"] for n, v in memory_rows(p)]
    mem_rows += [["required", f"{m.required_bytes / GIB:.2f}"], ["device", f"{m.capacity_bytes / GIB:.2f}"]]
    mem_rows += [[f"host: {n}", f"{v / GIB:.2f}"] for n, v in m.cpu_bytes.items()]
    time_rows = [[n, f"{v * 1e3:.1f}"] for n, v in sorted(p.time.breakdown.items(), key=lambda kv: -kv[1])]
    advice = "".join(f"<li>{esc(a)}</li>" for a in p.advice)
    return (
        head
        + f"<h2>Memory per GPU (peak at {esc(m.peak_phase)})</h2>"
        + memory_svg(p)
        + _table(["item", "GiB"], mem_rows, {1})
        + "<h2>Step time per GPU</h2>"
        + time_svg(p)
        + _table(["kind", "ms"], time_rows, {1})
        + f"<h2>Advice</h2><ul>{advice}</ul>"
        + _sliders(p)
    )


def render_html(result: Plan | list[Plan]) -> str:
    """A self-contained page for one plan, or for search rows (ranked table + the best row's detail)."""
    if isinstance(result, list):
        rows = [
            [
                str(n),
                p.layout(),
                p.input.recompute,
                f"{p.input.micro_batch} x {p.input.num_microbatches}",
                f"{p.peak_gib:.1f}",
                f"{p.tokens_per_s:,.0f}",
                f"{p.mfu:.1%}",
                p.reason,
            ]
            for n, p in enumerate(result, 1)
        ]
        body = "<h1>tracetrain plan: layouts that fit</h1>" + _table(
            ["#", "layout", "recompute", "mb x accum", "peak GiB", "tokens/s", "MFU", "why"], rows, {0, 4, 5, 6}
        )
        if result:
            body += "<h1>Best row</h1>" + _plan_body(result[0])
    else:
        body = "<h1>tracetrain plan</h1>" + _plan_body(result)
    return (
        f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>tracetrain plan</title>'
        f"<style>{_CSS}</style></head><body>{body}</body></html>"
    )
