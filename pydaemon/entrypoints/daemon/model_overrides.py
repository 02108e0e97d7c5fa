"""What the daemon says about its model where the operator overrides the model's own word:
``--served-model-name`` (the names clients use in ``model``; the first is the one answers and
metrics carry) and ``--chat-template`` (a Jinja template, or a file holding one, instead of
the tokenizer's), as vLLM's flags of the same names. Both apply to the front end only: the
engine core never renders a chat."""

from __future__ import annotations

import copy
from pathlib import Path

from pydaemon.engine.engine_client import EngineClient
from pydaemon.entrypoints.common.lora_adapters import check_adapter_name
from pydaemon.tokenizer.chat_template import check_chat_template

MAX_CHAT_TEMPLATE_BYTES = 1 << 20


def parse_served_model_names(value: str | list[str] | None) -> list[str]:
    """--served-model-name NAME [NAME ...] (a string or a list in TOML) -> the names;
    ValueError for a name that is not usable (adapter names' rule: it reaches metrics labels
    and /v1/models)."""
    names = [value] if isinstance(value, str) else list(value or [])
    for name in names:
        try:
            check_adapter_name(name)
        except ValueError as e:
            raise ValueError(
                f"--served-model-name: {e}".replace("adapter name", "a name")
            ) from None
    if len(set(names)) != len(names):
        raise ValueError("--served-model-name names a model twice")
    return names


def read_chat_template(value: str | None) -> str | None:
    """--chat-template: a file holding the template, else the template itself (vLLM's rule);
    ValueError when it does not parse."""
    if not value:
        return None
    path = Path(value)
    is_file = len(value) < 4096 and "\n" not in value and path.is_file()
    if is_file:
        if path.stat().st_size > MAX_CHAT_TEMPLATE_BYTES:
            raise ValueError(
                f"--chat-template {value}: larger than {MAX_CHAT_TEMPLATE_BYTES} bytes"
            )
        try:
            template = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--chat-template {value}: cannot read it: {e}") from None
    else:
        template = value
    try:
        check_chat_template(template)
    except ValueError as e:
        raise ValueError(f"--chat-template: {e}") from None
    return template


def apply_model_overrides(
    client: EngineClient, served_model_names: list[str], chat_template: str | None
) -> None:
    """Sets the served name and the chat template on the started client's model info and
    tokenizer (a copy of it), before anything is served."""
    if served_model_names:
        client.model_info.model_name = served_model_names[0]
    if chat_template is not None:
        if client.tokenizer is None:
            raise ValueError("--chat-template: this model has no tokenizer to render chats")
        # A copy: the engine's own tokenizer (an in-process engine's) stays as it was.
        client.tokenizer = copy.copy(client.tokenizer)
        client.tokenizer.chat_template = chat_template
        client.model_info.has_chat_template = True
