"""Single-GPU loops of the advice-truth corpus: each problem with its fixed twin, and a healthy control.

Each `build_*` returns the step of one variant; the problem and its twin differ in the one line the
cause names (the comment on it says which). Sizes are for an H100/H200: each step takes milliseconds to
a few hundred, so that 20 timed steps and a profiled few take seconds.
"""

from __future__ import annotations

import torch
from advice_truth_common import Case, Settings, Step, TinyLM, autocast, lm_loss, python_work
from torch.utils.data import DataLoader, Dataset

VOCAB = 4096


def _lm(s: Settings, dim: int, layers: int, **kw) -> tuple[TinyLM, torch.optim.Optimizer]:
    model = TinyLM(s.dim(dim), s.n(layers), VOCAB, **kw).to(s.device)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)


def _tokens(s: Settings, batch: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(VOCAB, (s.n(batch), s.n(seq) + 1), device=s.device)
    return ids[:, :-1], ids[:, 1:]


def _train(model, opt, x: torch.Tensor, y: torch.Tensor, s: Settings) -> torch.Tensor:
    with autocast(s):
        loss = lm_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


class SlowTokens(Dataset):
    """Samples that cost CPU time to make (decode + tokenize stand-in), as on-the-fly tokenization does."""

    def __init__(self, seq: int, cost_us: float) -> None:
        self.seq, self.cost_us = seq, cost_us

    def __len__(self) -> int:
        return 1_000_000

    def __getitem__(self, i: int) -> torch.Tensor:
        python_work(self.cost_us)
        return torch.randint(VOCAB, (self.seq + 1,), generator=torch.Generator().manual_seed(i))


def build_loader(variant: str, s: Settings) -> Step:
    model, opt = _lm(s, 1024, 4)
    workers = 0 if variant == "problem" else 4  # the cause: samples made in the training process
    loader = DataLoader(
        SlowTokens(s.n(1024), 1500),
        batch_size=s.n(8),
        num_workers=workers,
        pin_memory=s.device.type == "cuda",
        persistent_workers=workers > 0,
        prefetch_factor=4 if workers else None,
    )
    batches = iter(loader)

    def step() -> None:
        batch = next(batches).to(s.device, non_blocking=True)  # (batch, seq + 1)
        _train(model, opt, batch[:, :-1], batch[:, 1:], s)

    return step


def build_pageable(variant: str, s: Settings) -> Step:
    model, opt = _lm(s, 1024, 4, features=True)
    # Host-side features (a frozen encoder's output, say), fp32 (16, 2048, 1024): 128 MiB a batch.
    host = [torch.randn(s.n(16), s.n(2048), s.dim(1024)) for _ in range(4)]
    if variant == "fixed" and s.device.type == "cuda":
        host = [h.pin_memory() for h in host]  # what DataLoader(pin_memory=True) hands over
    _, y = _tokens(s, 16, 2048)
    state = {"i": 0}

    def step() -> None:
        h = host[state["i"] % len(host)]
        state["i"] += 1
        x = h.to(s.device, non_blocking=variant == "fixed")  # the cause: a blocking pageable copy
        _train(model, opt, x, y, s)

    return step


def build_item(variant: str, s: Settings) -> Step:
    # Kernels large enough that without the syncs the GPU is fed (at dim 512 and 4k tokens the twin
    # itself was launch-bound, and the syncs cost only 13% of a host-paced step).
    model, opt = _lm(s, 1024, 12)
    x, y = _tokens(s, 8, 1024)

    def step() -> None:
        with autocast(s):
            loss = lm_loss(model(x), y)
        loss.backward()
        if variant == "problem":  # the cause: a host sync per parameter, to log gradient norms
            norms = {n: p.grad.norm().item() for n, p in model.named_parameters()}
        else:  # the norms stay on the GPU; one read for all of them
            norms = dict(
                zip(
                    (n for n, _ in model.named_parameters()),
                    torch.stack([p.grad.norm() for p in model.parameters()]).tolist(),
                )
            )
        assert norms
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def build_cpu_optimizer(variant: str, s: Settings) -> Step:
    model, gpu_opt = _lm(s, 1024, 4)
    params = list(model.parameters())
    if variant == "fixed":
        x, y = _tokens(s, 8, 512)

        def fixed_step() -> None:
            _train(model, gpu_opt, x, y, s)

        return fixed_step
    # The cause: fp32 master weights and AdamW states kept on the host and stepped there by the CPU,
    # with blocking copies of gradients down and weights up (pageable memory) around it.
    master = [p.detach().cpu() for p in params]
    cpu_opt = torch.optim.AdamW(master, lr=1e-4, foreach=True)
    x, y = _tokens(s, 8, 512)

    def step() -> None:
        with autocast(s):
            loss = lm_loss(model(x), y)
        loss.backward()
        for m, p in zip(master, params):
            m.grad = p.grad.cpu()
        cpu_opt.step()
        cpu_opt.zero_grad(set_to_none=True)
        for m, p in zip(master, params):
            p.data.copy_(m)
        model.zero_grad(set_to_none=True)

    return step


def build_offload(variant: str, s: Settings) -> Step:
    model, opt = _lm(s, 1024, 4)
    x, y = _tokens(s, 4, 1024)

    def step() -> None:
        if variant == "problem":  # the cause: saved activations go to the host and back, unoverlapped
            with torch.autograd.graph.save_on_cpu(pin_memory=False), autocast(s):
                loss = lm_loss(model(x), y)
        else:
            with autocast(s):
                loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def build_fp32(variant: str, s: Settings) -> Step:
    model, opt = _lm(s, 1024, 4)
    x, y = _tokens(s, 8, 1024)

    def step() -> None:
        if variant == "problem":  # the cause: no autocast, every GEMM in fp32
            loss = lm_loss(model(x), y)
        else:
            with autocast(s):
                loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def build_launch(variant: str, s: Settings) -> Step:
    model, opt = _lm(s, 128, 16)
    x, y = _tokens(s, 4, 64)
    run = model if variant == "problem" else torch.compile(model)  # the cause: ~500 tiny eager kernels

    def step() -> None:
        _train(run, opt, x, y, s)

    return step


def build_recompile(variant: str, s: Settings) -> Step:
    import torch._dynamo.config as dynamo_config

    # The user raised the limit to silence "recompile_limit reached": now every new length recompiles.
    for key in ("recompile_limit", "cache_size_limit"):
        if hasattr(dynamo_config, key):
            setattr(dynamo_config, key, 1000)
    model, opt = _lm(s, 256, 1)  # one block: each recompile stays a second or two
    run = torch.compile(model, dynamic=False if variant == "problem" else None)  # the cause: dynamic=False
    state = {"k": 0}

    def step() -> None:
        state["k"] += 1
        x, y = _tokens(s, 8, 64 + 8 * state["k"])  # unpadded batches: a new length every step
        _train(run, opt, x, y, s)

    return step


def build_control_compiled(variant: str, s: Settings) -> Step:
    model, opt = _lm(s, 1024, 4)
    run = torch.compile(model)
    x, y = _tokens(s, 8, 1024)

    def step() -> None:
        _train(run, opt, x, y, s)

    return step


CASES: tuple[Case, ...] = (
    Case("loader_workers", "DataLoader(num_workers=0) with CPU-heavy samples; fixed: num_workers=4", build_loader),
    Case(
        "pageable_copies",
        "a 128 MiB pageable batch copied with .to(device); fixed: pinned + non_blocking",
        build_pageable,
    ),
    Case("item_per_param", "gradient norm .item() per parameter; fixed: one read of stacked norms", build_item),
    Case(
        "cpu_optimizer",
        "AdamW states on the host, stepped by the CPU, blocking copies; fixed: fused AdamW on the GPU",
        build_cpu_optimizer,
    ),
    Case(
        "activation_offload",
        "save_on_cpu(pin_memory=False): activations copied out and back unoverlapped; fixed: kept on the GPU",
        build_offload,
    ),
    Case("fp32_matmul", "no autocast: fp32 GEMMs; fixed: autocast bf16", build_fp32),
    Case("launch_bound", "16 tiny blocks (dim 128, 256 tokens) in eager; fixed: torch.compile", build_launch, warmup=3),
    Case(
        "recompile",
        "torch.compile(dynamic=False) with a new sequence length every step; fixed: default dynamic",
        build_recompile,
        active=1,
    ),
    Case(
        "control_compiled",
        "healthy: compiled 4-block LM, bf16, fused AdamW",
        build_control_compiled,
        variants=("control",),
    ),
)
