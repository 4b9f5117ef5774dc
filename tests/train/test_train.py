"""The training step and loop: accumulation, NaN guard, schedule, and the real CLI end to end."""

import json
import math

import pytest
import torch
from conftest import cli_here
from helpers import SMALL, _rows, _run, read_metrics, run_cli

from tracetrain.config import OptimSection, load_config
from tracetrain.errors import TracetrainError
from tracetrain.train.assemble import Assembly, run_step_context, step_context
from tracetrain.train.metrics import MetricsLogger
from tracetrain.train.optim import lr_factor
from tracetrain.train.step import StepContext, train_step


def _model_and_opt(seed: int = 0, sgd: bool = False) -> tuple[torch.nn.Module, torch.optim.Optimizer, StepContext]:
    """The model, optimizer and the step's context of a run without weight decay and without clipping."""
    a = _run(f"--train.seed={seed}", "--optim.weight_decay=0.0")
    assert a.optimizer is not None
    if sgd:  # update = gradient: parameters after one step compare the gradients themselves
        opt: torch.optim.Optimizer = torch.optim.SGD(a.module.parameters(), lr=1.0)
        return a.module, opt, step_context(a.spec, optimizer=opt)
    return a.module, a.optimizer, run_step_context(a)


def test_accumulation_equals_one_large_batch():
    big = _rows(4)
    halves = [{k: v[:1] for k, v in big.items()}, {k: v[1:] for k, v in big.items()}]
    m1, o1, ctx = _model_and_opt(sgd=True)
    m2, o2, _ = _model_and_opt(sgd=True)
    out1 = train_step(m1, o1, [big], ctx)
    out2 = train_step(m2, o2, halves, ctx)
    assert out1.loss.item() == pytest.approx(out2.loss.item(), rel=1e-6)
    assert out1.grad_norm.item() == pytest.approx(out2.grad_norm.item(), rel=1e-5)
    for p1, p2 in zip(m1.parameters(), m2.parameters()):
        assert torch.allclose(p1, p2, atol=1e-6, rtol=0)
    # And the check can fail: naive per-micro-batch means give a different gradient.
    m3, _, _ = _model_and_opt()
    from tracetrain.train.step import loss_sum

    for mb in halves:
        (loss_sum(m3, mb, ctx) / (mb["labels"] != -100).sum() / 2).backward()
    naive = torch.nn.utils.clip_grad_norm_(list(m3.parameters()), float("inf"))
    assert naive.item() != pytest.approx(out1.grad_norm.item(), rel=1e-3)


def test_non_finite_step_is_skipped_and_counted():
    model, opt, ctx = _model_and_opt()
    before = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        model.layers[0].mlp.up_proj.weight[0, 0] = float("nan")
    out = train_step(model, opt, [_rows(2)], ctx)
    assert not out.finite.item()
    changed = [not torch.equal(a, b) for a, b in zip(before, model.parameters())]
    assert sum(changed) == 1  # only the weight we poisoned differs; no update was applied


def _fused_run(grad_clip: float = 0.0) -> Assembly:
    """A run with the fused AdamW (the spec's `optimizer_fused`), clipping at `grad_clip` (0: none)."""
    a = _run("--optim.fused=on", f"--train.grad_clip={grad_clip}")
    assert a.spec.optimizer_fused and a.optimizer is not None and a.optimizer.defaults["fused"]
    return a


@pytest.mark.parametrize("max_norm", [0.05, 1e9])
def test_clip_folded_into_fused_adamw_equals_clip_then_step(max_norm):
    """The fused optimizer divides by the clip factor in its kernel (step.py `fold_clip`); the update
    must equal clip_grad_norm_ followed by the same fused AdamW step, clipped or not."""
    a1, a2 = _fused_run(max_norm), _fused_run()
    clip_ctx, ctx = run_step_context(a1), run_step_context(a2)
    assert clip_ctx.fused_skip and clip_ctx.grad_clip == max_norm
    m1, o1, m2, o2 = a1.module, a1.optimizer, a2.module, a2.optimizer
    batches = [_rows(2, seed=s) for s in range(3)]
    for batch in batches:
        out = train_step(m1, o1, [batch], clip_ctx)
        # The reference: the plain path (what optimizer_update does without the fused kernel).
        from tracetrain.train.step import loss_sum

        (loss_sum(m2, batch, ctx) / (batch["labels"] != -100).sum()).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(list(m2.parameters()), max_norm, foreach=True)
        o2.step()
        o2.zero_grad(set_to_none=True)
        assert out.grad_norm.item() == pytest.approx(ref_norm.item(), rel=1e-5)
    clipped = max_norm < out.grad_norm.item()
    assert clipped == (max_norm == 0.05)  # the small bound really clips
    for p1, p2 in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(p1, p2, atol=2e-6, rtol=1e-5)
    # And the check can fail: the unclipped update is far from the clipped one.
    if clipped:
        a3 = _fused_run()
        for batch in batches:
            train_step(a3.module, a3.optimizer, [batch], run_step_context(a3))
        m3 = a3.module
        assert max((a - b).abs().max().item() for a, b in zip(m1.parameters(), m3.parameters())) > 1e-4


def test_fused_skip_with_folded_clip_leaves_weights_untouched():
    a = _fused_run(grad_clip=1.0)
    model = a.module
    before = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        model.layers[0].mlp.up_proj.weight[0, 0] = float("nan")
    out = train_step(model, a.optimizer, [_rows(2)], run_step_context(a))
    assert not out.finite.item()
    changed = [not torch.equal(a, b) for a, b in zip(before, model.parameters())]
    assert sum(changed) == 1


def test_bad_streak_stops_with_clear_error(tmp_path):
    log = MetricsLogger(tmp_path, torch.device("cpu"), 1.0, None, max_bad_steps=3)
    nan, bad = torch.tensor(float("nan")), torch.tensor(False)
    for step in range(3):
        log.record(step, nan, nan, bad, ~bad, 1e-3, 10, 0.0)
    with pytest.raises(TracetrainError, match="NaN/inf for 3 steps in a row"):
        log.flush()


def test_lr_schedule_warmup_then_cosine_to_floor():
    cfg = OptimSection(lr=1.0, warmup_steps=10, min_lr_ratio=0.1, schedule="cosine")
    assert lr_factor(0, cfg, 100) == pytest.approx(0.1)
    assert lr_factor(9, cfg, 100) == pytest.approx(1.0)
    assert lr_factor(55, cfg, 100) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_factor(100, cfg, 100) == pytest.approx(0.1)
    lin = OptimSection(lr=1.0, warmup_steps=0, min_lr_ratio=0.0, schedule="linear")
    assert lr_factor(50, lin, 100) == pytest.approx(0.5)


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    """The real `tracetrain train` command, end to end in its own process: (run directory, its output, the
    wall-clock times just before it started and just after it ended). Two tests below read it."""
    import time

    out = tmp_path_factory.mktemp("small")
    start = time.time()
    proc = run_cli("train", *SMALL, f"--train.output_dir={out}", "--train.run_name=r1")
    return out / "r1", proc, start, time.time()


def test_cli_train_writes_a_complete_run_directory(small_run):
    run, proc, _, _ = small_run
    steps, evals = read_metrics(run)
    assert [r["step"] for r in steps] == list(range(1, 25))
    assert all(math.isfinite(r["loss"]) and r["tokens_per_s"] > 0 for r in steps)
    assert len(evals) == 1 and evals[0]["step"] == 12
    summary = json.loads((run / "summary.json").read_text())
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    final = [r for r in lines if r.get("final")]
    assert len(final) == 1 and final[0]["kind"] == "eval" and final[0]["step"] == 24
    assert final[0]["eval_loss"] == summary["eval_loss"] and final[0]["exact_match"] == summary["exact_match"]
    assert {"eval_loss", "eval_ppl", "exact_match", "tokens_per_s", "checkpoint"} <= set(summary)
    assert load_config(run / "config.toml").train.steps == 24
    assert (run / "checkpoints" / "step_00000024" / "model.safetensors").is_file()
    assert len((run / "samples.jsonl").read_text().splitlines()) == 8
    assert "held-out loss" in proc.stdout
    # The loss fell.
    assert steps[-1]["loss"] < steps[0]["loss"] - 0.5


def test_metrics_lines_carry_time_kind_and_each_steps_own_throughput(small_run):
    run, _, start, end = small_run
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert {r["kind"] for r in lines} == {"train", "eval"}
    assert all(start <= r["time"] <= end for r in lines)
    assert [r["time"] for r in lines] == sorted(r["time"] for r in lines)
    train = [r for r in lines if r["kind"] == "train"]
    for r in train:  # the step's own tokens over its own time
        assert abs(r["tokens_per_s"] - r["tokens"] / r["step_s"]) <= 1e-6 * r["tokens_per_s"]
    # Not the interval's figure copied onto each line of the interval (SMALL logs every 4 steps).
    assert len({r["tokens_per_s"] for r in train[:4]}) > 1
    summary = json.loads((run / "summary.json").read_text())
    warm = summary["throughput_warmup_steps"]
    assert warm == 2 and summary["throughput_steps"] == 22  # 10% of 24 steps are warm-up
    whole = sum(r["tokens"] for r in train[warm:]) / sum(r["step_s"] for r in train[warm:])
    assert abs(summary["tokens_per_s"] - whole) <= 1e-6 * whole


def test_cli_user_errors_are_one_line(tmp_path):
    proc = run_cli("train", "--optim.lr=-1", check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: config key 'optim.lr': -1.0 is out of range; it must be > 0"
    # The same path in this process (the subprocess above shows a real exit status and stderr).
    proc = cli_here("train", "--data.kind=instruction", f"--data.path={tmp_path / 'nope.jsonl'}", check=False)
    assert proc.returncode == 2 and "nope.jsonl" in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_parallel_layout_must_match_the_job():
    proc = cli_here("train", "--parallel.tp=2", check=False)
    assert proc.returncode == 2 and "parallel." in proc.stderr and "the job has 1 rank(s)" in proc.stderr
