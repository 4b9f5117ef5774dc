"""Chat templates: the built-in ones (for tokenizers without their own) and the Jinja environment that
renders any template the way transformers' `apply_chat_template` does.

transformers renders a template with a sandboxed, immutable Jinja environment with `trim_blocks` and
`lstrip_blocks`, the `loopcontrols` extension, a `tojson` filter that keeps non-ASCII text and does not
escape HTML, the globals `raise_exception` and `strftime_now`, and the tokenizer's named special tokens
(bos_token, eos_token, ...) as variables. `render` does the same, so a rendered conversation is the
text transformers would produce, character for character (tests compare them).

A template may mark what the model generates with `{% generation %}...{% endgeneration %}`; rendering
then also returns the character spans of those blocks (`render(..., track=True)`).
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Written for tracetrain. Every template renders each message's content verbatim, so the data pipeline
# can find it, and ends an assistant turn with the family's end-of-turn token.
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

LLAMA_3 = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

# Mistral-Instruct's [INST] format: a system message is folded into the first user turn, and user and
# assistant turns alternate; the assistant's answer ends with the EOS token.
MISTRAL = (
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set system = messages[0]['content'] + '\n\n' %}{% set turns = messages[1:] %}"
    "{% else %}{% set system = '' %}{% set turns = messages %}{% endif %}"
    "{{ bos_token }}"
    "{% for message in turns %}"
    "{% if message['role'] not in ['user', 'assistant'] %}"
    "{{ raise_exception('Mistral has only system, user and assistant messages, not ' + message['role']) }}"
    "{% elif (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Mistral turns must alternate user, assistant, user, ... after an optional system message') }}"
    "{% elif message['role'] == 'user' %}"
    "{{ '[INST] ' + (system if loop.first else '') + message['content'] + ' [/INST]' }}"
    "{% else %}"
    "{{ ' ' + message['content'] + eos_token }}"
    "{% endif %}"
    "{% endfor %}"
)

BUILTIN_TEMPLATES: dict[str, str] = {"chatml": CHATML, "llama-3": LLAMA_3, "mistral": MISTRAL}

_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


class _GenerationTracker(jinja2.ext.Extension):
    """`{% generation %}body{% endgeneration %}`: renders body unchanged, and, while tracking, records the
    [start, end) character span it occupies in the output."""

    tags = {"generation"}  # noqa: RUF012  # jinja2.ext.Extension declares it as an instance attribute

    def __init__(self, environment: jinja2.Environment) -> None:
        super().__init__(environment)
        self.output: list[str] | None = None  # the chunks rendered so far, while tracking
        self.spans: list[tuple[int, int]] = []

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

    def _mark(self, caller: Any) -> str:
        text = caller()
        if self.output is not None:
            start = sum(map(len, self.output))
            self.spans.append((start, start + len(text)))
        return text


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Namespace(jinja2.utils.Namespace):
    """Jinja's `namespace()`, refusing underscore names: templates come from the Hub, and a stored
    `_...` attribute is a step towards Python internals the sandbox otherwise keeps out of reach."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # Namespace's own signature trick: `self` may be a kwarg
        self, rest = args[0], args[1:]
        for name in dict(*rest, **kwargs):
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, *rest, **kwargs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template may not store {name!r} on a namespace")


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """The template compiled in its own sandboxed environment (one per template: the tracker has state).

    Raises jinja2.TemplateSyntaxError for a malformed template.
    """
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTracker, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _Namespace
    return env.from_string(source)


def has_generation_markers(source: str) -> bool:
    """Does the template mark generated text with `{% generation %}` blocks?"""
    return _GENERATION_TAG.search(source) is not None


def render(
    source: str,
    variables: dict[str, Any],
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = False,
    track: bool = False,
) -> tuple[str, list[tuple[int, int]]]:
    """(rendered text, generation-block spans) of `messages`; spans are only collected with `track`.

    `variables` are the tokenizer's special tokens (bos_token, ...). Template errors propagate.
    """
    template = compile_template(source)
    context = {
        **variables,
        "messages": messages,
        "tools": None,
        "documents": None,
        "add_generation_prompt": add_generation_prompt,
    }
    if not track:
        return template.render(**context), []
    tracker = next(e for e in template.environment.extensions.values() if isinstance(e, _GenerationTracker))
    tracker.output, tracker.spans = [], []
    try:
        for chunk in template.generate(**context):
            tracker.output.append(chunk)
        return "".join(tracker.output), list(tracker.spans)
    finally:
        tracker.output, tracker.spans = None, []
