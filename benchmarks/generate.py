"""Generation speed: prefill and decode tokens/s of tracetrain's `generate_batch` with the in-GPU cache
(eager, and with the decode step replayed as a CUDA graph) and the offloaded cache, next to Hugging Face
transformers' `generate` with its default (dynamic) cache, on the same random weights; then the longest
context that fits at batch 1, with and without offload (doubling search).

Unattended, one process, a time budget (`--budget-s`, default 330 s; the longest case, llama3-8b at batch
16 and 32k offloaded, is estimated at about a minute, so the run should end within 8 minutes): a case
that would start after the budget is reported as skipped. Cases the planner
(`tracetrain.plan.plan_generation`) says cannot fit in GPU or host memory are skipped with the reason;
an out-of-memory error ends only its own case; memory is freed between cases. Prompts are random token
ids of one length (no padding) so that the peer sees the same work; EOS is never sampled, every row
decodes its full budget.

Measured per case: prefill tokens/s (the whole prompt, chunked by `generate_batch`), decode tokens/s
(batch x decode steps / time, the first decode step - lazy init, graph capture - left out; transformers:
(time of n new tokens - time of 1) / (n - 1)), peak GPU memory, and the planner's decode estimate.
"Fits" in the search = a cache of that length is allocated and a decode step at its last position runs
(no prefill: chunked, its extra memory scales with the chunk, and the attention backend decides how).
Prefill chunks are bounded so that attention scores, if SDPA falls back to its math backend (GQA with
a mask), stay within 4 GiB; an offloaded prefill that would copy more than 200 GB host-to-device (each
chunk fetches all earlier positions; llama3-8b at batch 16 and 32k) is not run: decode is then timed on
a synthetic cache.

  python3 benchmarks/generate.py           # GPU: llama2-7b and llama3-8b shapes, bf16 (writes $OUT and results/)
  python3 benchmarks/generate.py --tiny    # CPU smoke test: a tiny model, small contexts, fp32
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, write_result  # noqa: E402

from tracetrain.models.generate import GenerationRequest, forward_last, generate_batch, make_cache  # noqa: E402
from tracetrain.models.llama import ModelArgs, Transformer, rope_inv_freq  # noqa: E402
from tracetrain.models.presets import get_preset  # noqa: E402
from tracetrain.models.accounting import kv_cache_bytes  # noqa: E402
from tracetrain.plan import plan_generation  # noqa: E402

METHODS = ("gpu", "gpu+graph", "offload", "hf")
GIB = 2**30


def setup(tiny: bool) -> dict:
    if tiny:
        args = ModelArgs(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=160, vocab_size=256)
        return dict(device=torch.device("cpu"), dtype=torch.float32, models={"tiny": args}, batches=(1, 4),
                    contexts=(64, 256), new_tokens={"gpu": 8, "offload": 8, "hf": 8}, search=(64, 4096),
                    chunk=32, gpu="h100-sxm", refetch_limit=1e6)
    return dict(device=torch.device("cuda"), dtype=torch.bfloat16,
                models={n: get_preset(n) for n in ("llama2-7b", "llama3-8b")}, batches=(1, 16),
                contexts=(4096, 32768), new_tokens={"gpu": 32, "offload": 8, "hf": 32}, search=(4096, 1 << 21),
                chunk=2048, gpu=torch.cuda.get_device_name(0), refetch_limit=200e9)


def host_available_bytes() -> int:
    for line in open("/proc/meminfo"):
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        if hasattr(torch._C, "_host_emptyCache"):
            torch._C._host_emptyCache()  # cached pinned blocks go back to the OS (the next case pins other sizes)
        torch.cuda.reset_peak_memory_stats()


def is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


def build_models(args: ModelArgs, device: torch.device, dtype: torch.dtype) -> tuple[Transformer, object | None]:
    """Random weights shared by tracetrain's model and the HF one (no second copy); HF None if absent."""
    try:
        import transformers
    except ImportError:
        transformers = None
    if transformers is None:
        from tracetrain.models.build import materialize
        return materialize(args, device, 0, dtype).eval(), None
    extra = {"rope_scaling": {"rope_type": "llama3", **args.rope_scaling}} if args.rope_scaling else {}
    cfg = transformers.LlamaConfig(hidden_size=args.dim, intermediate_size=args.ffn_dim,
                                   num_hidden_layers=args.n_layers,
                                   num_attention_heads=args.n_heads, num_key_value_heads=args.n_kv_heads,
                                   vocab_size=args.vocab_size, rope_theta=args.rope_theta, rms_norm_eps=args.norm_eps,
                                   max_position_embeddings=1 << 22, tie_word_embeddings=args.tie_embeddings,
                                   attention_bias=args.qkv_bias, bos_token_id=None, eos_token_id=None, pad_token_id=0,
                                   **extra)
    cfg._attn_implementation = "sdpa"
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        torch.manual_seed(0)
        with torch.device(device):
            hf = transformers.LlamaForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(default)
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    with torch.device("meta"):
        ours = Transformer(args)
    ours.load_state_dict({k.removeprefix("model."): v for k, v in hf.state_dict().items()}, assign=True)
    ours.rope_inv_freq = rope_inv_freq(args).to(device)  # a non-persistent buffer: not in the state dict
    ours.tie_weights()
    return ours.eval(), hf


def sync(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def prefill_chunk(args: ModelArgs, batch: int, context: int, s: dict) -> int:
    """Prefill chunk bounded so that materialised fp32 scores (batch, heads, chunk, context) stay <= 4 GiB:
    with GQA and a mask, SDPA may fall back to its math backend (efficient attention has no GQA, flash no
    mask); 128 <= chunk <= the default."""
    limit = 4 * GIB // (batch * args.n_heads * context * 4)
    return max(min(128, s["chunk"]), min(s["chunk"], 1 << max(0, limit.bit_length() - 1)))


def refetch_bytes(args: ModelArgs, batch: int, context: int, chunk: int, s: dict) -> int:
    """Bytes an offloaded chunked prefill copies host-to-device: every chunk fetches all earlier positions."""
    dtype_bytes = torch.empty((), dtype=s["dtype"]).element_size()
    num_chunks = context // chunk
    return num_chunks * (num_chunks - 1) // 2 * chunk * kv_cache_bytes(args, batch, 1, dtype_bytes)


def synthetic_cache(model: Transformer, batch: int, context: int, offload: bool, filled: int, s: dict):
    """A cache of `context` positions that claims `filled` of them (not written: timing and memory only)."""
    cache = make_cache(model, batch, context, s["dtype"], offload, 0)
    cache.length = filled
    if offload:
        cache.fetch(0)
    else:
        cache.pos.fill_(filled)
    return cache


def decode_only(model: Transformer, method: str, batch: int, context: int, new: int, s: dict) -> dict:
    """Decode steps on a synthetic cache (no prefill), timed after the first; eager forwards, greedy."""
    cache = synthetic_cache(model, batch, context, method == "offload", context - new, s)
    tokens = torch.zeros(batch, 1, dtype=torch.long, device=s["device"])
    positions = torch.full((batch, 1), context - new, device=s["device"])
    with torch.no_grad(), torch.autocast(s["device"].type, dtype=s["dtype"], enabled=s["dtype"] != torch.float32):
        for step in range(new):
            if step == 1:
                start = sync(s["device"])
            tokens = forward_last(model, tokens, positions, cache).argmax(-1, keepdim=True)
            positions = positions + 1
    seconds = sync(s["device"]) - start
    if method == "offload":
        cache.synchronize()
    return {"decode_tok_s": batch * (new - 1) / seconds, "decode_steps": new - 1}


def run_ours(model: Transformer, method: str, batch: int, context: int, new: int, s: dict) -> dict:
    chunk = prefill_chunk(model.args, batch, context, s)
    refetch = refetch_bytes(model.args, batch, context, chunk, s)
    if method == "offload" and refetch > s["refetch_limit"]:
        return {**decode_only(model, method, batch, context, new, s), "prefill_chunk": chunk,
                "note": f"prefill not run: in chunks of {chunk} it would copy {refetch / 1e9:.3g} GB "
                        "host-to-device; decode timed on a synthetic cache"}
    prompts = torch.randint(0, model.args.vocab_size, (batch, context - new)).tolist()
    timings: dict = {}
    generate_batch(model, [GenerationRequest(p, new) for p in prompts], -1, 0, dtype=s["dtype"],
                   kv_offload=method == "offload", cuda_graph=method == "gpu+graph", prefill_chunk=chunk,
                   timings=timings)
    return {"prefill_tok_s": timings["prefill_tokens"] / timings["prefill_s"],
            "decode_tok_s": batch * timings["decode_steps"] / timings["decode_s"] if timings["decode_s"] else None,
            "decode_steps": timings["decode_steps"], "prefill_chunk": chunk}


def run_hf(hf, batch: int, context: int, new: int, device: torch.device) -> dict:
    ids = torch.randint(0, hf.config.vocab_size, (batch, context - new), device=device)
    kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=False, eos_token_id=None, pad_token_id=0)

    def timed(n: int) -> float:
        start = sync(device)
        out = hf.generate(ids, max_new_tokens=n, **kwargs)
        end = sync(device)
        assert out.shape[1] == ids.shape[1] + n, f"HF generated {out.shape[1] - ids.shape[1]} of {n} tokens"
        return end - start

    with torch.no_grad():
        one, full = timed(1), timed(new)
    return {"prefill_tok_s": batch * ids.shape[1] / one,
            "decode_tok_s": batch * (new - 1) / (full - one) if full > one else None,  # None: timing noise
            "decode_steps": new - 1}


def logits_difference(ours: Transformer, hf, s: dict) -> dict:
    """Both models on one random prompt: the weights are shared, so the logits must agree (to bf16 noise)."""
    tokens = torch.randint(0, ours.args.vocab_size, (1, 64), device=s["device"])
    with torch.no_grad(), torch.autocast(s["device"].type, dtype=s["dtype"], enabled=s["dtype"] != torch.float32):
        a, b = ours(tokens).float(), hf(tokens).logits.float()
    return {"max_abs_diff": round((a - b).abs().max().item(), 4), "logit_std": round(b.std().item(), 4),
            "same_argmax": round((a.argmax(-1) == b.argmax(-1)).float().mean().item(), 3)}


def skip_reason(args: ModelArgs, method: str, batch: int, context: int, s: dict) -> str | None:
    dtype_bytes = torch.empty((), dtype=s["dtype"]).element_size()
    p = plan_generation(args, batch, context, dtype_bytes, s["gpu"], offload=method == "offload")
    if s["device"].type == "cuda":
        total = torch.cuda.get_device_properties(0).total_memory
        if p.gpu_bytes > 0.92 * total:
            return f"planner: needs {p.gpu_bytes / GIB:.1f} GiB of GPU memory before activations ({total / GIB:.0f})"
    if p.cpu_cache_bytes > 0.8 * host_available_bytes():
        return f"planner: needs {p.cpu_cache_bytes / GIB:.1f} GiB of pinned host memory " \
               f"({host_available_bytes() / GIB:.0f} available)"
    return None


def run_case(ours, hf, name, args, method, batch, context, s) -> dict:
    row = {"model": name, "batch": batch, "context": context, "method": method}
    dtype_bytes = torch.empty((), dtype=s["dtype"]).element_size()
    plan = plan_generation(args, batch, context, dtype_bytes, s["gpu"], offload=method == "offload")
    row["plan_decode_tok_s"] = round(plan.decode_tokens_per_s, 1)
    if method == "gpu+graph" and s["device"].type != "cuda":
        return {**row, "status": "skipped: CUDA graphs need a GPU"}
    if method == "hf" and hf is None:
        return {**row, "status": "skipped: transformers is not installed"}
    reason = skip_reason(args, method, batch, context, s)
    if reason:
        return {**row, "status": f"skipped: {reason}"}
    new = s["new_tokens"]["offload" if method == "offload" else ("hf" if method == "hf" else "gpu")]
    try:
        result = run_hf(hf, batch, context, new, s["device"]) if method == "hf" else \
            run_ours(ours, method, batch, context, new, s)
        row.update(status="ok", **{k: round(v, 1) if isinstance(v, float) else v for k, v in result.items()})
    except Exception as e:  # noqa: BLE001 - one case's failure must not end the run; it is reported
        row["status"] = "OOM" if is_oom(e) else f"error: {type(e).__name__}: {str(e)[:300]}"
        if not is_oom(e):
            traceback.print_exc()
    if s["device"].type == "cuda":
        row["peak_gib"] = round(torch.cuda.max_memory_allocated() / GIB, 2)
    free_memory()
    return row


def fits(model: Transformer, context: int, offload: bool, s: dict) -> None:
    """A cache of `context` positions and a decode step at its last position (batch 1)."""
    cache = synthetic_cache(model, 1, context, offload, context - 1, s)
    with torch.no_grad(), torch.autocast(s["device"].type, dtype=s["dtype"], enabled=s["dtype"] != torch.float32):
        forward_last(model, torch.zeros(1, 1, dtype=torch.long, device=s["device"]),
                     torch.full((1, 1), context - 1, device=s["device"]), cache)
    sync(s["device"])
    if offload:
        cache.synchronize()


def longest_context(model: Transformer, args: ModelArgs, offload: bool, start: int, s: dict, deadline: float) -> dict:
    """Double the context from `start` until it fails; the last that worked, and why the search stopped."""
    best, ctx, low, cap = None, start, s["search"][0], s["search"][1]
    while True:
        if ctx > cap:
            stop = f"cap {cap}"
            break
        if time.perf_counter() > deadline:
            stop = "time budget"
            break
        reason = skip_reason(args, "offload" if offload else "gpu", 1, ctx, s) if offload else None
        if reason:
            stop = f"{ctx}: {reason}"
            break
        try:
            fits(model, ctx, offload, s)
            best, ctx = ctx, ctx * 2
        except Exception as e:  # noqa: BLE001
            stop = f"{ctx}: " + ("OOM" if is_oom(e) else f"{type(e).__name__}: {str(e)[:200]}")
            break
        finally:
            free_memory()
    if best is None and start > low:
        best = f"< {start} (not searched below)"
    return {"offload": offload, "longest_context": best, "stopped": stop}


def render(rows: list[dict], search: list[dict]) -> str:
    lines = [f"{'model':<10} {'batch':>5} {'context':>7} {'method':<9} {'prefill tok/s':>13} {'decode tok/s':>12} "
             f"{'plan decode':>11} {'peak GiB':>8}  status"]
    for r in rows:
        lines.append(f"{r['model']:<10} {r['batch']:>5} {r['context']:>7} {r['method']:<9} "
                     f"{r.get('prefill_tok_s') or '':>13} {r.get('decode_tok_s') or '':>12} "
                     f"{r['plan_decode_tok_s']:>11} {r.get('peak_gib', ''):>8}  {r['status']}"
                     + (" (decode only, synthetic cache)" if r.get("note") else ""))
    lines.append("")
    lines.append("longest context at batch 1 (doubling):")
    for r in search:
        lines.append(f"  {r['model']:<10} {'offload' if r['offload'] else 'in-GPU':<8} {r['longest_context']}"
                     f"  (stopped: {r['stopped']})")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="CPU smoke test: tiny model, small contexts")
    ap.add_argument("--budget-s", type=float, default=330.0, help="start no case after this many seconds")
    ap.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated subset of {','.join(METHODS)}")
    ap.add_argument("--no-search", action="store_true", help="skip the longest-context search")
    a = ap.parse_args()
    s = setup(a.tiny)
    methods = [m for m in a.methods.split(",") if m]
    deadline = time.perf_counter() + a.budget_s
    rows, search, same_weights = [], [], []
    for name, args in s["models"].items():
        try:
            ours, hf = build_models(args, s["device"], s["dtype"])
            run_ours(ours, "gpu", 1, 2 * s["chunk"], 4, s)  # warm-up: kernels, cuBLAS handles
            if hf is not None and "hf" in methods:
                run_hf(hf, 1, 2 * s["chunk"], 4, s["device"])
                same_weights.append({"model": name, **logits_difference(ours, hf, s)})
        except Exception as e:  # noqa: BLE001
            rows.append({"model": name, "batch": 0, "context": 0, "method": "build", "plan_decode_tok_s": "",
                         "status": f"error: {type(e).__name__}: {str(e)[:300]}"})
            continue
        for context in s["contexts"]:
            for batch in s["batches"]:
                for method in methods:
                    if time.perf_counter() > deadline:
                        rows.append({"model": name, "batch": batch, "context": context, "method": method,
                                     "plan_decode_tok_s": "", "status": "skipped: time budget"})
                        continue
                    rows.append(run_case(ours, hf, name, args, method, batch, context, s))
                    print(json.dumps(rows[-1]), flush=True)
        if not a.no_search:
            del hf
            free_memory()
            gpu = longest_context(ours, args, False, s["search"][0], s, deadline)
            # Offload usually holds at least what fits in the GPU: start at the in-GPU result (saves
            # pinning every smaller size; a failure there is reported as "< start").
            start = gpu["longest_context"] if isinstance(gpu["longest_context"], int) else s["search"][0]
            search += [{"model": name, **gpu}, {"model": name, **longest_context(ours, args, True, start, s, deadline)}]
            print(json.dumps(search[-2:]), flush=True)
        del ours
        free_memory()
    table = render(rows, search)
    print(table)
    payload = {"env": environment(), "tiny": a.tiny, "cases": rows, "longest_context": search,
               "ours_vs_hf_logits": same_weights,
               "budget_s": a.budget_s, "dtype": str(s["dtype"]), "prefill_chunk": s["chunk"]}
    out = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "generate_table.txt").write_text(table + "\n")
    if a.tiny:
        if out is not None:
            (out / "generate_tiny.json").write_text(json.dumps(payload, indent=2))
    else:
        device = payload["env"]["device"].replace(" ", "-")
        print(f"written: {write_result(f'generate_{device}.json', payload, out)}")


if __name__ == "__main__":
    main()
