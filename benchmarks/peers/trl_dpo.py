#!/usr/bin/env python3
"""Peer benchmark: TRL's DPOTrainer (sigmoid loss, reference = the PEFT base with the adapter off) on HF
transformers + PEFT LoRA r=16 on q/k/v/o, Llama-2-7B shape, random bf16 weights, one GPU, offline.

    PYTHONPATH=$PEERSITE python3 benchmarks/peers/trl_dpo.py --pairs 4 --prompt 512 --completion 512

Synthetic pairs: `prompt` tokens then `completion` tokens for chosen and rejected alike, every length
fixed (no padding), written as text of a word-level tokenizer built here whose words map one to one onto
ids (the GPU machine has no tokenizer download). The trainer runs --warmup + --steps steps of
--pairs pairs (2 * pairs sequences of prompt + completion tokens); each step's time is the wall clock
between a TrainerCallback's step begin and step end, the GPU synchronised at both, median over the timed steps. Tokens counted: every
token of the step's sequences (no padding exists), the same count benchmarks/dpo.py uses for ours.
Gradient checkpointing off (DPOConfig's default is on; 7B LoRA fits an H200 without it, as ours runs
without recomputation). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch


def word_tokenizer(vocab_size: int):
    """A fast tokenizer whose word "tN" is id N (N < vocab_size); '<pad>' = 0, '<eos>' = 1."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    vocab["<pad>"], vocab["<eos>"] = 0, 1
    vocab.pop("t0"), vocab.pop("t1")
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def synthetic_pairs(n: int, prompt: int, completion: int, vocab: int, seed: int = 0) -> list[dict]:
    """Pairs whose chosen / rejected end in EOS after `completion - 1` words (TRL appends EOS)."""
    g = torch.Generator().manual_seed(seed)
    words = lambda k: " ".join(f"t{i}" for i in torch.randint(2, vocab, (k,), generator=g).tolist())  # noqa: E731
    return [
        {"prompt": words(prompt), "chosen": " " + words(completion - 1), "rejected": " " + words(completion - 1)}
        for _ in range(n)
    ]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--completion", type=int, default=512)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--cpu-test", action="store_true", help="a 2-layer model on the CPU: checks the script runs")
    a = ap.parse_args()
    cuda = not a.cpu_test
    import datasets
    import peft
    import transformers
    import trl
    from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback

    vocab = 32000
    shape = (
        dict(
            hidden_size=4096,
            intermediate_size=11008,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=32,
        )
        if cuda
        else dict(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4
        )
    )
    cfg = LlamaConfig(
        **shape,
        vocab_size=vocab,
        max_position_embeddings=4096,
        attn_implementation="sdpa",
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=1,
    )
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16 if cuda else torch.float32)
    with torch.device("cuda" if cuda else "cpu"):
        model = LlamaForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    tok = word_tokenizer(vocab)
    total = a.pairs * (a.warmup + a.steps)
    data = datasets.Dataset.from_list(synthetic_pairs(total, a.prompt, a.completion, vocab))
    times: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if cuda:
                torch.cuda.synchronize()
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            if cuda:  # the step's GPU work is done: its wall time (TRL's own host syncs included)
                torch.cuda.synchronize()
            times.append(time.perf_counter() - self.start)

    with tempfile.TemporaryDirectory() as out:
        args = trl.DPOConfig(
            output_dir=out,
            per_device_train_batch_size=a.pairs,
            max_steps=a.warmup + a.steps,
            learning_rate=1e-4,
            bf16=cuda,
            use_cpu=not cuda,
            gradient_checkpointing=False,
            logging_steps=10_000,
            save_strategy="no",
            report_to="none",
            max_length=a.prompt + a.completion + 8,
            beta=0.1,
            loss_type=["sigmoid"],
            dataloader_num_workers=0,
            seed=0,
        )
        lora = peft.LoraConfig(
            r=16,
            lora_alpha=32,
            lora_dropout=0.0,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
            task_type="CAUSAL_LM",
        )
        trainer = trl.DPOTrainer(
            model=model, args=args, train_dataset=data, processing_class=tok, peft_config=lora, callbacks=[Timer()]
        )
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        trainer.train()
    step_s = statistics.median(times[a.warmup :])
    tokens = 2 * a.pairs * (a.prompt + a.completion)
    print(
        json.dumps(
            {
                "peer": f"trl {trl.__version__} DPOTrainer + peft {peft.__version__}",
                "transformers": transformers.__version__,
                "case": "llama2-7b-lora-dpo",
                "pairs": a.pairs,
                "prompt": a.prompt,
                "completion": a.completion,
                "tokens_per_step": tokens,
                "step_s_median": round(step_s, 4),
                "step_s_all": [round(t, 4) for t in times],
                "tokens_per_s": round(tokens / step_s),
                "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
                "device": torch.cuda.get_device_name(0) if cuda else "cpu",
                "torch": torch.__version__,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
