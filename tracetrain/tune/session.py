"""`tune(config, ...)`: measure the baseline, try each candidate, keep what helps, combine, write the result.

The loop, in order:
1. the baseline: the user's config (or, when the planner says it cannot fit, the planner's best fitting
   rows until one runs), measured over the trial window with a profile of a few steps (tune/trial.py);
2. the candidates (tune/space.py) from that profile's advice and the planner's what-ifs, best predicted
   gain first, those the planner says cannot fit recorded as pruned; each measured in its own process;
3. the numerics guard: a candidate whose mean loss over the window differs from the baseline's by more
   than 0.1% is held to the spread between two baseline seeds (the second seed is measured the first
   time it is needed) and refused beyond it, unless `--allow` names its kind (fp8, fp16) or `numerics`;
4. the winners (at least `MIN_GAIN` faster, within --max-memory, guard passed) combined where their keys
   do not overlap, and the combination measured; the fastest measured trial is the result.
The budget is checked before each trial (a trial is not started when the slowest one so far would not
fit in what is left) and bounds each trial's run; Ctrl-C stops the running trial. Either way what was
measured is kept: `tuned.toml` and `tune/report.html` are written from the trials that finished.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tracetrain.config import Config, to_toml
from tracetrain.tune.ledger import Ledger, trial_key
from tracetrain.tune.space import (
    Candidate,
    Planner,
    build_candidates,
    fitting_start,
    make_candidate,
    override,
    per_gpu_tokens_per_s,
)
from tracetrain.tune.trial import TrialOutcome, Window, command, run_trial

MIN_GAIN = 0.02  # a change must be this much faster to be kept: below it, run-to-run noise decides
SAME_LOSS = 1e-3  # relative loss difference read as the same numerics (reduction order, no seed spread)


class BudgetSpent(Exception):
    """The time budget does not leave room for another trial."""


@dataclass
class Trial:
    """A candidate and what measuring it gave, judged against the baseline."""

    role: str  # baseline | seed | candidate | combination
    candidate: Candidate
    outcome: TrialOutcome
    key: str = ""
    resumed: bool = False
    gain: float | None = None  # measured tokens/s over the baseline's, minus 1
    guard: str = ""
    kept: bool = False
    winner: bool = False

    @property
    def tokens_per_s(self) -> float | None:
        m = self.outcome.measurement
        return m.tokens_per_s if m is not None and self.outcome.status == "ok" else None


@dataclass
class TuneResult:
    """What `tune` returns: every trial, the tuned config and the changed keys, where the files are."""

    trials: list[Trial]
    config: Config
    changes: dict[str, Any]
    baseline: Trial | None
    best: Trial | None
    tuned_toml: Path
    report_html: Path
    interrupted: bool
    seconds: float
    device: str
    notes: list[str] = field(default_factory=list)


@dataclass
class Options:
    budget_min: float
    max_memory_gib: float | None
    allow: tuple[str, ...]
    window: Window
    gpus: int
    tries: tuple[dict[str, Any], ...]
    max_trials: int | None = None  # candidates measured at most (None: as many as the budget allows)


class Session:
    """One tune: the base config, its tune folder, the ledger of finished trials and the clock."""

    def __init__(self, cfg: Config, opts: Options, tune_dir: Path, device: str, gpu: str, say: Callable[[str], None]):
        from tracetrain.train.rundir import atomic_write_text

        self.cfg, self.opts, self.tune_dir, self.device, self.gpu, self.say = cfg, opts, tune_dir, device, gpu, say
        (tune_dir / "runs").mkdir(parents=True, exist_ok=True)
        self.base_text = to_toml(cfg)
        self.base_toml = tune_dir / "base.toml"
        atomic_write_text(self.base_toml, self.base_text)
        self.ledger = Ledger(tune_dir)
        self.started = time.monotonic()
        self.deadline = self.started + opts.budget_min * 60
        self.trials: list[Trial] = []
        self.durations: list[tuple[float, bool]] = []  # (seconds, profiled) of the trials, run or recorded
        self.start: dict[str, Any] = {}  # changes the baseline needed to fit (planner), else empty
        # With --gpus N and a one-GPU config, the N ranks shard the data (the planner's what-if, too).
        par = cfg.parallel
        one_gpu = par.dp_replicate * par.dp_shard * par.tp * par.pp * par.cp == 1
        self.implicit: dict[str, Any] = {"parallel.dp_shard": opts.gpus} if opts.gpus > 1 and one_gpu else {}
        self.baseline: Trial | None = None
        self.seed: Trial | None = None
        self.notes: list[str] = []

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")

    # ------------------------------------------------------------------ measuring

    def measure(self, role: str, cand: Candidate, profiled: bool = False) -> Trial:
        """The trial of `cand` on top of the start changes: from the ledger, or run now."""
        overrides = self.opts.window.overrides(self.cfg, profiled, self.cuda)
        overrides += [override(k, v) for k, v in self.start.items() if k not in cand.change_dict]
        overrides += cand.overrides()
        key = trial_key(self.base_text, [self.opts.window.key(), *overrides], self.device, self.opts.gpus)
        outcome = self.ledger.get(key)
        resumed = outcome is not None
        if outcome is None:
            remaining = self.deadline - time.monotonic()
            if remaining <= 0 or remaining < self._estimate_s():
                raise BudgetSpent
            # The run directory is named by the key (kept out of it: a moved tune folder still resumes).
            where = [override("train.output_dir", str(self.tune_dir / "runs")), override("train.run_name", key)]
            cmd = command(self.base_toml, overrides + where, self.opts.gpus)
            outcome = run_trial(cmd, self.tune_dir / "runs" / key, self.opts.window, remaining)
            self.ledger.add(key, cand.label, outcome)
        # A recorded trial's time counts too: on a rerun it is what the next trial will take.
        self.durations.append((outcome.seconds, profiled))
        trial = Trial(role, cand, outcome, key, resumed)
        self.trials.append(trial)
        if outcome.status == "budget":
            self._show(trial)
            raise BudgetSpent
        return trial

    def _estimate_s(self) -> float:
        """How long the next trial will take: the slowest plain trial so far, else half the profiled
        baseline (its profile, analysis and a cold compile cache are extra), else nothing known (0)."""
        plain = [s for s, profiled in self.durations if not profiled]
        if plain:
            return max(plain)
        return 0.5 * max((s for s, _ in self.durations), default=0.0)

    def judge(self, trial: Trial) -> None:
        """Gain against the baseline, the memory cap and the numerics guard; `kept` when it helps."""
        base = self.baseline
        m, o = trial.outcome.measurement, trial.outcome
        if base is None or base.outcome.measurement is None or m is None or o.status != "ok":
            return
        bm = base.outcome.measurement
        trial.gain = m.tokens_per_s / bm.tokens_per_s - 1
        if self._over_cap(trial):
            return
        delta = abs(m.loss - bm.loss)
        if delta <= SAME_LOSS * abs(bm.loss):
            trial.guard = f"same loss (difference {delta:.2g})"
        else:
            spread = self._seed_spread()
            allowed = [w for w in (trial.candidate.numerics, "numerics") if w and w in self.opts.allow]
            if delta <= max(spread, SAME_LOSS * abs(bm.loss)):
                trial.guard = f"loss within the seed spread ({delta:.3g} <= {spread:.3g})"
            elif allowed:
                trial.guard = f"loss differs by {delta:.3g} (seed spread {spread:.3g}); allowed by --allow {allowed[0]}"
            else:
                trial.guard = f"refused: loss differs by {delta:.3g}, beyond the seed spread {spread:.3g}"
                o.status = "numerics"
                return
        trial.kept = trial.gain >= MIN_GAIN

    def _over_cap(self, trial: Trial) -> bool:
        cap, m = self.opts.max_memory_gib, trial.outcome.measurement
        peak = (m.peak_reserved_gib or m.peak_gib) if m else None
        if cap is None or peak is None or peak <= cap:
            return False
        trial.outcome.status = "over-memory"
        trial.outcome.message = f"measured peak {peak:.1f} GiB is over --max-memory {cap:g}"
        return True

    def _seed_spread(self) -> float:
        """|loss(seed) - loss(seed + 1)| of the baseline: the noise the guard allows (measured once)."""
        if self.seed is None:
            cand = Candidate(
                "baseline, second seed", (("train.seed", self.cfg.train.seed + 1),), "numerics guard", "seed"
            )
            self.seed = self.measure("seed", cand)
            self._show(self.seed)
        assert self.baseline is not None and self.baseline.outcome.measurement is not None
        m = self.seed.outcome.measurement
        if m is None:
            return 0.0  # the second seed did not run: only the same loss passes
        return abs(m.loss - self.baseline.outcome.measurement.loss)

    # ------------------------------------------------------------------ the loop

    def run(self) -> bool:
        """The whole loop; True when Ctrl-C stopped it."""
        try:
            if self._baseline():
                self._candidates()
        except BudgetSpent:
            self.notes.append(f"the time budget ({self.opts.budget_min:g} min) ran out; later candidates not measured")
            self.say(self.notes[-1])
        except KeyboardInterrupt:
            self.notes.append("interrupted (Ctrl-C): the trials measured so far are kept")
            self.say(self.notes[-1])
            return True
        return False

    def _baseline(self) -> bool:
        planner = Planner.of(self.cfg.replace(self.implicit), self.gpu, self.opts.gpus, self.opts.max_memory_gib)
        p = planner.base
        base = Candidate(
            "baseline",
            tuple(self.implicit.items()),
            "your config",
            "baseline",
            predicted_gain=0.0 if p else None,
            predicted_tokens_per_s=per_gpu_tokens_per_s(p) if p else None,
            predicted_peak_gib=p.peak_gib if p else None,
            fits=p.fits if p else None,
        )
        queue = (fitting_start(planner) if self.cuda else []) or [base]
        while queue:
            cand = queue.pop(0)
            self.start = {**self.implicit, **cand.change_dict}
            trial = self.measure("baseline", cand, profiled=True)
            self._over_cap(trial)
            self.baseline = trial
            self._show(trial)
            if trial.outcome.status == "ok":
                return True
            if trial.outcome.status not in ("oom", "over-memory"):
                break
            if cand is base and p is not None and self.cuda:  # fitted on paper only: leaner rows
                queue = fitting_start(planner, below_gib=p.peak_gib)
        self.notes.append(f"the baseline did not run: {self.baseline.outcome.message if self.baseline else ''}")
        return False

    def _candidates(self) -> None:
        planner = Planner.of(self.cfg.replace(self.start), self.gpu, self.opts.gpus, self.opts.max_memory_gib)
        assert self.baseline is not None
        cands = build_candidates(planner, self.baseline.outcome.advice, self.cuda, self.opts.allow, self.opts.tries)
        self.say(f"{len(cands)} candidates from the profile's advice and the planner's what-ifs")
        measured = 0
        for cand in cands:
            if self.opts.max_trials is not None and measured >= self.opts.max_trials:
                self.notes.append(f"stopped after {measured} candidates (--max-trials)")
                break
            if cand.fits is False and cand.source != "--try":
                reason = f"pruned: the planner needs {cand.predicted_peak_gib:.1f} GiB, more than fits"
                self.trials.append(Trial("candidate", cand, TrialOutcome("pruned", 0.0, message=reason)))
                continue
            trial = self.measure("candidate", cand)
            measured += 1
            self._judge_and_show(trial)
        self._combine(planner)

    def _judge_and_show(self, trial: Trial) -> None:
        """Judge a measured trial and show it, also when the guard's second seed does not fit the budget."""
        try:
            self.judge(trial)
        finally:
            self._show(trial)

    def _combine(self, planner: Planner) -> None:
        """Merge the kept changes, largest gain first, skipping keys already set; measure the merge."""
        kept = sorted((t for t in self.trials if t.kept), key=lambda t: -(t.gain or 0.0))
        merged: dict[str, Any] = {}
        used: list[str] = []
        for t in kept:
            changes = t.candidate.change_dict
            if _knobs(changes) & _knobs(merged) or planner.predict({**merged, **changes})[0] is None:
                continue
            merged |= changes
            used.append(t.candidate.label)
        if len(used) < 2:
            return
        cand = make_candidate(planner, " + ".join(used), merged, "the kept changes together", "combination")
        if cand is not None:
            self._judge_and_show(self.measure("combination", cand))

    def best(self) -> Trial | None:
        kept = [t for t in self.trials if t.kept and t.tokens_per_s]
        best = max(kept, key=lambda t: t.tokens_per_s or 0.0, default=None)
        if best is not None:
            best.winner = True
        return best

    def _show(self, trial: Trial) -> None:
        """One progress line per trial: elapsed of budget, what changed, what it measured."""
        elapsed = time.monotonic() - self.started
        clock = f"{_mmss(elapsed)}/{_mmss(self.opts.budget_min * 60)}"
        o, m = trial.outcome, trial.outcome.measurement
        if o.status == "ok" and m is not None:
            gain = f", {trial.gain:+.1%}" if trial.gain is not None else ""
            pred = trial.candidate.predicted_gain
            gain += f" (predicted {pred:+.1%})" if pred is not None and trial.role != "baseline" else ""
            mem = f", {m.peak_gib:.2f} GiB" if m.peak_gib is not None else ""
            verdict = " kept" if trial.kept else ""
            what = f"{m.tokens_per_s:,.0f} tok/s{gain}{mem}{verdict}"
        else:
            what = f"{o.status}: {o.message or trial.guard}"
        again = " (recorded earlier)" if trial.resumed else ""
        self.say(f"[{self.trials.index(trial) + 1:>2}] {clock} {trial.candidate.label}: {what}{again}")


# Keys that are one knob with another (the chunk of the fused loss is part of the fused loss): two
# winners on one knob are alternatives, never combined.
_SAME_KNOB = {
    "train.fused_ce_chunk": "train.fused_ce",
    "memory.recompute_every": "memory.recompute",
    "memory.activation_offload_fraction": "memory.activation_offload",
    "train.grad_accum_steps": "train.micro_batch_size",
    "data.prefetch_factor": "data.num_workers",
}


def _knobs(changes: dict[str, Any]) -> set[str]:
    """The knobs `changes` turn. Every `parallel.*` key is one knob, the layout: two layouts that won
    are alternatives (DDP's `dp_replicate` and ZeRO-2's `zero_stage` merged would be a third layout)."""
    return {"parallel" if key.startswith("parallel.") else _SAME_KNOB.get(key, key) for key in changes}


def _mmss(seconds: float) -> str:
    return f"{int(seconds // 60)}:{int(seconds % 60):02d}"


def check_allow(words: Sequence[str]) -> tuple[str, ...]:
    from tracetrain.errors import ConfigError
    from tracetrain.tune.space import ALLOW_CHOICES

    bad = [w for w in words if w not in ALLOW_CHOICES]
    if bad:
        raise ConfigError(f"--allow {','.join(bad)}: not a kind tune knows; allowed: {', '.join(ALLOW_CHOICES)}")
    return tuple(words)
