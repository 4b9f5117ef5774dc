"""Generation: per-row exactness under left padding, EOS / stop strings / budgets with finish reasons,
the fixed-shape decode step, chunked prefill, and the prompts-file path (`generate_jsonl`)."""

import json

import pytest
import torch

from tracetrain.config import DataSection
from tracetrain.data import ByteTokenizer
from tracetrain.models.generate import GenerationRequest, generate_batch, generate_jsonl, read_prompts_jsonl
from tracetrain.models.llama import ModelArgs, Transformer

NEVER = -1  # an EOS id the model cannot sample: rows run to their budget


def letters(ids: list[int]) -> str:
    """A toy detokenizer: one letter per id (stop strings can then be read off the ids)."""
    return "".join(chr(ord("a") + i % 26) for i in ids)


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread_torch):
    yield


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return Transformer(ModelArgs(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=97)).eval()


PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16], [17]]


def test_rows_match_batch_of_one(model):
    """Left padding, different budgets and stop strings: every row as it would be alone (fp32, greedy)."""
    free = generate_batch(model, [GenerationRequest(p, 12) for p in PROMPTS], NEVER, 0, decode=letters)
    stop = letters(free[2].tokens)[4:6]  # a stop string that row 2 is known to produce
    requests = [GenerationRequest(p, n, s) for p, n, s in
                zip(PROMPTS, [12, 5, 12, 0], [[], ["zzzz"], [stop], []])]
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
    assert out.tokens == free.tokens[:cut + 2] and out.num_generated == cut + 2  # stopped on the completing token
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
        assert a.tokens == (b.tokens[:b.tokens.index(eos)] if eos in b.tokens else b.tokens)


def test_chunked_prefill_and_full_recompute(model):
    """Prefill in chunks of 2 gives the tokens of a cache-free greedy loop."""
    out = generate_batch(model, [GenerationRequest(p, 6) for p in PROMPTS], NEVER, 0, prefill_chunk=2)
    for prompt, result in zip(PROMPTS, out):
        seq = list(prompt)
        with torch.no_grad():
            for _ in range(6):
                seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
        assert seq[len(prompt):] == result.tokens


def test_decode_step_has_static_shapes(model):
    """What CUDA-graph capture needs: every decode step sees the same mask and K/V shapes."""
    seen = []
    core = model.layers[0].self_attn.attn_core
    handle = core.register_forward_pre_hook(lambda m, a: seen.append((tuple(a[1].shape), tuple(a[3].shape))))
    try:
        generate_batch(model, [GenerationRequest(p, 6) for p in PROMPTS[:2]], NEVER, 0)
    finally:
        handle.remove()
    max_len = len(PROMPTS[0]) + 6
    assert seen[0] == ((2, 2, 9, 16), (2, 1, 9, 9))  # prefill: the written positions only
    assert set(seen[1:]) == {((2, 2, max_len, 16), (2, 1, 1, max_len))}  # 5 decode steps, one shape


def test_sampling_is_seeded_and_timings_are_filled(model):
    def run(seed):
        g = torch.Generator().manual_seed(seed)
        return [r.tokens for r in generate_batch(model, [GenerationRequest(p, 8) for p in PROMPTS], NEVER, 0,
                                                 temperature=1.0, top_k=20, top_p=0.9, generator=g)]
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
    lines = [{"prompt": "a longer prompt than the others"}, {"question": "q?", "max_new_tokens": 3},
             {"prompt": "hi", "stop": "\n"}, {"question": "p", "stop": ["x", "y"]}]
    src = tmp_path / "prompts.jsonl"
    src.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    records = read_prompts_jsonl(src, data)
    assert records[1]["text"].endswith("### Instruction:\nq?\n\n### Response:\n") and records[2]["stop"] == ["\n"]
    assert read_prompts_jsonl(src, data, raw=True)[0]["text"] == "a longer prompt than the others"
    summary = generate_jsonl(model, tok, data, src, tmp_path / "out.jsonl", max_new_tokens=6, batch_size=3)
    out = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [o["prompt"] for o in out] == ["a longer prompt than the others", "q?", "hi", "p"]
    assert set(out[0]) == {"prompt", "completion", "finish_reason", "tokens"}
    assert out[1]["tokens"] <= 3 and summary["prompts"] == 4 and summary["tokens"] == sum(o["tokens"] for o in out)
    alone = generate_batch(model, [GenerationRequest([tok.bos_id] + tok.encode(records[0]["text"]), 6)],
                           tok.eos_id, tok.pad_id, decode=tok.decode)[0]
    assert out[0]["completion"] == alone.text and out[0]["finish_reason"] == alone.finish_reason
    src.write_text('{"text": "no prompt field"}\n')
    with pytest.raises(Exception, match="prompts.jsonl:1: needs a string field 'prompt' or 'question'"):
        read_prompts_jsonl(src, data)


def test_cli_prompts_file_end_to_end(tmp_path):
    """`tracetrain generate --prompts-file` on a real run; plain and offloaded caches write the same lines."""
    from test_train import SMALL, run_cli

    from tracetrain.cli import build_parser
    parsed, _ = build_parser()[0].parse_known_args(["generate", "RUN", "--prompt", "x"])
    if not hasattr(parsed, "prompts_file"):
        pytest.skip("the CLI's generate subcommand has no --prompts-file yet (code handed to the lead)")
    run_cli("train", *SMALL, "--train.steps=8", "--train.eval_generate=0", f"--train.output_dir={tmp_path}",
            "--train.run_name=r", "--logging.progress=false")
    (tmp_path / "p.jsonl").write_text('{"prompt": "reverse: abc"}\n{"instruction": "upper: q", "stop": "Q"}\n')
    outs = []
    for extra in ([], ["--kv-offload", "--gpu-window", "2"]):
        out = tmp_path / f"out{len(outs)}.jsonl"
        summary = json.loads(run_cli("generate", str(tmp_path / "r"), "--prompts-file", str(tmp_path / "p.jsonl"),
                                     "--output", str(out), "--max-new-tokens", "6", *extra).stdout)
        assert summary["prompts"] == 2
        outs.append([json.loads(x) for x in out.read_text().splitlines()])
    assert outs[0] == outs[1] and [o["prompt"] for o in outs[0]] == ["reverse: abc", "upper: q"]
    assert all(o["finish_reason"] in ("eos", "stop", "length") for o in outs[0])
