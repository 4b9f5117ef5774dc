"""Peer: unsloth QLoRA (4-bit NF4 base, bitsandbytes) training steps on a Llama-3 shape with random weights.

usage: PYTHONPATH=$PEERSITE python3 unsloth_qlora_peer.py SHAPE BATCH SEQ GC [TARGETS]
  SHAPE: llama3-8b | llama3-70b (or a JSON dict of LlamaConfig fields); GC: false | true | unsloth
  (unsloth's gradient checkpointing mode); TARGETS: all-linear (default) | qkvo. Prints one JSON line.

A model of 8B or 70B random weights cannot be a bf16 checkpoint on the GPU machine's disk (70B: 141 GB), and
transformers leaves the 4-bit layers of weights missing from a checkpoint unquantised. So this writes a
*pre-quantised* bitsandbytes checkpoint, as unsloth's own `*-bnb-4bit` repositories are: every projection
drawn on the GPU (normal, std 0.02), quantised there by bitsandbytes (NF4, blocks of 64, double
quantisation: what `load_in_4bit=True` does) and saved with its quant state under the names bitsandbytes'
`Linear4bit._save_to_state_dict` uses; the embedding, head and norms stay bf16. The folder goes to
/dev/shm when it has room (a RAM disk: 70B in 4 bits is ~39 GB), else /tmp, and is deleted at the end.
unsloth then loads it with `FastLanguageModel.from_pretrained(load_in_4bit=True)`, adds LoRA r=16, and
plain training steps are timed (CUDA events, median of 10 after 3 warm-up steps), as unsloth_peer.py does.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
import time

SHAPES = {
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0),
    "llama3-70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                       num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0),
}
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def projections(c: dict) -> dict[str, tuple[int, int]]:
    d, f = c["hidden_size"], c["intermediate_size"]
    kv = c["num_key_value_heads"] * d // c["num_attention_heads"]
    return {"self_attn.q_proj": (d, d), "self_attn.k_proj": (kv, d), "self_attn.v_proj": (kv, d),
            "self_attn.o_proj": (d, d), "mlp.gate_proj": (f, d), "mlp.up_proj": (f, d), "mlp.down_proj": (d, f)}


def write_bnb4_checkpoint(folder: str, c: dict, device: str, max_seq: int) -> float:
    """A pre-quantised bitsandbytes NF4 checkpoint of random weights (one shard per block); returns seconds."""
    import torch
    from bitsandbytes.functional import quantize_4bit
    from safetensors.torch import save_file
    from transformers import BitsAndBytesConfig, LlamaConfig

    t0 = time.time()
    g = torch.Generator(device=device).manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device=device, dtype=torch.float32) * 0.02).to(torch.bfloat16)

    d, n = c["hidden_size"], c["num_hidden_layers"]
    weight_map: dict[str, str] = {}

    def save(tensors: dict, name: str) -> None:
        save_file({k: v.contiguous().cpu() for k, v in tensors.items()}, os.path.join(folder, name),
                  metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))

    def ones() -> torch.Tensor:  # a new tensor per name: safetensors refuses tensors that share memory
        return torch.ones(d, dtype=torch.bfloat16)

    for i in range(n):
        tensors = {f"model.layers.{i}.input_layernorm.weight": ones(),
                   f"model.layers.{i}.post_attention_layernorm.weight": ones()}
        for proj, shape in projections(c).items():
            key = f"model.layers.{i}.{proj}.weight"
            q, state = quantize_4bit(randn(*shape), blocksize=64, compress_statistics=True, quant_type="nf4",
                                     quant_storage=torch.uint8)
            tensors[key] = q
            tensors.update({f"{key}.{k}": v for k, v in state.as_dict(packed=True).items()})
        save(tensors, f"model-{i + 1:05d}.safetensors")
    save({"model.embed_tokens.weight": randn(c["vocab_size"], d), "lm_head.weight": randn(c["vocab_size"], d),
          "model.norm.weight": ones()}, "model-head.safetensors")
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    cfg = LlamaConfig(**c, max_position_embeddings=max(8192, max_seq), torch_dtype="bfloat16",
                      tie_word_embeddings=False)
    cfg.quantization_config = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_quant_storage=torch.uint8).to_dict()
    cfg.save_pretrained(folder)
    write_tokenizer(folder, c["vocab_size"])
    return time.time() - t0


def write_tokenizer(folder: str, vocab_size: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="t1", eos_token="t2", unk_token="t0",
                            pad_token="t3").save_pretrained(folder)


def checkpoint_folder(nbytes: int) -> str:
    shm = "/dev/shm"
    if os.path.isdir(shm) and shutil.disk_usage(shm).free > nbytes * 1.2:
        return tempfile.mkdtemp(prefix="qlora_peer_", dir=shm)
    return tempfile.mkdtemp(prefix="qlora_peer_")


def main() -> None:
    shape, batch, seq = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    gc_mode = sys.argv[4] if len(sys.argv) > 4 else "false"
    targets = ALL if (sys.argv[5] if len(sys.argv) > 5 else "all-linear") == "all-linear" else ALL[:4]
    c = SHAPES[shape] if shape in SHAPES else json.loads(shape)
    os.environ.setdefault("UNSLOTH_DISABLE_STATISTICS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import unsloth  # noqa: F401  (before transformers, as unsloth requires)
    import torch
    from unsloth import FastLanguageModel

    numel = c["num_hidden_layers"] * sum(o * i for o, i in projections(c).values())
    folder = checkpoint_folder(numel // 2 + 4 * c["vocab_size"] * c["hidden_size"])
    try:
        write_s = write_bnb4_checkpoint(folder, c, "cuda", seq)
        torch.cuda.empty_cache()  # the drawing's cached blocks go back before unsloth loads
        t0 = time.time()
        model, _ = FastLanguageModel.from_pretrained(folder, max_seq_length=seq, dtype=torch.bfloat16,
                                                     load_in_4bit=True)
        gc = {"false": False, "unsloth": "unsloth", "true": True}[gc_mode]
        model = FastLanguageModel.get_peft_model(model, r=16, lora_alpha=32, lora_dropout=0, bias="none",
                                                 target_modules=targets, use_gradient_checkpointing=gc,
                                                 random_state=0)
        load_s = time.time() - t0
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    four_bit = sum(1 for m in model.modules() if type(m).__name__ == "Linear4bit")
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=True)
    x = torch.randint(0, c["vocab_size"], (batch, seq), device="cuda")

    def step() -> torch.Tensor:
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        loss = step()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    s = statistics.median(times)
    print(json.dumps({"peer": f"unsloth 4-bit (gc={gc_mode})", "model": shape, "mode": "qlora", "batch": batch,
                      "seq": seq, "targets": "all-linear" if targets == ALL else "qkvo", "linear4bit_layers": four_bit,
                      "step_s_median": round(s, 4), "step_s_all": times, "tokens_per_s": round(batch * seq / s),
                      "loss": float(loss), "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
                      "checkpoint_write_s": round(write_s, 1), "load_s": round(load_s, 1),
                      "unsloth": getattr(unsloth, "__version__", "?")}), flush=True)


if __name__ == "__main__":
    main()
