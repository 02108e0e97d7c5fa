"""LoRARequest: which LoRA adapter a request runs with (vLLM's name and fields), and
LoRAAdapterInfo: what the engine reports of a loaded adapter.

A LoRARequest is a plain, frozen value. It is loaded once through the engine client's
``add_lora`` (the engine core reads and checks the adapter; every worker loads its validated
weights: pydaemon/worker/lora_manager.py) and then travels with each request that names it.
``lora_int_id`` identifies the weights: two requests with the same id share the adapter's
device slot and cached KV blocks; an adapter loaded again from other files must get a new id.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str  # what clients call it: the OpenAI ``model`` field, gRPC ``adapter``
    lora_int_id: int  # >= 1, unique per adapter weights
    lora_path: str  # a PEFT directory: adapter_config.json + adapter_model.safetensors

    def __post_init__(self) -> None:
        if not self.lora_name:
            raise ValueError("LoRARequest.lora_name must not be empty")
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(
                f"LoRARequest.lora_int_id must be an integer >= 1 (got {self.lora_int_id!r})"
            )
        if not self.lora_path:
            raise ValueError("LoRARequest.lora_path must not be empty")


_LORA_SALT_MARK = "\x00lora:"


def prefix_cache_salt(cache_salt: str, lora_request: LoRARequest | None) -> str:
    """The salt the prefix cache hashes a request's blocks with: its ``cache_salt`` and its
    adapter, so that KV computed under one adapter is never served to another (or to the
    base model)."""
    if lora_request is None:
        return cache_salt
    return f"{cache_salt}{_LORA_SALT_MARK}{lora_request.lora_int_id}"


def is_lora_salt(salt: str) -> bool:
    """Whether a prefix-cache salt is a LoRA adapter's (prefix_cache_salt)."""
    return _LORA_SALT_MARK in salt


@dataclass(frozen=True)
class LoRAAdapterInfo:
    """A loaded adapter, as the engine core checked it (``EngineClient.add_lora``)."""

    lora_name: str
    lora_int_id: int
    lora_path: str
    rank: int  # the largest module rank
    target_modules: tuple[str, ...]  # PEFT module names its weights cover
