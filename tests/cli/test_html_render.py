"""Reports open in a real browser: headless Chromium renders them with no console errors."""


from helpers import DATA, console_errors, render_in_browser

TRACES = DATA / "traces"


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
