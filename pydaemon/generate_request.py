"""GenerateRequest: one generation request as a front end hands it to the engine.

vLLM's ``generate(prompt, sampling_params, request_id, lora_request=..., priority=...)``
arguments as one plain value, so that every layer that passes a request on (the gRPC
servicer, the OpenAI handlers, the engine clients, ``LLMEngine``) declares it once: a field
added here reaches the engine core without five signatures to change. The engine core gets
it tokenized, as ``pydaemon.core.messages.EngineCoreRequest``.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydaemon.lora_request import LoRARequest
from pydaemon.sampling_params import SamplingParams


@dataclass(frozen=True)
class GenerateRequest:
    request_id: str  # unique among the engine's live requests
    prompt: str | list[int]  # text (tokenized by the front end) or token ids
    params: SamplingParams
    priority: int = 0  # lower runs first (vLLM's priority scheduling); ties in arrival order
    cache_salt: str | None = None  # prefix-cache isolation: blocks are shared only within a salt
    lora_request: LoRARequest | None = None  # the adapter it runs with; None: the base model
