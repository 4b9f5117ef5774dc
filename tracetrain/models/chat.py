"""`tracetrain generate --chat`: answer one user message (plus an optional system message) with the run's
chat template, as the model saw conversations in training, stopping at EOS or an end-of-turn id.

The prompt is the template rendered with `add_generation_prompt=True` (data/chat.py
`render_generation_prompt`: ids, BOS only where the tokenizer adds one and the template did not already
write it), and a row ends at any of the tokenizer's `stop_ids` (EOS, `<|im_end|>`, `<|eot_id|>`, ...).
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

from tracetrain.config import Config
from tracetrain.data.tokenizer import Tokenizer
from tracetrain.errors import TracetrainError
from tracetrain.models.generate import GenerationRequest, generate_batch
from tracetrain.models.llama import Transformer


def chat_messages(prompt: str, system: str | None = None) -> list[dict[str, str]]:
    """[system (when given), user] messages for one prompt."""
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]


def chat_prompt_ids(cfg: Config, tok: Tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """The ids a run's model answers `messages` from: its chat template with the generation prompt."""
    from tracetrain.data.chat import render_generation_prompt, resolve_chat_template

    template = resolve_chat_template(cfg.data, tok)
    if template is None:
        raise TracetrainError(
            f"--chat needs a chat template: the run's tokenizer {tok.name} has none and "
            f"data.chat_template = {cfg.data.chat_template!r}; pass "
            "--data.chat_template=NAME_OR_FILE.jinja, or drop --chat"
        )
    return render_generation_prompt(template, tok, messages)


def generate_chat(
    model: Transformer,
    tok: Tokenizer,
    cfg: Config,
    prompts: list[str],
    system: str | None = None,
    *,
    max_new_tokens: int = 128,
    stop: list[str] | None = None,
    **options: Any,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """One {"prompt", "completion", "finish_reason", "tokens"} per prompt, and a summary, as
    `generate_records` returns them; `options` go to `generate_batch` (sampling, dtype, KV offload)."""
    requests = [
        GenerationRequest(chat_prompt_ids(cfg, tok, chat_messages(p, system)), max_new_tokens, list(stop or []))
        for p in prompts
    ]
    start = time.perf_counter()
    # One prompt per batch: a chat turn is answered alone, and a row's result does not depend on its batch.
    results = [generate_batch(model, [r], tok.stop_ids, tok.pad_id, decode=tok.decode, **options)[0] for r in requests]
    seconds = time.perf_counter() - start
    lines = [
        {"prompt": p, "completion": out.text, "finish_reason": out.finish_reason, "tokens": out.num_generated}
        for p, out in zip(prompts, results)
    ]
    generated = sum(out.num_generated for out in results)
    summary = {
        "prompts": len(prompts),
        "tokens": generated,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(generated / seconds, 1) if seconds > 0 else None,
        "finish_reasons": dict(Counter(out.finish_reason for out in results)),
    }
    return lines, summary
