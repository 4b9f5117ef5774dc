"""End-to-end CLI runs beyond `train`: profile, eval, generate, export; fp16; TensorBoard."""

import importlib.util
import json

import pytest
import torch
from conftest import cli_here
from helpers import SMALL, _rows, _run, read_metrics, run_cli

from tracetrain.train.assemble import run_step_context
from tracetrain.train.step import train_step

HAVE_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs")
    # In this process: the real `train` command runs end to end in test_train.py.
    cli_here(
        "train",
        *SMALL,
        "--train.steps=40",
        f"--train.output_dir={out}",
        "--train.run_name=base",
        f"--logging.tensorboard={str(HAVE_TENSORBOARD).lower()}",
    )
    return out / "base"


@pytest.mark.skipif(
    not HAVE_TENSORBOARD, reason="tensorboard is an optional extra: pip install 'tracetrain[tensorboard]'"
)
def test_tensorboard_events_hold_the_logged_losses(trained):
    """TensorBoard's own reader finds every train loss of metrics.jsonl at its step (train/tracking.py)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert len(list((trained / "tensorboard").glob("events.out.tfevents.*"))) == 1
    events = EventAccumulator(str(trained / "tensorboard"))
    events.Reload()
    steps, _ = read_metrics(trained)
    logged = [(e.step, e.value) for e in events.Scalars("loss")]
    assert logged == [(r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in steps]


@pytest.mark.skipif(HAVE_TENSORBOARD, reason="tensorboard is installed: this checks a bare install without it")
def test_tensorboard_without_the_extra_is_one_line_naming_it(tmp_path):
    args = ("train", *SMALL, "--train.steps=8", f"--train.output_dir={tmp_path}", "--logging.tensorboard=true")
    proc = cli_here(*args, check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: logging.tensorboard = true needs the tensorboard package: pip install 'tracetrain[tensorboard]'"
    ), proc.stderr


def test_eval_reports_loss_and_exact_match(trained):
    proc = run_cli("eval", str(trained))
    result = json.loads(proc.stdout)
    summary = json.loads((trained / "summary.json").read_text())
    assert result["eval_loss"] == pytest.approx(summary["eval_loss"], rel=1e-6)
    assert 0.0 <= result["exact_match"] <= 1.0 and result["exact_match_n"] == 8


def test_generate_applies_template_and_is_deterministic(trained):
    # The first in a process of its own, the rest in this one: equal output across the two is part of
    # what "deterministic" means here.
    a = run_cli("generate", "--json", str(trained), "--prompt", "reverse: abc", "--max-new-tokens", "8").stdout
    b = cli_here("generate", "--json", str(trained), "--prompt", "reverse: abc", "--max-new-tokens", "8").stdout
    assert a == b and json.loads(a)["prompt"] == "reverse: abc"
    sampled = cli_here(
        "generate",
        "--json",
        str(trained),
        "--prompt",
        "upper: xyz",
        "--temperature",
        "1.0",
        "--top-p",
        "0.9",
        "--seed",
        "3",
    ).stdout
    assert "completion" in json.loads(sampled)
    # Without --json: the text itself; with several prompts, each under its prompt.
    text = cli_here("generate", str(trained), "--prompt", "reverse: abc", "--max-new-tokens", "8").stdout
    assert text == json.loads(a)["completion"] + "\n"
    two = cli_here(
        "generate", str(trained), "--prompt", "reverse: abc", "--prompt", "upper: q", "--max-new-tokens", "8"
    )
    assert two.stdout.startswith("### reverse: abc\n" + json.loads(a)["completion"] + "\n\n### upper: q\n")


def test_export_hf_loads_in_transformers(trained, tmp_path):
    transformers = pytest.importorskip("transformers")
    cli_here("export", str(trained), "--hf", str(tmp_path / "hf"))  # test_export.py runs it as a subprocess
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    from tracetrain.inference import load_trained

    ours = load_trained(trained, "cpu").model
    tokens = torch.randint(0, 259, (2, 30))
    with torch.no_grad():
        # --dtype auto writes the run's own fp32 weights (bf16 before): the logits agree to float rounding.
        assert (ours(tokens) - hf(tokens).logits.float()).abs().max().item() < 1e-4
    proc = cli_here("export", str(trained), "--peft", str(tmp_path / "peft"), check=False)
    assert proc.returncode == 2 and "full fine-tune" in proc.stderr


def test_profile_writes_trace_and_reports(tmp_path):
    from tracetrain.profile.step_timer import NUM_EACH_SIDE

    proc = run_cli(
        "profile",
        *SMALL,
        f"--train.output_dir={tmp_path}",
        "--train.run_name=p",
        "--profile.start_step=3",
        "--profile.num_steps=2",
    )
    prof = tmp_path / "p" / "profile"
    assert (prof / "rank0.json.gz").is_file() and (prof / "report.html").is_file()
    report = json.loads((prof / "report.json").read_text())
    steps, _ = read_metrics(tmp_path / "p")
    # The run stops a few unprofiled steps after the window: timed on both sides for the real step time.
    assert len(steps) == 4 + NUM_EACH_SIDE
    timing = json.loads((prof / "rank0.timing.json").read_text())
    assert len(timing["before_ms"]) == 1 and len(timing["after_ms"]) == NUM_EACH_SIDE  # step 1; 2 is warm-up
    assert timing["real_step_ms"] > 0
    assert report["ranks"][0]["overhead"]["method"] == "measured"
    assert "step time without the profiler" in proc.stdout
    assert "report html" in proc.stdout
    text = json.dumps(report)
    for phase in ("forward", "backward", "optimizer", "data_wait"):
        assert phase in text


def test_profiler_off_adds_nothing(tmp_path):
    from tracetrain.config import ProfileSection
    from tracetrain.profile.capture import ProfileCapture

    cap = ProfileCapture(ProfileSection(enabled=False), tmp_path, torch.device("cpu"))
    assert cap.profiler is None and cap.phase("forward") is cap.phase("backward")
    assert not (tmp_path / "profile").exists()


def test_fp16_overflow_is_skipped_and_scale_lowered():
    a = _run("--train.precision=fp16", "--train.grad_clip=1.0")
    model, opt = a.module, a.optimizer
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**30)  # overflows fp16 (max 65504)
    ctx = run_step_context(a, scaler=scaler)
    assert ctx.autocast_dtype == torch.float16
    before = [p.detach().clone() for p in model.parameters()]
    out = train_step(model, opt, [_rows(2)], ctx)
    assert not out.finite.item() and not out.diverged.item()  # an overflow is routine, not divergence
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert scaler.get_scale() < 2.0**30
    for _ in range(40):  # the scale comes down until steps apply
        out = train_step(model, opt, [_rows(2)], ctx)
        if out.finite.item():
            break
    assert out.finite.item()


def test_fp16_run_resumes_with_scaler_state(tmp_path):
    cli_here(
        "train",
        *SMALL,
        "--train.steps=6",
        "--train.precision=fp16",
        f"--train.output_dir={tmp_path}",
        "--train.run_name=h",
        "--train.eval_generate=0",
    )
    state = torch.load(tmp_path / "h" / "checkpoints" / "step_00000006" / "trainer_state.pt", weights_only=True)
    assert state["counters"]["scaler"]["scale"] > 0


def test_presets_print_exact_parameter_counts():
    # README: `tracetrain presets` lists "architectures and exact parameter counts"; billions with three
    # decimals made the 0.87M-parameter default model "0.001B".
    from tracetrain.models.accounting import num_params
    from tracetrain.models.presets import PRESETS

    lines = {line.split()[0]: line for line in cli_here("presets").stdout.splitlines()}
    assert set(lines) == set(PRESETS)
    for name, args in PRESETS.items():
        assert f" {num_params(args):,} " in lines[name], lines[name]
