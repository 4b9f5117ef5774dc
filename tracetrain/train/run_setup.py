"""What one training run holds, built from the config in a fixed order: the job (device, ranks, logs),
the data, the model with its transforms and optimizer, the FLOP and peak figures; then the run directory's
files, and the state a checkpoint restores. `train/loop.py` runs the steps over what is built here.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from tracetrain.config import Config, describe_warmup, to_toml
from tracetrain.data import DATA_CACHE_DIR, build_datasets, build_loader, check_vocab, load_tokenizer
from tracetrain.devices import peak_flops
from tracetrain.models.accounting import training_flops_per_token
from tracetrain.profile.capture import ProfileCapture
from tracetrain.train.assemble import reapply_after_load, run_step_context
from tracetrain.train.checkpoint import TrainState, load_checkpoint, restore_rng, train_state_from_dict
from tracetrain.train.console import Reporter
from tracetrain.train.faults import CallbackError
from tracetrain.train.metrics import MetricsLogger
from tracetrain.train.oom import MemoryPhases, configure_allocator, explain_oom, is_out_of_memory, preflight
from tracetrain.train.optim import build_scheduler, note_resolved_steps, size_by_epochs
from tracetrain.train.resume import ResumePoint, check_data_unchanged, check_steps_cover, data_fingerprint
from tracetrain.train.rundir import atomic_write_text
from tracetrain.train.runtime import resolve_device
from tracetrain.train.state_checks import SCHEDULER_LOOSE_KEYS, check_like


class Callbacks:
    """User hooks, each optional on each object: `on_step(step, metrics)` every `logging.log_interval`
    steps with the latest step's metrics (read at the interval's one host sync), `on_eval(step, metrics)`
    after each held-out evaluation (and the final one), `on_save(step, path)` after each checkpoint.
    Rank 0 only. An exception in a callback stops the run: the steps done are saved first (train/faults.py)."""

    def __init__(self, callbacks: Any = ()) -> None:
        self.callbacks = list(callbacks)

    def __call__(self, hook: str, *args: Any) -> None:
        for cb in self.callbacks:
            fn = getattr(cb, hook, None)
            if fn is None:
                continue
            try:
                fn(*args)
            except Exception as e:
                raise CallbackError(f"callback {type(cb).__name__}.{hook} raised {type(e).__name__}: {e}") from e


class RunSetup:
    """Everything one training run holds, built from the config in a fixed order. Building writes no
    file (`open_run_dir` does, once every check has passed), except torchrun's per-rank logs."""

    def __init__(self, cfg: Config, reporter: Reporter, log_dir: Path | None) -> None:
        self.cfg, self.reporter = cfg, reporter
        # Started by open_run_dir, once every setup check has passed (close() tolerates their absence).
        self.metrics: MetricsLogger
        self.prof: ProfileCapture
        self.callbacks = Callbacks()
        self.phases = MemoryPhases()  # the phase an out-of-memory error names
        self._join_job(log_dir)
        configure_allocator(cfg.memory, self.device)
        torch.manual_seed(cfg.train.seed)
        self.config_toml = to_toml(cfg)
        self._build_data()
        self._build_model_and_optimizer()
        self._build_instruments()
        self.start_step = self.step = self.done = 0  # done: steps completed so far
        self.resumed_from: Path | None = None  # the checkpoint this process continued from
        self.skipped_at_start = 0  # non-finite steps skipped before the checkpoint resumed from

    def _join_job(self, log_dir: Path | None) -> None:
        """One process, or one rank of a torchrun job: device, process group, layout, logs, watchdog."""
        from tracetrain.models.build import model_args_from_config
        from tracetrain.parallel import dist as tdist
        from tracetrain.validate import check_named_files, validate

        cfg = self.cfg
        check_named_files(cfg)  # a missing file is the error named, before any setting's
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
            cache = Path(cfg.train.output_dir) / DATA_CACHE_DIR  # memory-mapped rows, reused by later runs
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
        self.reporter.decisions(self.spec.decision_lines())
        self.precision = self.spec.precision
        self.args = self.spec.model_args
        check_vocab(self.tokenizer, self.args.vocab_size)  # before a large model is materialised
        if self.rank0:  # before building or loading: a run that will not fit says so, and what would
            preflight(self.spec, self.reporter.note)
        # LoRA checkpoints hold only the adapters when the frozen base can be reloaded from its source;
        # a randomly initialised base (benchmarks, tests) is saved whole.
        self.adapters_only = self.spec.adapters_only
        mesh = None
        if self.dist.is_distributed:
            from tracetrain.parallel.mesh import build_mesh

            mesh = build_mesh(cfg.parallel, device.type)
        # With model.init_from the materialise row reads each rank's slices of the checkpoint: a load.
        with (
            self.reporter.status(f"building model on {device}"),
            self.oom_guard("load" if cfg.model.init_from else "build"),
        ):
            self.assembly = assemble(self.spec, mesh)
        self.par = self.assembly.par
        self.model = self.assembly.module
        assert self.assembly.optimizer is not None  # the table's optimizer row always applies
        self.optimizer: torch.optim.Optimizer = self.assembly.optimizer
        self.offload = self.assembly.activation_offload
        if cfg.memory.unified_memory != "none":
            self.note_managed()
        self.scheduler = build_scheduler(self.optimizer, cfg.optim, cfg.train.steps)
        if note := describe_warmup(cfg.optim, cfg.train.steps):  # after train.epochs has set the step count
            self.reporter.note(note)
        # fp16 needs dynamic loss scaling; bf16 has fp32's exponent range and does not.
        self.scaler = torch.amp.GradScaler(device.type) if self.precision == "fp16" else None

    def _build_instruments(self) -> None:
        cfg, device = self.cfg, self.device
        num_lora = sum(p.numel() for p in self.model.parameters() if p.requires_grad) if cfg.train.mode == "lora" else 0
        self.flops = training_flops_per_token(
            self.args,
            cfg.data.seq_len,
            mode=cfg.train.mode,
            num_lora_params=num_lora,  # experts: the model's own (args.num_experts, config or checkpoint)
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
            atomic_write_text(run_dir / "spec.json", json.dumps(self.spec.to_json(), indent=2))
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
            filename=name,
            skipped_steps=self.skipped_at_start,
        )
        if self.rank0:
            from tracetrain.train.tracking import open_trackers

            self.metrics.trackers = open_trackers(cfg, run_dir, run_dir.name, self.dist.world_size)
        self.prof = ProfileCapture(cfg.profile, run_dir, device)
        self.ctx = run_step_context(self.assembly, scaler=self.scaler, phase=self.phases.around(self.prof.phase))

    @contextlib.contextmanager
    def oom_guard(self, phase: str) -> Iterator[None]:
        """Run a phase; running out of memory in it becomes one line (train/oom.py), told to the other ranks."""
        from tracetrain.parallel.dist import report_out_of_memory

        try:
            with self.phases(phase):
                yield
        except BaseException as e:
            if not is_out_of_memory(e):
                raise
            error = explain_oom(
                e,
                self.cfg,
                self.device,
                self.phases.name,
                rank=self.dist.rank,
                world_size=self.dist.world_size,
                run_dir=getattr(self, "run_dir", None),
            )
            report_out_of_memory(self.watchdog, error)
            raise error from None

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
        with self.oom_guard("load"):
            state = self._load(resume)
        if reapply_after_load(self.assembly):
            self.note_managed()
        self._check_saved_state(state, resume.checkpoint)
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
        self.resumed_from = resume.checkpoint
        self.skipped_at_start = state.counters.get("skipped_steps", 0)
        self.reporter.note(f"resumed from {resume.checkpoint} at step {self.start_step}")

    def _check_saved_state(self, state: TrainState, where: Path) -> None:
        """The schedule, loss scale and data position saved have the make of this run's own (one line
        naming the key otherwise, never a traceback from their `load_state_dict`)."""
        check_like(state.scheduler, self.scheduler.state_dict(), where, "scheduler", loose=SCHEDULER_LOOSE_KEYS)
        if self.scaler is not None and state.counters.get("scaler"):
            check_like(state.counters["scaler"], self.scaler.state_dict(), where, "counters.scaler")
        check_like(state.loader, self.loader.state_dict(), where, "loader")

    def _load(self, resume: ResumePoint) -> Any:
        """The checkpoint's weights and optimizer into this rank's tensors; the rest of its state returned."""
        if (resume.checkpoint / "dcp").is_dir():  # sharded (saved by several ranks): any layout can load it
            from tracetrain.train.sharded_checkpoint import load_sharded

            raw = load_sharded(resume.checkpoint, self.model, self.optimizer)
            state = train_state_from_dict(raw, resume.checkpoint)
            restore_rng(state, resume.checkpoint)  # checked above, before the RNG is touched
            return state
        return load_checkpoint(resume.checkpoint, self.model, self.optimizer, lora=self.adapters_only)

    def close(self) -> None:
        if hasattr(self, "metrics"):
            self.metrics.close()
        if hasattr(self, "prof"):
            self.prof.finish(lambda _: None)  # stops a profiler left running by an exception

    def announce(self) -> None:
        self.reporter.model_summary(self.args, self.model, self.cfg, self.device_name, self.precision, self.flops.model)


def _as_dict(stats: Any) -> dict[str, Any]:
    if isinstance(stats, dict):
        return stats
    import dataclasses

    return dataclasses.asdict(stats)
