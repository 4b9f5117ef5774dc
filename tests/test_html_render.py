"""Reports open in a real browser: headless Chromium renders them with no console errors."""

import shutil
import subprocess
from pathlib import Path

import pytest

TRACES = Path(__file__).parent / "data" / "traces"


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    pytest.skip("headless Chromium is not installed (Debian package 'chromium'; .ci/run installs it)")


def render_in_browser(html_file: Path, tmp_path: Path) -> tuple[str, str]:
    """(DOM after scripts ran, browser log). Flags keep Chromium off the network and quiet."""
    cmd = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
           "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic",
           f"--user-data-dir={tmp_path / 'profile'}", "--enable-logging=stderr", "--v=0",
           "--virtual-time-budget=2000", "--dump-dom", html_file.as_uri()]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout, proc.stderr


def console_errors(log: str) -> list[str]:
    return [line for line in log.splitlines() if "CONSOLE" in line and ("Uncaught" in line or "Error" in line)]


def test_analyzer_report_renders_without_console_errors(tmp_path):
    from tracetrain.profile.analyze import analyze, render_html
    page = tmp_path / "report.html"
    page.write_text(render_html(analyze([str(TRACES / "real_h200.json.gz")])))
    dom, log = render_in_browser(page, tmp_path)
    assert not console_errors(log), console_errors(log)
    assert "<svg" in dom and "</html>" in dom


def test_console_error_detection_can_fail(tmp_path):
    page = tmp_path / "broken.html"
    page.write_text("<html><body><script>undefinedFunction();</script></body></html>")
    _, log = render_in_browser(page, tmp_path)
    assert console_errors(log), "a page that throws must be caught"


def test_planner_page_renders_and_its_sliders_run(tmp_path):
    from tracetrain.config import load_config
    from tracetrain.plan import plan, plan_input_from_config, render_html
    cfg = load_config(None, ["--model.preset=llama3.2-1b", "--data.seq_len=2048", "--train.micro_batch_size=4"])
    page = tmp_path / "plan.html"
    page.write_text(render_html(plan(plan_input_from_config(cfg, 1, "h100-sxm"))))
    dom, log = render_in_browser(page, tmp_path)
    assert not console_errors(log), console_errors(log)
    # The what-if bar and text start empty in the page; only the script fills them.
    import re
    live_text = re.search(r'<p id="live-text">([^<]*)</p>', dom)
    assert live_text and re.match(r"(fits|does not fit): [\d.]+ GiB of [\d.]+ GiB", live_text.group(1)), live_text
    assert re.search(r'<div id="live-bar"><svg', dom)
