"""Held-out evaluation: loss and perplexity during training; exact match by greedy generation at the end."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

from torch import nn

from tracetrain.config import Config
from tracetrain.data import encode_prompt, exact_match, iter_batches
from tracetrain.models.generate import generate
from tracetrain.progress import Progress, ReportingList
from tracetrain.train.step import StepContext, evaluate


def run_eval(
    model: nn.Module, eval_ds: Any, cfg: Config, ctx: StepContext, progress: Progress | None = None
) -> dict[str, float]:
    """Loss / perplexity over the first `train.eval_batches` held-out batches (each reported to `progress`)."""
    batches = list(itertools.islice(iter_batches(eval_ds, cfg.train.micro_batch_size), cfg.train.eval_batches))
    if not batches:
        return {}
    return evaluate(model, ReportingList(batches, progress, "evaluating", "batches"), ctx)


def exact_match_eval(
    model: nn.Module,
    tokenizer: Any,
    examples: list[tuple[str, str]],
    cfg: Config,
    ctx: StepContext,
    run_dir: Path | None,
    batch_size: int = 32,
    samples_path: Path | None = None,
    progress: Progress | None = None,
) -> dict[str, float]:
    """Greedy answers to held-out prompts, scored by exact match (GSM8K-style `#### N` references: the final
    number); answers written to `samples_path`, else to run_dir/samples.jsonl when a run_dir is given."""
    examples = examples[: cfg.train.eval_generate]
    if not examples:
        return {}
    correct = 0
    samples = []
    max_new = max(8, min(512, cfg.data.seq_len // 2))
    for i in range(0, len(examples), batch_size):
        chunk = examples[i : i + batch_size]
        prompts = [encode_prompt(tokenizer, p) for p, _ in chunk]  # BOS only when the tokenizer has one
        # Any stop id ends an answer: EOS and end-of-turn tokens (<|eot_id|>, <|im_end|>, ...).
        outs = generate(
            model,  # type: ignore[arg-type]  # a Transformer with transforms applied (typed nn.Module here)
            prompts,
            max_new,
            tokenizer.stop_ids,
            tokenizer.pad_id,
            dtype=ctx.autocast_dtype,
        )  # None: the model's own dtype
        for (prompt, reference), ids in zip(chunk, outs):
            prediction = tokenizer.decode(ids)
            ok = exact_match(prediction, reference, cfg.data.kind)
            correct += ok
            samples.append({"prompt": prompt, "reference": reference, "prediction": prediction, "correct": ok})
        if progress:
            progress("generating answers", len(samples), len(examples), "examples")
    samples_path = samples_path or (run_dir / "samples.jsonl" if run_dir is not None else None)
    if samples_path is not None:
        with open(samples_path, "w") as f:
            f.writelines(json.dumps(s) + "\n" for s in samples)
    return {"exact_match": correct / len(examples), "exact_match_n": len(examples)}


def final_evaluation(
    model: nn.Module, tokenizer: Any, eval_ds: Any, cfg: Config, ctx: StepContext, run_dir: Path | None, reporter: Any
) -> dict[str, Any]:
    with reporter.status("final evaluation") as progress:
        result: dict[str, Any] = dict(run_eval(model, eval_ds, cfg, ctx, progress))
        examples = getattr(eval_ds, "examples", [])
        result.update(exact_match_eval(model, tokenizer, examples, cfg, ctx, run_dir, progress=progress))
    return result
