"""Peer row for #19: DeepSpeed ZeRO-Offload (CPU Adam) on the llama2-7b full fine-tune, one GPU, same batch.

The counterpart of benchmarks/offload_check.py (tracetrain's `memory.optimizer_offload = true`): a
Hugging Face LlamaForCausalLM of the llama2-7b shape (dim 4096, 32 layers, 32 heads, ffn 11008, vocab
32000, SDPA attention) with random weights in bf16, activation checkpointing of every decoder layer
(the same recompute work as our full recomputation), micro-batch 4 x 2048 of random tokens, gradient
accumulation 8, AdamW (betas 0.9/0.95, weight decay 0.1 on matrices, 0 on norms), clipping at 1.0. The
optimizer is DeepSpeed's own pairing for this: ZeRO stage 2 (or 3) with `offload_optimizer` to the CPU,
which builds DeepSpeedCPUAdam (JIT-compiled C++, needs a C++ compiler and ninja).

Host memory decides two settings. DeepSpeed pins its host buffers with torch's caching pinned
allocator, which rounds each buffer up to a power of two: for 7B under ZeRO-2 that is 130 GiB with
`pin_memory: true`, more than a 128 GiB machine has, so `--pin-memory auto` (the default) pins only
when the estimate (`host_estimate_bytes`) fits MemAvailable, and the JSON says which ran. Gradients
accumulate in fp32 (`data_types.grad_accum_dtype`, as ours do): with DeepSpeed's bf16 default the
offload path keeps another bf16 copy of every gradient on the host, 125 GiB unpinned for 7B.

One process, no launcher: the script sets RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT/LOCAL_RANK itself.
Prints one JSON line last: {system, case, tokens_per_s, step_s, step_s_all, peak_gib, host_peak_gib, ...}
(`peak_gib`: torch.cuda.max_memory_allocated after engine setup; `host_peak_gib`: the process's peak
RSS; `host_used_peak_gib`: the machine's peak MemTotal - MemAvailable, sampled, which also counts
pinned pages the driver maps outside RSS), and a copy under $OUT when set.

The wheels, made here (the GPU machine has no network; `echo /.peers/ >> .git/info/exclude` first):
DeepSpeed 0.19.8 has only an sdist, built once into a pure-Python wheel without ops (the CPU Adam op is
JIT-built where it runs), plus the packages it imports that the GPU image may lack, for CPython 3.12:

  DS_BUILD_OPS=0 python3 -m pip wheel --no-deps --no-build-isolation deepspeed==0.19.8 -w .peers/deepspeed
  python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \\
    -d .peers/deepspeed pydantic==2.14.4 pydantic-core==2.50.5 annotated-types typing-inspection \\
    typing-extensions einops hjson msgpack ninja py-cpuinfo psutil packaging tqdm

On the GPU machine (carry `.peers`), installed beside the image's torch, never over it:

  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/dssite .peers/deepspeed/*.whl \\
    && export PYTHONPATH=/tmp/dssite PATH=/tmp/dssite/bin:$PATH || exit
  PYTHONUNBUFFERED=1 python3 benchmarks/peers_deepspeed.py --stage 2 --accum 8

`--tiny` builds a 2-layer, hidden-64 model and runs the same path on whatever device there is (the
CPU included, where DeepSpeed's CPU accelerator and gloo stand in for CUDA and NCCL).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import shutil
import socket
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM

GIB = 2**30
HOST_RESERVE_BYTES = 6 * GIB  # torch and CUDA libraries, the CUDA context's host side, Python, the JIT build
SUB_GROUP_NUMEL = 10**9  # ZeRO-3 `sub_group_size`: the optimizer steps over flat chunks of this many elements
SHAPES: dict[str, dict[str, int]] = {
    "llama2-7b": dict(
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        vocab_size=32000,
    ),
    "tiny": dict(
        hidden_size=64,
        intermediate_size=172,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=259,
    ),
}


def require_toolchain() -> None:
    """DeepSpeedCPUAdam is JIT-built by torch.utils.cpp_extension: a C++ compiler and ninja must be on PATH."""
    compiler = os.environ.get("CXX", "c++")  # what torch.utils.cpp_extension calls
    if shutil.which(compiler) is None:
        sys.exit(
            f"peers_deepspeed: no C++ compiler {compiler!r} on PATH (set CXX=g++ if only g++ exists); "
            "DeepSpeedCPUAdam is JIT-compiled and cannot be built on this machine"
        )
    if shutil.which("ninja") is None:
        sys.exit(
            "peers_deepspeed: no 'ninja' on PATH (torch's JIT build of DeepSpeedCPUAdam needs it); with the "
            "carried wheel installed by `pip install --target DIR`, add DIR/bin to PATH"
        )


def pow2_ceil(num_bytes: int) -> int:
    """The block torch's caching pinned allocator takes for a buffer of `num_bytes`."""
    return 1 << max(num_bytes - 1, 0).bit_length()


def host_estimate_bytes(groups: list[list[int]], stage: int, pinned: bool, grad_accum_fp32: bool) -> int:
    """Host bytes DeepSpeed's offloaded optimizer holds for parameter groups of these numels (one rank).

    ZeRO-2: fp32 masters, fp32 gradients and a bf16 upload buffer, each one flat buffer per group and
    pinned when `pinned`; the two fp32 AdamW moments (never pinned); with bf16 accumulation also a bf16
    host buffer per parameter. ZeRO-3 (rough): a flat gradient buffer over all parameters in the
    accumulation dtype, fp32 masters and moments, and a pinned fp32 gradient per optimizer sub-group."""
    pin = pow2_ceil if pinned else (lambda n: n)
    total = 0
    for numels in groups:
        n = sum(numels)
        if stage == 2:
            total += pin(4 * n) + pin(4 * n) + pin(2 * n) + 8 * n
            total += 0 if grad_accum_fp32 else sum(pin(2 * k) for k in numels)
        else:
            full, rest = divmod(n, SUB_GROUP_NUMEL)
            total += 4 * n + 8 * n + full * pin(4 * SUB_GROUP_NUMEL) + (pin(4 * rest) if rest else 0)
    if stage == 3:
        total += pin((4 if grad_accum_fp32 else 2) * sum(map(sum, groups)))
    return total


def meminfo_bytes(key: str) -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


class HostUsedPeak:
    """Peak of MemTotal - MemAvailable, sampled every `period_s` by a daemon thread."""

    def __init__(self, period_s: float = 0.2) -> None:
        self.peak_bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, args=(period_s,), daemon=True)
        self._thread.start()

    def _sample(self, period_s: float) -> None:
        total = meminfo_bytes("MemTotal")
        while not self._stop.wait(period_s):
            self.peak_bytes = max(self.peak_bytes, total - meminfo_bytes("MemAvailable"))

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak_bytes


def init_single_process(backend: str) -> None:
    """A world of one, without a launcher: the variables torchrun would set, on a free local port."""
    import deepspeed

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }.items():
        os.environ.setdefault(key, value)
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False)


def build_model(shape: str, seq: int, device: torch.device) -> LlamaForCausalLM:
    """LlamaForCausalLM of `shape` with random weights, in bf16, built on `device` (meta for counting)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    fields: dict[str, Any] = {**SHAPES[shape], "max_position_embeddings": seq, "attn_implementation": "sdpa"}
    config = LlamaConfig(**fields, use_cache=False)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bf16 directly: no fp32 copy of 7B anywhere
    try:
        with device:
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return model


def param_groups(model: nn.Module) -> list[dict[str, Any]]:
    """Weight decay on matrices, none on norms: the groups offload_check.py gives CPUOffloadAdamW."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]


def choose_pinning(a: argparse.Namespace, groups: list[list[int]]) -> tuple[bool, dict[str, float]]:
    """`--pin-memory`: auto pins when the pinned estimate fits MemAvailable less a reserve; exits if neither fits."""
    budget = meminfo_bytes("MemAvailable") - HOST_RESERVE_BYTES
    estimates = {
        pinned: host_estimate_bytes(groups, a.stage, pinned, a.grad_accum_dtype == "fp32") for pinned in (True, False)
    }
    facts = {
        "host_budget_gib": budget / GIB,
        "host_estimate_pinned_gib": estimates[True] / GIB,
        "host_estimate_unpinned_gib": estimates[False] / GIB,
    }
    if a.pin_memory != "auto":
        return a.pin_memory == "true", facts
    if estimates[True] <= budget:
        return True, facts
    if estimates[False] <= budget:
        return False, facts
    sys.exit(
        f"peers_deepspeed: host memory too small: ZeRO-{a.stage} offload needs about "
        f"{estimates[False] / GIB:.1f} GiB unpinned, {budget / GIB:.1f} GiB available after the reserve"
    )


def ds_config(a: argparse.Namespace, pinned: bool) -> dict[str, Any]:
    zero: dict[str, Any] = {
        "stage": a.stage,
        "offload_optimizer": {"device": "cpu", "pin_memory": pinned},
        "contiguous_gradients": True,
        "overlap_comm": True,
    }
    if a.stage == 3:
        zero["sub_group_size"] = SUB_GROUP_NUMEL
    return {
        "train_micro_batch_size_per_gpu": a.batch,
        "gradient_accumulation_steps": a.accum,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "data_types": {"grad_accum_dtype": a.grad_accum_dtype},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
        "zero_optimization": zero,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def optimizer_step(engine: Any, batches: list[torch.Tensor], sync: Any) -> tuple[float, float]:
    """One optimizer step over `batches` (one per micro-batch): seconds and mean loss.

    engine.backward scales each loss by 1/accum; engine.step() is called after every micro-batch and
    applies the CPU Adam update (and the weight upload) only at the accumulation boundary, the last one."""
    sync()
    start = time.perf_counter()
    total = torch.zeros((), device=batches[0].device)
    for tokens in batches:  # (batch, seq)
        loss = engine(input_ids=tokens, labels=tokens).loss
        engine.backward(loss)
        engine.step()
        total += loss.detach().float()
    sync()  # the step is done when the updated bf16 weights are back on the device
    return time.perf_counter() - start, total.item() / len(batches)


def load_cpu_adam() -> float:
    """JIT-build (or load from torch's extension cache) DeepSpeedCPUAdam's op; seconds taken."""
    from deepspeed.ops.op_builder import CPUAdamBuilder

    start = time.perf_counter()
    CPUAdamBuilder().load(verbose=False)
    return time.perf_counter() - start


def run(a: argparse.Namespace) -> dict[str, Any]:
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    cuda = torch.cuda.is_available()
    shape = "tiny" if a.tiny else "llama2-7b"
    groups = [[p.numel() for p in g["params"]] for g in param_groups(build_model(shape, a.seq, torch.device("meta")))]
    pinned, host_facts = choose_pinning(a, groups)
    sampler = HostUsedPeak()
    build_s = load_cpu_adam()
    init_single_process("nccl" if cuda else "gloo")
    device = torch.device(get_accelerator().device_name(0))
    torch.manual_seed(0)
    model = build_model(shape, a.seq, device)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    checkpointed = sum(bool(getattr(layer, "gradient_checkpointing", False)) for layer in model.model.layers)
    start = time.perf_counter()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=param_groups(model), config=ds_config(a, pinned))
    init_s = time.perf_counter() - start
    print(
        f"optimizer {type(engine.optimizer).__name__} over {type(engine.optimizer.optimizer).__name__}, "
        f"pin_memory={pinned}, cpu_adam op {build_s:.0f} s, engine {init_s:.0f} s",
        flush=True,
    )
    gen = torch.Generator().manual_seed(0)
    vocab = SHAPES[shape]["vocab_size"]
    batches = [torch.randint(0, vocab, (a.batch, a.seq), generator=gen).to(device) for _ in range(a.accum)]
    peak_init = torch.cuda.max_memory_allocated() / GIB if cuda else None
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    runs = [optimizer_step(engine, batches, get_accelerator().synchronize) for _ in range(a.warmup + a.steps)]
    step_s_all = [s for s, _ in runs[a.warmup :]]
    step_s = statistics.median(step_s_all)
    pinned_peak = torch.cuda.host_memory_stats().get("allocated_bytes.peak") if cuda else None
    return {
        "system": f"deepspeed {deepspeed.__version__} zero{a.stage}-offload",
        "case": f"{shape}-full-offload",
        "tokens_per_s": a.batch * a.seq * a.accum / step_s,
        "step_s": step_s,
        "step_s_all": step_s_all,
        "losses": [loss for _, loss in runs],
        "peak_gib": torch.cuda.max_memory_allocated() / GIB if cuda else None,
        "peak_gib_setup": peak_init,
        "host_peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB,
        "host_used_peak_gib": sampler.stop() / GIB,
        "host_pinned_peak_gib": None if pinned_peak is None else pinned_peak / GIB,
        "pin_memory": pinned,
        "grad_accum_dtype": a.grad_accum_dtype,
        **host_facts,
        "batch": a.batch,
        "seq": a.seq,
        "accum": a.accum,
        "warmup": a.warmup,
        "checkpointed_layers": checkpointed,
        "num_layers": SHAPES[shape]["num_hidden_layers"],
        "cpu_threads": torch.get_num_threads(),
        "cpu_adam_load_s": build_s,
        "engine_init_s": init_s,
        "num_params": sum(map(sum, groups)),
        "deepspeed": deepspeed.__version__,
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "date": datetime.date.today().isoformat(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--stage", type=int, choices=[2, 3], default=2, help="ZeRO stage")
    ap.add_argument("--batch", type=int, default=4, help="micro-batch rows")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--accum", type=int, default=8, help="gradient accumulation steps per optimizer step")
    ap.add_argument("--warmup", type=int, default=2, help="untimed optimizer steps")
    ap.add_argument("--steps", type=int, default=3, help="timed optimizer steps (median reported)")
    ap.add_argument(
        "--pin-memory",
        choices=["auto", "true", "false"],
        default="auto",
        help="offload_optimizer.pin_memory; auto pins when the host estimate fits",
    )
    ap.add_argument("--grad-accum-dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--tiny", action="store_true", help="2 layers, hidden 64: the same path, on any device")
    a = ap.parse_args()
    if a.steps < 3 and not a.tiny:
        ap.error(f"--steps {a.steps}: at least 3 timed steps for a median")
    if not (torch.cuda.is_available() or a.tiny):
        sys.exit("peers_deepspeed: the 7B row needs a CUDA GPU (use --tiny on a CPU)")
    require_toolchain()
    result = run(a)
    text = json.dumps(result)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], f"peers_deepspeed_zero{a.stage}.json").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
