#!/usr/bin/env bash
# Device call: throughput next to the peers, and the profiling seed experiments, all with tracetrain
# itself. Run from the repository root with .carry and .whl carried; results land in $OUT.
source benchmarks/gpu_env.sh
D=.carry/data; R=/tmp/runs; rm -rf $R
COMMON=(--logging.progress=false --train.output_dir=$R --logging.log_interval=5)

echo "== 1. throughput next to the HF peer"
python3 benchmarks/train_speed.py --peer .carry/peers/hf_peer.py --peer-liger

echo "== 2. profile: llama2-7b LoRA r=16 q/k/v/o, batch 4 x 2048 packed, bf16"
tt profile "${COMMON[@]}" --train.run_name=lora7b --model.preset=llama2-7b --train.mode=lora \
  --data.seq_len=2048 --train.micro_batch_size=4 --data.synthetic_examples=40000 \
  --profile.start_step=6 --profile.num_steps=3 --train.eval_batches=1 --profile.profile_memory=true
cp $R/lora7b/profile/rank0.json.gz "$OUT/lora7b_trace.json.gz"; cp $R/lora7b/profile/report.json "$OUT/lora7b_report.json"

echo "== 3. profile: data loading on the fly (GSM8K, GPT-2 tokenizer), num_workers 0 vs 4"
for W in 0 4; do
  tt profile "${COMMON[@]}" --train.run_name=loader$W --config configs/gsm8k-small-full.toml \
    --data.path=$D/gsm8k/train.jsonl --data.eval_path=$D/gsm8k/test.jsonl --data.tokenizer=$D/gpt2_tokenizer.json \
    --data.tokenize=on_the_fly --data.pack=false --data.seq_len=256 --train.micro_batch_size=64 \
    --data.num_workers=$W --profile.start_step=11 --profile.num_steps=4 --train.eval_batches=1 \
    --logging.progress=false --train.output_dir=$R
  cp $R/loader$W/profile/rank0.json.gz "$OUT/loader_w${W}_trace.json.gz"
  cp $R/loader$W/profile/report.json "$OUT/loader_w${W}_report.json"
done
python3 -m tracetrain.cli analyze $R/loader0/profile/rank0.json.gz --compare $R/loader4/profile/rank0.json.gz | head -60
ls -la "$OUT"
