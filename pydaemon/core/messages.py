"""The messages between a front end and the engine core: plain data, token ids only.

A front end (``LLMEngine`` in-process, or the daemon's front-end process) tokenizes, sends an
``EngineCoreRequest``, and gets back per step one ``EngineCoreOutputs`` with the new token
ids of every sequence that moved; it detokenizes and checks stop strings itself.

The per-step outputs are msgspec Structs (hundreds of records a step: cheap to build, and
msgpack-encoded in ~0.05 ms for 512 sequences, where pickle takes milliseconds); the
commands toward the core are dataclasses, pickled (few per step, and they carry
SamplingParams whatever fields it grows).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import msgspec

from pydaemon.core.model_info import ModelInfo
from pydaemon.core.stats import EngineStats
from pydaemon.lora_request import LoRAAdapterInfo, LoRARequest
from pydaemon.outputs import RequestMetrics, TokenLogprobs
from pydaemon.sampling_params import SamplingParams


@dataclass
class EngineCoreRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: list[int]
    arrival_time: float
    priority: int = 0
    cache_salt: str = ""
    lora_request: LoRARequest | None = None  # None: the base model


class SeqOutput(msgspec.Struct, array_like=True):
    """One sequence's news in one step. For beam search (reported once, at the end) the
    whole hypotheses, ``index`` being the rank."""

    index: int
    new_token_ids: list[int]
    cumulative_logprob: float
    new_logprobs: list[TokenLogprobs] | None = None  # one entry per new token when asked
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | None = None  # the stop token id that matched


class EngineCoreOutput(msgspec.Struct, array_like=True):
    request_id: str
    seqs: list[SeqOutput]
    finished: bool = False  # no more outputs for this request
    metrics: RequestMetrics | None = None  # set when it changes (first token, finish)
    error: str | None = None  # the core failed or rejected the request
    # SamplingParams.prompt_logprobs: those of the next prompt positions (from 1, in order)
    new_prompt_logprobs: list[TokenLogprobs] | None = None


class UtilityResult(msgspec.Struct, array_like=True):
    """The answer to a ``UtilityCall``: ``result`` pickled, or the ValueError's message."""

    call_id: int
    result: bytes = b""
    error: str | None = None


class EngineCoreOutputs(msgspec.Struct, array_like=True):
    outputs: list[EngineCoreOutput] = msgspec.field(default_factory=list)
    # Below: only over the process transport (one message per step).
    rejected: list[tuple[str, str]] = msgspec.field(default_factory=list)  # (id, why) at add
    stats: EngineStats | None = None  # when asked for, and a few times a second
    fatal_error: str | None = None  # the core failed and exits after this message
    utility_results: list[UtilityResult] = msgspec.field(default_factory=list)


class LoRAEngine(Protocol):
    """What runs the LoRA control calls: EngineCore, or LLMEngine in front of it."""

    def add_lora(self, lora_request: LoRARequest) -> LoRAAdapterInfo: ...
    def remove_lora(self, lora_int_id: int) -> bool: ...
    def list_loras(self) -> list[LoRAAdapterInfo]: ...


@dataclass(frozen=True)
class AddLoRA:
    """Loads the adapter on every worker (``EngineClient.add_lora``)."""

    lora_request: LoRARequest

    def run(self, engine: LoRAEngine) -> LoRAAdapterInfo:
        return engine.add_lora(self.lora_request)


@dataclass(frozen=True)
class RemoveLoRA:
    """Unloads the adapter (``EngineClient.remove_lora``)."""

    lora_int_id: int

    def run(self, engine: LoRAEngine) -> bool:
        return engine.remove_lora(self.lora_int_id)


@dataclass(frozen=True)
class ListLoRAs:
    """The adapters in service (``EngineClient.list_loras``)."""

    def run(self, engine: LoRAEngine) -> list[LoRAAdapterInfo]:
        return engine.list_loras()


# A front end's control call to the engine core, run between two steps.
EngineCall = AddLoRA | RemoveLoRA | ListLoRAs


@dataclass
class UtilityCall:
    """Front end -> engine-core process: ``call`` between two steps; answered by a
    ``UtilityResult`` with the same ``call_id``."""

    call_id: int
    call: EngineCall


@dataclass
class CoreCommands:
    """Front end -> engine-core process: everything since the last message, batched."""

    adds: list[EngineCoreRequest] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)
    finish_seqs: list[tuple[str, int]] = field(default_factory=list)  # stop strings matched
    calls: list[UtilityCall] = field(default_factory=list)
    want_stats: bool = False
    shutdown: bool = False

    @property
    def is_empty(self) -> bool:
        has_work = self.adds or self.aborts or self.finish_seqs or self.calls or self.want_stats
        return not has_work and not self.shutdown


@dataclass
class CoreReady:
    """The engine-core process's first message once its model is loaded and warm."""

    model_info: ModelInfo
    stats: EngineStats


@dataclass
class CoreStartupFailed:
    message: str
    is_bad_setting: bool  # a ValueError: the operator's to fix, its message is enough
