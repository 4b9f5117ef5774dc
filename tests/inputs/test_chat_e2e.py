"""Chat fine-tuning end to end, on CPU with no downloads: a tiny Llama saved by transformers with a chat
tokenizer -> `tracetrain data` (the loss mask) -> LoRA `train` -> `export --hf` -> transformers loads it,
renders the same prompt, stops at the end-of-turn id, and agrees with tracetrain's logits.

The tokenizer is a byte-level BPE trained at test time (conftest's bpe_json, GPT-2's design) plus
ChatML's <|im_start|> / <|im_end|>, in a folder with a tokenizer_config.json written here. Like a base model's, its eos_token is <|endoftext|>: the end-of-turn
id is known only from generation_config.json, so every step must carry it through.
"""

import json

import pytest
import torch
from conftest import cli_here

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

pytestmark = pytest.mark.usefixtures("one_thread_torch")

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TINY_LLAMA = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
SYSTEM = "You are a terse calculator. Answer in one sentence."


def conversations() -> list[list[dict[str, str]]]:
    """Multi-turn conversations with a system prompt, written for this test."""
    convs = []
    for a in range(2, 14):
        b = a + 3
        convs.append(
            [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"What is {a} plus {b}?"},
                {"role": "assistant", "content": f"{a} plus {b} is {a + b}."},
                {"role": "user", "content": "And twice that?"},
                {"role": "assistant", "content": f"Twice that is {2 * (a + b)}."},
            ]
        )
    return convs


def sharegpt(conv: list[dict[str, str]]) -> dict:
    names = {"system": "system", "user": "human", "assistant": "gpt"}
    return {"conversations": [{"from": names[m["role"]], "value": m["content"]} for m in conv]}


@pytest.fixture(scope="module")
def base(tmp_path_factory, bpe_json):
    """A Hugging Face model folder: tiny random Llama + chat tokenizer + generation_config with both stop ids."""
    out = tmp_path_factory.mktemp("base")
    tok = tokenizers.Tokenizer.from_file(str(bpe_json))
    tok.add_special_tokens(
        [
            tokenizers.AddedToken("<|im_start|>", special=True, normalized=False),
            tokenizers.AddedToken("<|im_end|>", special=True, normalized=False),
        ]
    )
    tok.save(str(out / "tokenizer.json"))
    eot, im_end = tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": None,
                "eos_token": "<|endoftext|>",
                "pad_token": "<|endoftext|>",
                "add_bos_token": False,
                "model_max_length": 256,
                "chat_template": CHATML,
            }
        )
    )
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        **TINY_LLAMA, vocab_size=tok.get_vocab_size(), bos_token_id=None, eos_token_id=eot, tie_word_embeddings=False
    )
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(out)
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [eot, im_end], "pad_token_id": eot}))
    return out, im_end


@pytest.fixture(scope="module")
def chat_args(base, tmp_path_factory):
    folder, _ = base
    data = tmp_path_factory.mktemp("data") / "chat.jsonl"
    rows = [{"messages": c} for c in conversations()]
    rows[1] = sharegpt(conversations()[1])  # both row formats in one file
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    # data.tokenizer = 'auto' (the default): the init_from folder's tokenizer and chat template.
    return [
        "--data.kind=chat",
        f"--data.path={data}",
        f"--model.init_from={folder}",
        "--data.seq_len=128",
        "--data.eval_fraction=0.1",
    ]


def test_data_show_json_masks_exactly_the_assistant_turns(base, chat_args, tmp_path):
    folder, _ = base
    proc = cli_here("data", *chat_args, "--show", "2", "--json", "--stats-json", str(tmp_path / "stats.json"))
    shown = json.loads(proc.stdout)
    assert isinstance(shown, list) and len(shown) == 2
    hf_tok = transformers.AutoTokenizer.from_pretrained(folder)
    for ex, conv in zip(shown, conversations()):  # file order: lines 1 and 2 (the ShareGPT row)
        answers = [m["content"] + "<|im_end|>" for m in conv if m["role"] == "assistant"]
        assert ex["trained_spans"] == answers
        assert ex["trained_text"] == "".join(answers)
        assert ex["text"] == hf_tok.apply_chat_template(conv, tokenize=False)  # no BOS: add_bos_token false
        ids = hf_tok.apply_chat_template(conv, tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        assert ex["num_tokens"] == len(ids)
        assert ex["num_trained"] == sum(len(hf_tok.encode(a)) for a in answers)
    assert [ex["where"].rsplit(":", 1)[1].strip() for ex in shown] == ["1", "2"]
    stats = json.loads((tmp_path / "stats.json").read_text())
    assert stats["train"]["examples"] + stats["eval"]["examples"] == len(conversations())
    assert 0 < stats["train"]["trained_share"] < 0.5
    # The packed rows training reads carry the same mask: their trained tokens are the answers' tokens.
    answer_tokens = sum(
        len(hf_tok.encode(m["content"] + "<|im_end|>"))
        for conv in conversations()
        for m in conv
        if m["role"] == "assistant"
    )
    assert stats["train"]["trained_tokens"] + stats["eval"]["trained_tokens"] == answer_tokens
    assert stats["truncated"] == stats["dropped"] == stats["bad_rows_skipped"] == 0
    assert "train example lengths" in proc.stderr  # the statistics go to stderr with --json


@pytest.fixture(scope="module")
def exported(base, chat_args, tmp_path_factory):
    """A LoRA run on the chat data and its fp32 --hf export, both through the CLI's main in this process."""
    out = tmp_path_factory.mktemp("runs")
    # data.tokenizer stays 'auto': training, export and generate must all find init_from's own tokenizer.
    cli_here(
        "train",
        *chat_args,
        "--train.mode=lora",
        "--lora.targets=['q_proj', 'v_proj', 'o_proj']",
        "--train.steps=6",
        "--train.micro_batch_size=2",
        "--optim.lr=0.02",
        "--optim.warmup_steps=0",
        "--train.device=cpu",
        "--train.eval_interval=0",
        "--train.eval_batches=1",
        "--train.eval_generate=0",
        f"--train.output_dir={out}",
        "--train.run_name=chat",
    )
    run = out / "chat"
    cli_here("export", str(run), "--hf", str(out / "hf"), "--dtype", "fp32")
    return run, out / "hf"


def _hf(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()


@pytest.mark.slow
def test_exported_tokenizer_renders_the_training_prompt(base, exported):
    from tracetrain.data.chat import render_generation_prompt, resolve_chat_template
    from tracetrain.inference import load_trained

    run, hf_dir = exported
    hf_tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    assert hf_tok.chat_template == CHATML
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is 5 plus 9?"}]
    expected = hf_tok.apply_chat_template(messages, add_generation_prompt=True)
    expected = expected["input_ids"] if hasattr(expected, "keys") else expected
    loaded = load_trained(run, "cpu")
    ours = render_generation_prompt(
        resolve_chat_template(loaded.cfg.data, loaded.tokenizer), loaded.tokenizer, messages
    )
    assert ours == list(expected)


@pytest.mark.slow
def test_transformers_generate_stops_at_end_of_turn(base, exported):
    _, im_end = base
    _, hf_dir = exported
    hf_tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    model = _hf(hf_dir)
    eos = model.generation_config.eos_token_id
    assert im_end in (eos if isinstance(eos, list) else [eos])
    prompt = hf_tok.apply_chat_template(
        [{"role": "user", "content": "What is 5 plus 9?"}], add_generation_prompt=True, return_tensors="pt"
    )
    prompt = prompt["input_ids"] if hasattr(prompt, "keys") else prompt

    class EndTurnAtThird(transformers.LogitsProcessor):
        """Forces <|im_end|> as the third new token: generation must stop right there, not run to the limit."""

        def __call__(self, input_ids, scores):
            if input_ids.shape[1] == prompt.shape[1] + 2:
                scores = torch.full_like(scores, -float("inf"))
                scores[:, im_end] = 0.0
            return scores

    out = model.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=20,
        do_sample=False,
        logits_processor=transformers.LogitsProcessorList([EndTurnAtThird()]),
    )
    assert out.shape[1] == prompt.shape[1] + 3 and out[0, -1].item() == im_end


@pytest.mark.slow
def test_exported_logits_match_tracetrain_and_differ_from_base(base, exported):
    from tracetrain.inference import load_trained

    folder, _ = base
    run, hf_dir = exported
    ours = load_trained(run, "cpu").model
    x = torch.randint(0, ours.args.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hf_logits = _hf(hf_dir)(x).logits
        torch.testing.assert_close(ours(x), hf_logits, atol=1e-4, rtol=0)
        # The adapters were trained and merged: the export is not the base model.
        assert (hf_logits - _hf(folder)(x).logits).abs().max().item() > 1e-3


@pytest.mark.slow
def test_generate_chat_matches_transformers_greedy(exported):
    run, hf_dir = exported
    proc = cli_here(
        "generate",
        "--json",
        str(run),
        "--chat",
        "--system",
        SYSTEM,
        "--prompt",
        "What is 5 plus 9?",
        "--max-new-tokens",
        "6",
        "--device",
        "cpu",
    )
    line = json.loads(proc.stdout)
    assert line["prompt"] == "What is 5 plus 9?" and line["finish_reason"] in ("eos", "length")
    hf_tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    prompt = hf_tok.apply_chat_template(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is 5 plus 9?"}],
        add_generation_prompt=True,
        return_tensors="pt",
    )
    prompt = prompt["input_ids"] if hasattr(prompt, "keys") else prompt
    out = _hf(hf_dir).generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6, do_sample=False)
    new = out[0, prompt.shape[1] :].tolist()
    assert line["tokens"] == len(new)
    assert line["completion"] == hf_tok.decode(new, skip_special_tokens=True)
    proc = cli_here("generate", "--json", str(run), "--chat", "--prompts-file", "x.jsonl", check=False)
    assert proc.returncode == 2 and "--chat takes --prompt" in proc.stderr
