"""Long-context memory switches: the tiled norm + MLP (same outputs and gradients as untiled, through the
real step too), its `auto` rule and its tie to compile in `resolve`, the adaptive fused cross-entropy
chunk, and the planner's longest context."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from tracetrain.config import load_config
from tracetrain.errors import ConfigError
from tracetrain.kernels.fused_ce import CHUNK_MULTIPLE, adaptive_chunk_tokens, fused_linear_cross_entropy
from tracetrain.memory.recompute import apply_recompute
from tracetrain.memory.tiled_mlp import AUTO_MIN_TOKENS, apply_tiled_mlp, is_tiled, tiles
from tracetrain.models.llama import ModelArgs, Transformer
from tracetrain.models.lora import apply_lora
from tracetrain.plan.longest import fitting_remedy, longest_context, plan_at
from tracetrain.spec import resolve
from tracetrain.train.assemble import assemble, run_step_context
from tracetrain.train.step import train_step

ARGS = ModelArgs(dim=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=64)
CPU = torch.device("cpu")


def tiny(lora: bool) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(ARGS).double()
    model.init_weights()
    if lora:
        apply_lora(model, rank=4, alpha=8.0, dropout=0.0, targets=["all-linear"], adapter_dtype=torch.float64)
        for name, p in model.named_parameters():
            if "lora_B" in name:  # B starts at zero: random B makes the adapters matter
                torch.nn.init.normal_(p, std=0.1)
    return model


def loss_and_grads(model: Transformer, tokens: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("tile", [5, 64])
@pytest.mark.parametrize("recompute", ["none", "full"])
def test_tiled_output_and_grads_equal_untiled(lora: bool, tile: int, recompute: str) -> None:
    tokens = torch.randint(0, ARGS.vocab_size, (2, 41), generator=torch.Generator().manual_seed(1))
    ref_model = tiny(lora)
    model = copy.deepcopy(ref_model)
    assert apply_tiled_mlp(model, tile) == ARGS.n_layers and all(is_tiled(b) for b in model.layers)
    apply_recompute(model, recompute)  # type: ignore[arg-type]
    ref, got = loss_and_grads(ref_model, tokens), loss_and_grads(model, tokens)
    torch.testing.assert_close(got[0], ref[0], rtol=0, atol=1e-12)
    assert got[1].keys() == ref[1].keys()
    for name, g in ref[1].items():
        torch.testing.assert_close(got[1][name], g, rtol=1e-10, atol=1e-12, msg=name)
    with torch.no_grad():  # no grad: plain tiles, the same logits
        torch.testing.assert_close(model(tokens), ref_model(tokens), rtol=0, atol=1e-12)


def test_tiles_saves_only_tile_inputs() -> None:
    """Under grad, the feed-forward half keeps nothing of size ffn_dim per token: its tiles recompute."""
    model = tiny(lora=True)
    apply_tiled_mlp(model, 8)
    block = model.layers[1]
    x = torch.randn(1, 40, ARGS.dim, dtype=torch.float64, requires_grad=True)
    saved: list[torch.Size] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        block.ffn(x).sum().backward()
    assert saved and all(ARGS.ffn_dim not in s for s in saved), saved
    assert tiles(17, 8) == [(0, 8), (8, 16), (16, 17)]
    with pytest.raises(ValueError, match="already tiled"):
        apply_tiled_mlp(model, 8)
    with pytest.raises(ValueError, match=">= 1"):
        apply_tiled_mlp(tiny(lora=False), 0)


def _cfg(*extra: str):
    return load_config(
        None,
        [
            "--model.preset=tiny",
            "--train.mode=lora",
            "--lora.targets=all-linear",
            "--train.micro_batch_size=2",
            "--data.seq_len=24",
            "--train.precision=fp32",
            "--memory.recompute=full",
            *extra,
        ],
    )


def test_real_step_with_tiled_mlp_matches_untiled() -> None:
    """The run `tracetrain train` assembles (config switch, resolve, TRANSFORMS row) and its real step."""
    tokens = torch.randint(0, 300, (2, 25), generator=torch.Generator().manual_seed(2))
    batch = {
        "input_ids": tokens[:, :-1],
        "labels": tokens[:, 1:],
        "position_ids": torch.arange(24).expand(2, 24),
        "document_ids": torch.zeros(2, 24, dtype=torch.long),
    }
    losses = {}
    # As benchmarks/long_context.py runs it: full recomputation and the streamed offload of block inputs.
    for tiled in ("off", "on"):
        overrides = (
            f"--memory.tiled_mlp={tiled}",
            "--memory.tiled_mlp_tokens=7",
            "--memory.activation_offload=streamed",
        )
        spec = resolve(_cfg(*overrides), CPU)
        built = assemble(spec)
        assert ("tiled_mlp" in built.applied) == (tiled == "on")
        ctx = run_step_context(built)
        losses[tiled] = [float(train_step(built.module, built.optimizer, [batch], ctx).loss) for _ in range(3)]
    assert losses["on"] == pytest.approx(losses["off"], rel=1e-5)
    assert losses["on"][2] != losses["on"][0]  # the steps trained


def test_auto_rule_and_compile_tie() -> None:
    cuda = torch.device("cuda")
    short = resolve(_cfg(), cuda, probe=False)
    assert short.tiled_mlp_tokens == 0 and short.compile
    seq = AUTO_MIN_TOKENS // 2
    long = resolve(_cfg(f"--data.seq_len={seq}"), cuda, probe=False)
    assert long.tiled_mlp_tokens == 8192 and not long.compile and long.fused_kernels
    got = {d.key: d for d in long.decisions}
    assert got["memory.tiled_mlp"].value == "on" and got["memory.tiled_mlp"].reason.startswith("65,536 tokens")
    assert (got["train.compile"].value, got["train.compile"].reason) == ("off", "tiled norm + MLP runs eagerly")
    forced = resolve(_cfg(f"--data.seq_len={seq}", "--train.compile=on"), cuda, probe=False)
    assert forced.tiled_mlp_tokens == 0 and forced.compile  # auto tiling yields to an explicit compile
    with pytest.raises(ConfigError, match=r"memory\.tiled_mlp"):
        resolve(_cfg("--memory.tiled_mlp=on", "--train.compile=on"), cuda, probe=False)


def test_adaptive_chunk_from_free_memory() -> None:
    vocab = 128_256
    row = vocab * 2  # bf16 logits
    assert adaptive_chunk_tokens(80 * 2**30, vocab, 4096) == 4096  # plenty: the configured chunk, never more
    assert adaptive_chunk_tokens(2 * 1000 * row, vocab, 4096) == 768  # half of free holds 1000 rows -> 768
    assert adaptive_chunk_tokens(0, vocab, 4096) == CHUNK_MULTIPLE  # never below one multiple
    got = adaptive_chunk_tokens(3 * 2**30, vocab, 8192, bytes_per_logit=4)
    assert got % CHUNK_MULTIPLE == 0 and got * vocab * 4 <= 3 * 2**30 // 2


def test_chunk_size_does_not_change_the_loss() -> None:
    g = torch.Generator().manual_seed(0)
    h = torch.randn(1000, 16, dtype=torch.float64, generator=g)
    w = torch.randn(50, 16, dtype=torch.float64, generator=g)
    labels = torch.randint(0, 50, (1000,), generator=g)
    ref = F.cross_entropy(h @ w.t(), labels, reduction="sum")
    for chunk in (256, 333, 4096):
        got = fused_linear_cross_entropy(h, w, labels, chunk_tokens=chunk, adaptive=True)  # CPU: chunk as given
        torch.testing.assert_close(got, ref)


def _8b_lora(*extra: str):
    return load_config(
        None,
        [
            "--model.preset=llama3.1-8b",
            "--train.mode=lora",
            "--lora.rank=32",
            "--lora.targets=all-linear",
            "--train.micro_batch_size=1",
            "--data.seq_len=2048",
            *extra,
        ],
    )


def test_longest_context_is_the_fitting_edge() -> None:
    cfg = _8b_lora("--memory.recompute=full")
    found = longest_context(cfg, "h200", multiple=4096)
    assert found.seq_len > 0 and found.limited_by == "GPU memory"
    assert plan_at(cfg, found.seq_len, "h200").fits and not plan_at(cfg, found.seq_len + 4096, "h200").fits
    untiled = longest_context(cfg, "h200", overrides=("--memory.tiled_mlp=off",), multiple=4096)
    assert untiled.seq_len < found.seq_len  # the tiled MLP is what buys the extra length
    offloaded = longest_context(
        cfg, "h200", overrides=("--memory.activation_offload=streamed",), multiple=4096, host_memory_gib=64
    )
    assert offloaded.limited_by == "host memory" and offloaded.plan is not None
    assert offloaded.plan.memory.host_bytes_per_node <= 64 * 2**30 < offloaded.plan.memory.host_capacity_bytes + 1
    assert "longest data.seq_len" in found.line()


def test_fitting_remedy_names_switches_that_fit() -> None:
    """200k tokens on an H200: with 120 GiB of host memory only recomputation fits; with the planner's
    default host (1 TiB) every block's activations fit on the host, and offloading them without
    recomputation is planned faster, so that is the advice."""
    cfg = _8b_lora()
    remedy = fitting_remedy(cfg, 200_000, "h200", host_memory_gib=120)
    assert remedy is not None
    switches, recomputed = remedy
    assert "--memory.recompute=full" in switches and recomputed.fits
    remedy = fitting_remedy(cfg, 200_000, "h200")
    assert remedy is not None
    switches, offloaded = remedy
    assert switches == ("--memory.tiled_mlp=on", "--memory.activation_offload=streamed") and offloaded.fits
    assert offloaded.input.recompute == "none" and offloaded.tokens_per_s > recomputed.tokens_per_s
    assert offloaded.memory.host_bytes_per_node > 120 * 2**30  # why it was not the advice with 120 GiB
    assert fitting_remedy(cfg, 1 << 23, "h200", host_memory_gib=64) is None


def test_plan_command_prints_the_longest_context(capsys: pytest.CaptureFixture) -> None:
    from tracetrain.cli import main

    args = ["plan", "--gpu", "h200", "--longest-context", "--host-memory-gib", "120"]
    assert main(args + ["--model.preset=llama3.1-8b", "--train.mode=lora", "--train.micro_batch_size=1"]) == 0
    out = capsys.readouterr().out
    tail = out[out.index("longest context on 1 x") :].splitlines()
    assert tail[1].startswith("  with these settings: longest data.seq_len")
    assert any("--memory.recompute=full" in line for line in tail[2:])
    assert "runs out of host memory" in tail[-1]  # the last row offloads: the host is the limit...
    # ...and keeps the last blocks' inputs on the GPU, so both memories hold block inputs.
    assert "with --memory.activation_offload_fraction=0." in tail[-1]
    fraction = float(tail[-1].split("activation_offload_fraction=")[1].split(":")[0])
    assert 0 < round(fraction * 32) < 31


@pytest.mark.parametrize("host_gib,switches", [
    (120, "--memory.tiled_mlp=on --memory.activation_offload=streamed"),  # every block's activations fit the host
    (16, "--memory.recompute=full"),  # they do not: recompute
])
def test_plan_command_names_the_switches_that_fit(host_gib: int, switches: str, capsys: pytest.CaptureFixture) -> None:
    """`tracetrain plan` for a length that does not fit says, as the pre-flight line does, the fastest planned
    long-context switches under which it fits, given the host memory it is told of."""
    from tracetrain.cli import main

    args = ["plan", "--gpu", "h100-sxm", "--host-memory-gib", str(host_gib), "--model.preset=llama3.1-8b",
            "--train.mode=lora", "--lora.rank=32", "--lora.targets=all-linear", "--train.micro_batch_size=1",
            "--data.seq_len=65536", "--data.pack=false"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "does not fit" in out
    (line,) = [x for x in out.splitlines() if x.startswith("It fits with ")]
    assert line.startswith(f"It fits with {switches} (planned ") and line.endswith("tokens/s).")
    assert ("GiB of host memory" in line) == ("offload" in switches)


def test_preflight_line_names_the_longest_and_the_switches_that_fit() -> None:
    from tracetrain.plan import plan
    from tracetrain.plan.mapping import plan_input_from_config
    from tracetrain.train.oom import preflight_line

    cfg = _8b_lora("--data.seq_len=200000")
    p = plan(plan_input_from_config(cfg, 1, "h200"))
    assert not p.fits
    line = preflight_line(cfg, "h200", p.memory.required_bytes / 2**30, p.memory.capacity_bytes / 2**30)
    assert "\n" not in line and line.startswith("data.seq_len = 200,000 x micro-batch 1 will likely not fit")
    longest = longest_context(cfg, "h200").seq_len
    assert f"the longest data.seq_len these settings fit is {longest:,}." in line
    assert line.endswith("tokens/s).") and "It fits with --memory.recompute=full" in line


def test_preflight_line_names_the_host_memory_an_offloading_remedy_needs(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a host with room for every block's activations the fastest remedy offloads them: the line says
    how much host memory that takes, as planned."""
    from tracetrain.plan import plan
    from tracetrain.plan.longest import fitting_remedy
    from tracetrain.plan.mapping import plan_input_from_config
    from tracetrain.train import oom

    monkeypatch.setattr(oom, "_host_available_gib", lambda: 512.0)
    cfg = _8b_lora("--data.seq_len=200000")
    p = plan(plan_input_from_config(cfg, 1, "h200"))
    line = oom.preflight_line(cfg, "h200", p.memory.required_bytes / 2**30, p.memory.capacity_bytes / 2**30)
    remedy = fitting_remedy(cfg, 200_000, "h200", host_memory_gib=512.0)
    assert remedy is not None and remedy[1].memory.host_bytes_per_node > 100 * 2**30
    host = remedy[1].memory.host_bytes_per_node / 2**30
    assert f"It fits with {' '.join(remedy[0])} (planned " in line and "--memory.activation_offload=streamed" in line
    assert f"and {host:.1f} GiB of host memory, " in line and line.endswith("tokens/s).")


def test_fitting_remedy_is_the_fastest_planned_row_that_fits() -> None:
    """At 32k the tiled MLP alone and full recomputation both fit an 80 GB GPU; the planner predicts the
    tiled MLP faster (no block recomputed), so that is the advice, with its planned speed."""
    from tracetrain.plan.longest import LONG_CONTEXT_REMEDIES

    cfg = _8b_lora("--data.seq_len=32768")
    switches, p = fitting_remedy(cfg, 32768, "h100-sxm")  # type: ignore[misc]
    fitting = [plan_at(cfg, 32768, "h100-sxm", 1, row) for row in LONG_CONTEXT_REMEDIES]
    fitting = [q for q in fitting if q.fits]
    assert len(fitting) >= 2 and p.tokens_per_s == max(q.tokens_per_s for q in fitting)
    assert switches == ("--memory.tiled_mlp=on",)
    slower = [q for q in fitting if q.input.recompute == "full"]
    assert slower and all(q.tokens_per_s < p.tokens_per_s for q in slower)


def test_offload_pool_carves_large_buffers_without_power_of_two_rounding() -> None:
    """Long-context block inputs are large and not powers of two: the streamed offload's host pool cuts
    its buffers out of shared power-of-two blocks instead of rounding each one up."""
    from tracetrain.memory.activation_offload import PinnedBufferPool

    for like in (torch.randn(9000), torch.randn(100, 90).t()):  # contiguous, and dense but transposed
        pool = PinnedBufferPool(per_shape=31)
        pool.CARVE_MIN_BYTES = 0  # the class's 64 MiB threshold, lowered for a test-sized tensor
        key, first = pool.take(like)
        taken = [first] + [pool.take(like)[1] for _ in range(30)]
        nbytes = like.numel() * 4
        assert pool.num_buffers == 31 and all(t.shape == like.shape and t.stride() == like.stride() for t in taken)
        assert len({t.data_ptr() for t in taken}) == 31  # 31 distinct buffers
        assert 31 * nbytes <= pool.num_bytes < 31 * nbytes + 6 * nbytes < 31 * 65536  # not 31 x 2**16
        for i, t in enumerate(taken):
            t.fill_(i)
        assert all(bool((t == i).all()) for i, t in enumerate(taken))  # no two overlap
        pool.give(key, taken[0])
        assert pool.take(like)[1] is taken[0] and pool.num_buffers == 31
