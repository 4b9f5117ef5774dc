"""Single-process checks of the parallel package's pieces: layout validation, stage split, sequence
sharding, the context-parallel mask, the MoE block, and the no-op hooks of a one-process ParallelModel."""

from __future__ import annotations

import pytest
import torch
from parallel_harness import assemble_tiny, global_batches, run_step, tiny_config

from tracetrain.errors import ConfigError
from tracetrain.models.attention import document_causal_mask
from tracetrain.models.build import model_args_from_config
from tracetrain.models.moe import MoEFeedForward, load_balancing_loss
from tracetrain.parallel.apply import ParallelModel
from tracetrain.parallel.context_parallel import CPDocuments, _unzigzag, shard_sequence
from tracetrain.parallel.mesh import validate_parallel
from tracetrain.parallel.pipeline import split_layers
from tracetrain.train.assemble import step_context
from tracetrain.train.step import train_step


@pytest.mark.parametrize("overrides, world, keys", [
    (["--parallel.dp_shard=2"], 4, "parallel.pp * dp_replicate * dp_shard * cp * tp"),
    (["--parallel.tp=4"], 4, "parallel.tp, model.n_kv_heads"),          # 2 kv heads
    (["--parallel.tp=2", "--data.seq_len=31"], 2, "parallel.tp, parallel.sequence_parallel, data.seq_len"),
    (["--parallel.cp=2", "--data.seq_len=30"], 2, "parallel.cp, data.seq_len"),
    (["--parallel.dp_shard=2", "--parallel.ep=2"], 2, "parallel.ep, model.num_experts"),
    (["--parallel.dp_shard=2", "--parallel.ep=4", "--model.num_experts=4"], 2, "parallel.ep, parallel.dp_shard"),
    (["--parallel.pp=2", "--model.n_layers=1"], 2, "model.n_layers"),
    (["--parallel.pp=2", "--parallel.pp_microbatches=3"], 2, "parallel.pp_microbatches"),
    (["--parallel.tp=2", "--train.mode=lora"], 2, "parallel.tp, train.mode"),
])
def test_validation_names_the_keys(overrides: list[str], world: int, keys: str) -> None:
    cfg = tiny_config(["--train.micro_batch_size=4"] + overrides)
    with pytest.raises(ConfigError, match=keys.replace("*", r"\*")):
        validate_parallel(cfg, model_args_from_config(cfg), world)


def test_pipeline_refuses_tied_embeddings() -> None:
    cfg = tiny_config(["--parallel.pp=2", "--model.preset=small", "--model.n_layers=2", "--model.dim=64",
                       "--model.vocab_size=128", "--train.micro_batch_size=4"])
    with pytest.raises(ConfigError, match="untied embeddings"):
        validate_parallel(cfg, model_args_from_config(cfg), 2)


def test_split_layers_even_with_extra_layers_first() -> None:
    assert split_layers(4, 4) == [[0], [1], [2], [3]]
    assert split_layers(7, 3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert sum(split_layers(32, 6), []) == list(range(32))


def test_sequence_shards_cover_the_sequence_once() -> None:
    seq = torch.arange(16).expand(2, 16)
    shards = [shard_sequence({"input_ids": seq}, r, 2)["input_ids"] for r in range(2)]
    assert shards[0][0].tolist() == [0, 1, 2, 3, 12, 13, 14, 15]   # chunks 0 and 3: balanced causal work
    gathered = torch.cat(shards, dim=1)
    assert torch.equal(_unzigzag(gathered, 2, dim=1), seq)


def test_cp_chunk_mask_is_the_document_causal_mask() -> None:
    doc = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2], [0, 0, 0, 0, 0, 0, 0, 0]])
    full = document_causal_mask(doc)  # (batch, 1, seq, seq)
    for chunk in range(4):
        start, end = 2 * chunk, 2 * chunk + 2
        assert torch.equal(CPDocuments(doc).chunk_mask(chunk, 2), full[:, :, start:end, :end])


def test_moe_with_one_expert_is_the_dense_mlp() -> None:
    torch.manual_seed(0)
    moe = MoEFeedForward(dim=16, ffn_dim=32, num_experts=1, top_k=1)
    moe.experts.init_weights(0.1, 0.1)
    x = torch.randn(2, 5, 16)
    gate, up, down = (w[0] for w in moe.experts.weights())
    dense = torch.nn.functional.silu(x @ gate.t()) * (x @ up.t()) @ down.t()
    torch.testing.assert_close(moe(x), dense, rtol=1e-5, atol=1e-6)


def test_moe_aux_loss_gradient_is_injected_with_its_weight() -> None:
    torch.manual_seed(0)
    moe = MoEFeedForward(dim=16, ffn_dim=32, num_experts=4, top_k=2, aux_loss_weight=0.3)
    moe.experts.init_weights(0.1, 0.1)
    torch.nn.init.normal_(moe.router.weight, std=0.5)
    x = torch.randn(3, 7, 16)
    moe(x).square().sum().backward()
    injected = moe.router.weight.grad.clone()
    moe.zero_grad()
    moe.aux_loss_weight = 0.0
    out = moe(x)
    probs = moe.router(x.reshape(-1, 16)).float().softmax(-1)
    explicit = out.square().sum() + 0.3 * load_balancing_loss(probs, probs.topk(2, dim=-1).indices)
    explicit.backward()
    torch.testing.assert_close(injected, moe.router.weight.grad, rtol=1e-5, atol=1e-7)
    assert float(moe.last_aux_loss) >= 1.0 - 1e-6  # 1.0 = perfectly balanced, larger = imbalance


def test_single_process_hooks_reproduce_train_step() -> None:
    cfg = tiny_config([])
    batches = global_batches(cfg, 4, 2)
    plain = assemble_tiny(cfg)
    want = run_step(plain, batches)
    # The same run with a one-process ParallelModel's hooks in the step (the trainer has none on one process).
    hooked = assemble_tiny(cfg)
    par = ParallelModel(parts=[hooked.module])
    assert plain.par is None and hooked.optimizer is not None
    got = train_step(par.module, hooked.optimizer, batches, step_context(hooked.spec, optimizer=hooked.optimizer, par=par))
    assert float(got.loss) == pytest.approx(float(want.loss), abs=1e-6)
    assert float(got.grad_norm) == pytest.approx(float(want.grad_norm), rel=1e-6)
    for (name, p), q in zip(par.module.named_parameters(), plain.module.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-7, msg=name)


def test_one_rank_fsdp_runs_the_tables_data_parallel_rows(tmp_path) -> None:
    """`assemble(..., shard_mesh=)` (benchmarks/compose_gpu.py's FSDP2 on one GPU): the data-parallel and
    layout rows run on one process, the parameters become DTensors, and a step gives the plain run's loss."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from tracetrain.parallel.mesh import build_mesh
    from tracetrain.spec import resolve
    from tracetrain.train.assemble import assemble

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        cfg = tiny_config([])
        mesh1 = init_device_mesh("cpu", (1,), mesh_dim_names=("dp_shard_cp",))
        sharded = assemble(resolve(cfg, torch.device("cpu")), build_mesh(cfg.parallel, "cpu"), shard_mesh=mesh1)
        plain = assemble_tiny(cfg)
        assert {"data_parallel", "layout"} <= set(sharded.applied) and sharded.par is not None
        assert isinstance(next(sharded.module.parameters()), DTensor) and plain.par is None
        batches = global_batches(cfg, 4, 1)
        got, want = run_step(sharded, batches), run_step(plain, batches)
        assert float(got.loss) == pytest.approx(float(want.loss), abs=1e-6)
        assert float(got.grad_norm) == pytest.approx(float(want.grad_norm), rel=1e-5)
    finally:
        dist.destroy_process_group()
