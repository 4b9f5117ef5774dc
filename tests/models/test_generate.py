"""Generation: per-row exactness under left padding, EOS / stop strings / budgets with finish reasons,
the fixed-shape decode step, chunked prefill, and the prompts-file path (`generate_jsonl`)."""

import json
import shutil

import pytest
import torch
from torch.nn.attention.bias import CausalBias, causal_lower_right

from tracetrain.config import DataSection
from tracetrain.data import ByteTokenizer
from tracetrain.data.prompts import read_prompts_jsonl
from tracetrain.models.attention import cached_attention, lower_right_causal_mask
from tracetrain.models.generate import (
    GenerationRequest,
    forward_last,
    generate_batch,
    generate_jsonl,
    left_pad,
    make_cache,
)
from tracetrain.models.kv_cache import causal_valid_mask
from tracetrain.models.llama import ModelArgs, Transformer

NEVER = -1  # an EOS id the model cannot sample: rows run to their budget


def letters(ids: list[int]) -> str:
    """A toy detokenizer: one letter per id (stop strings can then be read off the ids)."""
    return "".join(chr(ord("a") + i % 26) for i in ids)


pytestmark = pytest.mark.usefixtures("one_thread_torch")  # conftest: one torch thread for the module


@pytest.fixture(scope="module")
def model(gen_model):
    return gen_model


PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16], [17]]


def test_rows_match_batch_of_one(model):
    """Left padding, different budgets and stop strings: every row as it would be alone (fp32, greedy)."""
    free = generate_batch(model, [GenerationRequest(p, 12) for p in PROMPTS], NEVER, 0, decode=letters)
    stop = letters(free[2].tokens)[4:6]  # a stop string that row 2 is known to produce
    requests = [GenerationRequest(p, n, s) for p, n, s in zip(PROMPTS, [12, 5, 12, 0], [[], ["zzzz"], [stop], []])]
    together = generate_batch(model, requests, NEVER, 0, decode=letters)
    for request, result in zip(requests, together):
        alone = generate_batch(model, [request], NEVER, 0, decode=letters)[0]
        assert result == alone
    assert [r.finish_reason for r in together] == ["length", "length", "stop", "length"]
    assert [r.num_generated for r in together][:2] == [12, 5] and together[3].tokens == []


def test_stop_string_cuts_text_and_ends_row(model):
    free = generate_batch(model, [GenerationRequest(PROMPTS[0], 12)], NEVER, 0, decode=letters)[0]
    text = letters(free.tokens)
    stop = text[5:7]
    cut = text.find(stop)  # the first occurrence may be earlier than 5
    out = generate_batch(model, [GenerationRequest(PROMPTS[0], 12, ["no-such", stop])], NEVER, 0, decode=letters)[0]
    assert out.finish_reason == "stop" and out.text == text[:cut]
    assert out.tokens == free.tokens[: cut + 2] and out.num_generated == cut + 2  # stopped on the completing token
    with pytest.raises(ValueError, match="decode"):
        generate_batch(model, [GenerationRequest(PROMPTS[0], 4, [stop])], NEVER, 0)


def test_eos_ends_row_and_is_excluded(model):
    free = generate_batch(model, [GenerationRequest(p, 10) for p in PROMPTS], NEVER, 0)
    eos = free[0].tokens[3]
    first = free[0].tokens.index(eos)
    out = generate_batch(model, [GenerationRequest(p, 10) for p in PROMPTS], eos, 0)
    assert out[0].finish_reason == "eos" and out[0].tokens == free[0].tokens[:first]
    assert out[0].num_generated == first + 1
    for a, b in zip(out[1:], free[1:]):  # other rows: cut at their own EOS if they sample it, else as before
        assert a.tokens == (b.tokens[: b.tokens.index(eos)] if eos in b.tokens else b.tokens)


def test_chunked_prefill_and_full_recompute(model):
    """Prefill in chunks of 2 gives the tokens of a cache-free greedy loop."""
    out = generate_batch(model, [GenerationRequest(p, 6) for p in PROMPTS], NEVER, 0, prefill_chunk=2)
    for prompt, result in zip(PROMPTS, out):
        seq = list(prompt)
        with torch.no_grad():
            for _ in range(6):
                seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
        assert seq[len(prompt) :] == result.tokens


def _record_attention(monkeypatch):
    """Wrap the model's cached attention: (q shape, k shape, mask shape or 'causal') per call."""
    import tracetrain.models.llama as llama
    from tracetrain.models.attention import cached_attention

    seen = []

    def wrapper(q, k, v, mask):
        seen.append((tuple(q.shape), tuple(k.shape), "causal" if isinstance(mask, CausalBias) else tuple(mask.shape)))
        return cached_attention(q, k, v, mask)

    monkeypatch.setattr(llama, "cached_attention", wrapper)
    return seen


def test_decode_step_shapes_and_masks(model, monkeypatch):
    """A graph-ready step (cuda_graph; eager on CPU) reads all max_len positions with a dense mask at every
    step; an eager step reads the written positions; an unpadded batch attends with no mask tensor."""
    seen = _record_attention(monkeypatch)
    max_len, layers = len(PROMPTS[0]) + 6, model.args.n_layers
    generate_batch(model, [GenerationRequest(p, 6) for p in PROMPTS[:2]], NEVER, 0, cuda_graph=True)
    calls = seen[::layers]
    assert calls[0] == ((2, 4, 9, 16), (2, 2, 9, 16), (2, 1, 9, 9))  # prefill: the written positions only
    assert set(calls[1:]) == {((2, 4, 1, 16), (2, 2, max_len, 16), (2, 1, 1, max_len))}  # 5 decode steps
    seen.clear()
    generate_batch(model, [GenerationRequest(p, 6) for p in PROMPTS[:2]], NEVER, 0)
    assert [c[1][2] for c in seen[::layers]] == [9, 10, 11, 12, 13, 14] and seen[-1][2] == (2, 1, 1, 14)
    seen.clear()
    generate_batch(model, [GenerationRequest(p, 6) for p in (PROMPTS[0], PROMPTS[0][::-1])], NEVER, 0, prefill_chunk=4)
    assert {c[2] for c in seen} == {"causal"} and [c[1][2] for c in seen[::layers]] == [4, 8, 9, 10, 11, 12, 13, 14]


def _reference_attention(q, k, v, mask):
    """Float64 attention with K/V repeated to every query head: the definition, (batch, heads, s, head_dim)."""
    n_rep = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(n_rep, 1) for t in (k, v))
    scores = q.double() @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    return (scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v).float()


@pytest.mark.parametrize("n_rep", [1, 2, 4])
@pytest.mark.parametrize("s", [1, 5])
@pytest.mark.parametrize("kind", ["padded", "causal"])
def test_cached_attention_matches_reference(n_rep, s, kind):
    """Grouped decode/prefill (dense mask) and the mask-free path (CausalBias) against float64 math; q, k
    and v laid out as the model and the caches hand them over (non-contiguous views)."""
    torch.manual_seed(n_rep * 10 + s)
    batch, kv_heads, head_dim, cached, max_len = 3, 2, 16, 7, 20
    keys = cached + s
    q = torch.randn(batch, s, kv_heads * n_rep, head_dim).transpose(1, 2)
    store = torch.randn(2, batch, kv_heads, max_len, head_dim)
    k, v = store[0, :, :, :keys], store[1, :, :, :keys]
    valid = torch.ones(batch, max_len, dtype=torch.bool)
    if kind == "padded":
        valid[0, :3] = False  # rows 0 and 1 left-padded
        valid[1, :1] = False
    dense = causal_valid_mask(valid, torch.arange(cached, keys), keys)  # (batch, 1, s, keys)
    mask = dense if kind == "padded" else causal_lower_right(s, keys)
    out = cached_attention(q, k, v, mask)
    assert out.shape == (batch, kv_heads * n_rep, s, head_dim)
    torch.testing.assert_close(out, _reference_attention(q, k, v, dense), atol=2e-6, rtol=1e-5)
    if kind == "padded":  # a fixed-shape decode step also reads unwritten positions, masked
        wide = causal_valid_mask(valid, torch.arange(cached, keys), max_len)
        out = cached_attention(q, store[0], store[1], wide)
        torch.testing.assert_close(out, _reference_attention(q, store[0], store[1], wide), atol=2e-6, rtol=1e-5)


def test_lower_right_causal_mask_is_causal_bias():
    """The dense mask used for GQA in fp32 on CUDA (no flash there) is the CausalBias it replaces."""
    for s, keys in [(1, 1), (1, 6), (4, 4), (3, 9)]:
        expected = causal_lower_right(s, keys)._materialize(torch.device("cpu"))
        assert torch.equal(lower_right_causal_mask(s, keys, torch.device("cpu"))[0, 0], expected)


def _decode_logits(model, prompts, steps, chunk, **cache_options):
    """Prefill (in chunks) and greedy decode straight on a cache; per-step logits (steps, batch, vocab)."""
    tokens, valid, positions = left_pad(prompts, 0, torch.device("cpu"))
    cache = make_cache(model, len(prompts), tokens.shape[1] + steps, torch.float32, **cache_options)
    cache.set_prompt_mask(valid)
    out = []
    with torch.no_grad():
        for a in range(0, tokens.shape[1], chunk):
            logits = forward_last(model, tokens[:, a : a + chunk], positions[:, a : a + chunk], cache)
        pos = positions[:, -1:] + 1
        for _ in range(steps):
            out.append(logits)
            logits, pos = forward_last(model, logits.argmax(-1, keepdim=True), pos, cache), pos + 1
    return torch.stack(out)


CACHES = {
    "static": dict(kv_offload=False, gpu_window=0),
    "fixed-shape": dict(kv_offload=False, gpu_window=0, fixed_shape=True),
    "offload": dict(kv_offload=True, gpu_window=3),
}


@pytest.mark.parametrize("cache", list(CACHES))
@pytest.mark.parametrize("prompts", [PROMPTS, [PROMPTS[0], PROMPTS[0][::-1]]], ids=["padded", "same-length"])
def test_gqa_generation_matches_cache_free_recompute(cache, prompts):
    """GQA ratio 4, prompts of different lengths (dense-mask kernels) or of one length (mask-free kernels),
    chunked prefill: every row's greedy tokens equal a cache-free full recompute of that row alone, and
    its logits agree within fp32 rounding."""
    torch.manual_seed(1)
    gqa = Transformer(ModelArgs(dim=64, n_layers=2, n_heads=8, n_kv_heads=2, ffn_dim=128, vocab_size=97)).eval()
    steps = 5
    logits = _decode_logits(gqa, prompts, steps, chunk=4, **CACHES[cache])
    for row, prompt in enumerate(prompts):
        seq = list(prompt)
        with torch.no_grad():
            for t in range(steps):
                expected = gqa(torch.tensor([seq]))[0, -1]  # training attention path (is_causal), no cache
                torch.testing.assert_close(logits[t, row], expected, atol=1e-5, rtol=1e-5)
                assert int(logits[t, row].argmax()) == int(expected.argmax())
                seq.append(int(expected.argmax()))


def test_sampling_is_seeded_and_timings_are_filled(model):
    def run(seed):
        g = torch.Generator().manual_seed(seed)
        return [
            r.tokens
            for r in generate_batch(
                model,
                [GenerationRequest(p, 8) for p in PROMPTS],
                NEVER,
                0,
                temperature=1.0,
                top_k=20,
                top_p=0.9,
                generator=g,
            )
        ]

    assert run(1) == run(1) and run(1) != run(2)
    timings = {}
    generate_batch(model, [GenerationRequest(p, 8) for p in PROMPTS], NEVER, 0, timings=timings)
    assert timings["decode_steps"] == 6 and timings["prefill_tokens"] == 4 * 9
    assert timings["prefill_s"] > 0 and timings["decode_s"] > 0


def test_generate_jsonl_fields_order_and_templates(tmp_path):
    tok = ByteTokenizer()
    torch.manual_seed(0)
    model = Transformer(ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=259)).eval()
    data = DataSection(kind="instruction", template="alpaca", instruction_field="question", context_field="")
    lines = [
        {"prompt": "a longer prompt than the others"},
        {"question": "q?", "max_new_tokens": 3},
        {"prompt": "hi", "stop": "\n"},
        {"question": "p", "stop": ["x", "y"]},
    ]
    src = tmp_path / "prompts.jsonl"
    src.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    records = read_prompts_jsonl(src, data)
    assert records[1]["text"].endswith("### Instruction:\nq?\n\n### Response:\n") and records[2]["stop"] == ["\n"]
    assert read_prompts_jsonl(src, data, raw=True)[0]["text"] == "a longer prompt than the others"
    summary = generate_jsonl(model, tok, records, tmp_path / "out.jsonl", max_new_tokens=6, batch_size=3)
    out = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [o["prompt"] for o in out] == ["a longer prompt than the others", "q?", "hi", "p"]
    assert set(out[0]) == {"prompt", "completion", "finish_reason", "tokens"}
    assert out[1]["tokens"] <= 3 and summary["prompts"] == 4 and summary["tokens"] == sum(o["tokens"] for o in out)
    alone = generate_batch(
        model,
        [GenerationRequest([tok.bos_id] + tok.encode(records[0]["text"]), 6)],
        tok.eos_id,
        tok.pad_id,
        decode=tok.decode,
    )[0]
    assert out[0]["completion"] == alone.text and out[0]["finish_reason"] == alone.finish_reason
    src.write_text('{"text": "no prompt field"}\n')
    with pytest.raises(Exception, match=r"prompts\.jsonl:1: needs a string field 'prompt' or 'question'"):
        read_prompts_jsonl(src, data)


def test_cli_prompts_file_end_to_end(tmp_path):
    """`tracetrain generate --prompts-file` on a real run; plain and offloaded caches, and the compiled prefill
    (one prompt per batch: no padding), write the same lines."""
    from conftest import cli_here
    from helpers import SMALL, run_cli

    from tracetrain.cli import build_parser

    parsed, _ = build_parser()[0].parse_known_args(["generate", "RUN", "--prompt", "x"])
    if not hasattr(parsed, "prompts_file"):
        pytest.skip("the CLI's generate subcommand has no --prompts-file yet (code handed to the lead)")
    # The run is trained through the CLI's main in this process; `generate` runs as a real process, then
    # (offloaded cache) in this one.
    cli_here(
        "train",
        *SMALL,
        "--train.steps=8",
        "--train.eval_generate=0",
        f"--train.output_dir={tmp_path}",
        "--train.run_name=r",
        "--logging.progress=false",
    )
    (tmp_path / "p.jsonl").write_text('{"prompt": "reverse: abc"}\n{"instruction": "upper: q", "stop": "Q"}\n')
    outs = []
    variants = [(run_cli, []), (cli_here, ["--kv-offload", "--gpu-window", "2"])]
    if shutil.which("g++") or shutil.which("cc"):  # torch.compile on CPU needs a C++ compiler
        variants.append((cli_here, ["--prefill", "compiled", "--batch-size", "1"]))
    for run, extra in variants:
        out = tmp_path / f"out{len(outs)}.jsonl"
        proc = run(
            "generate",
            "--json",
            str(tmp_path / "r"),
            "--prompts-file",
            str(tmp_path / "p.jsonl"),
            "--output",
            str(out),
            "--max-new-tokens",
            "6",
            *extra,
        )
        assert json.loads(proc.stdout)["prompts"] == 2
        assert "runs eagerly" not in proc.stderr  # the compiled prefill ran where asked
        outs.append([json.loads(x) for x in out.read_text().splitlines()])
    assert all(o == outs[0] for o in outs) and [o["prompt"] for o in outs[0]] == ["reverse: abc", "upper: q"]
    assert all(o["finish_reason"] in ("eos", "stop", "length") for o in outs[0])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: checks which SDPA kernels take the calls")
@pytest.mark.parametrize("s", [1, 64])
@pytest.mark.parametrize("kind", ["padded", "causal"])
def test_cached_attention_runs_without_math_fallback_on_cuda(s, kind):
    """Llama-3 shapes (GQA ratio 4, head_dim 128) in bf16 with the math backend disabled: SDPA raises
    "No available kernel" if a call would need it. Results against float64 math."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    dev, batch, cached = torch.device("cuda"), 2, 1000
    keys = cached + s
    q = torch.randn(batch, s, 32, 128, device=dev, dtype=torch.bfloat16).transpose(1, 2)
    k, v = torch.randn(2, batch, 8, keys + 24, 128, device=dev, dtype=torch.bfloat16)[:, :, :, :keys].unbind(0)
    valid = torch.ones(batch, keys, dtype=torch.bool, device=dev)
    valid[0, :17] = kind != "padded"
    dense = causal_valid_mask(valid, torch.arange(cached, keys, device=dev), keys)
    mask = dense if kind == "padded" else causal_lower_right(s, keys)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]):
        out = cached_attention(q, k, v, mask)
    torch.testing.assert_close(out.float(), _reference_attention(q, k, v, dense), atol=2e-2, rtol=2e-2)


# ----------------------------------------------------------------------------------------------------
# Stop ids (EOS plus end-of-turn ids) and the CLI's checks of sampling options


def test_any_stop_id_ends_row_as_eos(model):
    """Several stop ids: each row ends at the first it samples, with finish reason "eos"; an int still works."""
    free = generate_batch(model, [GenerationRequest(p, 10) for p in PROMPTS], NEVER, 0)
    stops = {free[0].tokens[2], free[1].tokens[4]}
    out = generate_batch(model, [GenerationRequest(p, 10) for p in PROMPTS], stops, 0)
    for a, b in zip(out, free):
        cut = min((b.tokens.index(s) for s in stops if s in b.tokens), default=None)
        assert a.tokens == (b.tokens if cut is None else b.tokens[:cut])
        assert a.finish_reason == ("length" if cut is None else "eos")
    assert out[0].finish_reason == out[1].finish_reason == "eos"


def test_generate_records_stops_at_an_end_of_turn_id(tmp_path, bpe_json):
    """`tracetrain generate`'s path stops at any of the tokenizer's stop ids, not only at its EOS."""
    import shutil

    from fixtures_gen import bpe_token_id, bpe_vocab_size

    from tracetrain.data.tokenizer import load_tokenizer
    from tracetrain.models.generate import generate_records

    folder = tmp_path / "tok"
    folder.mkdir()
    shutil.copy(bpe_json, folder / "tokenizer.json")
    eot, newline = bpe_token_id("<|endoftext|>"), bpe_token_id("\u010a")
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [eot, newline]}))
    tok = load_tokenizer(str(folder))
    assert tok.eos_id == eot and newline in tok.stop_ids
    torch.manual_seed(0)
    model = Transformer(
        ModelArgs(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64, vocab_size=bpe_vocab_size())
    ).eval()
    with torch.no_grad():  # greedy always picks "\n": blocks add nothing, only its row reads coordinate 0
        model.layers[0].self_attn.o_proj.weight.zero_()
        model.layers[0].mlp.down_proj.weight.zero_()
        model.embed_tokens.weight[:, 0] = 1.0
        model.norm.weight.zero_()
        model.norm.weight[0] = 1.0
        model.lm_head.weight.zero_()
        model.lm_head.weight[newline, 0] = 100.0
    lines, _ = generate_records(
        model, tok, [{"prompt": "Hi", "text": "Hi", "stop": [], "max_new_tokens": None}], max_new_tokens=8
    )
    assert lines[0]["finish_reason"] == "eos" and lines[0]["tokens"] == 1 and lines[0]["completion"] == ""


@pytest.mark.parametrize(
    "flags,named",
    [
        (["--batch-size=0"], "--batch-size 0"),
        (["--max-new-tokens=-1"], "--max-new-tokens -1"),
        (["--top-k=-2"], "--top-k -2"),
        (["--temperature=-0.5"], "--temperature -0.5"),
        (["--top-p=0"], "--top-p 0.0"),
        (["--top-p=1.5"], "--top-p 1.5"),
        (["--top-p=nan"], "--top-p nan"),
        (["--output", "."], "--output . is a folder"),
        (["--output", "no/such/dir/out.jsonl"], "does not exist"),
        (["--prefill=jit"], "--prefill jit: must be one of eager, compiled"),
    ],
)
def test_cli_refuses_bad_generation_options(flags, named, capsys):
    """Checked before the model loads (the run path need not exist): exit 2, one line naming the flag."""
    from tracetrain.cli import main

    assert main(["generate", "no-such-run", "--prompt", "x", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and named in err[0], err


def test_cli_generate_option_error_is_one_line_in_a_subprocess():
    from helpers import run_cli

    proc = run_cli("generate", "--json", "no-such-run", "--prompt", "x", "--batch-size=0", check=False)
    assert proc.returncode == 2 and proc.stderr.strip() == "error: --batch-size 0: must be >= 1"
