"""Rendering: terminal, JSON, and the self-contained HTML page whose inline script must compute the
same memory as Python (checked under node when it is installed)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest
from rich.console import Console

from tracetrain.models.presets import get_preset
from tracetrain.plan import PlanInput, plan, render_html, render_json, render_terminal, search
from tracetrain.plan.html import JS_MODEL, slider_model
from tracetrain.plan.memory import plan_memory

BASE = PlanInput(model=get_preset("llama3.2-1b"), micro_batch=4, seq_len=2048, gpu="h200")


def test_html_is_self_contained_and_escaped() -> None:
    p = plan(BASE)
    p.reason = '<script>alert("x")</script>'
    page = render_html([p])
    assert page.startswith("<!doctype html>") and "<svg" in page
    assert "http://" not in page and "https://" not in page and "src=" not in page
    assert '<script>alert("x")</script>' not in page and "&lt;script&gt;" in page
    embedded = re.search(r'<script type="application/json" id="plan-model">(.*?)</script>', page, re.S)
    assert embedded and json.loads(embedded.group(1).replace("<\\/", "</"))["tables"]


def test_terminal_and_json_render() -> None:
    p = plan(BASE)
    console = Console(record=True, width=120)
    render_terminal(p, console)
    text = console.export_text()
    assert "Memory per GPU at backward start" in text and "Step time per GPU" in text and "█" in text
    data = json.loads(json.dumps(render_json(p)))
    assert data["kind"] == "tracetrain.plan" and data["memory"]["peak_bytes"] == p.memory.peak_bytes
    rows = search(BASE.replace(grad_accum=2), gpus=2, top=3)
    assert json.loads(json.dumps(render_json(rows)))["rows"][0]["reason"]


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed: the page's script is not checked")
def test_page_script_parses(tmp_path) -> None:  # type: ignore[no-untyped-def]
    page = render_html(plan(BASE))
    code = re.findall(r"<script>(.*?)</script>", page, re.S)
    assert len(code) == 1
    (tmp_path / "page.js").write_text(code[0])
    subprocess.run(["node", "--check", str(tmp_path / "page.js")], check=True, timeout=60)


POINTS = [  # (tp, recompute, offload, micro_batch, seq)
    (1, "none", "none", 4, 2048), (1, "selective", "none", 8, 1024), (2, "full", "streamed", 2, 4096),
    (4, "none", "streamed", 1, 8192), (8, "selective", "none", 16, 512)]


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed: the page's script is not run")
@pytest.mark.parametrize("base", [BASE, BASE.replace(precision="fp32", micro_batch=1, seq_len=1024),
                                  PlanInput(model=get_preset("llama2-7b"), mode="lora", num_gpus=8, dp_shard=8,
                                            micro_batch=2, seq_len=2048, gpu="h100")],
                         ids=["1b-bf16", "1b-fp32-math-attention", "7b-lora-fsdp8"])
def test_page_script_matches_python(base: PlanInput) -> None:
    model = slider_model(plan(base))
    calls = json.dumps([[tp, rc, off, mb, seq] for tp, rc, off, mb, seq in POINTS])
    script = (JS_MODEL + f"\nconst model = {json.dumps(model)};\n"
              f"console.log(JSON.stringify({calls}.map(a => evalMemory(model, String(a[0]), a[1], a[2], a[3], a[4]))));")
    out = subprocess.run(["node", "-e", script], capture_output=True, text=True, check=True, timeout=60)
    results = json.loads(out.stdout)
    for (tp, rc, off, mb, seq), js in zip(POINTS, results):
        layout = {"tp": tp, "num_gpus": tp} if base.num_gpus == 1 else {"tp": tp, "dp_shard": base.num_gpus // tp}
        py = plan_memory(base.replace(recompute=rc, activation_offload=off, micro_batch=mb, seq_len=seq, **layout))
        assert js["phase"] == py.peak_phase
        assert js["peak"] == pytest.approx(py.peak_bytes, rel=1e-9)
        assert js["required"] == pytest.approx(py.required_bytes, rel=1e-9)
        assert js["fits"] == py.fits
