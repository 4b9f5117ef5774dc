"""Batched autoregressive generation with a static KV cache: greedy, temperature, top-k, top-p.

Prompts of different lengths are left-padded; padded positions are masked out of attention and
position ids count only real tokens, so each row generates exactly as it would alone.
"""

from __future__ import annotations

import torch

from tracetrain.models.llama import KVCache, Transformer


def sample_next(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                generator: torch.Generator | None) -> torch.Tensor:
    """(batch, vocab) logits -> (batch,) token ids."""
    if temperature <= 0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(-1, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop = cumulative - sorted_logits.softmax(-1) > top_p  # keep the smallest set reaching top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(model: Transformer, prompts: list[list[int]], max_new_tokens: int, eos_id: int, pad_id: int, *,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
             generator: torch.Generator | None = None, dtype: torch.dtype | None = None) -> list[list[int]]:
    """Continue each prompt; returns only the new tokens, cut at (and excluding) EOS."""
    device = model.embed_tokens.weight.device
    dtype = dtype or model.embed_tokens.weight.dtype
    batch, longest = len(prompts), max(len(p) for p in prompts)
    tokens = torch.full((batch, longest), pad_id, dtype=torch.long, device=device)
    valid = torch.zeros(batch, longest, dtype=torch.bool, device=device)
    for i, p in enumerate(prompts):
        tokens[i, longest - len(p):] = torch.tensor(p, device=device)
        valid[i, longest - len(p):] = True
    positions = (valid.long().cumsum(-1) - 1).clamp(min=0)  # (batch, longest)
    cache = KVCache(model.args, batch, longest + max_new_tokens, device, dtype)
    cache.valid[:, :longest] = valid
    was_training = model.training
    model.eval()
    with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
        logits = model(tokens, positions, cache=cache)[:, -1]
        next_pos = positions[:, -1] + 1
        out = torch.empty(batch, 0, dtype=torch.long, device=device)
        finished = torch.zeros(batch, dtype=torch.bool, device=device)
        for _ in range(max_new_tokens):
            nxt = sample_next(logits, temperature, top_k, top_p, generator)
            nxt = torch.where(finished, torch.full_like(nxt, pad_id), nxt)
            out = torch.cat([out, nxt[:, None]], dim=1)
            finished |= nxt == eos_id
            if bool(finished.all()):  # host sync per token: generation is latency-bound anyway
                break
            logits = model(nxt[:, None], next_pos[:, None], cache=cache)[:, -1]
            next_pos = next_pos + 1
    model.train(was_training)
    results = []
    for row in out.tolist():
        results.append(row[: row.index(eos_id)] if eos_id in row else row)
    return results
