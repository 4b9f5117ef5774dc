"""Cluster smoke test: a few data-parallel steps of a tiny model on every rank, results compared.

    torchrun --nnodes=2 --node_rank=0 --nproc-per-node=8 --rdzv_backend=c10d \
        --rdzv_endpoint=HOST:29500 -m tracetrain.train.smoke --out /shared/smoke

Every rank writes OUT/rank<R>.json (losses, gradient norms, a checksum of the final parameters) and
OUT/logs/rank<R>.log; rank 0 checks that all ranks agree and prints one line. Runs on CPU (gloo) or
GPU (NCCL, `--device cuda`), so it exercises rendezvous, the process group, FSDP collectives, the
failure watchdog and per-rank logging before a real job is started.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from tracetrain.config import Config, load_config
from tracetrain.parallel import dist as tdist

# A 4-layer, dim-64 model in fp32 with AdamW eps = 1 (an update is ~lr * gradient): ranks that disagree
# show it in the losses and parameters, not in round-off blurred by Adam's normalisation.
TINY = [
    "--model.dim=64",
    "--model.n_layers=4",
    "--model.n_heads=4",
    "--model.n_kv_heads=2",
    "--model.ffn_dim=128",
    "--model.vocab_size=128",
    "--data.seq_len=32",
    "--train.precision=fp32",
    "--optim.warmup_steps=0",
    "--optim.schedule=constant",
    "--optim.lr=5e-2",
    "--optim.fused=off",
    "--optim.eps=1.0",
    "--train.fused_ce=false",
]


def smoke_batches(cfg: Config, rows: int, seed: int, num: int = 1) -> list[dict[str, torch.Tensor]]:
    """`num` global micro-batches of `rows` rows, the same on every rank (one seeded generator): random
    tokens, two packed documents per row, ~30% ignored labels (so data-parallel ranks hold different
    target counts). The parallel layout tests use the same batches."""
    from tracetrain.models.build import model_args_from_config

    gen = torch.Generator().manual_seed(seed)
    seq, vocab = cfg.data.seq_len, model_args_from_config(cfg).vocab_size
    out = []
    for _ in range(num):
        ids = torch.randint(0, vocab, (rows, seq), generator=gen)
        labels = torch.randint(0, vocab, (rows, seq), generator=gen)
        labels[torch.rand(rows, seq, generator=gen) < 0.3] = -100
        split = torch.randint(seq // 4, 3 * seq // 4, (rows,), generator=gen)
        pos = torch.arange(seq).expand(rows, seq)
        doc = (pos >= split[:, None]).long()
        position_ids = torch.where(doc == 1, pos - split[:, None], pos)
        out.append({"input_ids": ids, "labels": labels, "position_ids": position_ids.contiguous(), "document_ids": doc})
    return out


def _full(t: torch.Tensor) -> torch.Tensor:
    """The full tensor of a DTensor parameter (collective), or the tensor itself."""
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="folder for rank<R>.json and logs/")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--timeout-s", type=int, default=120)
    a = ap.parse_args(argv)

    from tracetrain.parallel.mesh import build_mesh
    from tracetrain.spec import resolve
    from tracetrain.train.assemble import assemble, run_step_context
    from tracetrain.train.step import train_step

    out = Path(a.out)
    info = tdist.init_distributed(a.timeout_s, a.device)
    log = tdist.setup_rank_logging(out, info.rank)
    watchdog = tdist.Watchdog(info.rank, stall_s=a.timeout_s).start() if info.is_distributed else None
    with tdist.failure_guard(watchdog, info.rank):
        cfg = load_config(None, [*TINY, f"--parallel.dp_shard={info.world_size}", f"--train.device={a.device}"])
        log.info(f"rank {info.rank} of {info.world_size} on {info.device}: building the tiny model")
        mesh = build_mesh(cfg.parallel, a.device) if info.is_distributed else None
        # The trainer's own path: spec, the transform table (FSDP over every rank), the real step.
        built = assemble(resolve(cfg, info.device, info.world_size), mesh)
        assert built.optimizer is not None
        ctx = run_step_context(built)
        losses, norms = [], []
        for s in range(a.steps):
            result = train_step(built.module, built.optimizer, smoke_batches(cfg, 2 * info.world_size, seed=s), ctx)
            losses.append(float(result.loss))
            norms.append(float(result.grad_norm))
        params = {n: _full(p) for n, p in built.module.named_parameters()}
        rec = {"losses": losses, "norms": norms}
        checksum = float(sum(p.double().sum() for p in params.values()))
        record = {
            "rank": info.rank,
            "world_size": info.world_size,
            "losses": rec["losses"],
            "norms": rec["norms"],
            "param_checksum": checksum,
        }
        (out / f"rank{info.rank}.json").write_text(json.dumps(record))
        log.info(f"losses {rec['losses']}, parameter checksum {checksum:.6f}")
    tdist.shutdown(watchdog)
    if info.rank == 0:
        results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(info.world_size)]
        agree = all(
            r["losses"] == results[0]["losses"] and r["param_checksum"] == results[0]["param_checksum"] for r in results
        )
        print(f"smoke: {info.world_size} ranks {'agree' if agree else 'DISAGREE'}; losses {results[0]['losses']}")
        return 0 if agree else 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
