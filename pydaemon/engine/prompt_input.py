"""A front end's first step with a prompt: its token ids, and the EOS ids it stops at.

Light on purpose (no torch, no model code): the daemon's front-end process imports it.
"""

from __future__ import annotations

from pathlib import Path

from pydaemon.core.messages import EngineCoreRequest
from pydaemon.generate_request import GenerateRequest
from pydaemon.tokenizer.files import model_eos_token_ids


def eos_token_ids(
    tokenizer, model_config=None, model_dir: str | Path | None = None, extra: list[int] = ()
) -> list[int]:
    """Every id that ends a sequence: ``generation_config.json``'s and ``config.json``'s (read
    from ``model_dir``), the model config's, the tokenizer's and ``extra``; sorted, each once."""
    ids: set[int] = set(extra)
    if model_dir is not None:
        ids.update(model_eos_token_ids(Path(model_dir)))
    if model_config is not None:
        ids.update(model_config.eos_token_ids)
    if tokenizer is not None:
        ids.update(tokenizer.eos_token_ids)
    return sorted(ids)


def first_eos_token_id(tokenizer, eos_token_ids) -> int:
    """The one EOS id to show a client: the tokenizer's own, else the smallest; -1 if none."""
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        return tokenizer.eos_token_id
    return min(eos_token_ids, default=-1)


def tokenize_prompt(prompt: str | list[int], tokenizer) -> tuple[str | None, list[int]]:
    """-> (prompt text or None, token ids); ValueError for an empty or untokenizable prompt."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt is empty")
        if tokenizer is None:
            raise ValueError(
                "this model has no tokenizer (tokenizer.json or tokenizer.model): "
                "send the prompt as token ids"
            )
        return prompt, tokenizer.encode(prompt)
    token_ids = list(prompt)
    if not token_ids:
        raise ValueError("prompt_token_ids is empty")
    return None, token_ids


def to_core_request(
    request: GenerateRequest, token_ids: list[int], eos_token_ids: list[int], arrival_time: float
) -> EngineCoreRequest:
    """The engine core's form of a request: tokenized, with its stop ids and arrival time."""
    return EngineCoreRequest(
        request_id=request.request_id,
        prompt_token_ids=token_ids,
        params=request.params,
        eos_token_ids=eos_token_ids,
        arrival_time=arrival_time,
        priority=request.priority,
        cache_salt=request.cache_salt or "",
        lora_request=request.lora_request,
    )
