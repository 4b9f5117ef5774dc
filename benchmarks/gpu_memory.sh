#!/usr/bin/env bash
# Device call for the memory toolkit: the switch matrix, profiles of activation offload and unified
# memory (profiling seed experiments 3 and 4), and the 7B full fine-tune with optimizer offload.
source benchmarks/gpu_env.sh
R=/tmp/runs; rm -rf $R
echo "== 1. memory switches"
python3 benchmarks/memory.py --steps 10
echo "== 2. profiles: llama3.2-1b full FT 4 x 2048, offload off / streamed, unified-memory optimizer"
for CASE in none:--memory.activation_offload=none offload:--memory.activation_offload=streamed \
            unified:--memory.unified_memory=optimizer; do
  NAME=${CASE%%:*}; FLAG=${CASE#*:}
  tt profile --logging.progress=false --train.output_dir=$R --train.run_name=$NAME --model.preset=llama3.2-1b \
    --data.seq_len=2048 --train.micro_batch_size=4 --data.pack=false --data.synthetic_examples=8000 \
    --profile.start_step=4 --profile.num_steps=2 --train.eval_batches=1 "$FLAG" | grep -E "done|error|Advice" -A1
  cp $R/$NAME/profile/rank0.json.gz "$OUT/profile_1b_$NAME.json.gz" 2>/dev/null
done
python3 -m tracetrain.cli analyze $R/none/profile/rank0.json.gz --compare $R/offload/profile/rank0.json.gz | head -40
echo "== 3. llama2-7b full fine-tune with CPU optimizer offload, grad accum 8"
python3 benchmarks/offload_check.py --accum 8 --steps 10
ls -la "$OUT"
