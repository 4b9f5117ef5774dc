"""`tracetrain generate --chat`: answer one user message (plus an optional system message) with the run's
chat template, as the model saw conversations in training, stopping at EOS or an end-of-turn id.

The caller renders each prompt with the template and `add_generation_prompt=True` (data/chat.py
`chat_prompt_ids`: ids, BOS only where the tokenizer adds one and the template did not already write it),
and a row ends at any of the tokenizer's `stop_ids` (EOS, `<|im_end|>`, `<|eot_id|>`, ...).
"""

from __future__ import annotations

import time
from typing import Any

from tracetrain.models.generate import GenerationRequest, generate_batch, generation_lines
from tracetrain.models.llama import Transformer


def generate_chat(
    model: Transformer,
    tok: Any,
    prompts: list[str],
    prompt_ids: list[list[int]],
    *,
    max_new_tokens: int = 128,
    stop: list[str] | None = None,
    **options: Any,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """One {"prompt", "completion", "finish_reason", "tokens"} per prompt, and a summary, as
    `generate_records` returns them; `prompt_ids[i]` is `prompts[i]` rendered with the run's chat template
    (data/chat.py `chat_prompt_ids`); `options` go to `generate_batch` (sampling, dtype, KV offload)."""
    requests = [GenerationRequest(ids, max_new_tokens, list(stop or [])) for ids in prompt_ids]
    start = time.perf_counter()
    # One prompt per batch: a chat turn is answered alone, and a row's result does not depend on its batch.
    results = [generate_batch(model, [r], tok.stop_ids, tok.pad_id, decode=tok.decode, **options)[0] for r in requests]
    return generation_lines(prompts, results, time.perf_counter() - start)
