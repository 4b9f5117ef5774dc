"""`train(cfg)`: build everything from the config, run the loop, leave a complete run directory.

RUN_DIR layout:
  config.toml      the fully resolved config
  data_stats.json  what the data pipeline read, skipped, truncated and packed
  metrics.jsonl    one line per step (loss, grad_norm, lr, tokens_per_s, mfu, step/data/compute s,
                   peak memory) and one per evaluation (eval_loss, eval_ppl)
  samples.jsonl    held-out prompts with the model's greedy answers (instruction / synthetic data)
  summary.json     final numbers: eval loss, exact match, throughput, MFU, peak memory
  checkpoints/     step_NNNNNNNN/ folders (see checkpoint.py)
  tensorboard/     event files when logging.tensorboard = true
"""

from __future__ import annotations

import json
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tracetrain.config import Config, to_toml
from tracetrain.data import build_datasets, build_loader, check_vocab, load_tokenizer
from tracetrain.devices import peak_flops
from tracetrain.models.accounting import training_flops_per_token
from tracetrain.models.build import build_model
from tracetrain.profile.capture import ProfileCapture
from tracetrain.train.checkpoint import TrainState, load_checkpoint, save_checkpoint
from tracetrain.train.console import Reporter
from tracetrain.train.evaluation import final_evaluation, run_eval
from tracetrain.train.metrics import MetricsLogger
from tracetrain.train.oom import configure_allocator, explain_oom, preflight
from tracetrain.train.optim import build_optimizer, build_scheduler
from tracetrain.train.resume import ResumePoint
from tracetrain.train.runtime import refuse_unimplemented, resolve_device, resolve_precision
from tracetrain.train.step import StepContext, train_step


@dataclass
class TrainResult:
    run_dir: Path
    summary: dict[str, Any]


class _StopFlag:
    """SIGINT/SIGTERM set a flag; the loop saves a checkpoint at the next step boundary and exits.
    A second signal falls back to the default behaviour (immediate stop)."""

    def __init__(self) -> None:
        self.signal: str | None = None
        self.previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        for s in self.previous:
            signal.signal(s, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        self.signal = signal.Signals(signum).name
        for s, handler in self.previous.items():
            signal.signal(s, handler)

    def restore(self) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)


def _count_lora(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def train(cfg: Config, run_dir: Path, *, resume: ResumePoint | None = None,
          reporter: Reporter | None = None) -> TrainResult:
    """Train as `cfg` says, writing into `run_dir` (created by the caller; see `prepare_run_dir`)."""
    reporter = reporter or Reporter(cfg.logging.progress)
    refuse_unimplemented(cfg)
    device = resolve_device(cfg.train.device)
    precision = resolve_precision(cfg.train.precision, device)
    configure_allocator(cfg.memory, device)
    autocast_dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    torch.manual_seed(cfg.train.seed)
    (run_dir / "config.toml").write_text(to_toml(cfg))

    tokenizer = load_tokenizer(cfg.data.tokenizer)
    with reporter.status("reading and packing data"):
        train_ds, eval_ds, stats = build_datasets(cfg.data, tokenizer)
    (run_dir / "data_stats.json").write_text(json.dumps(_as_dict(stats), indent=2))
    reporter.data_stats(stats)

    is_lora = cfg.train.mode == "lora"
    # LoRA checkpoints hold only the adapters when the frozen base can be reloaded from its source;
    # a randomly initialised base (benchmarks, tests) is saved whole.
    adapters_only = is_lora and bool(cfg.model.init_from)
    base_dtype = _lora_base_dtype(cfg, device) if is_lora else None
    with reporter.status(f"building model on {device}"):
        model = build_model(cfg, device, base_dtype=base_dtype)
    args = model.args
    check_vocab(tokenizer, args.vocab_size)
    optimizer = build_optimizer(model, cfg.optim, device, cfg.memory)
    scheduler = build_scheduler(optimizer, cfg.optim, cfg.train.steps)
    loader = build_loader(train_ds, cfg.train.micro_batch_size, cfg.data, shuffle=True, seed=cfg.data.seed)

    start_step, counters = 0, {"skipped_steps": 0}
    # fp16 needs dynamic loss scaling; bf16 has fp32's exponent range and does not.
    scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None
    if resume is not None:
        state = load_checkpoint(resume.checkpoint, model, optimizer, lora=adapters_only)
        scheduler.load_state_dict(state.scheduler)
        if scaler is not None and state.counters.get("scaler"):
            scaler.load_state_dict(state.counters["scaler"])
        loader.load_state_dict(state.loader)
        start_step, counters = state.step, state.counters
        resume.truncate_metrics(run_dir, start_step)
        reporter.note(f"resumed from {resume.checkpoint} at step {start_step}")

    if cfg.memory.unified_memory != "none":
        from tracetrain.memory.unified import apply_unified_memory
        target = model if cfg.memory.unified_memory == "model" else optimizer
        apply_unified_memory(target, cfg.memory.unified_memory, coherent_memory=cfg.memory.coherent_memory)
    flops = training_flops_per_token(args, cfg.data.seq_len, mode=cfg.train.mode,
                                     num_lora_params=_count_lora(model) if is_lora else 0)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = peak_flops(device_name, precision, cfg.logging.peak_tflops) if device.type == "cuda" else None
    if device.type == "cuda" and peak is None:
        reporter.note(f"MFU not reported: {device_name!r} is not in the device table; "
                      "set logging.peak_tflops to its dense peak")
    metrics = MetricsLogger(run_dir, device, flops.model, peak, cfg.train.max_bad_steps, cfg.logging.tensorboard)
    metrics.skipped_steps = counters.get("skipped_steps", 0)
    prof = ProfileCapture(cfg.profile, run_dir, device)
    from tracetrain.memory import apply_activation_offload
    offload = apply_activation_offload(model, cfg.memory.activation_offload)
    ctx = StepContext(device=device, autocast_dtype=autocast_dtype, grad_clip=cfg.train.grad_clip,
                      use_document_mask=cfg.data.pack, fused_skip=bool(optimizer.defaults.get("fused")),
                      scaler=scaler, phase=prof.phase, activation_offload=offload)
    reporter.model_summary(args, model, cfg, device_name, precision, flops.model)
    preflight(cfg, device, reporter.note)
    config_toml = to_toml(cfg)

    def checkpoint(step: int) -> Path:
        counters = {"skipped_steps": metrics.skipped_steps, "scaler": scaler.state_dict() if scaler else {}}
        state = TrainState(step=step, scheduler=scheduler.state_dict(), loader=loader.state_dict(),
                           counters=counters)
        with reporter.status(f"saving checkpoint at step {step}"), prof.phase("checkpoint"):
            return save_checkpoint(run_dir, model, optimizer, state, config_toml, lora=adapters_only,
                                   keep_last=cfg.checkpoint.keep_last)

    stop = _StopFlag()
    tokens_per_step = cfg.train.micro_batch_size * cfg.train.grad_accum_steps * cfg.data.seq_len
    step = start_step
    interrupted_at: Path | None = None
    model.train()
    try:
        try:
            with reporter.progress(cfg.train.steps, start_step) as bar:
                metrics.restart_window()
                for step in range(start_step, cfg.train.steps):
                    prof.step_begin(step)
                    t0 = time.perf_counter()
                    with prof.phase("data_wait"):
                        micro_batches = [next(loader) for _ in range(cfg.train.grad_accum_steps)]
                    data_wait_s = time.perf_counter() - t0
                    lr = scheduler.get_last_lr()[0]
                    out = train_step(model, optimizer, micro_batches, ctx)
                    scheduler.step()
                    prof.step_end(step)
                    metrics.record(step, out.loss, out.grad_norm, out.finite, out.diverged, lr, tokens_per_step,
                                   data_wait_s)
                    done = step + 1
                    if done % cfg.logging.log_interval == 0 or done == cfg.train.steps or stop.signal:
                        rec = metrics.flush()
                        bar.update(done, rec)
                    if cfg.train.eval_interval and done % cfg.train.eval_interval == 0 and done < cfg.train.steps:
                        with prof.phase("eval"):
                            ev = run_eval(model, eval_ds, cfg, ctx)
                        metrics.log_eval(done, ev)
                        reporter.eval_line(done, ev)
                        metrics.restart_window()
                    if stop.signal:
                        interrupted_at = checkpoint(done)
                        break
                    if cfg.checkpoint.interval and done % cfg.checkpoint.interval == 0 and done < cfg.train.steps:
                        checkpoint(done)
                        metrics.restart_window()
        except torch.OutOfMemoryError as e:
            # At the step boundary: snapshot the allocator and say which switches would fit.
            raise explain_oom(e, cfg, device, run_dir, step) from None
        summary_extra = prof.finish(reporter.note)
        if interrupted_at is not None:
            reporter.note(f"{stop.signal} received: saved checkpoint {interrupted_at} at step {step + 1}; "
                          f"continue with: tracetrain train --resume {run_dir}")
            summary = {"interrupted": True, "signal": stop.signal, "step": step + 1,
                       "checkpoint": str(interrupted_at)}
        else:
            summary = final_evaluation(model, tokenizer, eval_ds, cfg, ctx, run_dir, reporter)
            summary.update(_throughput_summary(metrics, cfg, step + 1))
            if cfg.checkpoint.save_final:
                summary["checkpoint"] = str(checkpoint(cfg.train.steps))
        summary.update(summary_extra)
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        reporter.summary(summary, run_dir)
        return TrainResult(run_dir=run_dir, summary=summary)
    finally:
        stop.restore()
        metrics.close()
        prof.finish(lambda _: None)  # stops a profiler left running by an exception


def _lora_base_dtype(cfg: Config, device: torch.device) -> torch.dtype:
    choice = cfg.lora.base_dtype
    if choice == "auto":
        choice = "bf16" if device.type == "cuda" else "fp32"
    return {"bf16": torch.bfloat16, "fp32": torch.float32}[choice]


def _throughput_summary(metrics: MetricsLogger, cfg: Config, steps: int) -> dict[str, Any]:
    last = metrics.last
    return {"steps": steps, "train_loss": last.get("loss"), "tokens_per_s": last.get("tokens_per_s"),
            "mfu": last.get("mfu"), "skipped_steps": metrics.skipped_steps,
            **{k: v for k, v in last.items() if k.startswith("mem_")}}


def _as_dict(stats: Any) -> dict[str, Any]:
    if isinstance(stats, dict):
        return stats
    import dataclasses
    return dataclasses.asdict(stats)
