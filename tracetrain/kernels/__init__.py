"""Fused kernels for the training step, each a PyTorch custom op with two implementations:

- a pure-PyTorch one (the op's default kernel): runs on any device, is what the CPU tests check
  against float64 references, and states the math (forward and the hand-written backward) plainly;
- a Triton one, registered for CUDA when Triton is importable (`triton_kernels.py`).

Custom ops (`torch.library.custom_op`) rather than bare autograd Functions, so that `torch.compile`
treats a kernel as one opaque node instead of tracing into it, and the same module works eagerly and
inside a compiled block. The transforms that swap these into the model live in `apply.py`.

  rmsnorm.py   RMSNorm forward + backward, float32 statistics, one pass each way
  rope.py      rotary embedding of q and k, no float32 copies of q/k in memory
  swiglu.py    silu(gate) * up, forward + backward, without saving silu(gate)
  fused_ce.py  lm_head + cross-entropy, token chunk by chunk: no full (tokens, vocab) logits

Not a custom op: adamw_triton.py, the CUDA update of train/optim.py's AdamW (Triton only).
nf4_triton.py: the CUDA kernel of models/qlora.py's `tracetrain::nf4_dequantise` (QLoRA's 4-bit base),
registered when a QLoRA run is assembled (Triton only).
"""

from __future__ import annotations

import functools
import importlib.util
import os


@functools.cache
def triton_available() -> bool:
    """Triton is importable (the CUDA kernels are registered); False on the CPU-only test machines."""
    return importlib.util.find_spec("triton") is not None


def triton_interpreting() -> bool:
    """Triton's interpreter is on (TRITON_INTERPRET=1): kernels run on host tensors, in NumPy (the CPU test
    of the AdamW kernel); read when a kernel is launched, as Triton reads it when one is compiled."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on")
