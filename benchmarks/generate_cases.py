"""The measured cases of benchmarks/generate.py: the cached attention's kernel paths, one decode/prefill
case of ours (`gpu`, `gpu+graph`, `offload`) or of transformers (`hf`), and their logits compared."""

from __future__ import annotations

import statistics

import torch
from generate_measure import (
    GIB,
    PREFILL_VARIANTS,
    autocast,
    does_not_fit,
    failure,
    free_memory,
    median_s,
    prefill,
    refetch_bytes,
    sync,
)

from tracetrain.models.attention import cached_attention, sdpa_attention
from tracetrain.models.generate import GraphedDecodeStep, forward_last, make_cache
from tracetrain.models.kv_cache import OffloadedKVCache, causal_valid_mask
from tracetrain.models.llama import ModelArgs, Transformer
from tracetrain.models.prefill import PrefillMode, last_position_refusal
from tracetrain.plan import plan_generation, plan_prefill


def attention_kernels(s: dict) -> list[dict]:
    """The cached attention's kernel paths at GQA shapes vs the `enable_gqa` + dense-mask call of before."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    a, dev, rows = s["attention"], s["device"], []
    fused = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
    shapes = [("decode", b, 1) for b in a["batches"]] + [("prefill chunk", 1, a["chunk"])]
    for phase, batch, q_len in shapes:
        keys = a["keys"]
        q = torch.randn(batch, q_len, a["heads"], a["head_dim"], device=dev, dtype=s["dtype"]).transpose(1, 2)
        k, v = torch.randn(2, batch, a["kv_heads"], keys, a["head_dim"], device=dev, dtype=s["dtype"]).unbind(0)
        valid = torch.ones(batch, keys, dtype=torch.bool, device=dev)
        dense = causal_valid_mask(valid, torch.arange(keys - q_len, keys, device=dev), keys)
        paths = {
            "new: no mask tensor (flash)": lambda: cached_attention(q, k, v, causal_lower_right(q_len, keys)),
            "new: dense mask, grouped heads": lambda: cached_attention(q, k, v, dense),
            "before: enable_gqa + dense mask": lambda: sdpa_attention(q, k, v, dense),
        }
        for name, fn in paths.items():
            row = {"phase": phase, "batch": batch, "q_len": q_len, "keys": keys, "path": name}
            try:
                row["ms"] = round(median_s(fn, dev) * 1e3, 3)
                if dev.type == "cuda":
                    try:
                        with sdpa_kernel(fused):
                            fn()
                        row["without_math"] = True
                    except RuntimeError:
                        row["without_math"] = False
            except Exception as e:
                row["status"] = failure(e)
            rows.append(row)
            free_memory()
        del q, k, v, dense
        free_memory()
    return rows


def run_ours(model: Transformer, method: str, batch: int, context: int, s: dict, mode: PrefillMode = "eager") -> dict:
    warmup, steps, repeats = s["decode"]["offload" if method == "offload" else "gpu"]
    prompt, dev, graph = context - warmup - steps * repeats, s["device"], method == "gpu+graph"
    cache = make_cache(model, batch, context, s["dtype"], method == "offload", 0, fixed_shape=method == "gpu+graph")
    cache.set_prompt_mask(torch.ones(batch, prompt, dtype=torch.bool, device=dev))
    logits, prefill_s, path = prefill(model, cache, batch, prompt, s, mode)
    use_graph = graph and dev.type == "cuda"
    step = GraphedDecodeStep(model, cache, batch, dev) if use_graph else (lambda t, p, c: forward_last(model, t, p, c))
    token, pos = logits.argmax(-1, keepdim=True), torch.full((batch, 1), prompt, device=dev)
    tok_s = []
    with torch.no_grad(), autocast(s, graph):
        for _ in range(warmup):
            token, pos = step(token, pos, cache).argmax(-1, keepdim=True), pos + 1
        for _ in range(repeats):
            start = sync(dev)
            for _ in range(steps):
                token, pos = step(token, pos, cache).argmax(-1, keepdim=True), pos + 1
            tok_s.append(batch * steps / (sync(dev) - start))
    if isinstance(cache, OffloadedKVCache):
        cache.synchronize()
    row = {
        "prefill_path": path,
        "prefill_last_block": "every position" if last_position_refusal(model) else "last position",
        "prefill_tok_s": batch * prompt / prefill_s if prefill_s else None,
        "decode_tok_s": statistics.median(tok_s),
        "decode_tok_s_repeats": [round(x, 1) for x in tok_s],
        "decode_steps": f"{warmup} warm-up + {repeats} x {steps}",
    }
    if prefill_s is None:
        row["note"] = (
            f"prefill not run: it would copy {refetch_bytes(model.args, batch, prompt, s) / 1e9:.3g} GB "
            "host-to-device; decode timed on a cache that claims the prompt's positions"
        )
    return row


def run_hf(hf, batch: int, context: int, s: dict) -> dict:
    _, steps, repeats = s["decode"]["hf"]
    dev = s["device"]
    ids = torch.randint(0, hf.config.vocab_size, (batch, context - 1 - steps), device=dev)
    kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=False, eos_token_id=None, pad_token_id=0)

    def timed(n: int) -> float:
        start = sync(dev)
        out = hf.generate(ids, max_new_tokens=n, **kwargs)
        end = sync(dev)
        assert out.shape[1] == ids.shape[1] + n, f"HF generated {out.shape[1] - ids.shape[1]} of {n} tokens"
        return end - start

    pairs = []
    with torch.no_grad():
        while len(pairs) < repeats:
            one = timed(1)
            pairs.append((one, timed(1 + steps)))
            if one > 1.0:  # a pair is not cheap: one is enough
                break
    decode = [batch * steps / (full - one) for one, full in pairs if full > one]
    return {
        "prefill_tok_s": batch * ids.shape[1] / statistics.median(p[0] for p in pairs),
        "decode_tok_s": statistics.median(decode) if decode else None,  # None: timing noise
        "decode_tok_s_repeats": [round(x, 1) for x in decode],
        "decode_steps": f"{len(pairs)} x {steps}",
    }


def logits_difference(ours: Transformer, hf, s: dict) -> dict:
    """Both models on one random prompt: the weights are shared, so the logits must agree (to bf16 noise)."""
    tokens = torch.randint(0, ours.args.vocab_size, (1, 64), device=s["device"])
    with torch.no_grad(), autocast(s):
        a, b = ours(tokens).float(), hf(tokens).logits.float()
    return {
        "max_abs_diff": round((a - b).abs().max().item(), 4),
        "logit_std": round(b.std().item(), 4),
        "same_argmax": round((a.argmax(-1) == b.argmax(-1)).float().mean().item(), 3),
    }


def cached_logits_difference(ours: Transformer, hf, s: dict) -> dict:
    """The cached path against transformers' whole-prompt logits on one random prompt: the first 63 tokens
    prefilled into an in-GPU cache (the last position's logits), then one decode step for the 64th (the
    paths generation runs, with the fused kernels in the fused twin)."""
    tokens = torch.randint(0, ours.args.vocab_size, (1, 64), device=s["device"])
    positions = torch.arange(64, device=s["device"])[None]
    cache = make_cache(ours, 1, 64, s["dtype"], False, 0)
    cache.set_prompt_mask(torch.ones(1, 63, dtype=torch.bool, device=s["device"]))
    with torch.no_grad(), autocast(s):
        prefilled = forward_last(ours, tokens[:, :63], positions[:, :63], cache).float()
        decoded = forward_last(ours, tokens[:, 63:], positions[:, 63:], cache).float()
        ref = hf(tokens).logits.float()
    a, b = torch.stack([prefilled[0], decoded[0]]), ref[0, 62:64]
    return {
        "max_abs_diff": round((a - b).abs().max().item(), 4),
        "logit_std": round(b.std().item(), 4),
        "same_argmax": round((a.argmax(-1) == b.argmax(-1)).float().mean().item(), 3),
    }


def run_case(
    ours, hf, name: str, args: ModelArgs, method: str, batch: int, context: int, s: dict, variant: str = "eager"
) -> dict:
    """One row: `hf`, or ours (`ours`: {"plain": model, "fused": its fused-kernel twin}) with a prefill
    variant of PREFILL_VARIANTS (the offloaded cache runs the eager one)."""
    row = {"model": name, "batch": batch, "context": context, "method": method}
    if method != "hf":
        row["variant"] = variant
    dtype_bytes = torch.empty((), dtype=s["dtype"]).element_size()
    plan = plan_generation(args, batch, context, dtype_bytes, s["gpu"], offload=method == "offload")
    row["plan_decode_tok_s"] = round(plan.decode_tokens_per_s, 1)
    if method in ("gpu", "gpu+graph"):  # the whole prompt in one forward (the offloaded cache runs chunks)
        row["plan_prefill_tok_s"] = round(
            plan_prefill(args, batch, context, dtype_bytes, s["gpu"], variant).tokens_per_s
        )
    if method == "gpu+graph" and s["device"].type != "cuda":
        row["note"] = "no CUDA: the fixed-shape step runs eagerly"
    if method == "hf" and hf is None:
        return {**row, "status": "skipped: transformers is not installed"}
    reason = does_not_fit(args, method == "offload", batch, context, s)
    if reason:
        return {**row, "status": f"does not fit (predicted): {reason}"}
    try:
        if method == "hf":
            result = run_hf(hf, batch, context, s)
        else:
            which, mode = PREFILL_VARIANTS[variant]
            result = run_ours(ours[which], method, batch, context, s, mode)
        row.update(status="ok", **{k: round(v, 1) if isinstance(v, float) else v for k, v in result.items()})
    except Exception as e:
        row["status"] = failure(e)
    if s["device"].type == "cuda":
        row["peak_gib"] = round(torch.cuda.max_memory_allocated() / GIB, 2)
    free_memory()
    return row
