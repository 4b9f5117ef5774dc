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

import contextlib
import dataclasses
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tracetrain.config import Config
from tracetrain.errors import TracetrainError
from tracetrain.train.checkpoint import (
    TrainState,
    latest_checkpoint,
    list_checkpoints,
    save_checkpoint,
    trainer_state_dict,
)
from tracetrain.train.console import Reporter
from tracetrain.train.evaluation import final_evaluation, run_eval
from tracetrain.train.faults import CallbackError, RunStopped, StopFlag, describe, silence_stdout, stdout_reader_gone
from tracetrain.train.metrics import MetricsLogger
from tracetrain.train.oom import is_out_of_memory
from tracetrain.train.resume import ResumePoint, claim_run_dir
from tracetrain.train.run_setup import Callbacks, RunSetup
from tracetrain.train.rundir import RunLock, atomic_write_text, discard_unstarted, lock_run_dir
from tracetrain.train.step import train_step


@dataclass
class TrainResult:
    run_dir: Path
    summary: dict[str, Any]
    signum: int | None = None  # the SIGINT/SIGTERM that stopped the run early (checkpoint saved); None: finished
    model: torch.nn.Module | None = None  # the trained model (this rank's part under several ranks)
    tokenizer: Any = None  # the tokenizer the run trained with


def train(
    cfg: Config,
    run_dir: Path | None = None,
    *,
    resume: ResumePoint | None = None,
    reporter: Reporter | None = None,
    callbacks: Any = (),
    hold_signals: bool = False,
) -> TrainResult:
    """Train as `cfg` says and leave a complete run directory.

    The directory is `resume.run_dir` when resuming, else `run_dir` if given (made by `prepare_run_dir`),
    else a fresh one claimed (`claim_run_dir`) only once every setup check has passed (data read and
    tokenised, vocabulary vs model, device, shapes): a run that cannot start leaves nothing behind. It is
    locked for the run's life: one process per run directory (rank 0 locks under torchrun).
    SIGINT/SIGTERM/SIGHUP save a checkpoint and return with `TrainResult.signum` set; any other error after
    the first step saves one and raises `RunStopped` naming the cause (train/faults.py). `hold_signals`:
    keep ignoring further signals after returning (the CLI, whose exit status says the first signal).
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
        result = _train(run, StopFlag(hold_signals))
    except BaseException:
        # The error in flight is the one to report (RunStopped names the saved checkpoint): closing the
        # metrics file or a tracker on the same full disk must not replace it.
        with contextlib.suppress(Exception):
            run.close()
        lock.release()
        raise
    try:
        run.close()
    finally:
        lock.release()
    return result


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


def _train(run: _Run, stop: StopFlag) -> TrainResult:
    """The loop, then the final evaluation and checkpoint (or the interruption record); an error after the
    first step saves the steps done before it ends the run."""
    from tracetrain.parallel import dist as tdist

    try:
        # Several ranks: an error on one is reported to the others, which then stop too. Out of memory in
        # a step, an evaluation or a save is one line naming the phase (train/oom.py). Any other error
        # after the first step saves the steps done first (train/faults.py).
        with tdist.failure_guard(run.watchdog, run.dist.rank), run.oom_guard("step"):
            try:
                interrupted_at = run.run_steps(stop)
                with run.between_steps("the end of the run (final evaluation, checkpoint, summary)"):
                    summary = run.finish(interrupted_at, stop.name)
            except Exception as e:
                if is_out_of_memory(e):
                    raise  # oom_guard explains it
                raise run.save_after_failure(e) from e
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


class _Run(RunSetup):
    """A run once built (`RunSetup`): its steps, held-out evaluations, checkpoints and final summary."""

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
        with (
            self.between_steps(f"the checkpoint save at step {step}"),
            self.reporter.status(f"saving checkpoint at step {step}") as progress,
            self.prof.phase("checkpoint"),
            self.phases("save"),
        ):
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
                    progress=progress,
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

    def save_after_failure(self, error: Exception) -> BaseException:
        """Save the steps done before `error` stopped the run, and write the interruption record; the error
        to raise: `RunStopped` (one line: the cause, the checkpoint, how to continue), or `error` itself when
        there is nothing new to save (no step done, or already saved), under torchrun (a save is collective),
        or when the save failed too (the message then says so and names the last good checkpoint)."""
        if isinstance(error, TracetrainError) and not isinstance(error, CallbackError):
            return error  # the run's own verdicts (NaN weights, diverged steps) say what is kept already
        done, saved = self.done, list_checkpoints(self.run_dir)
        if self.dist.is_distributed or done <= self.start_step or (saved and _step_of(saved[-1]) == done):
            return error
        if stdout_reader_gone():
            silence_stdout()  # nothing more can be shown there; the one line goes to stderr
        cause = describe(error)
        try:
            path = self._save(done)  # no on_save callback: a callback may be what failed
        except Exception as save_error:
            kept = f"the last good checkpoint {saved[-1]} is kept" if saved else "no checkpoint exists"
            return RunStopped(
                f"{cause} at step {done}; saving a checkpoint failed too ({describe(save_error)}): {kept}"
            )
        summary = {"interrupted": True, "error": cause, "step": done, "checkpoint": str(path)}
        # The checkpoint is what a resume needs; summary.json is only the record.
        with contextlib.suppress(OSError, TracetrainError):
            atomic_write_text(self.run_dir / "summary.json", json.dumps(summary, indent=2))
        return RunStopped(
            f"{cause} at step {done}: saved checkpoint {path}; continue with: tracetrain train --resume {self.run_dir}"
        )

    def between_steps(self, where: str) -> contextlib.AbstractContextManager[None]:
        """A phase that is not a step (an evaluation, a save): the watchdog does not time it as one."""
        return self.watchdog.between_steps(where) if self.watchdog is not None else contextlib.nullcontext()

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
        self.metrics.record(
            step, out.loss, out.grad_norm, out.finite, out.diverged, lr, tokens, data_wait_s, stats=out.stats
        )
        self.done = step + 1
        if self.watchdog is not None:
            self.watchdog.beat(f"step {self.done}")

    def run_steps(self, stop: StopFlag) -> Path | None:
        """The loop; returns the checkpoint written on SIGINT/SIGTERM, if one arrived."""
        cfg, total = self.cfg, self.cfg.train.steps
        self.model.train()
        with self.reporter.progress(total, self.start_step) as bar:
            self.metrics.restart_window()
            for step in range(self.start_step, total):
                self.step = step  # the OOM explanation names the step that ran out
                self.one_step(step)
                done = self.done
                stopping = stop.agreed(self.dist.is_distributed)
                if done % cfg.logging.log_interval == 0 or done == total or stopping:
                    row = self.metrics.flush()  # the interval's one host sync
                    bar.update(done, row)
                    if row is not None:
                        self.callbacks("on_step", done, dict(row))
                if cfg.train.eval_interval and done % cfg.train.eval_interval == 0 and done < total:
                    self.evaluate(done)
                if stopping:
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
        with (
            self.between_steps(f"the evaluation at step {done}"),
            self.prof.phase("eval"),
            self.phases("evaluation"),
            self.reporter.status("evaluating") as progress,
        ):
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
                summary["checkpoint"] = str(self._final_checkpoint())
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

    def _final_checkpoint(self) -> Path:
        """The checkpoint of the final weights: saved now, unless this process resumed from a checkpoint
        of the last step and trained none (a signal in the last step saved it, then the run was resumed):
        that checkpoint holds them already, and saving it again would only replace it with a copy."""
        if self.resumed_from is not None and self.done == self.start_step:
            return self.resumed_from
        return self.checkpoint(self.cfg.train.steps)

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


def _step_of(checkpoint: Path) -> int:
    return int(checkpoint.name.removeprefix("step_"))


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
