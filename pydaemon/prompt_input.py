"""A front end's first step with a prompt: its token ids, and the EOS ids it stops at.

Light on purpose (no torch, no model code): the daemon's front-end process imports it.
"""

from __future__ import annotations


def eos_token_ids(tokenizer, model_config) -> list[int]:
    """The tokenizer's EOS ids if it has any, else the model config's."""
    if tokenizer is not None:
        return sorted(tokenizer.eos_token_ids)
    eos = model_config.eos_token_id
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else sorted(eos)


def tokenize_prompt(prompt: str | list[int], tokenizer) -> tuple[str | None, list[int]]:
    """-> (prompt text or None, token ids); ValueError for an empty or untokenizable prompt."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt is empty")
        if tokenizer is None:
            raise ValueError("this model has no tokenizer.model: send the prompt as token ids")
        return prompt, tokenizer.encode(prompt)
    token_ids = list(prompt)
    if not token_ids:
        raise ValueError("prompt_token_ids is empty")
    return None, token_ids
