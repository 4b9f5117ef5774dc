"""Measuring helpers of benchmarks/generate.py: synchronised clocks, freeing memory between cases, an
out-of-memory row, the two models on the same random weights (and a fused-kernel twin of ours on them), the
planner's fit check and the timed prefill of each prefill variant."""

from __future__ import annotations

import gc
import statistics
import time
import traceback
import warnings

import torch

from tracetrain.config import load_config
from tracetrain.models.accounting import kv_cache_bytes
from tracetrain.models.kv_cache import OffloadedKVCache
from tracetrain.models.llama import ModelArgs, Transformer, rope_inv_freq
from tracetrain.models.prefill import PrefillMode, compiled_prefill_refusal, prefill_chunk_tokens
from tracetrain.models.prefill import prefill as library_prefill
from tracetrain.plan import plan_generation
from tracetrain.spec import resolve
from tracetrain.train.assemble import assemble

# Prefill variants (`--prefill-variants`): (model: "plain" or "fused", prefill mode). "fused" is the plain
# model's twin with the Triton RMSNorm / RoPE / SwiGLU kernels (also in its decode steps), as `tracetrain
# generate` assembles it on CUDA; "compiled" runs the plain model's prefill through compiled block functions.
PREFILL_VARIANTS: dict[str, tuple[str, PrefillMode]] = {
    "eager": ("plain", "eager"),
    "compiled": ("plain", "compiled"),
    "fused": ("fused", "eager"),
}

GIB = 2**30


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


def failure(e: BaseException) -> str:
    if is_oom(e):
        return "OOM"
    traceback.print_exc()
    return f"error: {type(e).__name__}: {str(e)[:300]}"


def sync(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def median_s(fn, device: torch.device, warmup: int = 2, reps: int = 7) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start = sync(device)
        fn()
        times.append(sync(device) - start)
    return statistics.median(times)


def autocast(s: dict, graph: bool = False):
    # As generate_batch: autocast's cast cache would hold tensors allocated inside a graph capture.
    return torch.autocast(
        s["device"].type, dtype=s["dtype"], enabled=s["dtype"] != torch.float32, cache_enabled=not graph
    )


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
    cfg = transformers.LlamaConfig(
        hidden_size=args.dim,
        intermediate_size=args.ffn_dim,
        num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads,
        num_key_value_heads=args.n_kv_heads,
        vocab_size=args.vocab_size,
        rope_theta=args.rope_theta,
        rms_norm_eps=args.norm_eps,
        max_position_embeddings=1 << 22,
        tie_word_embeddings=args.tie_embeddings,
        attention_bias=args.qkv_bias,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
        **extra,
    )
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


def fused_twin(ours: Transformer, device: torch.device) -> Transformer:
    """`ours` with the fused kernels, on the same weight tensors (no second copy): the model rows of the
    generation spec (spec.py `resolve(..., generation=True)`, kernels asked 'on' so that the CPU smoke run
    swaps them too) up to the kernel row, then `ours`' tensors assigned."""
    cfg = load_config(
        None, ["--train.mode=full", "--data.pack=false", "--train.attention=sdpa", "--train.fused_kernels=on"]
    )
    spec = resolve(cfg, device, model_args=ours.args, generation=True)
    twin = assemble(spec, until="fused_kernels").plain()
    twin.load_state_dict(ours.state_dict(), assign=True)
    twin.rope_inv_freq = ours.rope_inv_freq  # a non-persistent buffer: not in the state dict
    twin.tie_weights()
    return twin.eval()


def refetch_bytes(args: ModelArgs, batch: int, prompt: int, s: dict) -> int:
    """Bytes an offloaded chunked prefill copies host-to-device: every chunk fetches all earlier positions."""
    dtype_bytes = torch.empty((), dtype=s["dtype"]).element_size()
    num_chunks = -(-prompt // s["chunk"])
    return num_chunks * (num_chunks - 1) // 2 * s["chunk"] * kv_cache_bytes(args, batch, 1, dtype_bytes)


def does_not_fit(args: ModelArgs, offload: bool, batch: int, context: int, s: dict) -> str | None:
    """The planner's verdict: a reason when the cache cannot fit (GPU, or pinned host memory), else None."""
    dtype_bytes = torch.empty((), dtype=s["dtype"]).element_size()
    p = plan_generation(args, batch, context, dtype_bytes, s["gpu"], offload=offload)
    if s["device"].type == "cuda":
        total = torch.cuda.get_device_properties(0).total_memory
        if p.gpu_bytes > 0.92 * total:
            return f"weights + cache {p.gpu_bytes / GIB:.1f} GiB > 92% of {total / GIB:.0f} GiB GPU memory"
    if p.cpu_cache_bytes > 0.7 * host_available_bytes():  # pinned pages cannot be swapped: leave headroom
        return (
            f"pinned cache {p.cpu_cache_bytes / GIB:.1f} GiB > 70% of {host_available_bytes() / GIB:.0f} "
            "GiB available host memory"
        )
    return None


def prefill(
    model: Transformer, cache, batch: int, prompt: int, s: dict, mode: PrefillMode = "eager"
) -> tuple[torch.Tensor, float | None, str]:
    """Random prompt ids through the cache as `generate_batch` runs them (`prefill_mode=mode`); (last logits,
    seconds, the path it took: "eager", "compiled", or "eager: <why the compiled prefill could not run>"),
    or a cache that only claims the prompt's positions (seconds None) when an offloaded prefill would copy
    too much."""
    dev = s["device"]
    if isinstance(cache, OffloadedKVCache) and refetch_bytes(model.args, batch, prompt, s) > s["refetch_limit"]:
        cache.length = prompt
        cache.fetch(0)
        return torch.zeros(batch, model.args.vocab_size, device=dev), None, "not run"
    tokens = torch.randint(0, model.args.vocab_size, (batch, prompt), device=dev)
    positions = torch.arange(prompt, device=dev).expand(batch, prompt)
    # The library's rule (generate_batch's default): the whole prompt when it fits, else chunks.
    chunk = prefill_chunk_tokens(model, batch, prompt, cache, s["dtype"], None)
    why = compiled_prefill_refusal(model, cache, prompt, chunk) if mode == "compiled" else None
    path = mode if why is None else f"eager: {why}"
    start = sync(dev)
    with torch.no_grad(), autocast(s), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # a refusal or a shrunk chunk warns; the row records it in `path`
        logits = library_prefill(model, tokens, positions, cache, chunk, mode, shrink_on_oom=True)
    shrunk = [str(w.message) for w in caught if "ran out of GPU memory" in str(w.message)]
    path += "".join(f"; {m}" for m in shrunk)
    return logits, sync(dev) - start, path
