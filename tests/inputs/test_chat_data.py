"""Chat data: templates rendered exactly as transformers renders them, the trained-token mask equal to
transformers' `return_assistant_tokens_mask`, tokenizer folders and their special tokens, packing, and
bad conversations. Tokenizer folders are built from a byte-level BPE trained at test time (GPT-2's design,
tests/fixtures_gen.py) plus added special tokens and a tokenizer_config.json written here; transformers is the reference, never our own code."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from conftest import cli_here
from fixtures_gen import bpe_ids, bpe_json_path

from tracetrain.config import DataSection, load_config
from tracetrain.data import (
    ByteTokenizer,
    HFTokenizer,
    build_datasets,
    load_tokenizer,
    render_generation_prompt,
    resolve_chat_template,
    tokenize_rows,
)
from tracetrain.data.chat import ChatTemplate, TemplateMismatch, tokenize_conversation
from tracetrain.data.chat_templates import CHATML, LLAMA_3, MISTRAL
from tracetrain.errors import ConfigError, DataError

transformers = pytest.importorskip("transformers")

# The BPE's <|endoftext|> and the id of the first special token a folder adds (GPT-2's are 50256, 50257).
EOT, ADDED = bpe_ids()

# ---------------------------------------------------------------------------------------------------
# Tokenizer folders of three families (the BPE + each family's special tokens)

LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
QWEN_SPECIALS = ["<|im_start|>", "<|im_end|>"]
MISTRAL_SPECIALS = ["<s>", "</s>", "[INST]", "[/INST]"]

# Marker versions of the templates: the same text, with {% generation %} around what the assistant writes.
LLAMA_3_MARKED = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] | trim + '<|eot_id|>' }}"
    "{% endgeneration %}{% else %}{{ message['content'] | trim + '<|eot_id|>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
# Qwen2-style: a default system prompt when the conversation has none, then ChatML.
QWEN = ("{% if messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}"
        "{% endif %}" + CHATML)
QWEN_MARKED = (
    "{% if messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}"
    "{% endif %}{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}{{ '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
MISTRAL_MARKED = MISTRAL.replace("{{ ' ' + message['content'] + eos_token }}",
                                 "{% generation %}{{ ' ' + message['content'] + eos_token }}{% endgeneration %}")

FAMILIES = {
    # name: (added special tokens, tokenizer_config, generation_config, template, marked template)
    "llama3": (LLAMA3_SPECIALS, {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
               {"eos_token_id": [ADDED + 1, ADDED + 4]}, LLAMA_3, LLAMA_3_MARKED),
    "qwen2": (QWEN_SPECIALS, {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
              {"eos_token_id": [ADDED + 1, EOT]}, QWEN, QWEN_MARKED),
    "mistral": (MISTRAL_SPECIALS, {"bos_token": {"__type": "AddedToken", "content": "<s>", "special": True},
                                   "eos_token": {"__type": "AddedToken", "content": "</s>", "special": True},
                                   "add_bos_token": True},
                None, MISTRAL, MISTRAL_MARKED),
}

CONVERSATIONS = {
    "multi_turn": [{"role": "user", "content": "What is the capital of France?"},
                   {"role": "assistant", "content": "Paris is the capital of France."},
                   {"role": "user", "content": "And of Italy?"},
                   {"role": "assistant", "content": "Rome."}],
    "system": [{"role": "system", "content": "You answer in one word."},
               {"role": "user", "content": "Colour of the sky?"},
               {"role": "assistant", "content": "Blue"}],
}


def make_folder(folder: Path, specials: list[str], config: dict, gen: dict | None = None,
                template: str | None = None) -> Path:
    """A Hugging Face tokenizer folder: the BPE's tokenizer.json plus `specials` (ids ADDED, ADDED + 1, ...)."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as RustTokenizer
    folder.mkdir(parents=True, exist_ok=True)
    rust = RustTokenizer.from_file(str(bpe_json_path()))
    rust.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    rust.save(str(folder / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", **config}
    if template is not None:
        cfg["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    if gen is not None:
        (folder / "generation_config.json").write_text(json.dumps(gen))
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One tokenizer folder per family, built once for the module (loading a BPE takes a while)."""
    base = tmp_path_factory.mktemp("families")
    return {family: make_folder(base / family, specials, config, gen, template)
            for family, (specials, config, gen, template, _) in FAMILIES.items()}


def hf_mask(folder: Path, template: str, messages: list[dict]) -> tuple[list[int], list[int]]:
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    out = hf.apply_chat_template(messages, chat_template=template, tokenize=True, return_dict=True,
                                 return_assistant_tokens_mask=True)
    return out["input_ids"], out["assistant_masks"]


# ---------------------------------------------------------------------------------------------------
# Golden: text, ids and mask equal transformers'

@pytest.mark.parametrize("conversation", list(CONVERSATIONS))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_rendering_and_mask_equal_transformers(folders: dict[str, Path], family: str,
                                               conversation: str) -> None:
    folder = folders[family]
    messages = CONVERSATIONS[conversation]
    tok = HFTokenizer(folder)
    template = FAMILIES[family][3]
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    ours = tokenize_conversation(ChatTemplate(family, template), tok, messages)
    assert ours.text == hf.apply_chat_template(messages, tokenize=False)
    assert ours.ids == hf.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    ids, mask = hf_mask(folder, FAMILIES[family][4], messages)
    assert ids == ours.ids and sum(mask) > 0
    assert [int(t) for t in ours.is_target] == mask  # found by prefix rendering, no markers
    marked = tokenize_conversation(ChatTemplate(family, FAMILIES[family][4]), tok, messages)
    assert marked.ids == ids and [int(t) for t in marked.is_target] == mask  # found by the markers


def test_trained_tokens_are_the_answers_and_their_end_of_turn(folders: dict[str, Path]) -> None:
    expected = {"llama3": ["Paris is the capital of France.<|eot_id|>", "Rome.<|eot_id|>"],
                "qwen2": ["Paris is the capital of France.<|im_end|>", "Rome.<|im_end|>"],
                "mistral": [" Paris is the capital of France.</s>", " Rome.</s>"]}
    for family, answers in expected.items():
        tok = HFTokenizer(folders[family])
        ex = tokenize_conversation(ChatTemplate(family, FAMILIES[family][3]), tok, CONVERSATIONS["multi_turn"])
        runs, current = [], []
        for i, target in zip(ex.ids, ex.is_target):
            if target:
                current.append(i)
            elif current:
                runs, current = runs + [current], []
        runs += [current] if current else []
        assert [tok._tok.decode(r, skip_special_tokens=False) for r in runs] == answers, family


def test_no_double_bos(folders: dict[str, Path]) -> None:
    folder = folders["llama3"]
    tok = HFTokenizer(folder)
    ex = tokenize_conversation(ChatTemplate("llama-3", LLAMA_3), tok, CONVERSATIONS["system"])
    assert ex.ids[0] == tok.bos_id == ADDED and ex.ids.count(tok.bos_id) == 1  # rendered, not added again
    ex = tokenize_conversation(ChatTemplate("chatml", CHATML), tok, CONVERSATIONS["system"])
    assert ex.ids[0] == tok.bos_id and ex.ids.count(tok.bos_id) == 1  # the template has none: added once
    qwen = HFTokenizer(folders["qwen2"])
    assert not qwen.add_bos
    ex = tokenize_conversation(ChatTemplate("qwen", QWEN), qwen, CONVERSATIONS["system"])
    assert ex.text.startswith("<|im_start|>system") and ex.ids[0] == ADDED  # <|im_start|>, no BOS


@pytest.mark.parametrize("family", list(FAMILIES))
def test_render_generation_prompt_equals_transformers(folders: dict[str, Path], family: str) -> None:
    folder = folders[family]
    messages = CONVERSATIONS["multi_turn"][:3]
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    expected = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    tok = HFTokenizer(folder)
    assert render_generation_prompt(FAMILIES[family][3], tok, messages) == expected["input_ids"]


# ---------------------------------------------------------------------------------------------------
# Tokenizer folders: special tokens read, never guessed

def test_folder_special_tokens(folders: dict[str, Path]) -> None:
    llama = HFTokenizer(folders["llama3"])
    # EOS is <|eot_id|> because tokenizer_config says so (a guess by name would pick <|end_of_text|>).
    assert (llama.bos_id, llama.eos_id, llama.pad_id, llama.add_bos) == (ADDED, ADDED + 4, ADDED + 4, True)
    assert llama.stop_ids == (ADDED + 4, ADDED + 1)  # + generation_config's <|end_of_text|>
    assert llama.chat_template == LLAMA_3 and llama.source_dir == folders["llama3"]
    qwen = HFTokenizer(folders["qwen2"])
    assert (qwen.eos_id, qwen.pad_id, qwen.add_bos, qwen.stop_ids) == (ADDED + 1, EOT, False, (ADDED + 1, EOT))
    mistral = load_tokenizer(str(folders["mistral"] / "tokenizer.json"))  # the folder's file
    assert (mistral.bos_id, mistral.eos_id, mistral.add_bos, mistral.stop_ids) == (ADDED, ADDED + 1, True, (ADDED + 1,))
    assert mistral.source_dir == folders["mistral"]


def test_folder_template_sources(tmp_path: Path) -> None:
    named = [{"name": "tool_use", "template": "{{ 'tools' }}"}, {"name": "default", "template": CHATML}]
    tok = HFTokenizer(make_folder(tmp_path / "a", QWEN_SPECIALS, {"eos_token": "<|im_end|>"}, template=named))
    assert tok.chat_template == CHATML
    folder = make_folder(tmp_path / "b", QWEN_SPECIALS, {"eos_token": "<|im_end|>"})
    (folder / "chat_template.jinja").write_text(QWEN)
    assert HFTokenizer(folder).chat_template == QWEN
    folder = make_folder(tmp_path / "c", QWEN_SPECIALS, {}, gen={"eos_token_id": ADDED + 1})
    tok = HFTokenizer(folder)
    assert tok.eos_id == ADDED + 1 and tok.chat_template is None  # EOS from generation_config alone
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "special_tokens_map.json").write_text(json.dumps({"eos_token": {"content": "<|im_end|>"}}))
    tok = HFTokenizer(make_folder(tmp_path / "d", QWEN_SPECIALS, {}))
    assert tok.eos_id == ADDED + 1


def test_folder_errors(tmp_path: Path) -> None:
    folder = make_folder(tmp_path / "noeos", QWEN_SPECIALS, {})
    with pytest.raises(DataError, match=r"noeos: no eos_token in tokenizer_config.json .* generation_config.json"):
        HFTokenizer(folder)
    folder = make_folder(tmp_path / "wrong", QWEN_SPECIALS, {"eos_token": "<|nope|>"})
    with pytest.raises(DataError, match=r"tokenizer_config.json names the token '<\|nope\|>'"):
        HFTokenizer(folder)


def test_bare_tokenizer_json_rule(tmp_path: Path) -> None:
    bpe = load_tokenizer(str(bpe_json_path()))
    assert bpe.bos_id == bpe.eos_id == bpe.pad_id == EOT and bpe.stop_ids == (EOT,)
    assert bpe.add_bos and bpe.source_dir is None and bpe.chat_template is None
    folder = make_folder(tmp_path / "x", QWEN_SPECIALS, {})
    bare = tmp_path / "bare.json"
    bare.write_text((folder / "tokenizer.json").read_text())
    with pytest.raises(DataError) as err:
        load_tokenizer(str(bare))
    assert str(err.value) == (f"{bare}: a bare tokenizer.json with 3 special tokens (<|endoftext|>, <|im_start|>, "
                              "<|im_end|>) does not say which is BOS or EOS; set data.tokenizer to the Hugging Face "
                              "tokenizer folder (with its tokenizer_config.json)")


def test_auto_tokenizer_from_init_from(folders: dict[str, Path], tmp_path: Path) -> None:
    assert isinstance(load_tokenizer("auto"), ByteTokenizer)
    ckpt = folders["qwen2"]
    tok = load_tokenizer("auto", init_from=str(ckpt))
    assert isinstance(tok, HFTokenizer) and tok.source_dir == ckpt
    empty = tmp_path / "weights_only"
    empty.mkdir()
    assert isinstance(load_tokenizer("auto", init_from=str(empty)), ByteTokenizer)
    (empty / "tokenizer.model").write_bytes(b"\0")
    with pytest.raises(DataError, match=r"tokenizer.model.*no tokenizer.json"):
        load_tokenizer("auto", init_from=str(empty))
    assert load_config(None, []).data.tokenizer == "auto"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_save_hf_files_round_trip(folders: dict[str, Path], tmp_path: Path, family: str) -> None:
    tok = HFTokenizer(folders[family])
    out = tmp_path / "export"
    assert tok.save_hf_files(out, CHATML) == ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]
    hf = transformers.AutoTokenizer.from_pretrained(str(out))
    text = "Hello world, <|im_end|> naïve </s>"
    assert hf(text, add_special_tokens=False)["input_ids"] == tok.encode(text)
    assert hf.eos_token_id == tok.eos_id and hf.chat_template == CHATML
    assert hf.bos_token_id == (tok.bos_id if tok.add_bos else None)
    again = HFTokenizer(out)
    specials = (tok.bos_id, tok.eos_id, tok.pad_id, tok.add_bos)
    assert (again.bos_id, again.eos_id, again.pad_id, again.add_bos) == specials
    messages = CONVERSATIONS["system"]
    assert hf.apply_chat_template(messages, tokenize=False) == tokenize_conversation(
        ChatTemplate("chatml", CHATML), again, messages).text


# ---------------------------------------------------------------------------------------------------
# Chat datasets

def write_rows(path: Path, rows: list) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def chat_cfg(path: str, **kw) -> DataSection:
    kw.setdefault("seq_len", 128)
    kw.setdefault("eval_fraction", 0.0)
    return DataSection(kind="chat", path=path, **kw)


def conversation(i: int) -> dict:
    return {"messages": [{"role": "user", "content": f"question {i}?"},
                         {"role": "assistant", "content": f"answer {i}."},
                         {"role": "user", "content": "more"}, {"role": "assistant", "content": f"done {i}"}]}


def test_chat_dataset_rows_loss_on_assistant_turns_only(folders: dict[str, Path], tmp_path: Path) -> None:
    tok = HFTokenizer(folders["llama3"])
    path = write_rows(tmp_path / "c.jsonl", [conversation(i) for i in range(12)])
    train, _, stats = build_datasets(chat_cfg(path, chat_template="auto"), tok)
    assert stats.train_examples == 12 and stats.bad_lines_skipped == 0
    eot, bos = ADDED + 4, ADDED
    seen = set()
    for r in range(len(train)):
        row = train[r]
        ids, labels, docs = row["input_ids"].tolist(), row["labels"].tolist(), row["document_ids"].tolist()
        for d in sorted(set(docs) - {-1}):
            span = [t for t in range(len(ids)) if docs[t] == d]
            assert span == list(range(span[0], span[-1] + 1))  # one contiguous, whole conversation per document
            assert ids[span[0]] == bos and ids[span[-1]] == eot and labels[span[-1]] == -100
            assert row["position_ids"][span[0]:span[-1] + 1].tolist() == list(range(len(span)))
            targets = [labels[t] for t in span if labels[t] != -100]
            text = tok._tok.decode(targets, skip_special_tokens=False)
            i = int(text.split("answer ")[1].split(".")[0])
            assert text == f"answer {i}.<|eot_id|>done {i}<|eot_id|>"
            seen.add(i)
    assert seen == set(range(12))


def test_chat_sharegpt_and_train_on_prompt(tmp_path: Path) -> None:
    tok = ByteTokenizer()
    sharegpt = {"conversations": [{"from": "system", "value": "S"}, {"from": "human", "value": "hi"},
                                  {"from": "gpt", "value": "yo"}]}
    path = write_rows(tmp_path / "s.jsonl", [sharegpt])
    train, _, _ = build_datasets(chat_cfg(path, chat_template="chatml"), tok)
    ids = train[0]["input_ids"].tolist()
    text = tok.decode(ids)
    assert text == ("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
                    "<|im_start|>assistant\nyo<|im_end|>\n")
    assert ids[0] == 256  # the byte tokenizer's BOS
    labels = [x for x in train[0]["labels"].tolist() if x != -100]
    assert tok.decode(labels) == "yo<|im_end|>"
    full, _, _ = build_datasets(chat_cfg(path, chat_template="chatml", train_on_prompt=True), tok)
    n = len(text.encode())
    assert full[0]["labels"].tolist()[:n] == ids[1:n + 1]  # every next token but the BOS's position ...
    # A custom messages field.
    chat = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    path = write_rows(tmp_path / "m.jsonl", [{"chat": chat}])
    train, _, _ = build_datasets(chat_cfg(path, chat_template="chatml", messages_field="chat"), tok)
    assert tok.decode([x for x in train[0]["labels"].tolist() if x != -100]) == "b<|im_end|>"


def test_chat_truncation(tmp_path: Path) -> None:
    tok = ByteTokenizer()
    long_answer = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "x" * 300}]}
    long_prompt = {"messages": [{"role": "user", "content": "p" * 300}, {"role": "assistant", "content": "y"}]}
    path = write_rows(tmp_path / "t.jsonl", [long_answer, conversation(1)])
    train, _, stats = build_datasets(chat_cfg(path, chat_template="chatml", seq_len=256, pack=False), tok)
    assert stats.examples_truncated == 1 and len(train) == 2
    assert any(train[i]["input_ids"].tolist()[-1] == ord("x") for i in range(2))  # cut at the end, full row
    path = write_rows(tmp_path / "u.jsonl", [conversation(1), long_prompt])
    with pytest.raises(DataError) as err:
        build_datasets(chat_cfg(path, chat_template="chatml", seq_len=256), tok)
    num_tokens = 1 + len("<|im_start|>user\n" + "p" * 300 + "<|im_end|>\n<|im_start|>assistant\ny<|im_end|>\n")
    assert str(err.value) == (f"{path}:2: every trained token lies past data.seq_len = 256 (the conversation has "
                              f"{num_tokens} tokens)")
    _, _, stats = build_datasets(chat_cfg(path, chat_template="chatml", seq_len=256, skip_bad_lines=True), tok)
    assert (stats.bad_lines_skipped, stats.train_examples) == (1, 1)


BAD_ROWS = [
    ({"messages": [{"role": "robot", "content": "beep"}, {"role": "assistant", "content": "b"}]}, "mistral",
     "built-in template 'mistral' raised an error for this conversation: Mistral has only system, user and "
     "assistant messages, not robot"),
    ({"messages": [{"role": "user", "content": "  "}, {"role": "assistant", "content": "b"}]}, "chatml",
     "message 0 (user) has empty content"),
    ({"messages": [{"role": "user", "content": "a"}]}, "chatml",
     "no assistant message, so nothing to train on (roles: user)"),
    ({"conversations": [{"from": "bot", "value": "a"}]}, "chatml",
     "ShareGPT message 0 has from = 'bot'; allowed: human, user, gpt, assistant, system, tool"),
    ({"prompt": "a"}, "chatml", "missing field 'messages' (or ShareGPT 'conversations'; fields present: 'prompt')"),
    ({"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "b"}]}, "chatml",
     "message 0 (user) has content of type int, expected a string"),
]


@pytest.mark.parametrize("row,template,reason", BAD_ROWS)
def test_bad_conversations_name_file_row_and_reason(folders: dict[str, Path], tmp_path: Path, row: dict,
                                                    template: str, reason: str) -> None:
    tok = HFTokenizer(folders["mistral"])
    path = write_rows(tmp_path / "bad.jsonl", [conversation(0), row, conversation(1)])
    with pytest.raises(DataError) as err:
        build_datasets(chat_cfg(path, chat_template=template), tok)
    assert str(err.value) == f"{path}:2: {reason}"
    _, _, stats = build_datasets(chat_cfg(path, chat_template=template, skip_bad_lines=True), tok)
    assert (stats.bad_lines_skipped, stats.train_examples) == (1, 2)


def test_role_the_template_renders_nothing_for(tmp_path: Path) -> None:
    only_user_assistant = tmp_path / "ua.jinja"
    only_user_assistant.write_text("{% for m in messages %}{% if m['role'] in ['user', 'assistant'] %}"
                                   "{{ m['role'] + ': ' + m['content'] + '\n' }}{% endif %}{% endfor %}")
    row = {"messages": [{"role": "tool", "content": "42"}, {"role": "user", "content": "a"},
                        {"role": "assistant", "content": "b"}]}
    path = write_rows(tmp_path / "r.jsonl", [row])
    with pytest.raises(DataError) as err:
        build_datasets(chat_cfg(path, chat_template=str(only_user_assistant)), ByteTokenizer())
    assert str(err.value) == (f"{path}:1: message 0 (role 'tool') is not in the text {only_user_assistant} renders: "
                              "it renders nothing for that role (roles chat templates render: system, user, assistant)")


def test_template_that_rewrites_answers_is_an_error_not_a_wrong_mask(tmp_path: Path) -> None:
    path = write_rows(tmp_path / "c.jsonl", [conversation(0)])
    # Answers rewritten (not skippable: every row would be wrong); a template whose last turn renders
    # differently from the same turn followed by more (no prefix property).
    answers_upper = tmp_path / "answers.jinja"
    answers_upper.write_text("{% for m in messages %}{% if m['role'] == 'assistant' %}{{ m['content'] | upper }}"
                             "{% else %}{{ m['content'] }}{% endif %}{{ '\n' }}{% endfor %}")
    with pytest.raises(TemplateMismatch, match=rf"{answers_upper} does not render assistant message 1's content "
                                               "verbatim"):
        build_datasets(chat_cfg(path, chat_template=str(answers_upper), skip_bad_lines=True), ByteTokenizer())
    last_differs = tmp_path / "last.jinja"
    last_differs.write_text("{% for m in messages %}{% if loop.last %}{{ '[last] ' }}{% endif %}"
                            "{{ m['content'] + '\n' }}{% endfor %}")
    with pytest.raises(TemplateMismatch, match=r"last.jinja: rendering messages 0..0 does not give a prefix .* "
                                                   "assistant message 1 cannot be located"):
        build_datasets(chat_cfg(path, chat_template=str(last_differs)), ByteTokenizer())


def test_template_errors(tmp_path: Path) -> None:
    path = write_rows(tmp_path / "c.jsonl", [conversation(0)])
    qwen_no_template = HFTokenizer(make_folder(tmp_path / "q", QWEN_SPECIALS, {"eos_token": "<|im_end|>"}))
    with pytest.raises(DataError) as err:
        build_datasets(chat_cfg(path), qwen_no_template)
    assert str(err.value) == (f"tokenizer {tmp_path / 'q'} has no chat_template (tokenizer_config.json or "
                              "chat_template.jinja), and data.chat_template = 'auto'; set data.chat_template to one "
                              "of chatml, llama-3, mistral or a .jinja file")
    with pytest.raises(DataError, match=r"'data.chat_template': 'zephyr' is not 'auto', a built-in template"):
        build_datasets(chat_cfg(path, chat_template="zephyr"), qwen_no_template)
    with pytest.raises(DataError, match=r"chat template file .*nope.jinja does not exist"):
        build_datasets(chat_cfg(path, chat_template=str(tmp_path / "nope.jinja")), qwen_no_template)
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}")
    with pytest.raises(TemplateMismatch, match=r"broken.jinja is not a valid Jinja template"):
        build_datasets(chat_cfg(path, chat_template=str(broken), skip_bad_lines=True), qwen_no_template)
    with pytest.raises(DataError, match=re.escape("'on_the_fly' is not supported for data.kind = 'chat'")):
        build_datasets(chat_cfg(path, chat_template="chatml", tokenize="on_the_fly", pack=False), qwen_no_template)


def test_resolve_chat_template(folders: dict[str, Path], tmp_path: Path) -> None:
    llama = HFTokenizer(folders["llama3"])
    assert resolve_chat_template(DataSection(), llama) == LLAMA_3
    assert resolve_chat_template(DataSection(), ByteTokenizer()) is None
    assert resolve_chat_template(DataSection(chat_template="mistral"), ByteTokenizer()) == MISTRAL
    f = tmp_path / "t.jinja"
    f.write_text(CHATML)
    assert resolve_chat_template(DataSection(chat_template=str(f)), llama) == CHATML


def test_tokenize_rows_gives_text_and_mask(tmp_path: Path) -> None:
    path = write_rows(tmp_path / "c.jsonl", [conversation(0), conversation(1)])
    rows = list(tokenize_rows(chat_cfg(path, chat_template="chatml", seq_len=512), ByteTokenizer()))
    assert [r.where for r in rows] == [f"{path}:1", f"{path}:2"]
    assert rows[0].text.startswith("<|im_start|>user\nquestion 0?") and len(rows[0].ids) == len(rows[0].is_target)
    trained = bytes(i for i, t in zip(rows[0].ids, rows[0].is_target) if t).decode()
    assert trained == "answer 0.<|im_end|>done 0<|im_end|>"
    instr = write_rows(tmp_path / "i.jsonl", [{"instruction": "a", "response": "b"}])
    (row,) = tokenize_rows(DataSection(kind="instruction", path=instr, template="plain"), ByteTokenizer())
    assert row.ids == [256, ord("a"), 10, ord("b"), 257] and row.is_target == [False, False, False, True, True]


def test_config_chat_kind_needs_path() -> None:
    with pytest.raises(ConfigError, match=re.escape("'data.path' is required when data.kind = 'chat'")):
        load_config(None, ["--data.kind=chat"])


def test_held_out_split_is_by_conversation(tmp_path: Path) -> None:
    path = write_rows(tmp_path / "c.jsonl", [conversation(i) for i in range(20)])
    train, eval_, stats = build_datasets(chat_cfg(path, chat_template="chatml", eval_fraction=0.1), ByteTokenizer())
    assert (stats.train_examples, stats.eval_examples, stats.examples_read) == (18, 2, 20)
    assert int((eval_.rows["document_ids"].max(dim=1).values + 1).sum()) == 2
    again, _, _ = build_datasets(chat_cfg(path, chat_template="chatml", eval_fraction=0.1), ByteTokenizer())
    assert torch.equal(train.rows["input_ids"], again.rows["input_ids"])  # seeded


def test_cli_trains_on_chat_data_and_names_a_bad_row(tmp_path: Path) -> None:
    # Through the CLI's main in this process (conftest.cli_here): `train` has real-process tests of its own.
    path = write_rows(tmp_path / "chat.jsonl", [conversation(i) for i in range(40)])
    common = ["--data.kind=chat", f"--data.path={path}", "--data.chat_template=chatml", "--data.seq_len=256",
              "--train.steps=3", "--optim.warmup_steps=0", "--train.micro_batch_size=2", "--train.eval_interval=0",
              "--train.eval_batches=1", "--train.eval_generate=0", "--train.device=cpu",
              f"--train.output_dir={tmp_path}", "--logging.progress=false", "--checkpoint.save_final=false"]
    proc = cli_here("train", *common, "--train.run_name=ok", check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "ok" / "metrics.jsonl").is_file()
    bad = write_rows(tmp_path / "bad.jsonl", [conversation(0), {"messages": [{"role": "user", "content": ""},
                                                                              {"role": "assistant", "content": "x"}]}])
    proc = cli_here("train", *common, f"--data.path={bad}", "--train.run_name=bad", check=False)
    assert proc.returncode == 2 and proc.stderr.strip() == f"error: {bad}:2: message 0 (user) has empty content"


def test_template_cannot_reach_python_internals(tmp_path: Path) -> None:
    """The template is rendered in Jinja's sandbox: a template that walks from a string to Python's classes
    (the usual route to running code) is refused, and the marker file it aims at never appears."""
    path = write_rows(tmp_path / "c.jsonl", [conversation(0)])
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.jinja"
    evil.write_text("{{ ''.__class__.__mro__[1].__subclasses__() }}"
                    "{{ cycler.__init__.__globals__.os.system('touch " + str(marker) + "') }}"
                    "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    tok = HFTokenizer(make_folder(tmp_path / "q", QWEN_SPECIALS, {"eos_token": "<|im_end|>"}))
    with pytest.raises(DataError) as err:
        build_datasets(chat_cfg(path, chat_template=str(evil)), tok)
    assert "\n" not in str(err.value) and "evil.jinja" in str(err.value)
    assert not marker.exists()
