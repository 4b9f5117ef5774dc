#!/usr/bin/env bash
# One device call for the core and fine-tuning checks. Run from the repository root on the GPU machine
# with .carry (peer script, GSM8K, GPT-2 tokenizer) and .whl (liger-kernel) carried. Writes to $OUT.
source benchmarks/gpu_env.sh
D=.carry/data; R=/tmp/runs; rm -rf $R
COMMON=(--logging.progress=false --train.output_dir=$R)

echo "== 1. throughput next to the HF peer"
python3 benchmarks/train_speed.py --peer .carry/peers/hf_peer.py --peer-liger

echo "== 2. real fine-tune: small preset on GSM8K, GPT-2 tokenizer"
tt train --config configs/gsm8k-small-full.toml --data.path=$D/gsm8k/train.jsonl \
  --data.eval_path=$D/gsm8k/test.jsonl --data.tokenizer=$D/gpt2_tokenizer.json "${COMMON[@]}" --train.run_name=gsm8k
cp $R/gsm8k/metrics.jsonl "$OUT/gsm8k_full_metrics.jsonl"; cp $R/gsm8k/summary.json "$OUT/gsm8k_full_summary.json"

echo "== 3. export to HF, then LoRA on top of the export"
tt export $R/gsm8k --hf $R/gsm8k_hf
tt train --config configs/gsm8k-small-full.toml --data.path=$D/gsm8k/train.jsonl \
  --data.eval_path=$D/gsm8k/test.jsonl --data.tokenizer=$D/gpt2_tokenizer.json "${COMMON[@]}" \
  --train.run_name=gsm8k_lora --model.init_from=$R/gsm8k_hf --train.mode=lora --train.steps=150 \
  --optim.lr=1e-3 --optim.warmup_steps=10 --train.eval_interval=50 --train.eval_generate=32
cp $R/gsm8k_lora/metrics.jsonl "$OUT/gsm8k_lora_metrics.jsonl"; cp $R/gsm8k_lora/summary.json "$OUT/gsm8k_lora_summary.json"
tt export $R/gsm8k_lora --peft $R/adapter && ls $R/adapter

echo "== 4. the built-in default on the GPU"
start=$SECONDS; tt train "${COMMON[@]}" --train.run_name=default | grep -E "done|run directory"
echo "default run wall time: $((SECONDS - start)) s"
cp $R/default/summary.json "$OUT/default_gpu_summary.json"
ls "$OUT"
