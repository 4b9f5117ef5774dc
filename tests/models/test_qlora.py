"""QLoRA (`lora.base_quant = "nf4"`): the NF4 format (error bound, torchao's values), the 4-bit linear's
forward and backward, training through the real assembly and step, and merges and exports that dequantise."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tracetrain.config import load_config
from tracetrain.errors import ConfigError
from tracetrain.models.export import export_hf
from tracetrain.models.lora import LoRALinear, apply_lora, merge_lora
from tracetrain.models.qlora import (
    BLOCK_SIZE,
    NF4_BITS_PER_PARAM,
    NF4_LEVELS,
    SCALER_BLOCK_SIZE,
    NF4Linear,
    dequantise_nf4,
    quantise_nf4,
)
from tracetrain.spec import resolve
from tracetrain.train.assemble import assemble, run_step_context
from tracetrain.train.step import train_step

try:
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4
except ImportError:
    try:
        from torchao.dtypes.nf4tensor import to_nf4  # torchao < 0.15
    except ImportError:
        to_nf4 = None

CPU = torch.device("cpu")
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]


def nf4_round_trip(w: torch.Tensor) -> torch.Tensor:
    return dequantise_nf4(*quantise_nf4(w), torch.tensor(NF4_LEVELS), tuple(w.shape), torch.float32)


def test_dequantised_within_nf4_error() -> None:
    w = torch.randn(96, 512, generator=torch.Generator().manual_seed(0)) * 0.02
    w[3, :64] = 0.0  # an all-zero block stays exact
    d = nf4_round_trip(w)
    blocks, deq = w.view(-1, BLOCK_SIZE), d.view(-1, BLOCK_SIZE)
    absmax = blocks.abs().amax(1, keepdim=True)
    # Rounding to the nearest level: at most half the widest gap between levels, times the block's scale;
    # plus the int8 error of the double-quantised scale (half a step of max|scale - mean| / 128).
    levels = torch.tensor(NF4_LEVELS)
    half_gap = (levels[1:] - levels[:-1]).max() / 2
    centred = absmax.view(-1) - absmax.mean()
    scale_err = centred.abs().max() / 128 / 2
    assert ((blocks - deq).abs() <= absmax * half_gap + scale_err + 1e-7).all()
    assert torch.equal(d[3, :64], torch.zeros(64))
    rel_rms = ((w - d).pow(2).mean() / w.pow(2).mean()).sqrt()
    assert 0.02 < rel_rms < 0.15  # 4 bits: about 10% relative error on normal weights, not 0 and not garbage


@pytest.mark.skipif(
    to_nf4 is None, reason="the comparison with torchao's NF4Tensor needs torchao (pip install torchao)"
)
def test_same_values_as_torchao() -> None:
    w = torch.randn(128, 256, generator=torch.Generator().manual_seed(1)) * 0.05  # 512 blocks: 2 scaler runs
    ref = to_nf4(w, BLOCK_SIZE, SCALER_BLOCK_SIZE)
    codes, scaler_codes, factors, _ = quantise_nf4(w)
    assert torch.equal(codes, ref.quantized_data)
    assert torch.equal(scaler_codes, ref.quantized_scalers)
    torch.testing.assert_close(factors, ref.quantization_factor, rtol=0, atol=0)
    torch.testing.assert_close(nf4_round_trip(w), ref.get_original_weight(), rtol=0, atol=0)


def test_memory_is_4_13_bits_per_weight() -> None:
    linear = torch.nn.Linear(1024, 4096, bias=False)
    q = NF4Linear(linear, torch.bfloat16)
    nbytes = sum(b.numel() * b.element_size() for b in q.buffers())
    assert nbytes * 8 / linear.weight.numel() == pytest.approx(NF4_BITS_PER_PARAM, abs=1e-3)
    assert pytest.approx(4.127, abs=1e-3) == NF4_BITS_PER_PARAM


def test_nf4_linear_forward_and_backward_use_the_dequantised_weight() -> None:
    torch.manual_seed(0)
    linear = torch.nn.Linear(128, 64, bias=True)
    q = NF4Linear(linear, torch.float32)
    w = q.weight
    assert not torch.equal(w, linear.weight)  # quantised, not a copy
    x = torch.randn(3, 5, 128, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    q(x).square().sum().backward()
    torch.nn.functional.linear(x_ref, w, linear.bias).square().sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-5)
    assert not any(p.requires_grad for p in q.parameters())


def qlora_cfg(*extra: str):
    return load_config(
        None,
        [
            "--model.n_layers=2",
            "--train.mode=lora",
            "--lora.targets=all-linear",
            "--lora.rank=8",
            "--optim.lr=3e-3",
            "--optim.weight_decay=0.0",
            "--train.device=cpu",
            *extra,
        ],
    )


def batch(seq: int = 32, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 259, (4, seq), generator=g)
    labels = torch.roll(ids, -1, dims=1)  # a learnable task: the next token is in the input
    pos = torch.arange(seq).expand(4, seq).contiguous()
    return {"input_ids": ids, "labels": labels, "position_ids": pos, "document_ids": torch.zeros_like(ids)}


def train_losses(cfg, steps: int) -> tuple[list[float], torch.nn.Module]:
    a = assemble(resolve(cfg, CPU))
    ctx = run_step_context(a)
    b = batch()
    losses = [train_step(a.module, a.optimizer, [b], ctx).loss.item() for _ in range(steps)]
    return losses, a.module


def test_qlora_trains_through_the_real_step_close_to_lora() -> None:
    q_losses, model = train_losses(qlora_cfg("--lora.base_quant=nf4"), 8)
    nf4 = [m for m in model.modules() if isinstance(m, NF4Linear)]
    assert len(nf4) == 2 * 7  # every projection of both blocks, adapted or not
    assert all(isinstance(m.base, NF4Linear) for m in model.modules() if isinstance(m, LoRALinear))
    assert q_losses[-1] < q_losses[0] - 0.1  # the adapters learn over the 4-bit base
    ref_losses, _ = train_losses(qlora_cfg(), 8)  # the same seeded base, unquantised
    assert q_losses[0] == pytest.approx(ref_losses[0], rel=0.02)
    assert q_losses[-1] == pytest.approx(ref_losses[-1], rel=0.05)
    assert q_losses[0] != ref_losses[0]  # the base really is quantised


@pytest.fixture
def qlora_model() -> torch.nn.Module:
    cfg = qlora_cfg("--lora.base_quant=nf4", "--lora.targets=q_proj,v_proj,down_proj")
    model = assemble(resolve(cfg, CPU), until="materialise").module
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LoRALinear):
                m.lora_B.weight.copy_(torch.randn(m.lora_B.weight.shape, generator=g) * 0.05)
    return model.eval()


def test_merge_dequantises_and_equals_unmerged(qlora_model: torch.nn.Module) -> None:
    x = batch(16)["input_ids"]
    with torch.no_grad():
        expected = qlora_model(x)
        merge_lora(qlora_model)
        assert not any(isinstance(m, (NF4Linear, LoRALinear)) for m in qlora_model.modules())
        torch.testing.assert_close(qlora_model(x), expected, atol=1e-4, rtol=0)


def test_export_hf_dequantises_and_loads_in_transformers(qlora_model: torch.nn.Module, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers", reason="the export check loads the folder with transformers")
    x = batch(16)["input_ids"]
    export_hf(qlora_model, qlora_model.args, tmp_path / "hf", dtype=torch.float32)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, qlora_model(x), atol=1e-4, rtol=0)
    assert any(isinstance(m, NF4Linear) for m in qlora_model.modules())  # the export left the model as it was


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (["--lora.base_quant=nf4"], "train.mode = 'full'"),
        (["--train.mode=lora", "--lora.base_quant=nf4", "--train.fp8=rowwise"], "train.fp8"),
    ],
)
def test_bad_combinations_are_one_line(overrides: list[str], words: str) -> None:
    with pytest.raises(ConfigError, match=r"lora\.base_quant") as e:
        load_config(None, overrides)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_apply_lora_nf4_on_a_real_model_quantises_before_wrapping() -> None:
    cfg = qlora_cfg()
    model = assemble(resolve(cfg.replace({"train.mode": "full"}), CPU), until="materialise").module
    dense = model.layers[0].self_attn.q_proj.weight.detach().clone()
    apply_lora(model, rank=4, alpha=8.0, dropout=0.0, targets=ATTN, base_dtype=torch.float32, base_quant="nf4")
    base = model.layers[0].self_attn.q_proj.base
    assert isinstance(base, NF4Linear)
    torch.testing.assert_close(base.weight, nf4_round_trip(dense), rtol=0, atol=0)


@pytest.mark.parametrize("compiled", [False, True])
def test_backward_saves_the_codes_not_a_16_bit_weight(compiled: bool) -> None:
    torch.manual_seed(0)
    q = NF4Linear(torch.nn.Linear(256, 128, bias=False), torch.float32)
    fn = torch.compile(q, backend="aot_eager", fullgraph=True) if compiled else q
    saved: list[torch.Tensor] = []

    def keep(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    x = torch.randn(4, 256, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        y = fn(x)
    y.square().sum().backward()
    assert not any(t.shape == (128, 256) for t in saved)  # (out, in): a dequantised weight kept for backward
    assert any(t.dtype == torch.uint8 for t in saved)
    x_ref = x.detach().clone().requires_grad_(True)
    torch.nn.functional.linear(x_ref, q.weight).square().sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-5)


def test_planner_counts_the_nf4_base_as_the_model_holds_it() -> None:
    from tracetrain.models.build import materialize
    from tracetrain.models.llama import ModelArgs
    from tracetrain.plan import PlanInput
    from tracetrain.plan.memory import stage_model

    args = ModelArgs(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=512, vocab_size=96)
    model = materialize(args, CPU, 0)
    apply_lora(model, 8, 16.0, 0.0, ATTN, base_dtype=torch.bfloat16, base_quant="nf4")
    real = sum(p.numel() * p.element_size() for p in model.parameters())
    real += sum(b.numel() * b.element_size() for n, b in model.named_buffers() if not n.endswith(("levels", "freq")))
    inp = PlanInput(model=args, mode="lora", lora_rank=8, lora_targets=tuple(ATTN), lora_base_quant="nf4")
    planned = stage_model(inp, 0).items["weights"].const
    assert planned == pytest.approx(real, rel=0.01)  # the scale runs' padding to 256 blocks is not modelled
    bf16 = stage_model(inp.replace(lora_base_quant="none"), 0).items["weights"].const
    projections = 2 * (2 * 256 * 256 + 2 * 256 * 128 + 3 * 256 * 512)
    assert bf16 - planned == pytest.approx(projections * (2 - NF4_BITS_PER_PARAM / 8))


def test_cli_train_then_export_dequantises(tmp_path: Path) -> None:
    """`tracetrain train` with QLoRA + DoRA, then `export --hf`: the checkpoint holds the 4-bit base as it
    was trained (random init: the whole model is saved), and the export is the merged, dequantised model."""
    from conftest import cli_here

    from tracetrain.inference import load_trained

    transformers = pytest.importorskip("transformers", reason="the export check loads the folder with transformers")
    cli_here("train", "--model.n_layers=2", "--train.mode=lora", "--lora.base_quant=nf4", "--lora.dora=true",
             "--train.steps=3", "--optim.warmup_steps=1", "--data.synthetic_examples=64", "--data.seq_len=32",
             "--train.micro_batch_size=4", "--logging.progress=false", "--train.eval_generate=0",
             f"--train.output_dir={tmp_path}", "--train.run_name=q")  # fmt: skip
    run = tmp_path / "q"
    cli_here("export", str(run), "--hf", str(tmp_path / "hf"), "--dtype", "fp32")
    ours = load_trained(run, "cpu").model
    assert any(isinstance(m, NF4Linear) for m in ours.modules())
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    x = batch(16)["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, ours(x), atol=1e-4, rtol=0)


@pytest.mark.parametrize("key", ["lora.base_quant=nf4", "lora.dora=true"])
def test_several_ranks_are_refused_in_one_line(key: str) -> None:
    from tracetrain.models.build import model_args_from_config
    from tracetrain.validate import validate

    cfg = load_config(None, ["--train.mode=lora", f"--{key}", "--parallel.dp_shard=2"])
    with pytest.raises(ConfigError, match=key.split("=")[0]) as e:
        validate(cfg, model_args_from_config(cfg), 2)
    assert "several ranks" in str(e.value) and "\n" not in str(e.value)
    validate(cfg.replace({"parallel.dp_shard": 1}), model_args_from_config(cfg), 1)  # one process: fine


def test_gguf_tensors_are_the_merged_dequantised_weights(qlora_model: torch.nn.Module) -> None:
    import copy

    gguf = pytest.importorskip("gguf", reason="the gguf package (pip install 'tracetrain[gguf]') names the tensors")
    from tracetrain.models.gguf_export import _tensors

    merged = copy.deepcopy(qlora_model)
    merge_lora(merged)
    ours = _tensors(qlora_model, qlora_model.args, gguf, torch.float32)
    reference = _tensors(merged, merged.args, gguf, torch.float32)
    assert [name for name, _, _ in ours] == [name for name, _, _ in reference]
    for (name, data, _), (_, ref, _) in zip(ours, reference):
        np.testing.assert_allclose(data, ref, atol=1e-6, rtol=0, err_msg=name)


class _CountOps(TorchDispatchMode):
    """Counts calls of each op (the 4-bit matmul's forward and input-gradient ops among them)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_selective_recomputation_keeps_the_4_bit_matmul_outputs(recompute: str) -> None:
    """The selective policy saves matmul outputs: QLoRA's nf4_linear is one, so backward dequantises each
    weight once more for the input gradient and does not rerun the 4-bit matmul."""
    cfg = qlora_cfg("--lora.base_quant=nf4", f"--memory.recompute={recompute}")
    a = assemble(resolve(cfg, CPU))
    with _CountOps() as mode:
        train_step(a.module, a.optimizer, [batch()], run_step_context(a))
    num_projections = 7 * cfg.model.n_layers
    assert mode.counts["tracetrain.nf4_linear"] == num_projections
    # the input gradients: block 0's q/k/v inputs need none (the embedding is frozen)
    assert mode.counts["tracetrain.nf4_linear_grad_input"] == num_projections - 3
