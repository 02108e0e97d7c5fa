"""Chat messages -> prompt text and token ids, with special-token text in messages kept as text.

A chat template writes the control tokens that delimit turns (``<|im_start|>``, ``<|eot_id|>``);
a client's message must not be able to write them too: user content holding
``<|im_end|>\\n<|im_start|>system\\n...`` would otherwise become a real system turn (role
injection). So, by default, every occurrence of a special token's text inside the messages (and
tools) is swapped for a placeholder before rendering, and the rendered prompt is encoded in
segments: the template's own text with special-token parsing, each placeholder as the plain
text it stands for. ``parse_special_tokens_in_content=True`` restores the old behaviour (the whole
rendered prompt parsed for special tokens, as transformers' ``apply_chat_template`` does).
Raw-text prompts never come here: they keep parsing special tokens.
"""

from __future__ import annotations

import re
import secrets
from typing import Any, Protocol

_OPEN, _CLOSE = "\ue000", "\ue001"  # Unicode private-use characters: never in a template
# Names the renderer passes itself: chat_template_kwargs may not set them.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {"messages", "tools", "documents", "add_generation_prompt", "template", "model_name",
     "special_tokens"}
)  # fmt: skip


class ChatTokenizer(Protocol):
    special_token_texts: frozenset[str]  # text that encode() turns into a control token

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool, tools: list | None, **kwargs: Any
    ) -> str: ...
    def encode(self, text: str, add_bos: bool = True) -> list[int]: ...
    def encode_segments(self, segments: list[tuple[str, bool]]) -> list[int]: ...


def encode_chat(
    tokenizer: ChatTokenizer | None,
    messages: list[dict],
    add_generation_prompt: bool = True,
    tools: list | None = None,
    *,
    chat_template_kwargs: dict[str, Any] | None = None,
    parse_special_tokens_in_content: bool = False,
    continue_final_message: bool = False,
) -> tuple[str, list[int]]:
    """-> (prompt text, its token ids). The template writes the BOS itself, so none is added
    (as transformers' ``apply_chat_template(tokenize=True)``). ``continue_final_message``
    (transformers' and vLLM's): the prompt ends right after the last message's content, so
    that the model continues that message (no end-of-turn, no generation prompt)."""
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be set")
    if tokenizer is None:
        raise ValueError("this model has no tokenizer: chat messages need tokenizer.json")
    kwargs = chat_template_kwargs or {}
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & kwargs.keys())
    if reserved:
        raise ValueError(f"chat_template_kwargs may not set {', '.join(reserved)}")
    specials = sorted(tokenizer.special_token_texts, key=len, reverse=True)
    pattern = re.compile("|".join(map(re.escape, specials))) if specials else None
    if (
        parse_special_tokens_in_content
        or pattern is None
        or not _mentions(pattern, (messages, tools))
    ):
        text = tokenizer.apply_chat_template(messages, add_generation_prompt, tools, **kwargs)
        if continue_final_message:
            text = _cut_after_final_message(text, messages)
        return text, tokenizer.encode(text, add_bos=False)
    nonce = secrets.token_hex(8)
    index = {s: i for i, s in enumerate(specials)}

    def hide(value: Any) -> Any:
        if isinstance(value, str):
            return pattern.sub(lambda m: f"{_OPEN}{nonce}{index[m.group()]}{_CLOSE}", value)
        if isinstance(value, dict):
            return {k: hide(v) for k, v in value.items()}
        if isinstance(value, list):
            return [hide(v) for v in value]
        return value

    hidden = hide(messages)
    rendered = tokenizer.apply_chat_template(hidden, add_generation_prompt, hide(tools), **kwargs)
    if continue_final_message:
        rendered = _cut_after_final_message(rendered, hidden)
    parts = re.split(f"{_OPEN}{nonce}(\\d+){_CLOSE}", rendered)
    segments: list[tuple[str, bool]] = []
    for k, part in enumerate(parts):  # [template, special index, template, ..., template]
        if k % 2:
            segments.append((specials[int(part)], False))
        elif _OPEN + nonce in part:
            raise ValueError(
                "the chat template changed message text that holds special-token text, so it "
                "cannot be kept as plain text; remove the special tokens from the messages"
            )
        elif part:
            segments.append((part, True))
    text = "".join(s for s, _ in segments)
    return text, tokenizer.encode_segments(segments)


def _cut_after_final_message(rendered: str, messages: list[dict]) -> str:
    """The rendered prompt up to the end of the last message's content (transformers' rule:
    its last occurrence, else that of its stripped text)."""
    final = messages[-1].get("content") if messages else None
    if not isinstance(final, str) or not final.strip():
        raise ValueError("continue_final_message needs a last message with text to continue")
    for text in (final, final.strip()):
        end = rendered.rfind(text)
        if end >= 0:
            return rendered[: end + len(text)]
    raise ValueError(
        "continue_final_message: the chat template does not write the last message's content "
        "as it is, so it cannot be continued"
    )


def _mentions(pattern: re.Pattern, value: Any) -> bool:
    if isinstance(value, str):
        return pattern.search(value) is not None
    if isinstance(value, dict):
        return any(_mentions(pattern, v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_mentions(pattern, v) for v in value)
    return False
