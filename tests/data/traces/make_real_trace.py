"""Write a real CUDA profiler trace for the analyzer's golden tests (run on a GPU machine):

    python tests/data/traces/make_real_trace.py OUT_DIR                       # one GPU
    torchrun --nproc-per-node 2 tests/data/traces/make_real_trace.py OUT_DIR  # two ranks, DDP + NCCL

A small bf16 transformer-like model (layer norm, SDPA attention, GELU MLP, cross-entropy, fused AdamW)
fed by a deliberately slow DataLoader without pinned memory, `loss.item()` every step (a host sync),
and tracetrain's phase annotations. Profiles 2 steps with record_shapes and profile_memory.
"""

import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile, record_function, schedule


class SlowDataset(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 10_000

    def __getitem__(self, index: int) -> torch.Tensor:
        time.sleep(0.0005)  # a slow loader: the GPU waits for it
        return torch.randn(512, 1024)


class Block(torch.nn.Module):
    def __init__(self, dim: int = 1024, heads: int = 16) -> None:
        super().__init__()
        self.heads = heads
        self.norm = torch.nn.LayerNorm(dim)
        self.qkv, self.proj = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)
        self.up, self.down = torch.nn.Linear(dim, 4 * dim), torch.nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape  # (batch, seq, dim)
        qkv = self.qkv(self.norm(x)).view(b, t, 3, self.heads, d // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each (batch, heads, seq, head_dim)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (batch, heads, seq, head_dim)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(x)))


def main(out_dir: str) -> None:
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    torch.cuda.set_device(rank)
    if world > 1:
        dist.init_process_group("nccl")
    torch.manual_seed(0)
    model = torch.nn.Sequential(Block(), Block()).cuda().to(torch.bfloat16)
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    batches = iter(torch.utils.data.DataLoader(SlowDataset(), batch_size=8, pin_memory=False))
    path = os.path.join(out_dir, f"real_rank{rank}.json.gz" if world > 1 else "real_h200.json.gz")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True,
                 profile_memory=True, schedule=schedule(wait=1, warmup=1, active=2, repeat=1),
                 on_trace_ready=lambda prof: prof.export_chrome_trace(path)) as prof:
        for _ in range(4):
            with record_function("tracetrain/data_wait"):
                x = next(batches).cuda().to(torch.bfloat16)
            with record_function("tracetrain/forward"):
                y = model(x).float()  # (batch, seq, dim)
                loss = F.cross_entropy(y.flatten(0, 1), torch.zeros(y.shape[0] * y.shape[1], dtype=torch.long,
                                                                  device=y.device))
            with record_function("tracetrain/backward"):
                loss.backward()
            with record_function("tracetrain/optimizer"):
                opt.step()
                opt.zero_grad(set_to_none=True)
            print(rank, loss.item())  # a host sync every step, on purpose
            prof.step()
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
