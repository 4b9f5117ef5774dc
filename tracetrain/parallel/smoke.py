"""Cluster smoke test: a few data-parallel steps of a tiny model on every rank, results compared.

    torchrun --nnodes=2 --node_rank=0 --nproc-per-node=8 --rdzv_backend=c10d \
        --rdzv_endpoint=HOST:29500 -m tracetrain.parallel.smoke --out /shared/smoke

Every rank writes OUT/rank<R>.json (losses, gradient norms, a checksum of the final parameters) and
OUT/logs/rank<R>.log; rank 0 checks that all ranks agree and prints one line. Runs on CPU (gloo) or
GPU (NCCL, `--device cuda`), so it exercises rendezvous, the process group, FSDP collectives, the
failure watchdog and per-rank logging before a real job is started.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tracetrain.parallel import dist as tdist


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="folder for rank<R>.json and logs/")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--timeout-s", type=int, default=120)
    a = ap.parse_args(argv)

    from tracetrain.parallel.apply import parallelize
    from tracetrain.parallel.mesh import build_mesh
    from tracetrain.parallel.testing import build_tiny, global_batches, tiny_config, train_and_record

    out = Path(a.out)
    info = tdist.init_distributed(a.timeout_s, a.device)
    log = tdist.setup_rank_logging(out, info.rank)
    watchdog = tdist.Watchdog(info.rank, stall_s=a.timeout_s).start() if info.is_distributed else None
    with tdist.failure_guard(watchdog, info.rank):
        cfg = tiny_config([f"--parallel.dp_shard={info.world_size}"])
        log.info(f"rank {info.rank} of {info.world_size} on {info.device}: building the tiny model")
        mesh = build_mesh(cfg.parallel, a.device) if info.is_distributed else None
        par = parallelize(build_tiny(cfg), mesh, cfg, device=info.device)
        steps = [global_batches(cfg, 2 * info.world_size, 1, seed=s) for s in range(a.steps)]
        rec = train_and_record(par, cfg, steps)
        checksum = float(sum(p.double().sum() for p in rec["params"].values()))
        result = {"rank": info.rank, "world_size": info.world_size, "losses": rec["losses"],
                  "norms": rec["norms"], "param_checksum": checksum}
        (out / f"rank{info.rank}.json").write_text(json.dumps(result))
        log.info(f"losses {rec['losses']}, parameter checksum {checksum:.6f}")
    tdist.shutdown(watchdog)
    if info.rank == 0:
        results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(info.world_size)]
        agree = all(r["losses"] == results[0]["losses"] and r["param_checksum"] == results[0]["param_checksum"]
                    for r in results)
        print(f"smoke: {info.world_size} ranks {'agree' if agree else 'DISAGREE'}; losses {results[0]['losses']}")
        return 0 if agree else 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
