"""Peak host memory per rank of loading and exporting a model of several GB shard by shard (issue #27).

A Llama of dim 4096 (ffn 14336, GQA 32/8, vocab 32000) with `--layers` blocks, bf16, is written here as a
Hugging Face checkpoint of several safetensors files plus an index (tensor by tensor, seeded; never
committed). Then, each case in fresh processes (gloo, on the CPU):

- `hf_load_fsdp2` / `hf_load_tp2`: 2 ranks assemble the model with `model.init_from` (the `materialise`
  row reads each rank's blocks with `get_slice`); `hf_load_1rank`: one process loads it whole, for scale;
- `resume_fsdp2`: 2 ranks assemble and load a sharded (DCP) checkpoint of the same model (`--resume`);
- `export_streamed`: one process exports that DCP checkpoint to HF safetensors (`export --hf`, streamed).

Per rank: peak RSS growth during the case (VmHWM after `clear_refs` reset it at the start, so file-backed
pages of mapped checkpoint files count too), this rank's parameter bytes, and the largest tensor.

  python3 benchmarks/shard_load_rss.py [--layers 6] [--dir /tmp/shard_load_rss]

Prints a table and writes benchmarks/results/shard_load_rss_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import environment, write_result  # noqa: E402

GIB = 2**30
SHAPE = {"dim": 4096, "n_heads": 32, "n_kv_heads": 8, "ffn_dim": 14336, "vocab_size": 32000}


def _peak() -> int:
    return int(re.search(r"VmHWM:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024  # type: ignore[union-attr]


def _reset_peak() -> int:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM restarts from what the process holds now
    return _peak()


def _config(layers: int, overrides: list[str]):  # noqa: ANN202
    from tracetrain.config import load_config

    base = ["--train.device=cpu", "--data.seq_len=128", "--train.precision=fp32", "--optim.fused=off"]
    if any(o.startswith("--model.init_from") for o in overrides):
        return load_config(None, base + overrides)
    shape = [f"--model.{k}={v}" for k, v in SHAPE.items()] + [f"--model.n_layers={layers}"]
    return load_config(None, base + shape + overrides)


def write_checkpoint(out: Path, layers: int, files: int) -> tuple[int, int]:
    """The seeded bf16 HF checkpoint in `files` safetensors files; (total bytes, largest tensor bytes)."""
    from tracetrain.models.build import build_on_meta, model_args_from_config
    from tracetrain.models.hf import hf_config_dict
    from tracetrain.models.init import fill_local, init_rule
    from tracetrain.train.sharded_export import write_safetensors_streamed

    args = model_args_from_config(_config(layers, []))
    meta = build_on_meta(args).state_dict()
    names = list(meta)
    per_file = -(-len(names) // files)
    out.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for i in range(files):
        chunk = names[i * per_file : (i + 1) * per_file]
        file = f"model-{i + 1:05d}-of-{files:05d}.safetensors"

        def produce(j: int, chunk: list[str] = chunk) -> torch.Tensor:
            name, shape = chunk[j], tuple(meta[chunk[j]].shape)
            t = torch.empty(shape, dtype=torch.bfloat16)
            fill_local(t, name, shape, (0,) * len(shape), init_rule(name, shape, args), seed=7)
            return t

        entries = [(n if n.startswith("lm_head") else "model." + n, tuple(meta[n].shape)) for n in chunk]
        write_safetensors_streamed(out / file, entries, torch.bfloat16, produce)
        weight_map.update(dict.fromkeys((e[0] for e in entries), file))
    total = sum(t.numel() * 2 for t in meta.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    (out / "config.json").write_text(json.dumps(hf_config_dict(args, torch.bfloat16)))
    return total, max(t.numel() * 2 for t in meta.values())


def _assemble(cfg, world: int):  # noqa: ANN001, ANN202
    from tracetrain.parallel.mesh import build_mesh
    from tracetrain.spec import resolve
    from tracetrain.train.assemble import assemble

    spec = resolve(cfg, torch.device("cpu"), world).replace(weights_dtype=torch.bfloat16)  # bf16, as on a GPU
    return assemble(spec, build_mesh(cfg.parallel, "cpu") if world > 1 else None, until="materialise")


def _local_bytes(module: torch.nn.Module) -> int:
    from torch.distributed.tensor import DTensor

    return sum((p.to_local() if isinstance(p, DTensor) else p).nbytes for p in module.parameters())


def rank_case(case: str, hf_dir: str, dcp_dir: str, layers: int, out_path: str) -> None:
    """One case on this rank (see the module doc); rank 0 writes every rank's figures to `out_path`."""
    import torch.distributed as dist

    from tracetrain.parallel import dist as tdist

    torch.set_num_threads(1)
    info = tdist.init_distributed(600, "cpu")
    world = info.world_size
    layout = {"hf_load_tp2": ["--parallel.tp=2"]}.get(case, [f"--parallel.dp_shard={world}"] if world > 1 else [])
    source = [f"--model.init_from={hf_dir}"] if case.startswith("hf_load") else []
    cfg = _config(layers, layout + source)
    start = time.perf_counter()
    base = _reset_peak()
    a = _assemble(cfg, world)
    if case == "resume_fsdp2":
        from tracetrain.train.sharded_checkpoint import load_sharded

        load_sharded(next((Path(dcp_dir) / "checkpoints").glob("step_*")), a.module, None)
    row = {"grown": _peak() - base, "local": _local_bytes(a.module), "s": time.perf_counter() - start}
    rows = [row] * world
    if world > 1:
        dist.all_gather_object(rows, row)
    if case == "hf_load_fsdp2":  # the DCP checkpoint the resume and export cases read (not timed)
        from tracetrain.train.sharded_checkpoint import save_sharded

        save_sharded(Path(dcp_dir), 0, a.module, torch.optim.SGD(a.module.parameters(), lr=0.0), {}, "", 1)
    if info.rank == 0:
        Path(out_path).write_text(json.dumps(rows))
    if world > 1:
        dist.destroy_process_group()


def export_case(dcp_ckpt: str, layers: int, out_dir: str, out_path: str) -> None:
    from tracetrain.models.build import model_args_from_config
    from tracetrain.train.sharded_export import write_hf_from_dcp

    args = model_args_from_config(_config(layers, []))
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    base = _reset_peak()
    write_hf_from_dcp(Path(dcp_ckpt), args, None, Path(out_dir), torch.bfloat16, 2 * 10**9)
    row = {"grown": _peak() - base, "local": 0, "s": time.perf_counter() - start}
    Path(out_path).write_text(json.dumps([row]))


def main() -> None:
    from tracetrain.parallel.launch import launch_local

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--dir", default="/tmp/shard_load_rss")
    a = parser.parse_args()
    work = Path(a.dir)
    shutil.rmtree(work, ignore_errors=True)
    total, largest = write_checkpoint(work / "hf", a.layers, a.files)
    print(f"checkpoint: {total / GIB:.2f} GiB in {a.files} files, largest tensor {largest / GIB:.3f} GiB")
    results = {}
    for case, world in [("hf_load_fsdp2", 2), ("hf_load_tp2", 2), ("hf_load_1rank", 1), ("resume_fsdp2", 2)]:
        out = work / f"{case}.json"
        launch_local(rank_case, world, case, str(work / "hf"), str(work / "run"), a.layers, str(out), timeout_s=3000)
        results[case] = json.loads(out.read_text())
    ckpt = next((work / "run" / "checkpoints").glob("step_*"))
    out = work / "export.json"
    launch_local(export_case, 1, str(ckpt), a.layers, str(work / "export"), str(out), timeout_s=3000)
    results["export_streamed"] = json.loads(out.read_text())
    print(f"{'case':<16} {'rank':>4} {'peak RSS growth GiB':>20} {'own params GiB':>15} {'x largest':>10} {'s':>7}")
    for case, rows in results.items():
        for r, row in enumerate(rows):
            extra = (row["grown"] - row["local"]) / largest
            print(f"{case:<16} {r:>4} {row['grown'] / GIB:>20.2f} {row['local'] / GIB:>15.2f} {extra:>10.1f} {row['s']:>7.1f}")
    payload = {**environment(), "model_bytes": total, "largest_tensor_bytes": largest, "layers": a.layers,
               "files": a.files, "shape": SHAPE, "cases": results,
               "columns": {"grown": "peak RSS growth (VmHWM) during the case, bytes",
                           "local": "this rank's parameter bytes", "s": "seconds"}}  # fmt: skip
    print(f"wrote {write_result('shard_load_rss_cpu.json', payload)}")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
