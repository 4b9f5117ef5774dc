"""The 2-GPU case of tune_check.py: does `tracetrain tune --gpus 2` pick a layout within 5% of the best
measured one (issue #31, point 5)?

1. `tracetrain.tune(..., gpus=2)` from the default switches, within its budget: its candidates start with
   the planner's top three layouts other than the baseline's (tune/space.py `layout_changes`);
2. the reference: every distinct layout the planner lists for 2 GPUs (`plan.search_layouts`: DDP, FSDP,
   ZeRO-1/2, tp2, cp2, pp2 with each schedule where the model allows a pipeline), each as the planner's
   best row of that layout, measured in its own process with tune's own trial window (a fresh ledger:
   nothing is reused from step 1), in the planner's order until the reference budget runs out;
3. tune's pick (its tuned config) measured the same way, unless it is one of the reference rows;
4. the ratio: the pick's reference tokens/s over the best layout's (pass: >= 0.95; above 1 when the pick
   is a layout plus other changes that beat every plain layout).
"""

from __future__ import annotations

import time
from dataclasses import fields
from pathlib import Path
from typing import Any

from tracetrain.config import Config, load_config
from tracetrain.plan import search_layouts
from tracetrain.tune.session import BudgetSpent, Options, Session, Trial
from tracetrain.tune.space import Candidate, Planner, per_gpu_tokens_per_s, row_changes
from tracetrain.tune.trial import Window

WITHIN = 0.95  # the bar: tune's pick within 5% of the best measured layout


def run_layout_case(
    name: str, overrides: list[str], budget_min: float, ref_budget_min: float, gpus: int, work: Path
) -> dict[str, Any]:
    """Tune with `gpus` GPUs, then measure every planner layout and tune's pick; the case's result row."""
    import shutil

    import tracetrain

    out = work / name
    shutil.rmtree(out, ignore_errors=True)  # a fresh tune and a fresh reference: nothing recorded earlier
    say = lambda line: print(f"  {name}: {line}", flush=True)  # noqa: E731
    start = time.monotonic()
    result = tracetrain.tune(None, overrides=overrides, budget_min=budget_min, gpus=gpus, out_dir=out, say=say)
    tune_s = time.monotonic() - start
    cfg = load_config(out / "tune" / "base.toml")  # the config tune's trials started from
    gpu = result.device.partition("(")[2].rstrip(")") or "h100-sxm"  # "cuda (NVIDIA H200)": the planner's GPU
    session = Session(cfg, _options(ref_budget_min, gpus), out / "reference", result.device, gpu, say)
    rows, picked = _reference(session, result.config)
    ref_s = time.monotonic() - start - tune_s
    # The best measured layout (tune's pick, when it is a layout plus other changes, may beat them all).
    measured = [r for r in rows if r["tokens_per_s"] and r["label"].startswith("layout ")]
    best = max(measured, key=lambda r: r["tokens_per_s"], default=None)
    pick = next((r for r in rows if r["is_pick"]), None)
    ratio = pick["tokens_per_s"] / best["tokens_per_s"] if pick and best and pick["tokens_per_s"] else None
    tune_best = result.best or result.baseline
    return {
        "case": name,
        "gpus": gpus,
        "overrides": overrides,
        "budget_min": budget_min,
        "reference_budget_min": ref_budget_min,
        "tune_pick": picked,
        "tune_pick_changes": result.changes,
        "tune_pick_tokens_per_s_in_tune": tune_best.tokens_per_s if tune_best else None,
        "tune_pick_tokens_per_s": pick["tokens_per_s"] if pick else None,
        "best_layout": best["label"] if best else None,
        "best_layout_tokens_per_s": best["tokens_per_s"] if best else None,
        "ratio_pick_to_best": ratio,
        "within_5_percent": ratio >= WITHIN if ratio is not None else None,
        "layouts_tune_measured": [t.candidate.label for t in result.trials if t.candidate.source == "layout"],
        "num_trials": sum(1 for t in result.trials if t.outcome.status != "pruned"),
        "minutes": result.seconds / 60,
        "reference_minutes": ref_s / 60,
        "num_reference_layouts": sum(1 for r in rows if r["label"].startswith("layout ")),
        "reference": rows,
        "trials": [_trial(t) for t in result.trials],
        "notes": result.notes + session.notes,
    }


def _options(budget_min: float, gpus: int) -> Options:
    return Options(budget_min, None, (), Window(), gpus, ())  # tune's default window (3 warm-up, 10 measured)


def _reference(session: Session, tuned: Config) -> tuple[list[dict[str, Any]], str]:
    """Each planner layout's best row, measured; tune's pick marked (and measured too if it is none of
    them). Returns the rows and the pick's label."""
    base = session.cfg.replace(session.implicit)
    planner = Planner.of(base, session.gpu, session.opts.gpus, None)
    assert planner.base is not None, "the planner cannot plan the case's config"
    cands = []
    for row in search_layouts(planner.base.input, planner.gpus):
        changes = {**session.implicit, **row_changes(planner, row)}
        cands.append(
            Candidate(
                f"layout {row.layout()}",
                tuple(sorted(changes.items())),
                row.reason,
                "reference",
                predicted_tokens_per_s=per_gpu_tokens_per_s(row),
                predicted_peak_gib=row.peak_gib,
                fits=True,
            )
        )
    match = [c for c in cands if _config(session.cfg, c.change_dict) == tuned]
    picked = match[0].label if match else "tune's pick"
    if not match:  # a layout plus other changes (a combination): measured first, it is what is judged
        changes = _changes(session.cfg, tuned)
        cands.insert(0, Candidate(picked, tuple(sorted(changes.items())), "tune's tuned config", "reference"))
    rows = []
    for cand in cands:
        row = {
            "label": cand.label,
            "changes": cand.change_dict,
            "reason": cand.reason,
            "predicted_tokens_per_s": cand.predicted_tokens_per_s,
            "predicted_peak_gib": cand.predicted_peak_gib,
            "is_pick": cand.label == picked,
            "status": "not measured (reference budget)",
            "tokens_per_s": None,
        }
        rows.append(row)
        try:
            trial = session.measure("reference", cand)
        except BudgetSpent:
            continue
        session.say(_line(trial))
        m = trial.outcome.measurement
        row |= {
            "status": trial.outcome.status,
            "message": trial.outcome.message,
            "seconds": trial.outcome.seconds,
            "tokens_per_s": trial.tokens_per_s,
            "peak_gib": m.peak_gib if m else None,
            "peak_reserved_gib": m.peak_reserved_gib if m else None,
            "loss": m.loss if m else None,
        }
        if trial.tokens_per_s and cand.predicted_tokens_per_s:  # the planner's error on this layout
            row["planner_error"] = cand.predicted_tokens_per_s / trial.tokens_per_s - 1
    return rows, picked


def _config(cfg: Config, changes: dict[str, Any]) -> Config | None:
    """`cfg` with `changes`, or None where the config refuses them (the trial then records why)."""
    from tracetrain.errors import TracetrainError

    try:
        return cfg.replace(changes)
    except TracetrainError:
        return None


def _changes(cfg: Config, tuned: Config) -> dict[str, Any]:
    """The keys (section.name) where `tuned` differs from `cfg`."""
    out = {}
    for section in fields(tuned):
        a, b = getattr(cfg, section.name), getattr(tuned, section.name)
        for key in fields(b):
            if getattr(a, key.name) != getattr(b, key.name):
                out[f"{section.name}.{key.name}"] = getattr(b, key.name)
    return out


def _line(trial: Trial) -> str:
    o = trial.outcome
    what = f"{trial.tokens_per_s:,.0f} tok/s" if trial.tokens_per_s else f"{o.status}: {o.message}"
    return f"reference {trial.candidate.label}: {what} ({o.seconds:.0f} s)"


def _trial(t: Trial) -> dict[str, Any]:
    m = t.outcome.measurement
    return {
        "label": t.candidate.label,
        "role": t.role,
        "source": t.candidate.source,
        "changes": dict(t.candidate.changes),
        "status": t.outcome.status,
        "message": t.outcome.message,
        "predicted_gain": t.candidate.predicted_gain,
        "measured_gain": t.gain,
        "predicted_tokens_per_s": t.candidate.predicted_tokens_per_s,
        "tokens_per_s": m.tokens_per_s if m else None,
        "peak_gib": m.peak_gib if m else None,
        "winner": t.winner,
        "seconds": t.outcome.seconds,
    }


def table(rows: list[dict[str, Any]]) -> str:
    """The markdown lines of the 2-GPU cases."""
    lines = [
        "| case | tune's pick | tok/s (reference) | best layout | tok/s | ratio | trials | tune min | ref min |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['case']} | error: {r['error'][:80]} | | | | | | | |")
            continue
        f = lambda v, p="{:,.0f}": p.format(v) if isinstance(v, (int, float)) else "-"  # noqa: E731
        lines.append(
            f"| {r['case']} | {r['tune_pick']} | {f(r['tune_pick_tokens_per_s'])} | {r['best_layout']} | "
            f"{f(r['best_layout_tokens_per_s'])} | {f(r['ratio_pick_to_best'], '{:.3f}')} | "
            f"{r['num_trials']} | {r['minutes']:.1f} | {r['reference_minutes']:.1f} |"
        )
    return "\n".join(lines)
