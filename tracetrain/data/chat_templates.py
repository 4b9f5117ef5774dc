"""Chat templates: the built-in ones (for tokenizers without their own) and the Jinja environment that
renders any template the way transformers' `apply_chat_template` does.

transformers renders a template with a sandboxed, immutable Jinja environment with `trim_blocks` and
`lstrip_blocks`, the `loopcontrols` extension, a `tojson` filter that keeps non-ASCII text and does not
escape HTML, the globals `raise_exception` and `strftime_now`, and the tokenizer's named special tokens
(bos_token, eos_token, ...) as variables. `render` does the same, so a rendered conversation is the
text transformers would produce, character for character (tests compare them).

A template may mark what the model generates with `{% generation %}...{% endgeneration %}`; rendering
then also returns the character spans of those blocks (`render(..., track=True)`).

Templates come from tokenizer folders and the Hub, so rendering is bounded: every call, attribute or item
lookup and loop step counts against a step budget and a time limit, the output against a size limit,
and a number that would size a string, list or power past that limit is refused before it is computed
(`TemplateLimitExceeded`, with the limit named). Jinja's sandbox keeps the template away from Python
internals; these limits keep it from hanging or filling memory.
"""

from __future__ import annotations

import functools
import json
import re
import time
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment, safe_range

# Limits for one render (one conversation): a real template takes well under a millisecond and a few
# thousand steps; these leave room for long conversations and slow machines.
RENDER_TIME_LIMIT_S = 5.0
RENDER_STEP_LIMIT = 1_000_000  # calls, lookups and loop steps: deterministic, unlike the time
RENDER_OUTPUT_LIMIT_CHARS = 1 << 24  # on top of the messages' own text, which templates repeat verbatim
_CONTENT_REPEATS = 4  # a template may render each message a few times (e.g. tojson of the whole list)


class TemplateLimitExceeded(Exception):
    """A render went past a step, time or output-size limit (the message names which)."""


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
        budget = _BUDGET.get()  # the only state a template can grow across loop steps (`ns.s = ns.s ~ ns.s`)
        if budget is not None and isinstance(value, (str, list, tuple, dict)):
            budget.check_size(len(value), "a namespace value")
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template may not store {name!r} on a namespace")


class _Budget:
    """What one render may still spend; `tick` is called at every step the template takes."""

    def __init__(self, output_chars: int) -> None:
        self.deadline = time.monotonic() + RENDER_TIME_LIMIT_S
        self.steps_left = RENDER_STEP_LIMIT
        self.output_chars = output_chars

    def tick(self) -> None:
        self.steps_left -= 1
        if self.steps_left < 0:
            raise TemplateLimitExceeded(f"took more than {RENDER_STEP_LIMIT:,} steps to render one conversation")
        if self.steps_left % 1024 == 0 and time.monotonic() > self.deadline:
            raise TemplateLimitExceeded(f"took more than {RENDER_TIME_LIMIT_S:g} s to render one conversation")

    def check_size(self, size: int, what: str) -> None:
        if size > self.output_chars:
            raise TemplateLimitExceeded(
                f"would build {what} of {size:,} items (limit {self.output_chars:,} for this conversation)"
            )


# The budget of the render under way in this thread; None outside a render (compiling, tests).
_BUDGET: ContextVar[_Budget | None] = ContextVar("chat_template_budget", default=None)


class _BoundedRange:
    """`range()` for templates: Jinja's sandbox caps the length, this also counts each step."""

    def __init__(self, env: _BoundedSandbox, *args: Any) -> None:
        self.env, self.items = env, safe_range(*args)

    def __iter__(self) -> Iterator[int]:
        for i in self.items:
            self.env.tick()
            yield i

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: Any) -> Any:
        return self.items[index]

    def __contains__(self, value: Any) -> bool:
        return value in self.items


_FORMATS = ("format", "format_map")


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """transformers' sandbox, with every call, lookup and operator counted against the render's `_Budget`."""

    intercepted_binops = frozenset(["*", "**", "%", "+"])

    def tick(self) -> None:
        budget = _BUDGET.get()
        if budget is not None:
            budget.tick()

    def _check_arguments(self, values: Any) -> None:
        """Numbers that size a result (`range`, `center`, `ljust`) and values grown by `~` (which Jinja
        does not route through any hook) are checked where they are passed on."""
        budget = _BUDGET.get()
        if budget is None:
            return
        for v in values:
            if isinstance(v, int):
                budget.check_size(abs(v), "a value sized by a number")
            elif isinstance(v, (str, list, tuple, dict)):
                budget.check_size(len(v), "a value")

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        __self.tick()
        __self._check_arguments([*args, *kwargs.values()])
        return __self._sized(super().call(__context, __obj, *args, **kwargs))

    def getattr(self, obj: Any, attribute: str) -> Any:
        self.tick()
        if isinstance(obj, str) and attribute in _FORMATS:  # '{:>9999999999}'.format(1)
            self._check_arguments([_format_widths(obj)])
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        self.tick()
        return super().getitem(obj, argument)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        self.tick()
        budget = _BUDGET.get()
        if budget is not None:
            budget.check_size(_binop_size(operator, left, right), f"the result of {operator!r}")
        return self._sized(super().call_binop(context, operator, left, right))

    def _sized(self, value: Any) -> Any:
        budget = _BUDGET.get()
        if budget is not None and isinstance(value, (str, list, tuple, dict)):
            budget.check_size(len(value), "a value")
        return value


def _binop_size(operator: str, left: Any, right: Any) -> int:
    """An upper bound on the size of `left operator right`, worked out without computing it."""
    sized = (str, list, tuple)
    if operator == "*" and isinstance(left, sized) and isinstance(right, int):
        return len(left) * max(right, 0)
    if operator == "*" and isinstance(right, sized) and isinstance(left, int):
        return len(right) * max(left, 0)
    if operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0:
        return abs(left).bit_length() * right // 8  # the digits' bytes: 9**9**9 is refused, not computed
    if operator == "+" and isinstance(left, sized) and isinstance(right, sized):
        return len(left) + len(right)
    if operator == "%" and isinstance(left, str):
        numbers = right if isinstance(right, tuple) else (right,)
        widths = sum(abs(v) for v in numbers if isinstance(v, int) and not isinstance(v, bool))
        return len(left) + widths + _format_widths(left)
    return 0


def _format_widths(fmt: str) -> int:
    """An upper bound on the padding the widths written in a format string ask for (`'%9999999999d'`,
    `'{:>9999999999}'`): every run of digits counts, so literal numbers only make it larger."""
    runs = re.findall(r"\d{4,}", fmt)
    return sum(int(run) if len(run) < 20 else 10**20 for run in runs)


def _bounded_filter(env: _BoundedSandbox, fn: Callable[..., Any]) -> Callable[..., Any]:
    """A filter that counts a step, refuses numbers past the size limit (`center(10**10)`) and results
    past it (Jinja calls filters directly, not through `call`)."""

    @functools.wraps(fn)  # keeps `jinja_pass_arg`, which tells Jinja what to pass first
    def bounded(*args: Any, **kwargs: Any) -> Any:
        env.tick()
        env._check_arguments([*args[1:], *kwargs.values()])
        return env._sized(fn(*args, **kwargs))

    return bounded


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """The template compiled in its own sandboxed environment (one per template: the tracker has state).

    Raises jinja2.TemplateSyntaxError for a malformed template.
    """
    env = _BoundedSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTracker, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.filters.update({name: _bounded_filter(env, fn) for name, fn in env.filters.items()})
    env.globals["range"] = functools.partial(_BoundedRange, env)
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

    `variables` are the tokenizer's special tokens (bos_token, ...). Template errors propagate; a render
    past the step, time or output limits raises TemplateLimitExceeded.
    """
    template = compile_template(source)
    context = {
        **variables,
        "messages": messages,
        "tools": None,
        "documents": None,
        "add_generation_prompt": add_generation_prompt,
    }
    content_chars = sum(len(str(m.get("content", ""))) for m in messages)
    budget = _Budget(RENDER_OUTPUT_LIMIT_CHARS + _CONTENT_REPEATS * content_chars)
    tracker = next(e for e in template.environment.extensions.values() if isinstance(e, _GenerationTracker))
    output: list[str] = []
    token = _BUDGET.set(budget)
    tracker.output, tracker.spans = (output if track else None), []
    try:
        size = 0
        for chunk in template.generate(**context):
            size += len(chunk)
            budget.check_size(size, "an output")
            output.append(chunk)
        return "".join(output), list(tracker.spans) if track else []
    finally:
        _BUDGET.reset(token)
        tracker.output, tracker.spans = None, []
