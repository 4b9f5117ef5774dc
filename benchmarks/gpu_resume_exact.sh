#!/usr/bin/env bash
# Device call: resume is bit-exact on a GPU with the CUDA defaults (compile, fused CE, train/optim.py's
# Triton AdamW): a 40-step full fine-tune of the default model against the same run stopped at step 20 and
# resumed; compares the step-40 checkpoints' weights and every step's loss. Run from the repository root:
#   PYTHONPATH=$PWD bash benchmarks/gpu_resume_exact.sh
# H100, 2026-11-27, commit 79e2c40: 39 tensors bit-identical, 40 of 40 losses equal.
set -e
TT="python3 -c 'import sys; from tracetrain.cli import main; sys.exit(main())'"
cd /tmp; rm -rf runs
C="--train.mode=full --train.steps=40 --checkpoint.interval=20 --optim.schedule=constant --optim.warmup_steps=2 --logging.progress=false --train.eval_interval=0"
eval $TT train $C --train.run_name=a 2>&1 | grep -E "done|error" | tail -2
eval $TT train $C --train.steps=20 --train.run_name=b 2>&1 | grep -E "done|error" | tail -2
eval $TT train --resume runs/b --train.steps=40 2>&1 | grep -E "done|error|resum" | tail -3
python3 - <<'PY'
import glob, json, torch
from safetensors.torch import load_file
def final(run):
    files = sorted(glob.glob(f"runs/{run}/checkpoints/step_00000040/*.safetensors"))
    out = {}
    for f in files: out.update(load_file(f))
    return out
a, b = final("a"), final("b")
print("checkpoint tensors compared:", len(a))
same = all(torch.equal(a[k], b[k]) for k in a) and a.keys() == b.keys()
print("weights after 40 steps, uninterrupted vs resumed at 20: bit-identical", same)
la = [json.loads(l) for l in open("runs/a/metrics.jsonl") if '"loss"' in l]
lb = [json.loads(l) for l in open("runs/b/metrics.jsonl") if '"loss"' in l]
ka = {r["step"]: r["loss"] for r in la if "step" in r}; kb = {r["step"]: r["loss"] for r in lb if "step" in r}
common = sorted(set(ka) & set(kb))
print("loss steps compared:", len(common), "equal:", all(ka[s] == kb[s] for s in common), "last", common[-1] if common else None, ka.get(40), kb.get(40))
PY
python3 -c "
from tracetrain.train.optim import AdamW
from tracetrain.kernels import triton_available
print('triton available', triton_available())"
