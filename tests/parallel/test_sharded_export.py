"""`tracetrain export RUN --hf DIR` on a checkpoint saved by several ranks streams tensor by tensor
(train/sharded_export.py): the files equal, bit for bit, those of the one-process export (which gathers
the whole model), transformers loads them with equal logits, and the streamed safetensors are sharded
with an index (issue #27 item 3).

The run: a 2-rank FSDP LoRA run of a tiny model through the real CLI (the ranks started by launch_local,
parallel_harness.cli_ranks; adapters merged on export), 2 steps, checkpoint at the end.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import cli_here
from parallel_harness import cli_ranks
from safetensors.torch import load_file

transformers = pytest.importorskip("transformers", reason="the export is loaded with transformers")

ARGS = ["--model.dim=64", "--model.n_layers=2", "--model.n_heads=4", "--model.n_kv_heads=2", "--model.ffn_dim=128",
        "--data.seq_len=32", "--data.synthetic_examples=60", "--train.steps=2", "--optim.warmup_steps=0",
        "--train.micro_batch_size=2", "--train.device=cpu", "--train.precision=fp32", "--train.eval_interval=0",
        "--train.eval_generate=0", "--logging.progress=false", "--train.mode=lora", "--lora.alpha=32",
        "--lora.targets=['all-linear']", "--optim.lr=0.05", "--parallel.dp_shard=2"]  # fmt: skip


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("runs")
    cli_ranks(2, "train", *ARGS, f"--train.output_dir={out}", "--train.run_name=r", timeout_s=400)
    assert list((out / "r" / "checkpoints").glob("*/dcp/.metadata"))  # saved by both ranks (DCP)
    return out / "r"


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


def test_streamed_export_equals_the_gathered_one(sharded_run: Path, tmp_path: Path) -> None:
    from tracetrain.data.chat import resolve_chat_template
    from tracetrain.inference import load_trained
    from tracetrain.models.export import export_run_hf

    streamed, gathered = tmp_path / "streamed", tmp_path / "gathered"
    cli_here("export", str(sharded_run), "--hf", str(streamed), "--dtype=fp32", "--max-shard-size=20KB")
    loaded = load_trained(sharded_run, "cpu")  # the one-process path: the whole model, DCP-gathered
    template = resolve_chat_template(loaded.cfg.data, loaded.tokenizer)
    export_run_hf(loaded, gathered, torch.float32, max_shard_bytes=10**9, chat_template=template)
    index = json.loads((streamed / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2  # sharded, with an index
    a, b = _tensors(streamed), _tensors(gathered)
    assert a.keys() == b.keys() == index["weight_map"].keys()
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]
    lora_b = [p for n, p in loaded.model.named_parameters() if n.endswith("lora_B.weight")]
    assert lora_b and max(p.abs().max().item() for p in lora_b) > 0  # trained adapters: the merge mattered

    hf = transformers.AutoModelForCausalLM.from_pretrained(streamed, torch_dtype=torch.float32).eval()
    tokens = torch.randint(0, loaded.model.args.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = loaded.model(tokens, torch.arange(16).expand(2, 16))
        theirs = hf(tokens).logits
    assert torch.allclose(ours, theirs, atol=1e-4, rtol=1e-4), (ours - theirs).abs().max()
