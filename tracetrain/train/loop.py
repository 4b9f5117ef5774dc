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

import dataclasses
import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from tracetrain.config import Config, to_toml
from tracetrain.data import DATA_CACHE_DIR, build_datasets, build_loader, check_vocab, load_tokenizer
from tracetrain.devices import peak_flops
from tracetrain.errors import TracetrainError
from tracetrain.models.accounting import training_flops_per_token
from tracetrain.profile.capture import ProfileCapture
from tracetrain.train.assemble import reapply_after_load, run_step_context
from tracetrain.train.checkpoint import (
    TrainState,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
    set_rng_state,
    train_state_from_dict,
    trainer_state_dict,
)
from tracetrain.train.console import Reporter
from tracetrain.train.evaluation import final_evaluation, run_eval
from tracetrain.train.metrics import MetricsLogger
from tracetrain.train.oom import configure_allocator, explain_oom, preflight
from tracetrain.train.optim import build_scheduler, note_resolved_steps, size_by_epochs
from tracetrain.train.resume import (
    ResumePoint,
    check_data_unchanged,
    check_steps_cover,
    claim_run_dir,
    data_fingerprint,
)
from tracetrain.train.rundir import RunLock, atomic_write_text, discard_unstarted, lock_run_dir
from tracetrain.train.runtime import resolve_device
from tracetrain.train.step import train_step


@dataclass
class TrainResult:
    run_dir: Path
    summary: dict[str, Any]
    signum: int | None = None  # the SIGINT/SIGTERM that stopped the run early (checkpoint saved); None: finished
    model: torch.nn.Module | None = None  # the trained model (this rank's part under several ranks)
    tokenizer: Any = None  # the tokenizer the run trained with


class Callbacks:
    """User hooks, each optional on each object: `on_step(step, metrics)` every `logging.log_interval`
    steps with the latest step's metrics (read at the interval's one host sync), `on_eval(step, metrics)`
    after each held-out evaluation (and the final one), `on_save(step, path)` after each checkpoint.
    Rank 0 only. An exception in a callback stops the run like any error (the latest checkpoint stays)."""

    def __init__(self, callbacks: Any = ()) -> None:
        self.callbacks = list(callbacks)

    def __call__(self, hook: str, *args: Any) -> None:
        for cb in self.callbacks:
            fn = getattr(cb, hook, None)
            if fn is not None:
                fn(*args)


class _StopFlag:
    """SIGINT/SIGTERM set a flag; the loop saves a checkpoint at the next step boundary and the CLI exits
    with 128 + the signal's number (130, 143), so a requeue wrapper can tell a stop from a finished run.
    Further SIGINT/SIGTERM are ignored until the process exits, so that a second Ctrl-C cannot cut the
    save in half; the first of them says how to stop at once anyway (kill -9)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.warned = False
        self.previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        for s in self.previous:
            signal.signal(s, self._handle)

    @property
    def name(self) -> str | None:
        return signal.Signals(self.signum).name if self.signum else None

    def _handle(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if self.signum is None:
            self.signum = signum
            # os.write: safe inside a signal handler (no buffered stream that may be mid-write).
            os.write(2, f"{name} received: finishing this step, then saving a checkpoint\n".encode())
            return
        if not self.warned:
            self.warned = True
            os.write(
                2,
                (
                    f"{name} ignored: saving a checkpoint first; to stop now without it: kill -9 {os.getpid()}\n"
                ).encode(),
            )

    def restore(self) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)


def train(
    cfg: Config,
    run_dir: Path | None = None,
    *,
    resume: ResumePoint | None = None,
    reporter: Reporter | None = None,
    callbacks: Any = (),
) -> TrainResult:
    """Train as `cfg` says and leave a complete run directory.

    The directory is `resume.run_dir` when resuming, else `run_dir` if given (made by `prepare_run_dir`),
    else a fresh one claimed (`claim_run_dir`) only once every setup check has passed (data read and
    tokenised, vocabulary vs model, device, shapes): a run that cannot start leaves nothing behind. It is
    locked for the run's life: one process per run directory (rank 0 locks under torchrun).
    SIGINT/SIGTERM save a checkpoint and return with `TrainResult.signum` set.
    """
    reporter = reporter or Reporter(cfg.logging.progress)
    lock = _lock_before_setup(cfg, run_dir, resume)
    run: _Run | None = None
    try:
        run = _Run(cfg, reporter, lock.path if lock else None)
        run.callbacks = Callbacks(callbacks if run.rank0 else ())
        if lock is None:  # validate-then-create: every check above passed
            lock = claim_run_dir(run.cfg)
        if resume is not None:
            run.restore(_newest(resume))
        run.open_run_dir(lock.path, resume)
        run.announce()
    except BaseException:
        if run is not None:
            run.close()
        if lock is not None:
            discard_unstarted(lock)  # only a directory this process created, holding only its own files
        raise
    try:
        return _train(run)
    finally:
        run.close()
        lock.release()


def _lock_before_setup(cfg: Config, run_dir: Path | None, resume: ResumePoint | None) -> RunLock | None:
    """The run directory that exists before setup (resume, given, or torchrun's), locked; None: a fresh
    single-process run, whose directory is claimed after setup."""
    from tracetrain.parallel.dist import env_world_size

    if resume is None and run_dir is None:
        return claim_run_dir(cfg) if env_world_size() > 1 else None  # the ranks log into it from the start
    path = resume.run_dir if resume is not None else run_dir
    assert path is not None
    if int(os.environ.get("RANK", "0")) != 0:  # rank 0 holds the job's lock
        return RunLock(path, None, created=False)
    return lock_run_dir(path)


def _newest(resume: ResumePoint) -> ResumePoint:
    """The newest checkpoint now that the lock is held: a run that held it may have saved more since
    `resolve_resume` looked (list_checkpoints is cheap; latest_checkpoint verifies, so only on change)."""
    if list_checkpoints(resume.run_dir)[-1:] == [resume.checkpoint]:
        return resume
    return dataclasses.replace(resume, checkpoint=latest_checkpoint(resume.run_dir))


def _train(run: _Run) -> TrainResult:
    """The loop, then the final evaluation and checkpoint (or the interruption record)."""
    stop = _StopFlag()
    from tracetrain.parallel import dist as tdist

    try:
        # Several ranks: an error on one is reported to the others, which then stop too.
        with tdist.failure_guard(run.watchdog, run.dist.rank):
            try:
                interrupted_at = run.run_steps(stop)
            except torch.OutOfMemoryError as e:
                # At the step boundary: snapshot the allocator and say which switches would fit.
                raise explain_oom(e, run.cfg, run.device, run.run_dir, run.step) from None
            summary = run.finish(interrupted_at, stop.name)
        tdist.shutdown(run.watchdog)
        return TrainResult(
            run_dir=run.run_dir,
            summary=summary,
            signum=stop.signum if interrupted_at is not None else None,
            model=run.model,
            tokenizer=run.tokenizer,
        )
    finally:
        stop.restore()


class _Run:
    """Everything one training run holds, built from the config in a fixed order. Building writes no
    file (`open_run_dir` does, once every check has passed), except torchrun's per-rank logs."""

    def __init__(self, cfg: Config, reporter: Reporter, log_dir: Path | None) -> None:
        self.cfg, self.reporter = cfg, reporter
        # Started by open_run_dir, once every setup check has passed (close() tolerates their absence).
        self.metrics: MetricsLogger
        self.prof: ProfileCapture
        self.callbacks = Callbacks()
        self._join_job(log_dir)
        configure_allocator(cfg.memory, self.device)
        torch.manual_seed(cfg.train.seed)
        self.config_toml = to_toml(cfg)
        self._build_data()
        self._build_model_and_optimizer()
        self._build_instruments()
        self.start_step = self.step = self.done = 0  # done: steps completed so far
        self.skipped_at_start = 0  # non-finite steps skipped before the checkpoint resumed from

    def _join_job(self, log_dir: Path | None) -> None:
        """One process, or one rank of a torchrun job: device, process group, layout, logs, watchdog."""
        from tracetrain.models.build import model_args_from_config
        from tracetrain.parallel import dist as tdist
        from tracetrain.validate import validate

        cfg = self.cfg
        self.device = resolve_device(cfg.train.device)
        args = self.model_args = model_args_from_config(cfg)
        # Layout, multi-rank switches, config vs model shape: before any rank waits on another and before
        # the run directory exists.
        validate(cfg, args, tdist.env_world_size())
        self.dist = tdist.init_distributed(cfg.parallel.timeout_s, self.device.type)
        self.rank0 = self.dist.rank == 0
        self.watchdog = None
        if self.dist.is_distributed:
            self.device = self.dist.device
            tdist.setup_rank_logging(log_dir, self.dist.rank)
            self.watchdog = tdist.Watchdog(self.dist.rank, cfg.parallel.timeout_s).start()
            if not self.rank0:  # one console and one set of files per job: rank 0's
                # Lives as long as the process (the reporter is used until exit): no context manager.
                self.reporter = Reporter(False, Console(file=open(os.devnull, "w")))  # noqa: SIM115
        par = cfg.parallel
        self.dp = par.dp_replicate * par.dp_shard  # ranks that read different rows of each micro-batch

    def _build_data(self) -> None:
        cfg = self.cfg
        self.tokenizer = load_tokenizer(cfg.data.tokenizer, cfg.model.init_from)  # 'auto': init_from's own
        with self.reporter.status("reading and packing data") as progress:
            cache = Path(cfg.train.output_dir) / DATA_CACHE_DIR  # a text corpus's memory-mapped rows, reused
            self.train_ds, self.eval_ds, stats = build_datasets(
                cfg.data, self.tokenizer, cache_dir=cache, progress=progress
            )
        self.data_stats = stats
        self.data_fingerprint = data_fingerprint(self.train_ds)  # stored in checkpoints, compared on resume
        self.reporter.data_stats(stats)
        # Every rank reads the same global micro-batch (same seed) and keeps its own rows of it.
        self.loader = build_loader(
            self.train_ds, cfg.train.micro_batch_size * self.dp, cfg.data, shuffle=True, seed=cfg.data.seed
        )
        self.sizing: dict[str, Any] = {}  # train.epochs: the step count is known only now that the rows exist
        if cfg.train.epochs:
            self.cfg, self.sizing = size_by_epochs(cfg, self.loader.batches_per_epoch)
            self.config_toml = note_resolved_steps(  # written by open_run_dir
                self.config_toml,
                steps=int(self.sizing["steps"]),
                epochs=float(self.sizing["epochs"]),
                batches_per_epoch=int(self.sizing["batches_per_epoch"]),
            )
            self.reporter.note(
                "train.epochs = {epochs}: {batches_per_epoch} batches per epoch -> {steps} steps".format(**self.sizing)
            )

    def _build_model_and_optimizer(self) -> None:
        """Every `auto` decided once (the spec), then the model, its transforms and the optimizer from the
        one ordered table (train/assemble.py)."""
        from tracetrain.spec import resolve
        from tracetrain.train.assemble import assemble

        cfg, device = self.cfg, self.device
        self.spec = resolve(cfg, device, self.dist.world_size, model_args=self.model_args)
        self.precision = self.spec.precision
        self.args = self.spec.model_args
        check_vocab(self.tokenizer, self.args.vocab_size)  # before a large model is materialised
        # LoRA checkpoints hold only the adapters when the frozen base can be reloaded from its source;
        # a randomly initialised base (benchmarks, tests) is saved whole.
        self.adapters_only = self.spec.adapters_only
        mesh = None
        if self.dist.is_distributed:
            from tracetrain.parallel.mesh import build_mesh

            mesh = build_mesh(cfg.parallel, device.type)
        with self.reporter.status(f"building model on {device}"):
            self.assembly = assemble(self.spec, mesh)
        self.par = self.assembly.par
        self.model = self.assembly.module
        assert self.assembly.optimizer is not None  # the table's optimizer row always applies
        self.optimizer: torch.optim.Optimizer = self.assembly.optimizer
        self.offload = self.assembly.activation_offload
        if cfg.memory.unified_memory != "none":
            self.note_managed()
        self.scheduler = build_scheduler(self.optimizer, cfg.optim, cfg.train.steps)
        # fp16 needs dynamic loss scaling; bf16 has fp32's exponent range and does not.
        self.scaler = torch.amp.GradScaler(device.type) if self.precision == "fp16" else None

    def _build_instruments(self) -> None:
        cfg, device = self.cfg, self.device
        num_lora = sum(p.numel() for p in self.model.parameters() if p.requires_grad) if cfg.train.mode == "lora" else 0
        self.flops = training_flops_per_token(
            self.args,
            cfg.data.seq_len,
            mode=cfg.train.mode,
            num_lora_params=num_lora,
            num_experts=cfg.model.num_experts,
            top_k=cfg.model.experts_top_k if cfg.model.num_experts else 0,
        )
        self.device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        peak = peak_flops(self.device_name, self.precision, cfg.logging.peak_tflops) if device.type == "cuda" else None
        if device.type == "cuda" and peak is None:
            self.reporter.note(
                f"MFU not reported: {self.device_name!r} is not in the device table; "
                "set logging.peak_tflops to its dense peak"
            )
        self.peak = peak

    def open_run_dir(self, run_dir: Path, resume: ResumePoint | None) -> None:
        """Write the run's files and start its instruments, once setup has passed every check."""
        cfg, device = self.cfg, self.device
        self.run_dir = run_dir
        if self.rank0:
            atomic_write_text(run_dir / "config.toml", self.config_toml)
            atomic_write_text(run_dir / "data_stats.json", json.dumps(_as_dict(self.data_stats), indent=2))
            # Before the metrics file is opened for appending (truncation replaces the file).
            if resume is not None and resume.truncate_metrics(run_dir, self.start_step):
                self.reporter.note(
                    f"{run_dir / 'metrics.jsonl'}: dropped a torn last line (the partial write of a stopped process)"
                )
        name = "metrics.jsonl" if self.rank0 else f"logs/metrics_rank{self.dist.rank}.jsonl"
        self.metrics = MetricsLogger(
            run_dir,
            device,
            self.flops.model,
            self.peak,
            cfg.train.max_bad_steps,
            cfg.logging.tensorboard and self.rank0,
            filename=name,
            skipped_steps=self.skipped_at_start,
        )
        if self.rank0:
            from tracetrain.train.tracking import open_trackers

            self.metrics.trackers = open_trackers(cfg, run_dir, run_dir.name, self.dist.world_size)
        self.prof = ProfileCapture(cfg.profile, run_dir, device)
        self.ctx = run_step_context(self.assembly, scaler=self.scaler, phase=self.prof.phase)

    def note_managed(self) -> None:
        """Say how much this rank holds in managed (unified) memory: the torch allocator's figures do not
        count it."""
        from tracetrain.memory.unified import managed_bytes

        which = "weights" if self.cfg.memory.unified_memory == "model" else "optimizer states"
        self.reporter.note(f"unified memory: {managed_bytes(self.device) / 2**30:.2f} GiB of {which} are managed")

    def restore(self, resume: ResumePoint) -> None:
        """Continue exactly: weights, optimizer, schedule, loss scale, data position, RNG, counters.
        Refused (before any file is touched) if the run would end before the checkpoint or the data changed."""
        check_steps_cover(self.cfg, resume.checkpoint)  # after train.epochs has set the step count
        if (resume.checkpoint / "dcp").is_dir():  # sharded (saved by several ranks): any layout can load it
            from tracetrain.train.sharded_checkpoint import load_sharded

            raw = load_sharded(resume.checkpoint, self.model, self.optimizer)
            set_rng_state(raw["rng"])
            state = train_state_from_dict(raw)
        else:
            state = load_checkpoint(resume.checkpoint, self.model, self.optimizer, lora=self.adapters_only)
        if reapply_after_load(self.assembly):
            self.note_managed()
        self.scheduler.load_state_dict(state.scheduler)
        if self.scaler is not None and state.counters.get("scaler"):
            self.scaler.load_state_dict(state.counters["scaler"])
        self.loader.load_state_dict(state.loader)  # a changed row count is refused here, with its own message
        note = check_data_unchanged(
            state.data_fingerprint, self.data_fingerprint, self.cfg, resume.checkpoint, len(self.train_ds)
        )
        if note:
            self.reporter.note(note)
        self.start_step = self.step = self.done = state.step
        self.skipped_at_start = state.counters.get("skipped_steps", 0)
        self.reporter.note(f"resumed from {resume.checkpoint} at step {self.start_step}")

    def close(self) -> None:
        if hasattr(self, "metrics"):
            self.metrics.close()
        if hasattr(self, "prof"):
            self.prof.finish(lambda _: None)  # stops a profiler left running by an exception

    def announce(self) -> None:
        self.reporter.model_summary(self.args, self.model, self.cfg, self.device_name, self.precision, self.flops.model)
        preflight(self.cfg, self.device, self.reporter.note)

    def checkpoint(self, step: int) -> Path:
        path = self._save(step)
        self.callbacks("on_save", step, path)
        return path

    def _save(self, step: int) -> Path:
        self._refuse_non_finite_weights(step)
        counters = {
            "skipped_steps": self.metrics.skipped_steps,
            "scaler": self.scaler.state_dict() if self.scaler else {},
        }
        state = TrainState(
            step=step,
            scheduler=self.scheduler.state_dict(),
            loader=self.loader.state_dict(),
            counters=counters,
            data_fingerprint=self.data_fingerprint,
        )
        with self.reporter.status(f"saving checkpoint at step {step}") as progress, self.prof.phase("checkpoint"):
            if self.dist.is_distributed:  # every rank writes its shards (DCP), atomically as one folder
                from tracetrain.train.sharded_checkpoint import save_sharded

                trainer_state = trainer_state_dict(state)
                return save_sharded(
                    self.run_dir,
                    step,
                    self.model,
                    self.optimizer,
                    trainer_state,
                    self.config_toml,
                    self.cfg.checkpoint.keep_last,
                )
            return save_checkpoint(
                self.run_dir,
                self.model,
                self.optimizer,
                state,
                self.config_toml,
                lora=self.adapters_only,
                keep_last=self.cfg.checkpoint.keep_last,
                progress=progress,
            )

    def _refuse_non_finite_weights(self, step: int) -> None:
        """A checkpoint never holds NaN/inf weights: an update from finite gradients can still overflow them,
        and saving such a checkpoint would rotate the good ones out (keep_last). One host sync, at save
        time only (not in the step's hot path)."""
        flags = [torch.isfinite(_local(p.detach())).all() for p in self.model.parameters() if p.requires_grad]
        ok = torch.stack(flags).all().to(torch.int32)
        if self.dist.is_distributed:  # every rank holds other shards; all must agree before any writes
            torch.distributed.all_reduce(ok, op=torch.distributed.ReduceOp.MIN)
        if bool(ok):
            return
        good = list_checkpoints(self.run_dir)
        kept = f"the last good checkpoint {good[-1]} is kept" if good else "no earlier checkpoint exists"
        raise TracetrainError(
            f"weights are NaN/inf after step {step}: checkpoint not saved ({kept}). "
            "Try a lower optim.lr, train.grad_clip > 0, or bf16 instead of fp16"
        )

    def one_step(self, step: int) -> None:
        """Fetch the micro-batches, train, and hand the (still on-device) results to the metrics."""
        cfg = self.cfg
        self.prof.step_begin(step)
        t0 = time.perf_counter()
        with self.prof.phase("data_wait"):
            micro_batches = [next(self.loader) for _ in range(cfg.train.grad_accum_steps)]
        data_wait_s = time.perf_counter() - t0
        lr = float(self.scheduler.get_last_lr()[0])
        out = train_step(self.model, self.optimizer, micro_batches, self.ctx)
        self.scheduler.step()
        self.prof.step_end(step)
        # Tokens per GPU (the global batch over the job's ranks): tokens/s and MFU are per GPU.
        tokens = cfg.train.micro_batch_size * self.dp * cfg.train.grad_accum_steps * cfg.data.seq_len
        tokens //= self.dist.world_size
        self.metrics.record(step, out.loss, out.grad_norm, out.finite, out.diverged, lr, tokens, data_wait_s)
        self.done = step + 1
        if self.watchdog is not None:
            self.watchdog.beat(f"step {self.done}")

    def run_steps(self, stop: _StopFlag) -> Path | None:
        """The loop; returns the checkpoint written on SIGINT/SIGTERM, if one arrived."""
        cfg, total = self.cfg, self.cfg.train.steps
        self.model.train()
        with self.reporter.progress(total, self.start_step) as bar:
            self.metrics.restart_window()
            for step in range(self.start_step, total):
                self.step = step  # the OOM explanation names the step that ran out
                self.one_step(step)
                done = self.done
                if done % cfg.logging.log_interval == 0 or done == total or stop.signum:
                    row = self.metrics.flush()  # the interval's one host sync
                    bar.update(done, row)
                    if row is not None:
                        self.callbacks("on_step", done, dict(row))
                if cfg.train.eval_interval and done % cfg.train.eval_interval == 0 and done < total:
                    self.evaluate(done)
                if stop.signum:
                    return self.checkpoint(done)
                if cfg.checkpoint.interval and done % cfg.checkpoint.interval == 0 and done < total:
                    self.checkpoint(done)
                    self.metrics.restart_window()
        return None

    def can_evaluate(self) -> bool:
        """Held-out loss needs the whole model's forward on every rank: not with pipeline parallelism."""
        return self.cfg.parallel.pp == 1

    def evaluate(self, done: int) -> None:
        if not self.can_evaluate():
            return
        with self.prof.phase("eval"), self.reporter.status("evaluating") as progress:
            values = run_eval(self.model, self.eval_ds, self.cfg, self.ctx, progress)
        self.metrics.log_eval(done, values)
        self.reporter.eval_line(done, values)
        self.callbacks("on_eval", done, dict(values))
        self.metrics.restart_window()

    def finish(self, interrupted_at: Path | None, signal_name: str | None) -> dict[str, Any]:
        """Final evaluation and checkpoint (or the interruption record); summary.json."""
        extra = self.prof.finish(self.reporter.note)
        done = self.done
        if interrupted_at is not None:
            self.reporter.note(
                f"{signal_name} received: saved checkpoint {interrupted_at} at step {done}; "
                f"continue with: tracetrain train --resume {self.run_dir}"
            )
            summary = {"interrupted": True, "signal": signal_name, "step": done, "checkpoint": str(interrupted_at)}
        else:
            summary = self._final_evaluation()
            if summary:
                self.metrics.log_eval(done, summary, final=True)
                self.callbacks("on_eval", done, dict(summary))
            summary.update(_throughput_summary(self.metrics, self.cfg, done))
            if self.cfg.checkpoint.save_final:
                summary["checkpoint"] = str(self.checkpoint(self.cfg.train.steps))
        summary.update(extra, **self.sizing)
        if self.dist.is_distributed:
            summary.update({"world_size": self.dist.world_size, "tokens_per_s_is_per_gpu": True})
        if interrupted_at is None and self.metrics.bad_streak:
            summary["final_steps_skipped"] = self.metrics.bad_streak
        if self.rank0:
            atomic_write_text(self.run_dir / "summary.json", json.dumps(summary, indent=2))
        self.metrics.finish_trackers(summary)
        self.reporter.summary(summary, self.run_dir)
        if "final_steps_skipped" in summary:
            raise self._ended_on_skipped_steps(summary)
        return summary

    def _ended_on_skipped_steps(self, summary: dict[str, Any]) -> TracetrainError:
        """The rule: a run whose final step diverged (loss or gradient NaN/inf, update not applied) fails,
        even below train.max_bad_steps; its weights are not what the config asked for. Routine fp16
        overflow skips (finite loss, loss scale lowered) do not count."""
        skipped, done = summary["final_steps_skipped"], self.done
        saved = f"; checkpoint {summary['checkpoint']} holds them" if "checkpoint" in summary else ""
        return TracetrainError(
            f"the last {skipped} step(s) of the run (to step {done}) had a NaN/inf loss or "
            f"gradient and were not applied: the weights are those after step {done - skipped}"
            f"{saved}. Try a lower optim.lr, train.grad_clip > 0, or bf16 instead of fp16"
        )

    def _final_evaluation(self) -> dict[str, Any]:
        if not self.can_evaluate():
            self.reporter.note(
                "held-out evaluation skipped: it needs the whole model on every rank "
                "(not available with pipeline parallelism yet); run `tracetrain eval` after"
            )
            return {}
        cfg = self.cfg
        if self.dist.is_distributed and cfg.train.eval_generate:
            # Greedy generation under sharded layouts is not supported yet: loss and perplexity only.
            self.reporter.note("exact-match generation skipped with several ranks; run `tracetrain eval` after")
            cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, eval_generate=0))
        return final_evaluation(
            self.model, self.tokenizer, self.eval_ds, cfg, self.ctx, self.run_dir if self.rank0 else None, self.reporter
        )


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (FSDP/TP parameters), or the tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _throughput_summary(metrics: MetricsLogger, cfg: Config, steps: int) -> dict[str, Any]:
    last = metrics.last
    return {
        "steps": steps,
        "train_loss": last.get("loss"),
        **metrics.throughput(),
        "last_interval_tokens_per_s": last.get("tokens_per_s"),
        "skipped_steps": metrics.skipped_steps,
        **{k: v for k, v in last.items() if k.startswith("mem_")},
    }


def _as_dict(stats: Any) -> dict[str, Any]:
    if isinstance(stats, dict):
        return stats
    import dataclasses

    return dataclasses.asdict(stats)
