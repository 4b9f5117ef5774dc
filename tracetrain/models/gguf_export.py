"""`tracetrain export RUN --gguf FILE`: a trained run as one llama-architecture GGUF file, for llama.cpp.

Written with the `gguf` package (llama.cpp's own Python writer; `pip install 'tracetrain[gguf]'`), laid out
as llama.cpp's `convert_hf_to_gguf.py` lays out a `LlamaForCausalLM`:

- tensor names from the package's Llama tensor map (`token_embd`, `blk.N.attn_q`, ..., `output_norm`,
  `output`; no `output` when the embeddings are tied), adapters merged;
- the q and k projections (and their biases) permuted per head from Hugging Face's rotate-half RoPE
  layout to the interleaved pairs llama.cpp rotates (`_permute`, the converter's `LlamaModel.permute`);
- 1-D tensors (norms, biases) in F32, matrices in the export dtype (F32, F16 or BF16);
- the `llama.*` hyper-parameters, and `rope_freqs` for Llama-3.1-style RoPE scaling;
- the tokenizer: a byte-pair tokenizer as `gpt2` (tokens, types, merges, bos/eos/pad ids and the chat
  template), padded to the embedding's rows with unused tokens; the built-in byte tokenizer has no GGUF
  form, so the file says `none` and names the ids (the note says so).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tracetrain.errors import CheckpointError, TracetrainError
from tracetrain.models.hf import _export_tensor, _hf_name
from tracetrain.models.llama import ModelArgs
from tracetrain.models.lora import is_lora_key
from tracetrain.models.qlora import dense_state_dict

GGUF_EXTRA = "pip install 'tracetrain[gguf]'"


def _gguf() -> Any:
    try:
        import gguf
    except ImportError:
        raise TracetrainError(f"--gguf needs the gguf package (llama.cpp's writer): {GGUF_EXTRA}") from None
    return gguf


def _permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Per head, rows [r0 .. r(d/2-1), i0 .. i(d/2-1)] (rotate-half) -> [r0, i0, r1, i1, ...] (pairs)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def rope_freq_factors(args: ModelArgs) -> list[float] | None:
    """Llama-3.1 RoPE scaling as llama.cpp applies it: one divisor per rotary frequency (None: plain RoPE)."""
    s = args.rope_scaling
    if not s:
        return None
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old = s["original_max_position_embeddings"]
    out = []
    for i in range(0, args.head_dim, 2):
        wavelen = 2 * math.pi * args.rope_theta ** (i / args.head_dim)
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return out


def _write_params(w: Any, gguf: Any, args: ModelArgs, name: str, file_type: int) -> None:
    w.add_name(name)
    w.add_context_length(args.max_seq_len)
    w.add_embedding_length(args.dim)
    w.add_block_count(args.n_layers)
    w.add_feed_forward_length(args.ffn_dim)
    w.add_head_count(args.n_heads)
    w.add_head_count_kv(args.n_kv_heads)
    w.add_rope_freq_base(args.rope_theta)
    w.add_layer_norm_rms_eps(args.norm_eps)
    w.add_vocab_size(args.vocab_size)
    w.add_rope_dimension_count(args.head_dim)
    w.add_file_type(file_type)


def _write_tokenizer(w: Any, gguf: Any, tok: Any, vocab_size: int, chat_template: str | None) -> list[str]:
    """The tokenizer's metadata; returns notes for the user."""
    ids = {"bos": tok.bos_id, "eos": tok.eos_id, "pad": tok.pad_id}
    if not tok.has_hf_form or tok.tokenizer_json().get("model", {}).get("type") != "BPE":
        w.add_tokenizer_model("none")
        notes = [f"note: the {tok.name} tokenizer has no GGUF form; the file names none (ids: {ids})"]
    else:
        spec = tok.tokenizer_json()
        special = {t["id"] for t in spec.get("added_tokens", []) if t.get("special")}
        by_id = {i: t for t, i in spec["model"]["vocab"].items()}
        by_id.update({t["id"]: t["content"] for t in spec.get("added_tokens", [])})
        tokens, types = [], []
        for i in range(vocab_size):  # the embedding's rows: ids past the tokenizer are padding
            tokens.append(by_id.get(i, f"[PAD{i}]"))
            kind = "CONTROL" if i in special else "NORMAL" if i in by_id else "UNUSED"
            types.append(getattr(gguf.TokenType, kind))
        merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"].get("merges", [])]
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        notes = []
    w.add_bos_token_id(ids["bos"])
    w.add_eos_token_id(ids["eos"])
    w.add_pad_token_id(ids["pad"])
    if chat_template:
        w.add_chat_template(chat_template)
    return notes


def _tensors(model: torch.nn.Module, args: ModelArgs, gguf: Any, dtype: torch.dtype) -> list[tuple[str, Any, Any]]:
    """(GGUF name, numpy data, raw GGML type or None) for every weight, in state-dict order."""
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, args.n_layers)
    out = []
    for key, value in dense_state_dict(model).items():  # NF4 (QLoRA) weights dequantised by _export_tensor
        if is_lora_key(key) or (args.tie_embeddings and key == "lm_head.weight"):
            continue
        hf = _hf_name(key)
        name = names.get_name(hf, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise CheckpointError(f"--gguf: no llama.cpp name for tensor {hf}")
        t = _export_tensor(model, key, value, torch.float32)
        if ".self_attn.q_proj." in hf:
            t = _permute(t, args.n_heads)
        elif ".self_attn.k_proj." in hf:
            t = _permute(t, args.n_kv_heads)
        data, raw = t.numpy(), None
        if t.dim() > 1 and dtype == torch.float16:
            data = data.astype(np.float16)
        elif t.dim() > 1 and dtype == torch.bfloat16:
            data, raw = gguf.quants.quantize(data, gguf.GGMLQuantizationType.BF16), gguf.GGMLQuantizationType.BF16
        out.append((name, data, raw))
    return out


def check_gguf_target(out: Path, overwrite: bool) -> None:
    """The gguf package is installed and `out` may be written (new, or an existing file with `overwrite`)."""
    _gguf()
    if out.is_dir():
        raise CheckpointError(f"--gguf {out} is a folder; name the .gguf file to write")
    if out.exists() and not overwrite:
        raise CheckpointError(f"--gguf {out} exists; pass --overwrite to replace it")
    if not out.parent.is_dir():
        raise CheckpointError(f"--gguf {out}: folder {out.parent} does not exist; create it first")


def export_run_gguf(
    loaded: Any, out_file: str | Path, dtype: torch.dtype, overwrite: bool = False, *, chat_template: str | None
) -> list[str]:
    """A trained run (`inference.load_trained`) as a llama-architecture GGUF file, with `chat_template` (the
    run's, data/chat.py `resolve_chat_template`); returns notes for the user."""
    gguf = _gguf()
    out = Path(out_file)
    check_gguf_target(out, overwrite)
    args: ModelArgs = loaded.model.args
    if args.num_experts or args.qk_norm or args.family != "llama":
        what = (
            f"the {args.family} architecture"
            if args.family != "llama"
            else "mixture-of-experts blocks"
            if args.num_experts
            else "q/k norms (Qwen3)"
        )
        raise CheckpointError(
            f"--gguf writes dense Llama models; this run's model has {what}: export --hf and convert that "
            "with llama.cpp's convert_hf_to_gguf.py"
        )
    file_type = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 32}[dtype]  # LlamaFileType ALL_F32, ...
    tmp = out.with_name(f".{out.name}.tmp")
    writer = gguf.GGUFWriter(tmp, "llama")
    _write_params(writer, gguf, args, loaded.checkpoint.parent.parent.name, file_type)
    notes = _write_tokenizer(writer, gguf, loaded.tokenizer, args.vocab_size, chat_template)
    factors = rope_freq_factors(args)
    if factors is not None:
        writer.add_tensor("rope_freqs.weight", np.asarray(factors, dtype=np.float32))
    for name, data, raw in _tensors(loaded.model, args, gguf, dtype):
        writer.add_tensor(name, data, raw_dtype=raw)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        tmp.replace(out)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise CheckpointError(f"cannot write {out}: {e.strerror}") from None
    return notes
