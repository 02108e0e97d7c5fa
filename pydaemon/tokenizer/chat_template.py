"""Chat templates: found in a model directory, rendered with jinja2 the way transformers does.

The environment matches transformers' ``apply_chat_template``: an immutable sandbox (templates
from the Hub are untrusted code) with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols``
extension, a ``{% generation %}`` block that renders its body, and the globals
``raise_exception``, ``strftime_now``, ``dict`` and ``namespace`` and a ``tojson`` filter that
does not escape HTML. The template sees ``messages``, ``tools``, ``documents``,
``add_generation_prompt``, the named special tokens (``bos_token``, ``eos_token``, ...) and any
extra keyword arguments, which override the special tokens.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

CHAT_TEMPLATE_FILE = "chat_template.jinja"
# Names a message's reasoning goes by; transformers copies it under the first two.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def load_chat_template(model_dir: Path, tokenizer_config: dict[str, Any]) -> str | None:
    """-> the model's default chat template, or None.

    Looked for in ``chat_template.jinja``, then ``tokenizer_config.json``'s ``chat_template``
    (a string, or a list of named templates of which ``default`` is taken), then
    ``chat_template.json``.
    """
    path = model_dir / CHAT_TEMPLATE_FILE
    if path.is_file():
        return path.read_text(encoding="utf-8")
    template = tokenizer_config.get("chat_template")
    if template is None and (model_dir / "chat_template.json").is_file():
        with open(model_dir / "chat_template.json", encoding="utf-8") as f:
            template = json.load(f).get("chat_template")
    return select_default_template(template)


def select_default_template(template: str | list | dict | None) -> str | None:
    """A template given as named variants (``[{"name", "template"}]``) -> its ``default``."""
    if template is None or isinstance(template, str):
        return template
    named = template
    if isinstance(template, list):
        named = {t["name"]: t["template"] for t in template}
    if not isinstance(named, dict) or "default" not in named:
        raise ValueError(f"chat_template has no 'default' variant: {sorted(named)}")
    return named["default"]


def check_chat_template(template: str) -> None:
    """ValueError unless ``template`` parses (as render_chat_template compiles it)."""
    _compile(template)


def render_chat_template(
    template: str | None,
    messages: list[dict[str, Any]],
    *,
    model_name: str,
    special_tokens: dict[str, str],
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
    **kwargs: Any,
) -> str:
    """Renders ``messages`` (each a dict with at least ``role``) into a prompt string."""
    if template is None:
        raise ValueError(
            f"model {model_name!r} has no chat template (no chat_template in "
            "tokenizer_config.json and no chat_template.jinja): send a text prompt, not messages"
        )
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
    chat = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError(f"messages[{i}] must be a dict with a string 'role', got {message!r}")
        # As transformers: keys whose value is None are dropped (templates test for presence).
        chat.append(_alias_reasoning({k: v for k, v in message.items() if v is not None}))
    try:
        return _compile(template).render(
            messages=_plain(chat),
            tools=_plain(tools),
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **{**special_tokens, **_plain(kwargs)},
        )
    except jinja2.TemplateError as e:
        raise ValueError(f"chat template of model {model_name!r} failed: {e}") from e


def _alias_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _plain(value: Any) -> Any:
    """Rebuilds ``value`` from plain JSON types, so the sandbox sees no foreign methods."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    return f"<{type(value).__name__}>"


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: renders its body (transformers marks it)."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_render", [], [])
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


class _TemplateNamespace(jinja2.utils.Namespace):
    """``namespace(...)`` that refuses underscore names (no reach into CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 (jinja's own signature trick)
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _check_namespace_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_namespace_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


def _check_namespace_name(name: Any) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")


class _TemplateDict:
    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False
) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"chat template does not parse: {e}") from e
