"""The model is built on meta, sharded, and only then materialised, each rank its own part (issue #27).

- 2- and 4-rank sharded inits (FSDP, TP, PP, FSDP x TP, EP, LoRA over FSDP, an uneven FSDP shard) give
  bit-identical full weights to the 1-rank init of the same seed: gathered on rank 0 and compared.
- No rank ever holds the whole model: a model of ~200 MiB is assembled under FSDP over 2 ranks and
  each rank's peak resident memory during `assemble` (VmHWM, reset just before) must stay under 75%
  of the model's size. The old path (whole model on every rank, then sharded) peaks above 100%.
- Seeded values drawn chunk by chunk: any block of a tensor equals that block of the whole tensor.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch

from tracetrain.models.init import InitRule, fill_local
from tracetrain.parallel.launch import launch_local

MOE = ["--model.num_experts=4", "--model.experts_top_k=2"]
LAYOUTS_2 = {
    "fsdp": ["--parallel.dp_shard=2"],
    "tp": ["--parallel.tp=2"],
    "pp": ["--parallel.pp=2", "--parallel.pp_microbatches=2"],
    "lora_fsdp": ["--parallel.dp_shard=2", "--train.mode=lora", "--lora.targets=['all-linear']"],
    "ep": ["--parallel.dp_shard=2", "--parallel.ep=2", *MOE],
    "tied_fsdp": ["--parallel.dp_shard=2"],  # tied embeddings (as llama3.2-1b): the head stays the embedding
}
# Each rank reads only its blocks of a multi-file HF checkpoint (fp32, written at test time from seed 99).
HF = "--model.init_from={hf}"
LAYOUTS_2_HF = {
    "hf_fsdp": ["--parallel.dp_shard=2", HF],
    "hf_tp": ["--parallel.tp=2", HF],
    "hf_pp": ["--parallel.pp=2", "--parallel.pp_microbatches=2", HF],
    "hf_lora_fsdp": ["--parallel.dp_shard=2", "--train.mode=lora", HF],
}
LAYOUTS_4 = {
    "fsdp_uneven": ["--parallel.dp_shard=4", "--model.vocab_size=130"],  # 33, 33, 33, 31 embedding rows
    "fsdp2_tp2": ["--parallel.dp_shard=2", "--parallel.tp=2"],
    "pp2_tp2": ["--parallel.pp=2", "--parallel.tp=2", "--parallel.pp_microbatches=2"],
}


def _config(overrides: list[str]) -> object:
    """The tiny config; with model.init_from the shape comes from the checkpoint (no model.* overrides)."""
    from parallel_harness import TINY

    from tracetrain.config import load_config

    if any(o.startswith("--model.init_from") for o in overrides):
        return load_config(None, [o for o in TINY if not o.startswith("--model.")] + overrides)
    return load_config(None, TINY + overrides)


def write_tiny_hf(out: Path) -> None:
    """A tiny HF checkpoint in 3 files (fp32), from a seed the runs do not use."""
    from tracetrain.models.build import materialize, model_args_from_config
    from tracetrain.models.export import export_hf

    args = model_args_from_config(_config([]))  # type: ignore[arg-type]
    export_hf(materialize(args, torch.device("cpu"), 99), args, out, torch.float32, max_shard_bytes=250_000)


def _stored(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {
        k.removeprefix("model."): v for f in sorted(Path(path).glob("*.safetensors")) for k, v in load_file(f).items()
    }


def _spec(cfg: object, world: int, tied: bool) -> object:
    from tracetrain.spec import resolve

    spec = resolve(cfg, torch.device("cpu"), world)  # type: ignore[arg-type]
    return spec.replace(model_args=dataclasses.replace(spec.model_args, tie_embeddings=True)) if tied else spec


def _tie_kept(a: object) -> bool:
    parts = a.parts  # type: ignore[attr-defined]
    return all(p.lm_head.weight is p.embed_tokens.weight for p in parts if getattr(p, "lm_head", None) is not None)


def _full_weights(a: object) -> dict[str, torch.Tensor]:
    """This rank's parameters as full tensors by plain-model name (collective for DTensors)."""
    from torch.distributed.tensor import DTensor

    from tracetrain.models.init import canonical_name

    out = {}
    for part in a.parts:  # type: ignore[attr-defined]
        for name, p in part.named_parameters():
            full = p.full_tensor() if isinstance(p, DTensor) else p
            out[canonical_name(name)] = full.detach().clone()
    return out


def gather_and_compare(layouts: dict[str, list[str]], out_path: str) -> None:
    """Each layout: assemble up to `materialise` on every rank, gather the full weights on rank 0, and
    compare them bitwise with a 1-rank assembly of the same config; rank 0 writes the mismatches."""
    import torch.distributed as dist

    from tracetrain.parallel import dist as tdist
    from tracetrain.parallel.mesh import build_mesh
    from tracetrain.train.assemble import assemble

    torch.set_num_threads(1)
    info = tdist.init_distributed(120, "cpu")
    results: dict[str, object] = {}
    for name, overrides in layouts.items():
        cfg = _config(overrides)
        tied = name.startswith("tied")
        a = assemble(_spec(cfg, info.world_size, tied), build_mesh(cfg.parallel, "cpu"))  # type: ignore[arg-type]
        assert a.optimizer is not None  # the whole table ran on the materialised shards
        gathered: list[dict[str, torch.Tensor]] = [{} for _ in range(info.world_size)]
        dist.all_gather_object(gathered, _full_weights(a))
        if info.rank == 0:
            merged = {k: v for d in gathered for k, v in d.items()}
            one_rank = _config([o for o in overrides if not o.startswith("--parallel.")])
            ref_assembly = assemble(_spec(one_rank, 1, tied), until="materialise")  # type: ignore[arg-type]
            ref = _full_weights(ref_assembly)
            init_from = cfg.model.init_from  # type: ignore[attr-defined]
            stored = _stored(init_from) if init_from else {}
            results[name] = {
                "not_from_checkpoint": sorted(
                    k for k in stored if not torch.equal(stored[k], merged.get(k, stored[k] + 1))
                ),
                "names_missing": sorted(ref.keys() - merged.keys()),
                "different": sorted(k for k in ref.keys() & merged.keys() if not torch.equal(ref[k], merged[k])),
                "num_params": len(ref),
                "tie_lost": tied and not (_tie_kept(a) and _tie_kept(ref_assembly)),
            }
    if info.rank == 0:
        Path(out_path).write_text(json.dumps(results))
    tdist.shutdown()  # every rank waits for the others first: rank 0 hosts the store


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("init") / "hf"
    write_tiny_hf(out)
    assert len(list(out.glob("*.safetensors"))) > 1
    return out


def _sharded_inits(world: int, layouts: dict[str, list[str]], hf: Path, out: Path) -> dict:
    layouts = {k: [o.format(hf=hf) for o in v] for k, v in layouts.items()}
    launch_local(gather_and_compare, world, layouts, str(out), timeout_s=400)
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def two_rank_inits(hf_checkpoint: Path) -> dict:
    """Both 2-rank groups (random init and init_from) in one job: one start-up of the ranks, not two."""
    return _sharded_inits(2, {**LAYOUTS_2, **LAYOUTS_2_HF}, hf_checkpoint, hf_checkpoint.parent / "init_2.json")


@pytest.fixture(scope="module")
def four_rank_inits(hf_checkpoint: Path) -> dict:
    return _sharded_inits(4, LAYOUTS_4, hf_checkpoint, hf_checkpoint.parent / "init_4.json")


@pytest.mark.parametrize(
    ("job", "layouts"),
    [("two_rank_inits", LAYOUTS_2), ("two_rank_inits", LAYOUTS_2_HF), ("four_rank_inits", LAYOUTS_4)],
    ids=["2_ranks", "2_ranks_hf", "4_ranks"],
)
def test_sharded_init_equals_one_rank_init(request: pytest.FixtureRequest, job: str, layouts: dict) -> None:
    results = request.getfixturevalue(job)
    for name in layouts:
        r = results[name]
        assert r["num_params"] > 10 and not r["names_missing"] and not r["different"], (name, r)
        assert not r["tie_lost"], (name, r)
        assert not r["not_from_checkpoint"], (name, r)  # with init_from every stored tensor was read, not drawn


# --------------------------------------------------------------------------------------------------
# No rank holds the whole model

BIG = ["--model.dim=1024", "--model.n_layers=4", "--model.n_heads=8", "--model.n_kv_heads=8",
       "--model.ffn_dim=4096", "--model.vocab_size=4096"]  # fmt: skip


def _peak_rss_bytes() -> int:
    return int(re.search(r"VmHWM:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024  # type: ignore[union-attr]


def peak_during_assembly(out_path: str) -> None:
    """Assemble the BIG model under FSDP over every rank; each rank reports its peak RSS growth."""
    import torch.distributed as dist

    from tracetrain.models.accounting import num_params
    from tracetrain.models.build import model_args_from_config
    from tracetrain.parallel import dist as tdist
    from tracetrain.parallel.mesh import build_mesh
    from tracetrain.spec import resolve
    from tracetrain.train.assemble import assemble

    torch.set_num_threads(1)
    info = tdist.init_distributed(120, "cpu")
    cfg = _config([*BIG, f"--parallel.dp_shard={info.world_size}"])
    spec = resolve(cfg, torch.device("cpu"), info.world_size)
    mesh = build_mesh(cfg.parallel, "cpu")
    Path("/proc/self/clear_refs").write_text("5")  # the peak restarts from what this process holds now
    base = _peak_rss_bytes()
    a = assemble(spec, mesh, until="materialise")
    grown = _peak_rss_bytes() - base
    local = sum(p.to_local().nbytes for p in a.module.parameters())  # type: ignore[attr-defined]
    model_bytes = num_params(model_args_from_config(cfg)) * 4  # fp32
    report = [None] * info.world_size
    dist.all_gather_object(report, {"grown": grown, "local": local, "model": model_bytes})
    if info.rank == 0:
        Path(out_path).write_text(json.dumps(report))
    tdist.shutdown()  # every rank waits for the others first: rank 0 hosts the store


def test_no_rank_holds_the_whole_model(tmp_path: Path) -> None:
    out = tmp_path / "peak.json"
    launch_local(peak_during_assembly, 2, str(out), timeout_s=400)
    for rank in json.loads(out.read_text()):
        assert rank["local"] * 2 >= rank["model"] * 0.95  # the shards really are this rank's half
        assert rank["grown"] < 0.75 * rank["model"], rank  # half the model plus one chunk, never all of it


# --------------------------------------------------------------------------------------------------
# Chunked seeded values: any block is that block of the whole


@pytest.mark.parametrize("rule", [InitRule("normal", 0.02), InitRule("uniform", 0.5)])
def test_blocks_equal_the_whole_tensor(rule: InitRule) -> None:
    shape = (37, 11)  # 64-element chunks: 5 rows each, so blocks straddle chunk boundaries
    whole = torch.empty(shape)
    fill_local(whole, "w", shape, (0, 0), rule, seed=3, chunk_elements=64)
    for rows, cols in [((0, 37), (0, 11)), ((4, 19), (0, 11)), ((9, 10), (3, 8)), ((30, 37), (10, 11))]:
        block = torch.empty(rows[1] - rows[0], cols[1] - cols[0])
        fill_local(block, "w", shape, (rows[0], cols[0]), rule, seed=3, chunk_elements=64)
        assert torch.equal(block, whole[rows[0] : rows[1], cols[0] : cols[1]])
    other = torch.empty(shape)
    fill_local(other, "w", shape, (0, 0), rule, seed=4, chunk_elements=64)
    assert not torch.equal(other, whole)  # the seed matters
