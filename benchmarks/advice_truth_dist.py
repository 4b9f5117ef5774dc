"""Two-rank loops of the advice-truth corpus (run under torchrun by benchmarks/advice_truth.py).

DDP without `no_sync` under gradient accumulation, DDP with one giant bucket, FSDP without prefetch,
unbalanced pipeline stages, a straggler rank; and healthy DDP and FSDP controls. Every rank writes its
own trace (`rank{R}.json.gz`); step times are the slowest rank's.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import time

import torch
import torch.distributed as dist
from advice_truth_cases import VOCAB, _tokens
from advice_truth_common import Block, Case, Settings, Step, TinyLM, autocast, lm_loss
from torch.nn.parallel import DistributedDataParallel as DDP


def setup() -> Settings:
    local = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=120))
    return Settings(device=device)


def slowest(times: list[float], s: Settings) -> list[float]:
    """Each step's time on the slowest rank."""
    t = torch.tensor(times, dtype=torch.float64, device=s.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _ddp(s: Settings, dim: int, layers: int, **kw) -> tuple[DDP, torch.optim.Optimizer]:
    torch.manual_seed(0)  # DDP broadcasts rank 0's weights anyway; same init keeps the ranks alike
    model = TinyLM(s.dim(dim), s.n(layers), VOCAB).to(s.device)
    ids = [s.device.index] if s.device.type == "cuda" else None
    ddp = DDP(model, device_ids=ids, **kw)
    return ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-4, fused=True)


def _accumulate(ddp: DDP, opt, micro: list, s: Settings, no_sync: bool) -> None:
    for i, (x, y) in enumerate(micro):
        last = i == len(micro) - 1
        # `no_sync` skips the all-reduce on all but the last micro-batch: gradients accumulate locally.
        with ddp.no_sync() if no_sync and not last else contextlib.nullcontext():
            with autocast(s):
                loss = lm_loss(ddp(x), y) / len(micro)
            loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def build_no_sync(variant: str, s: Settings) -> Step:
    # ~200M parameters. At 1k tokens per micro-batch the eager loop was host-paced, fixed or not (its
    # twin drew host_bound 45-69%), and the extra all-reduces hid in the host's time (-7% at 50M and
    # 200M parameters on NVLink). 8k tokens keep the GPU ahead of the host, so what the three extra
    # all-reduces cost is what the rule has to predict (likely little over NVLink: the rule says so).
    ddp, opt = _ddp(s, 2048, 4)
    micro = [_tokens(s, 8, 1024) for _ in range(4)]
    return lambda: _accumulate(ddp, opt, micro, s, no_sync=variant == "fixed")  # the cause: no no_sync


def build_control_ddp(variant: str, s: Settings) -> Step:
    ddp, opt = _ddp(s, 1024, 4)
    micro = [_tokens(s, 8, 1024) for _ in range(2)]
    return lambda: _accumulate(ddp, opt, micro, s, no_sync=True)


def build_buckets(variant: str, s: Settings) -> Step:
    # The cause: one 1 GiB bucket, so the all-reduce starts only when the whole backward is done.
    ddp, opt = _ddp(s, 2048, 6, **({"bucket_cap_mb": 1024} if variant == "problem" else {}))
    micro = [_tokens(s, 2, 1024)]  # 2k tokens: the all-reduce of 1.2 GB is as long as the backward
    return lambda: _accumulate(ddp, opt, micro, s, no_sync=False)


def build_straggler(variant: str, s: Settings) -> Step:
    ddp, opt = _ddp(s, 1024, 4)
    micro = [_tokens(s, 8, 1024)]
    late = variant == "problem" and dist.get_rank() == 1

    def step() -> None:
        if late:  # the cause: rank 1's host is slow (a stand-in for a slow disk or loader on one node)
            time.sleep(0.015)
        _accumulate(ddp, opt, micro, s, no_sync=False)

    return step


def build_fsdp_prefetch(variant: str, s: Settings) -> Step:
    from torch.distributed.fsdp import BackwardPrefetch, MixedPrecision
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    torch.manual_seed(0)
    model = TinyLM(s.dim(2048), s.n(8), VOCAB)
    problem = variant == "problem"
    fsdp = FSDP(
        model,
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        device_id=s.device if s.device.type == "cuda" else None,
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        # The cause: no prefetch, so each block's all-gather waits until autograd reaches the block.
        backward_prefetch=None if problem else BackwardPrefetch.BACKWARD_PRE,
        forward_prefetch=not problem,
        use_orig_params=True,
    )
    opt = torch.optim.AdamW(fsdp.parameters(), lr=1e-4, fused=True)
    # 16k tokens: at 4k the FSDP loop was host-paced with or without prefetch (host_bound 45-55% on
    # both), so the exposed all-gathers were not what held the step back.
    x, y = _tokens(s, 8, 2048)

    def step() -> None:
        lm_loss(fsdp(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def build_control_fsdp(variant: str, s: Settings) -> Step:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    model = TinyLM(s.dim(2048), s.n(8), VOCAB).to(s.device)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    x, y = _tokens(s, 8, 1024)

    def step() -> None:
        lm_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _p2p_order(micro: int) -> list[tuple[str, int]]:
    """1F1B with one micro-batch in flight ahead: activations ("a", i) and gradients ("g", i) in the one
    order both ranks post them (NCCL matches point-to-point operations in posting order)."""
    order = [("a", 0)]
    for i in range(1, micro):
        order += [("a", i), ("g", i - 1)]
    return order + [("g", micro - 1)]


def build_pipeline(variant: str, s: Settings) -> Step:
    torch.manual_seed(0)
    full = TinyLM(s.dim(1024), s.n(8), VOCAB)
    cut = (6 if variant == "problem" else 4) if not s.tiny else 1  # the cause: 6 blocks on stage 0, 2 on 1
    rank, num_micro = dist.get_rank(), 4
    blocks = full.blocks[:cut] if rank == 0 else full.blocks[cut:]
    parts = [full.embed, *blocks] if rank == 0 else [*blocks, full.norm, full.head]
    stage = torch.nn.Sequential(*parts).to(s.device)
    opt = torch.optim.AdamW(stage.parameters(), lr=1e-4, fused=True)
    micro = [_tokens(s, 4, 1024) for _ in range(num_micro)]
    shape = (s.n(4), s.n(1024), s.dim(1024))

    def step() -> None:
        outs: dict[int, torch.Tensor] = {}
        for kind, i in _p2p_order(num_micro):
            if rank == 0 and kind == "a":
                with autocast(s):
                    outs[i] = stage(micro[i][0])  # (batch, seq, dim) fp32 residual stream
                dist.send(outs[i].detach().contiguous(), dst=1)
            elif rank == 0:
                grad = torch.empty(shape, device=s.device)
                dist.recv(grad, src=1)
                outs.pop(i).backward(grad)
            elif kind == "a":
                h = torch.empty(shape, device=s.device)
                dist.recv(h, src=0)
                h.requires_grad_()
                with autocast(s):
                    loss = lm_loss(stage(h), micro[i][1]) / num_micro
                loss.backward()
                outs[i] = h.grad
            else:
                dist.send(outs.pop(i), dst=0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


CASES: tuple[Case, ...] = (
    Case("ddp_no_sync", "DDP, 4 micro-batches, all-reduce on every one; fixed: no_sync on the first 3", build_no_sync),
    Case(
        "ddp_buckets",
        "DDP(bucket_cap_mb=1024): one bucket, all-reduce after backward; fixed: default 25 MB",
        build_buckets,
    ),
    Case(
        "fsdp_prefetch",
        "FSDP without backward/forward prefetch; fixed: BACKWARD_PRE + forward_prefetch",
        build_fsdp_prefetch,
    ),
    Case(
        "pipeline_unbalanced",
        "2-stage 1F1B pipeline, 6 blocks on stage 0 and 2 on stage 1; fixed: 4 + 4",
        build_pipeline,
    ),
    Case("straggler", "DDP where rank 1 sleeps 15 ms a step; fixed: no sleep", build_straggler),
    Case("control_ddp", "healthy: DDP, 2 micro-batches with no_sync", build_control_ddp, variants=("control",)),
    Case("control_fsdp", "healthy: FSDP2 fully_shard per block, bf16", build_control_fsdp, variants=("control",)),
)
