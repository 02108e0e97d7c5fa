"""EngineClient: the one interface between a server (gRPC, HTTP) and the engine.

Implementations: ``pydaemon.engine.mp_client.MPEngineClient`` (the engine core in its own
process: what ``pagedd serve`` runs) and ``pydaemon.engine.inproc_client.InprocEngineClient`` (an engine
stepped by a thread of this process: tests, embedding). A server imports this module only.

Surface (InprocEngineClient's, so code written against it moves over unchanged):

- ``start()``: bind to the running event loop and begin serving (call once, on the loop).
- ``async generate(request: GenerateRequest)``: an async iterator of RequestOutput deltas
  until the finished one. Raises ValueError for bad input and EngineDeadError once the engine
  is gone; leaving the iteration early aborts.
- ``abort(request_id)``: the request's blocks are freed before the engine's next step.
- ``async add_lora(lora_request)`` -> LoRAAdapterInfo, ``async remove_lora(lora_int_id)``,
  ``async list_loras()``: the one control path of LoRA adapters, down to every worker (vLLM's
  names). ``add_lora`` reads and checks the adapter once, in the engine core, and every worker
  keeps its validated weights until ``remove_lora`` (deferred while requests use it).
- ``async stats()`` -> a fresh EngineStats; ``latest_stats``: the last one seen.
- ``is_alive``, ``seconds_since_progress()`` (for the watchdog), ``error``.
- ``model_info`` (ServedModelInfo: the real device and dtype), ``tokenizer`` (or None).
- ``num_unscheduled``: sequences (``num_sequences`` of each request) posted that have no
  output yet: what admission control counts, so one request of many sequences counts as many.
- ``async shutdown()``: aborts what is live and stops the engine.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from pydaemon.config.generation import GenerationDefaults
from pydaemon.core.messages import AddLoRA, EngineCall, ListLoRAs, RemoveLoRA
from pydaemon.generate_request import GenerateRequest
from pydaemon.logprobs_limit import DEFAULT_MAX_LOGPROBS
from pydaemon.lora_request import LoRAAdapterInfo, LoRARequest
from pydaemon.outputs import RequestOutput
from pydaemon.sampling_params import SamplingParams

# While idle the engine still reports this often, to show the watchdog it is alive.
IDLE_HEARTBEAT_S = 0.5


class EngineDeadError(RuntimeError):
    """The engine failed; no request can be served any more."""


class EngineCoreDiedError(EngineDeadError):
    """The engine-core process is gone (killed or crashed): streams end UNAVAILABLE."""


@dataclass
class ServedModelInfo:
    model_name: str
    max_model_len: int
    vocab_size: int
    block_size: int
    device: str  # the real one ("cuda:0", "cpu"), never "auto"
    dtype: str  # "bfloat16", ...
    eos_token_id: int  # -1 when none
    has_tokenizer: bool
    eos_token_ids: list[int] = field(default_factory=list)  # every id that ends a sequence
    # generation_config.json's sampling defaults, applied to fields a request leaves unset
    generation_defaults: GenerationDefaults = field(default_factory=GenerationDefaults)
    has_chat_template: bool = False
    max_logprobs: int = DEFAULT_MAX_LOGPROBS  # --max-logprobs in force (-1 resolved)
    # The KV cache's settings under vLLM's names (config/cache_info.py): cache_config_info
    cache_config: dict[str, str] = field(default_factory=dict)


class EngineClient(abc.ABC):
    error: BaseException | None = None
    latest_stats: Any = None
    num_unscheduled: int = 0
    model_info: ServedModelInfo
    tokenizer: Any = None

    @abc.abstractmethod
    def start(self) -> None: ...

    @abc.abstractmethod
    def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]: ...

    @abc.abstractmethod
    def abort(self, request_id: str) -> None: ...

    async def add_lora(self, lora_request: LoRARequest) -> LoRAAdapterInfo:
        """Loads the adapter on every worker (ValueError naming what is wrong with it)."""
        return await self._call(AddLoRA(lora_request))

    async def remove_lora(self, lora_int_id: int) -> bool:
        """Unloads the adapter: at once if no request uses it, else when the last one ends
        (new requests naming it are refused meanwhile). False if it is not loaded."""
        return await self._call(RemoveLoRA(lora_int_id))

    async def list_loras(self) -> list[LoRAAdapterInfo]:
        """The loaded adapters, in load order (those being unloaded excluded)."""
        return await self._call(ListLoRAs())

    @abc.abstractmethod
    async def _call(self, call: EngineCall) -> Any:
        """Runs ``call`` in the engine, between two steps; its ValueError is raised here."""

    @abc.abstractmethod
    async def stats(self) -> Any: ...

    @property
    @abc.abstractmethod
    def is_alive(self) -> bool: ...

    @abc.abstractmethod
    def seconds_since_progress(self) -> float: ...

    @abc.abstractmethod
    async def shutdown(self) -> None: ...


def num_sequences(params: SamplingParams) -> int:
    """Sequences one request runs at once (best_of, or the beam width)."""
    return params.beam_width if params.is_beam_search else params.best_of


def merge_deltas(first: RequestOutput, later: RequestOutput) -> RequestOutput:
    """Fold a later delta of the same request into an earlier one (a slow reader gets fewer,
    larger messages instead of a growing backlog)."""
    by_index = {o.index: o for o in first.outputs}
    for part in later.outputs:
        acc = by_index.get(part.index)
        if acc is None:
            by_index[part.index] = part
            continue
        acc.token_ids = acc.token_ids + part.token_ids
        acc.text += part.text
        if part.logprobs is not None:
            acc.logprobs = (acc.logprobs or []) + part.logprobs
        acc.finish_reason = part.finish_reason
        acc.stop_reason = part.stop_reason
        acc.cumulative_logprob = part.cumulative_logprob
    if later.prompt_logprobs:
        first.prompt_logprobs = (first.prompt_logprobs or []) + later.prompt_logprobs
    first.outputs = [by_index[i] for i in sorted(by_index)]
    first.finished = later.finished
    first.metrics = later.metrics
    first.error = later.error
    return first


async def stream_request(
    queue: asyncio.Queue, on_first: Callable[[], None], on_abandon: Callable[[], None]
) -> AsyncIterator[RequestOutput]:
    """Yields one request's outputs from its queue (RequestOutputs, or an exception to raise),
    merging deltas that queued up while the reader was busy. ``on_first`` runs when the first
    item arrives; ``on_abandon`` when the caller leaves before the finished output."""
    is_finished = False
    is_first = True
    try:
        while True:
            item = await queue.get()
            if is_first:
                is_first = False
                on_first()
            if isinstance(item, BaseException):
                is_finished = True
                raise item
            while not item.finished and not queue.empty():
                later = queue.get_nowait()
                if isinstance(later, BaseException):
                    is_finished = True
                    raise later
                item = merge_deltas(item, later)
            is_finished = item.finished
            yield item
            if is_finished:
                return
    finally:
        if is_first:
            on_first()
        if not is_finished:
            on_abandon()
