#!/usr/bin/env python3
# Run (GPU machine, checkout root, the peers' packages unpacked as in ../shared/peers/README.md):
#   PYTHONPATH=$PEERSITE python3 benchmarks/peers/unsloth_long.py --seq 32768 [--layers 32] [--steps 5] [--load-in-4bit]
"""Peer for the long-context benchmark (#32): unsloth LoRA training steps on the Llama 3.1 8B shape, batch 1,
one sequence of --seq tokens, random weights, one GPU; prints ONE JSON line (status ok / OOM / error).

As users run unsloth for long context: LoRA r=32 (alpha 32) on every linear layer, its gradient
checkpointing "unsloth" (the checkpointed layer inputs offloaded to host memory), bf16 base or its
4-bit (bitsandbytes NF4) base with --load-in-4bit. Adapted from ../shared/peers/unsloth_peer.py (the
Llama-2-7B r=16 peer of benchmarks/peers.py), which builds a checkpoint holding only a config, a
tokenizer and one tensor; a 4-bit base must be quantised from real tensors at load, so with
--load-in-4bit every weight is written (random, std 0.02) to a cached checkpoint folder per depth.

--layers < 32 builds the same shape with fewer blocks: long_context.py runs 2- and 3-block probes at
lengths where a 32-block step would take minutes, and extrapolates memory and time per block.
Output: step seconds (every step; the median skips the first, which warms up), tokens/s, peak GPU memory
allocated and reserved (GiB), the peak resident host memory while the steps run (sampled; offloaded
activations live there) and over the whole process (VmHWM, loading included), the loss.
"""
import argparse
import json
import os
import re
import statistics
import sys
import threading
import time

os.environ.setdefault("UNSLOTH_DISABLE_STATISTICS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

SHAPE = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
             vocab_size=128256, rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
             rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 8192})
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def host_peak_gib() -> float:
    found = re.search(r"VmHWM:\s+(\d+) kB", open("/proc/self/status").read())
    return int(found.group(1)) / 2**20 if found else float("nan")


class HostPeak:
    """Peak resident host memory while the steps run (VmRSS sampled every 20 ms in a thread): what the
    offloaded activations hold, without what building or loading the model touched before (VmHWM)."""

    def __init__(self) -> None:
        self.peak_bytes, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        page = os.sysconf("SC_PAGE_SIZE")
        while True:
            with open("/proc/self/statm") as f:
                self.peak_bytes = max(self.peak_bytes, int(f.read().split()[1]) * page)
            if self._stop.wait(0.02):
                return

    def __enter__(self) -> "HostPeak":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def write_config(folder: str, layers: int, max_pos: int) -> None:
    """config.json, rewritten for every length (the weights stay: they do not depend on it)."""
    from transformers import LlamaConfig

    LlamaConfig(num_hidden_layers=layers, max_position_embeddings=max_pos, torch_dtype="bfloat16",
                **SHAPE).save_pretrained(folder)


def write_checkpoint(folder: str, layers: int, full_weights: bool) -> None:
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(SHAPE["vocab_size"])}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="t1", eos_token="t2", unk_token="t0",
                            pad_token="t3").save_pretrained(folder)
    d, f, kv, v = SHAPE["hidden_size"], SHAPE["intermediate_size"], 8 * 128, SHAPE["vocab_size"]
    ones = lambda n: torch.ones(n, dtype=torch.bfloat16)  # noqa: E731
    if not full_weights:  # bf16: transformers initialises the rest (as ../shared/peers/unsloth_peer.py)
        save_file({"model.norm.weight": ones(d)}, f"{folder}/model.safetensors", metadata={"format": "pt"})
        return
    g = torch.Generator(device="cuda").manual_seed(0)
    rand = lambda *shape: (torch.randn(*shape, generator=g, device="cuda", dtype=torch.bfloat16) * 0.02).cpu()  # noqa: E731
    tensors = {"model.embed_tokens.weight": rand(v, d), "lm_head.weight": rand(v, d), "model.norm.weight": ones(d)}
    shapes = {"self_attn.q_proj": (d, d), "self_attn.k_proj": (kv, d), "self_attn.v_proj": (kv, d),
              "self_attn.o_proj": (d, d), "mlp.gate_proj": (f, d), "mlp.up_proj": (f, d), "mlp.down_proj": (d, f)}
    for i in range(layers):
        tensors.update({f"model.layers.{i}.{n}.weight": rand(*s) for n, s in shapes.items()})
        tensors[f"model.layers.{i}.input_layernorm.weight"] = ones(d)
        tensors[f"model.layers.{i}.post_attention_layernorm.weight"] = ones(d)
    save_file(tensors, f"{folder}/model.safetensors", metadata={"format": "pt"})
    torch.cuda.empty_cache()  # the generator's blocks: not part of the measured reservations


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, required=True)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--gc", default="unsloth", choices=["unsloth", "true", "false"])
    ap.add_argument("--load-in-4bit", action="store_true")
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--workdir", default="/tmp/unsloth_long")
    a = ap.parse_args()
    row = {"peer": f"unsloth(gc={a.gc}{', 4-bit base' if a.load_in_4bit else ''})", "model": "llama3.1-8b",
           "layers": a.layers, "batch": 1, "seq": a.seq, "lora_rank": a.rank, "targets": "all-linear"}
    try:
        import unsloth  # noqa: F401  (before transformers)
        from unsloth import FastLanguageModel
        import torch

        max_pos = max(131072, a.seq)
        folder = f"{a.workdir}/l{a.layers}_{'4bit' if a.load_in_4bit else 'bf16'}"
        if not os.path.exists(f"{folder}/model.safetensors"):
            os.makedirs(folder, exist_ok=True)
            write_checkpoint(folder, a.layers, full_weights=a.load_in_4bit)
        write_config(folder, a.layers, max_pos)
        model, _ = FastLanguageModel.from_pretrained(folder, max_seq_length=a.seq, dtype=torch.bfloat16,
                                                     load_in_4bit=a.load_in_4bit)
        gc = {"false": False, "unsloth": "unsloth", "true": True}[a.gc]
        model = FastLanguageModel.get_peft_model(model, r=a.rank, lora_alpha=a.rank, lora_dropout=0, bias="none",
                                                 target_modules=TARGETS, use_gradient_checkpointing=gc,
                                                 random_state=0)
        model.train()
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=True)
        x = torch.randint(0, SHAPE["vocab_size"], (1, a.seq), device="cuda")
        torch.cuda.reset_peak_memory_stats()
        times, loss = [], None
        with HostPeak() as host:
            for _ in range(a.steps):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                loss = model(input_ids=x, labels=x).loss
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
        row["host_peak_gib"] = round(host.peak_bytes / 2**30, 2)
        step_s = statistics.median(times[1:] if len(times) > 1 else times)
        row.update(status="ok", step_s_all=[round(t, 4) for t in times], step_s_median=round(step_s, 4),
                   tokens_per_s=round(a.seq / step_s, 1), loss=float(loss),
                   peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 3),
                   reserved_gib=round(torch.cuda.max_memory_reserved() / 2**30, 3),
                   unsloth=getattr(unsloth, "__version__", "?"))
    except Exception as e:  # noqa: BLE001 - the row says what happened; the caller goes on
        oom = "out of memory" in str(e).lower() or type(e).__name__ == "OutOfMemoryError"
        row.update(status="OOM" if oom else f"error: {type(e).__name__}: {str(e)[:400]}")
        if not oom:
            import traceback

            traceback.print_exc()
    row["host_hwm_gib"] = round(host_peak_gib(), 2)  # the whole process, loading included
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    t0 = time.time()
    main()
    print(f"# {time.time() - t0:.0f} s", file=sys.stderr)
