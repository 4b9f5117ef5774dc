"""The training report page (train/run_report.py): kept current while the run goes, drawn from the run's
own records, self-contained, overlaying several runs with `tracetrain report`, and clean in Chromium."""

import html
import json
import math
import re
import shutil

import pytest
from conftest import cli_here
from helpers import console_errors, render_in_browser, run_cli

ARGS = [
    "--data.synthetic_examples=400",
    "--data.seq_len=64",
    "--logging.log_interval=5",
    "--train.eval_interval=10",
    "--train.eval_generate=0",
    "--logging.progress=false",
    "--optim.warmup_steps=3",
]


def _charts(page: str) -> dict[str, list[int]]:
    """{chart title: [number of points of each polyline]} from the page's SVG (the linear drawings)."""
    out = {}
    for title, svg in re.findall(r'<svg class="chart lin"[^>]* aria-label="([^"]+)"[^>]*>(.*?)</svg>', page):
        out[title] = [len(p.split()) for p in re.findall(r'<polyline points="([^"]*)"', svg)]
    return out


def test_the_page_follows_the_run_and_shows_its_records(tmp_path):
    from tracetrain import train

    seen = {}

    class Peek:
        def on_step(self, step, metrics):
            seen[step] = _charts((tmp_path / "r" / "report.html").read_text())

    train(
        None, overrides=[*ARGS, "--train.steps=20", f"--train.output_dir={tmp_path}"], run_name="r", callbacks=[Peek()]
    )
    # Refreshed at each log interval: at step 5 the loss chart holds 5 steps, at step 15 it holds 15.
    assert seen[5]["Loss"][0] == 5 and seen[15]["Loss"][0] == 15
    page = (tmp_path / "r" / "report.html").read_text()
    charts = _charts(page)
    lines = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    train_lines = [r for r in lines if r["kind"] == "train"]
    evals = [r for r in lines if r["kind"] == "eval"]
    assert charts["Loss"] == [len(train_lines), len(evals)]  # train loss, held-out loss (10 and the final 20)
    assert len(evals) == 2
    for title in (
        "Loss against tokens",
        "Learning rate",
        "Throughput",
        "Peak memory",
        "Waiting for data",
        "Gradient norm (dashed: skipped steps)",
    ):
        assert charts[title][0] == len(train_lines), title
    assert "Model FLOPs utilisation" not in charts  # no MFU on the CPU: no empty chart either
    # The last train loss and the final held-out loss are on the cards, as logged.
    assert f"{train_lines[-1]['loss']:.4f}" in page and f"{evals[-1]['eval_loss']:.4f}" in page
    # Self-contained: no script, nothing fetched.
    assert "<script" not in page and not re.search(r'(src|href)="https?:', page)
    assert "examples_read" in page and "optim.lr" in page  # data statistics and the config


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two finished runs, a (10 steps, 1 eval) and b (15 steps, 2 evals), trained in this process (the real
    `train` command runs end to end in test_train.py); tests copy them before writing next to them."""
    out = tmp_path_factory.mktemp("runs")
    cli_here("train", *ARGS, "--train.steps=10", f"--train.output_dir={out}", "--train.run_name=a")
    cli_here("train", *ARGS, "--train.steps=15", "--optim.lr=1e-3", f"--train.output_dir={out}", "--train.run_name=b")
    return out


def test_report_overlays_runs_and_never_replaces_an_unnamed_file(runs, tmp_path):
    for name in ("a", "b"):
        shutil.copytree(runs / name, tmp_path / name)
    (tmp_path / "b" / "profile").mkdir()
    (tmp_path / "b" / "profile" / "report.html").write_text("<html></html>")
    proc = run_cli("report", "a", "b", cwd=tmp_path)  # the real command once; the rest in this process
    page = (tmp_path / "report-a-vs-b.html").read_text()
    assert "wrote report-a-vs-b.html" in proc.stdout
    assert _charts(page)["Loss"] == [10, 1, 15, 2]  # run a: 10 steps, 1 eval; run b: 15 steps, 2 evals
    assert 'href="b/profile/report.html"' in page  # the profile report of the run that has one
    proc = cli_here("report", "a", "b", cwd=tmp_path, check=False)
    assert proc.returncode == 2 and proc.stderr.strip() == (
        "error: report-a-vs-b.html exists; choose the page's path with --out"
    )
    cli_here("report", "a", "b", "--out", "both.html", cwd=tmp_path)
    assert (tmp_path / "both.html").read_text() == page
    proc = cli_here("report", str(tmp_path / "nope"), check=False)
    assert proc.returncode == 2 and "nope: not a run directory (no metrics.jsonl)" in proc.stderr


def test_report_page_renders_in_chromium(runs, tmp_path):
    dom, log = render_in_browser(runs / "a" / "report.html", tmp_path)
    assert not console_errors(log), console_errors(log)
    # 7 charts; the two loss charts also drawn on a log scale, hidden until their switch is ticked
    assert dom.count('<svg class="chart lin"') == 7 and dom.count('<svg class="chart log"') == 2
    assert "<polyline" in dom


# Added to a copy of the page (the page itself has no script): what Chromium shows of the "Loss" chart before
# and after a click on its log-scale switch, written into the DOM for --dump-dom.
PROBE = """<script>
const shown = () => [...document.querySelectorAll('svg[aria-label="Loss"]')]
  .filter(s => s.getBoundingClientRect().height > 0)
  .map(s => ({scale: s.dataset.scale, points: s.querySelector("polyline").getAttribute("points"),
              ticks: [...s.querySelectorAll(".ytick")].map(t => t.textContent)}));
const before = shown();
document.querySelector('label[for="log-loss"]').click();
const after = shown();
document.body.setAttribute("data-probe", JSON.stringify({before, after}));
</script>"""


def test_log_scale_switch_redraws_the_loss_in_chromium(runs, tmp_path):
    page = (runs / "b" / "report.html").read_text()
    assert "<script" not in page  # the switch is CSS: the page stays script-free
    probe = tmp_path / "probe.html"
    probe.write_text(page.replace("</body>", PROBE + "</body>"))
    dom, log = render_in_browser(probe, tmp_path)
    assert not console_errors(log), console_errors(log)
    found = re.search(r'data-probe="([^"]*)"', dom)
    assert found, "the probe did not run"
    seen = json.loads(html.unescape(found.group(1)))
    (before,), (after,) = seen["before"], seen["after"]  # one drawing visible at a time
    assert (before["scale"], after["scale"]) == ("lin", "log")
    xs = lambda d: [p.split(",")[0] for p in d["points"].split()]  # noqa: E731
    ys = lambda d: [float(p.split(",")[1]) for p in d["points"].split()]  # noqa: E731
    assert xs(before) == xs(after) and ys(before) != ys(after)  # same steps, new heights
    losses = [json.loads(r)["loss"] for r in (runs / "b" / "metrics.jsonl").read_text().splitlines() if '"loss"' in r]
    # On the log drawing, heights follow log(loss): the highest and lowest loss sit at the plot's top and
    # bottom margins, and a point's relative height is its log-loss's relative position.
    lo, hi = min(losses), max(losses)
    y = ys(after)
    rel = [(math.log(v) - math.log(lo)) / (math.log(hi) - math.log(lo)) for v in losses]
    top, bottom = min(y), max(y)
    for r, py in zip(rel, y):
        assert abs((bottom - py) / (bottom - top) - r) < 0.02
    assert after["ticks"] and all(float(t) > 0 for t in after["ticks"])  # a log axis has no 0


def test_report_can_be_turned_off(tmp_path):
    cli_here(
        "train",
        *ARGS,
        "--train.steps=5",
        "--logging.report=false",
        f"--train.output_dir={tmp_path}",
        "--train.run_name=off",
    )
    assert not (tmp_path / "off" / "report.html").exists()


@pytest.mark.parametrize("torn", [True, False])
def test_a_torn_last_line_is_skipped_and_a_bad_middle_line_named(tmp_path, torn):
    from tracetrain.errors import TracetrainError
    from tracetrain.train.run_report import RunData

    run = tmp_path / "x"
    run.mkdir()
    good = json.dumps({"kind": "train", "step": 1, "time": 1.0, "loss": 2.0})
    text = good + "\n" + '{"kind": "tr' if torn else '{"kind": "tr\n' + good
    (run / "metrics.jsonl").write_text(text)
    if torn:
        assert len(RunData.load(run).train) == 1
    else:
        with pytest.raises(TracetrainError, match=r"metrics.jsonl:1: not a JSON line"):
            RunData.load(run)
