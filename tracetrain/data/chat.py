"""Chat data: conversations -> the chat template's text -> tokens, with loss on every assistant turn.

A row holds `messages` (a list of {role, content}; the field is `data.messages_field`) or, when that
field is absent, ShareGPT `conversations` (a list of {from, value}, from = human / gpt / system / tool).
Each conversation is rendered ONCE with the chat template (`data.chat_template`: the tokenizer's own
with "auto", a built-in name, or a .jinja file) and tokenised ONCE with character offsets; a token
carries a loss when its characters overlap an assistant span:

- with `{% generation %}` markers in the template, the spans are the marked blocks (as transformers'
  `return_assistant_tokens_mask`);
- otherwise assistant turn i spans from the end of render(messages[:i], add_generation_prompt=True)
  to the end of render(messages[:i+1]) less trailing whitespace, i.e. exactly what a model must
  generate after the generation prompt: the answer and its end-of-turn token (`<|eot_id|>`,
  `<|im_end|>`, `</s>`), not the newline a template puts after it.

Both renderings must be prefixes of the whole conversation's rendering, and the answer must appear in
it verbatim; a template that breaks this cannot be masked reliably, and is an error naming it (never a
wrong mask). `data.train_on_prompt` puts the loss on every token instead.

A document is BOS (only when the tokenizer adds one and the rendered text does not already start with
the BOS token's text) + the rendered tokens. A conversation longer than `seq_len` is cut at the end
(counted); if no trained token is left it is a bad row. Documents are packed whole.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
import torch

from tracetrain.config import DataSection
from tracetrain.data.chat_templates import (
    BUILTIN_TEMPLATES,
    TemplateLimitExceeded,
    has_generation_markers,
    render,
)
from tracetrain.data.files import ReadPosition, iter_rows
from tracetrain.data.instruction import train_and_eval
from tracetrain.data.packing import DataStats, Document, Documents, TokenizedExample, compact_document
from tracetrain.data.tokenizer import SPECIAL_TOKEN_KEYS, Tokenizer
from tracetrain.errors import DataError, TracetrainError

SHAREGPT_FIELD = "conversations"
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
    "tool": "tool",
}


class TemplateMismatch(DataError):
    """The template renders conversations in a way that assistant tokens cannot be located in: a property
    of the template, not of one row, so it is never skipped as a bad row."""


@dataclass(frozen=True)
class ChatTemplate:
    name: str  # how messages name it: "built-in 'chatml'", "<folder>'s chat_template", a file path
    source: str


def chat_template_file(data: DataSection) -> Path | None:
    """The .jinja file `data.chat_template` names (None for 'auto' or a built-in name); DataError when a
    named .jinja file is not there."""
    spec = data.chat_template
    if spec == "auto" or spec in BUILTIN_TEMPLATES:
        return None
    path = Path(spec)
    if path.suffix == ".jinja" and not path.is_file():
        raise DataError(f"chat template file {path} does not exist (config key 'data.chat_template')")
    return path if path.is_file() else None


def chat_template_for(data: DataSection, tok: Tokenizer) -> ChatTemplate | None:
    """The template `data.chat_template` names; None for 'auto' when the tokenizer has none."""
    spec = data.chat_template
    if spec == "auto":
        if tok.chat_template is None:
            return None
        return ChatTemplate(f"the chat_template of tokenizer {tok.name}", tok.chat_template)
    if spec in BUILTIN_TEMPLATES:
        return ChatTemplate(f"built-in template '{spec}'", BUILTIN_TEMPLATES[spec])
    path = chat_template_file(data)
    if path is not None:
        try:
            return ChatTemplate(str(path), path.read_text(encoding="utf-8"))
        except UnicodeDecodeError as e:
            raise DataError(
                f"chat template file {path} is not UTF-8 text (byte {e.start}; config key 'data.chat_template')"
            ) from None
    raise DataError(
        f"config key 'data.chat_template': {spec!r} is not 'auto', a built-in template "
        f"({', '.join(BUILTIN_TEMPLATES)}) or a .jinja file"
    )


def resolve_chat_template(data: DataSection, tok: Tokenizer) -> str | None:
    """The chat template a run trains with: 'auto' -> the tokenizer's own; a built-in name -> its text;
    a path -> the file's text. None when 'auto' and the tokenizer has none (not chat data)."""
    template = chat_template_for(data, tok)
    return template.source if template else None


def _require_template(data: DataSection, tok: Tokenizer) -> ChatTemplate:
    template = chat_template_for(data, tok)
    if template is None:
        raise DataError(
            f"tokenizer {tok.name} has no chat_template (tokenizer_config.json or chat_template.jinja), "
            f"and data.chat_template = 'auto'; set data.chat_template to one of "
            f"{', '.join(BUILTIN_TEMPLATES)} or a .jinja file"
        )
    return template


# ----------------------------------------------------------------------------------------------------
# Rows -> messages


def parse_conversation(row: dict[str, Any], field: str) -> list[dict[str, Any]]:
    """A row -> its messages as {role, content, ...}; DataError with the reason for a bad row."""
    if field in row:
        messages, sharegpt = row[field], False
    elif SHAREGPT_FIELD in row:
        messages, sharegpt = row[SHAREGPT_FIELD], True
    else:
        present = ", ".join(map(repr, row)) or "none"
        raise DataError(f"missing field {field!r} (or ShareGPT {SHAREGPT_FIELD!r}; fields present: {present})")
    if not isinstance(messages, list) or not messages:
        raise DataError(f"field {field if not sharegpt else SHAREGPT_FIELD!r} must be a non-empty list of messages")
    out = [_sharegpt_message(m, i) if sharegpt else _message(m, i) for i, m in enumerate(messages)]
    if not any(m["role"] == "assistant" for m in out):
        raise DataError(f"no assistant message, so nothing to train on (roles: {', '.join(m['role'] for m in out)})")
    return out


def checked_messages(value: Any, field: str) -> list[dict[str, Any]]:
    """A field holding a list of {role, content} messages, each checked; DataError with the reason."""
    if not isinstance(value, list) or not value:
        raise DataError(f"field {field!r} must be a non-empty list of messages or a string")
    return [_message(m, i) for i, m in enumerate(value)]


def render_messages(
    data: DataSection, tok: Tokenizer, messages: list[dict[str, Any]], *, add_generation_prompt: bool = False
) -> str:
    """`messages` rendered as text with the run's chat template (`data.chat_template`)."""
    template = _require_template(data, tok)
    return _render(template, tok, messages, add_generation_prompt=add_generation_prompt)[0]


def _message(m: Any, i: int) -> dict[str, Any]:
    if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not m["role"]:
        raise DataError(f"message {i} is not an object with a string 'role' (system, user, assistant, tool, ...)")
    content = m.get("content")
    if not isinstance(content, str):
        raise DataError(f"message {i} ({m['role']}) has content of type {type(content).__name__}, expected a string")
    if not content.strip():
        raise DataError(f"message {i} ({m['role']}) has empty content")
    return dict(m)


def _sharegpt_message(m: Any, i: int) -> dict[str, Any]:
    if not isinstance(m, dict) or m.get("from") not in SHAREGPT_ROLES:
        got = m.get("from") if isinstance(m, dict) else m
        raise DataError(f"ShareGPT message {i} has from = {got!r}; allowed: {', '.join(SHAREGPT_ROLES)}")
    return _message({"role": SHAREGPT_ROLES[m["from"]], "content": m.get("value")}, i)


# ----------------------------------------------------------------------------------------------------
# Messages -> text, spans, tokens


def _render(
    template: ChatTemplate,
    tok: Tokenizer,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = False,
    track: bool = False,
) -> tuple[str, list[tuple[int, int]]]:
    try:
        text, spans = render(
            template.source, tok.special_tokens(), messages, add_generation_prompt=add_generation_prompt, track=track
        )
        if not text.isascii():
            text.encode("utf-8")  # a surrogate escape in the template's strings is not text a tokenizer reads
        return text, spans
    except UnicodeEncodeError as e:
        raise TemplateMismatch(
            f"{template.name} renders a lone surrogate (\\u{ord(e.object[e.start]):04x}), which is not Unicode text"
        ) from None
    except jinja2.TemplateSyntaxError as e:
        raise TemplateMismatch(
            f"{template.name} is not a valid Jinja template (line {e.lineno}: {e.message})"
        ) from None
    except TemplateLimitExceeded as e:
        raise TemplateMismatch(f"{template.name} {e}") from None
    except RecursionError:
        raise TemplateMismatch(f"{template.name} nests or recurses too deeply to render") from None
    except jinja2.UndefinedError as e:
        # A special token the tokenizer lacks (the byte tokenizer has no eos_token text) fails every row
        # alike: the template and tokenizer do not fit, which no row is to blame for.
        name = str(e).removesuffix(" is undefined").strip("'")
        if name in SPECIAL_TOKEN_KEYS:
            without = [n for n, source in BUILTIN_TEMPLATES.items() if name not in source]
            raise TemplateMismatch(
                f"{template.name} uses {name}, which tokenizer {tok.name} does not have; set data.chat_template "
                f"to a template without it (built-in: {', '.join(without)}) or data.tokenizer to one that has it"
            ) from None
        raise DataError(f"{template.name} raised an error for this conversation: {e}") from None
    except (
        jinja2.TemplateError,
        TypeError,
        ValueError,
        KeyError,
        IndexError,
        AttributeError,
        ArithmeticError,
    ) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DataError(f"{template.name} raised an error for this conversation: {reason}") from None


def _spans_by_prefix(
    template: ChatTemplate, tok: Tokenizer, messages: list[dict[str, Any]], full: str
) -> list[tuple[int, int]]:
    """Assistant spans found by rendering each conversation prefix (see the module doc)."""
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        plain, _ = _render(template, tok, messages[:i])
        prompt, _ = _render(template, tok, messages[:i], add_generation_prompt=True)
        turn, _ = _render(template, tok, messages[: i + 1])
        for rendered, last in ((plain, i - 1), (turn, i)):
            if not full.startswith(rendered):
                raise TemplateMismatch(
                    f"{template.name}: rendering messages 0..{last} does not give a prefix of "
                    f"the whole conversation's rendering, so assistant message {i} cannot be "
                    "located; add {% generation %} markers to the template or use another one"
                )
        # A template without a generation prompt (or one that is not a prefix) is located by its content.
        has_prompt = prompt != plain and full.startswith(prompt)
        start = len(prompt) if has_prompt else len(plain)
        content_at = full.find(m["content"].strip(), start, len(turn))
        if content_at < 0:
            raise TemplateMismatch(
                f"{template.name} does not render assistant message {i}'s content verbatim, so "
                "its tokens cannot be located; use a template that keeps message text as is"
            )
        if not has_prompt and not full[start:content_at].isspace():
            # Spacing between the prompt and the answer ("[/INST] Paris") is generated with the answer;
            # a tokenizer that splits the space off would otherwise leave its token untrained.
            start = content_at
        spans.append((start, len(turn.rstrip())))
    return spans


def _check_all_rendered(template: ChatTemplate, messages: list[dict[str, Any]], full: str) -> None:
    """Every message's text must be in the rendering: a role the template drops is a bad row, and an
    answer it rewrites makes the template unusable for masking."""
    for i, m in enumerate(messages):
        if m["role"] == "assistant" and m["content"].strip() not in full:
            raise TemplateMismatch(
                f"{template.name} does not render assistant message {i}'s content verbatim, so "
                "its tokens cannot be located; use a template that keeps message text as is"
            )
        if m["content"].strip() not in full:
            raise DataError(
                f"message {i} (role {m['role']!r}) is not in the text {template.name} renders: it "
                "renders nothing for that role (roles chat templates render: system, user, assistant)"
            )


def _token_mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[bool]:
    """Per token: do its characters [a, b) overlap any span [s, e)? (both sorted by position)"""
    mask, k = [], 0
    for a, b in offsets:
        while k < len(spans) and spans[k][1] <= a:
            k += 1
        mask.append(k < len(spans) and spans[k][0] < b and a < spans[k][1])
    return mask


def tokenize_conversation(
    template: ChatTemplate, tok: Tokenizer, messages: list[dict[str, Any]], train_on_prompt: bool = False
) -> TokenizedExample:
    """One conversation -> its rendered text, ids (BOS included where due) and per-token trained mask."""
    markers = has_generation_markers(template.source)
    full, spans = _render(template, tok, messages, track=markers)
    _check_all_rendered(template, messages, full)
    spans = [(a, b) for a, b in spans if b > a]  # an empty block marks nothing
    if markers and not spans:
        raise TemplateMismatch(
            f"{template.name} has {{% generation %}} markers but marks nothing in a conversation "
            "with assistant messages (an empty block, or one where no text is rendered): every token's "
            "loss would be masked; put the blocks around what the assistant writes"
        )
    if not markers:
        spans = _spans_by_prefix(template, tok, messages, full)
    ids, offsets = tok.encode_with_offsets(full)
    is_target = [True] * len(ids) if train_on_prompt else _token_mask(offsets, spans)
    if not any(is_target):
        raise TemplateMismatch(
            f"{template.name} marks no token of this conversation as trained (the marked text is only "
            "whitespace or lies outside the rendering): every token's loss would be masked"
        )
    bos_text = tok.bos_text
    if tok.add_bos and not (bos_text and full.startswith(bos_text)):
        ids, is_target = [tok.bos_id] + ids, [train_on_prompt] + is_target
    return TokenizedExample("", full, ids, is_target)


def render_generation_prompt(template: str, tok: Tokenizer, messages: list[dict[str, Any]]) -> list[int]:
    """The ids a model is given to answer `messages` (add_generation_prompt=True), with no double BOS."""
    text, _ = _render(ChatTemplate("the chat template", template), tok, messages, add_generation_prompt=True)
    ids = tok.encode(text)
    bos_text = tok.bos_text
    if tok.add_bos and not (bos_text and text.startswith(bos_text)):
        ids = [tok.bos_id] + ids
    return ids


def chat_messages(prompt: str, system: str | None = None) -> list[dict[str, str]]:
    """[system (when given), user] messages for one prompt."""
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]


def chat_prompt_ids(data: DataSection, tok: Tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """The ids a run's model answers `messages` from (`generate --chat`): its chat template with the
    generation prompt."""
    template = resolve_chat_template(data, tok)
    if template is None:
        raise TracetrainError(
            f"--chat needs a chat template: the run's tokenizer {tok.name} has none and "
            f"data.chat_template = {data.chat_template!r}; pass "
            "--data.chat_template=NAME_OR_FILE.jinja, or drop --chat"
        )
    return render_generation_prompt(template, tok, messages)


# ----------------------------------------------------------------------------------------------------
# Files -> datasets


def iter_chat_examples(
    data: DataSection, tok: Tokenizer, path: str, key: str, stats: DataStats, split: str = "train"
) -> Iterator[TokenizedExample]:
    """Every usable conversation of `path`, tokenised and cut to `data.seq_len` (`where` = file:line or
    file: row N). A bad row raises DataError `<where>: <reason>`, or with `data.skip_bad_lines` is counted
    in `stats.bad_lines_skipped`; truncations are counted in `stats.examples_truncated`."""
    template = _require_template(data, tok)
    position = ReadPosition()  # rows are read one at a time: a file larger than memory is never held whole
    parse = lambda r: parse_conversation(r, data.messages_field)  # noqa: E731
    rows = iter_rows(path, key, parse, data.skip_bad_lines, position, split)
    for where, messages in rows:
        try:
            ex = _truncate(tokenize_conversation(template, tok, messages, data.train_on_prompt), data.seq_len, stats)
        except TemplateMismatch as e:
            raise TemplateMismatch(f"{where}: {e}") from None
        except DataError as e:
            if not data.skip_bad_lines:
                raise DataError(f"{where}: {e}") from None
            stats.bad_lines_skipped += 1
            continue
        yield TokenizedExample(where, ex.text, ex.ids, ex.is_target)
    stats.bad_lines_skipped += position.bad  # the file's unreadable rows, known once it is read


def _truncate(ex: TokenizedExample, seq_len: int, stats: DataStats) -> TokenizedExample:
    if len(ex.ids) <= seq_len:
        return ex
    if not any(ex.is_target[1:seq_len]):
        raise DataError(
            f"every trained token lies past data.seq_len = {seq_len} (the conversation has {len(ex.ids)} tokens)"
        )
    stats.examples_truncated += 1
    return TokenizedExample(ex.where, ex.text, ex.ids[:seq_len], ex.is_target[:seq_len])


def chat_documents(data: DataSection, tok: Tokenizer, key: str = "data.path") -> Documents:
    """`data.kind = "chat"`: conversation file(s) -> both splits' documents (`record_rows` packs them)."""
    if data.tokenize == "on_the_fly":
        raise DataError(
            "config key 'data.tokenize': 'on_the_fly' is not supported for data.kind = 'chat' yet; use 'ahead'"
        )
    stats = DataStats()

    def documents(path: str, key: str, split: str) -> list[Document]:  # int32 arrays: text and lists dropped
        examples = iter_chat_examples(data, tok, path, key, stats, split)
        return [compact_document(ex.ids, ex.is_target) for ex in examples]

    docs = documents(data.path, key, data.split)
    train, eval_ = train_and_eval(data, docs, documents)
    if not train:
        raise DataError(
            f"{data.path}: no usable conversations ({stats.bad_lines_skipped} bad rows skipped; config key '{key}')"
        )
    stats.examples_read = len(docs) + (len(eval_) if data.eval_path else 0)
    stats.train_examples, stats.eval_examples = len(train), len(eval_)
    # Packing is greedy in order, and neighbouring rows of a file are often alike: shuffle first.
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(data.seed)).tolist()
    return Documents([train[i] for i in order], eval_, [], stats)
