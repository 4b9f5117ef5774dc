"""`tracetrain export RUN --gguf FILE`: llama.cpp's own reader (`gguf.GGUFReader`) loads the file back with
the tensor names, shapes, dtypes, q/k layout and metadata llama.cpp's converter writes for a Llama model.

A tiny run with a byte-level BPE tokenizer trained here (no shared data) is exported in fp32 and bf16."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import TINY_MODEL, train_run

gguf = pytest.importorskip("gguf", reason="the gguf package (pip install 'tracetrain[gguf]') writes and reads GGUF")

pytestmark = pytest.mark.usefixtures("one_thread_torch")


def bpe_tokenizer_folder(folder: Path) -> Path:
    """A byte-level BPE tokenizer (GPT-2 style) of 300 ids trained on generated text, with its config."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    words = ["add", "the", "numbers", "answer", "plus", "is", "what", "sum", "of", "and"]
    tok.train_from_iterator([" ".join(words[(i * 7 + j) % 10] for j in range(12)) for i in range(200)], trainer)
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "GPT2TokenizerFast", "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("gguf")
    tok = bpe_tokenizer_folder(tmp / "tok")
    return train_run(tmp / "runs", "g", *TINY_MODEL, f"--data.tokenizer={tok}", "--model.vocab_size=304")


def field(reader, key: str):
    return reader.fields[key].contents()


def unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's interleaved RoPE rows back to Hugging Face's rotate-half rows (the inverse of the export)."""
    head = w.shape[0] // n_heads
    return w.reshape(n_heads, head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("dtype", ["auto", "bf16"])
def test_gguf_loads_in_llama_cpps_reader(run: Path, tmp_path: Path, dtype: str) -> None:
    from tracetrain.cli import main
    from tracetrain.inference import load_trained

    out = tmp_path / "model.gguf"
    assert main(["export", str(run), "--gguf", str(out), "--dtype", dtype]) == 0
    reader = gguf.GGUFReader(out)
    loaded = load_trained(run, "cpu")
    args = loaded.model.args
    expected = {
        "general.architecture": "llama",
        "llama.block_count": args.n_layers,
        "llama.embedding_length": args.dim,
        "llama.feed_forward_length": args.ffn_dim,
        "llama.attention.head_count": args.n_heads,
        "llama.attention.head_count_kv": args.n_kv_heads,
        "llama.context_length": args.max_seq_len,
        "llama.vocab_size": 304,
        "llama.rope.dimension_count": args.head_dim,
        "general.file_type": 0 if dtype == "auto" else 32,  # ALL_F32 (the run's fp32 weights) / MOSTLY_BF16
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.bos_token_id": loaded.tokenizer.bos_id,
        "tokenizer.ggml.eos_token_id": loaded.tokenizer.eos_id,
    }
    assert {k: field(reader, k) for k in expected} == expected
    assert field(reader, "llama.rope.freq_base") == pytest.approx(args.rope_theta)
    assert field(reader, "llama.attention.layer_norm_rms_epsilon") == pytest.approx(args.norm_eps)
    tokens, types = field(reader, "tokenizer.ggml.tokens"), field(reader, "tokenizer.ggml.token_type")
    assert len(tokens) == len(types) == 304  # one per embedding row: 300 ids, 4 padding rows
    assert tokens[loaded.tokenizer.eos_id] == "<|endoftext|>" and types[loaded.tokenizer.eos_id] == 3  # CONTROL
    assert tokens[303] == "[PAD303]" and types[303] == 5  # UNUSED
    assert field(reader, "tokenizer.ggml.merges")  # the BPE merges, as "a b" strings
    names = {
        f"blk.{i}.{n}.weight"
        for i in range(args.n_layers)
        for n in (
            "attn_norm",
            "attn_q",
            "attn_k",
            "attn_v",
            "attn_output",
            "ffn_norm",
            "ffn_gate",
            "ffn_up",
            "ffn_down",
        )
    }
    names |= {"token_embd.weight", "output_norm.weight", "output.weight"}
    tensors = {t.name: t for t in reader.tensors}
    assert set(tensors) == names
    ours = {k: v.float() for k, v in loaded.model.state_dict().items()}
    rope = {"attn_q": args.n_heads, "attn_k": args.n_kv_heads}
    for ours_key, gguf_name in [
        ("embed_tokens.weight", "token_embd.weight"),
        ("layers.1.self_attn.q_proj.weight", "blk.1.attn_q.weight"),
        ("layers.1.self_attn.k_proj.weight", "blk.1.attn_k.weight"),
        ("layers.0.self_attn.v_proj.weight", "blk.0.attn_v.weight"),
        ("layers.0.mlp.down_proj.weight", "blk.0.ffn_down.weight"),
        ("layers.1.post_attention_layernorm.weight", "blk.1.ffn_norm.weight"),
        ("norm.weight", "output_norm.weight"),
        ("lm_head.weight", "output.weight"),
    ]:
        t = tensors[gguf_name]
        want = ours[ours_key].numpy()
        assert tuple(t.shape) == tuple(reversed(want.shape))  # GGUF lists dimensions innermost first
        matrix = want.ndim > 1
        assert t.tensor_type.name == ("BF16" if dtype == "bf16" and matrix else "F32")
        data = np.asarray(t.data)
        if t.tensor_type.name == "BF16":  # raw bytes of 16-bit words: the upper half of a float32
            data = (np.frombuffer(data.tobytes(), dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
            want = torch.from_numpy(want).to(torch.bfloat16).float().numpy()
        data = data.reshape(want.shape)
        kind = gguf_name.split(".")[2] if gguf_name.startswith("blk.") else ""
        if kind in rope:
            assert not np.array_equal(data, want)  # rows reordered for llama.cpp's RoPE ...
            data = unpermute(data, rope[kind])  # ... and exactly those of ours
        np.testing.assert_array_equal(data, want)


def test_gguf_refuses_an_existing_file_and_names_the_extra_when_missing(
    run: Path, tmp_path: Path, capsys, monkeypatch
) -> None:
    from conftest import cli_here

    from tracetrain.cli import main

    out = tmp_path / "m.gguf"
    out.write_bytes(b"mine")
    assert main(["export", str(run), "--gguf", str(out)]) == 2
    assert "exists; pass --overwrite" in capsys.readouterr().err and out.read_bytes() == b"mine"
    # Without the package (an import of gguf fails: None in sys.modules, put back after the test): one line
    # naming the extra, before the model loads; through the CLI's main in this process.
    monkeypatch.setitem(sys.modules, "gguf", None)
    proc = cli_here("export", str(run), "--gguf", str(tmp_path / "n.gguf"), check=False)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "error: --gguf needs the gguf package (llama.cpp's writer): pip install 'tracetrain[gguf]'"
    ]


def test_rope_freq_factors_match_transformers_llama3_scaling() -> None:
    """`rope_freqs` (Llama-3.1 RoPE scaling): base inv_freq / transformers' scaled inv_freq, per frequency."""
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from tracetrain.models.gguf_export import rope_freq_factors
    from tracetrain.models.llama import ModelArgs

    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    args = ModelArgs(dim=2048, n_heads=32, n_kv_heads=8, rope_theta=500000.0, rope_scaling=scaling)
    hf = transformers.LlamaConfig(
        hidden_size=2048, num_attention_heads=32, rope_theta=500000.0, rope_scaling={"rope_type": "llama3", **scaling}
    )
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    base = 1.0 / (500000.0 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64))
    factors = rope_freq_factors(args)
    assert factors is not None and factors[0] == 1.0 and factors[-1] == 8.0
    np.testing.assert_allclose(factors, (base / scaled.double()).numpy(), rtol=1e-4)
    assert rope_freq_factors(ModelArgs()) is None
