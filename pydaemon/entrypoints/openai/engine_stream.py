"""The engine requests of one HTTP request (one per prompt) as one stream of outputs.

Only the engine client's public surface is used (``GenerateClient``): ``generate``, an async
iterator of RequestOutput deltas that aborts its request when left early. Leaving this stream
early (client gone, error, drain) closes every per-prompt iterator, which aborts the engine
requests and frees their KV blocks before the engine's next step.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from pydaemon.generate_request import GenerateRequest
from pydaemon.lora_request import LoRARequest
from pydaemon.outputs import RequestOutput
from pydaemon.sampling_params import SamplingParams

_DONE = object()
# Deltas a batch may hold for a slow reader; past this its prompts wait, and the engine client
# merges their deltas meanwhile (one growing delta per prompt, bounded by max_tokens).
MAX_BUFFERED_DELTAS = 1024


@dataclass
class EnginePrompt:
    """One prompt, tokenized by the front end."""

    token_ids: list[int]
    text: str | None = None  # the prompt as text, when known (echo)


class GenerateClient(Protocol):
    """What the HTTP layer uses of the engine client (InprocEngineClient / EngineClient)."""

    def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]: ...

    @property
    def is_alive(self) -> bool: ...


class EngineRequestFailed(ValueError):
    """The engine refused or failed a request (e.g. a prompt that can never fit)."""


def engine_requests(
    request_id: str,
    prompts: list[EnginePrompt],
    params: SamplingParams | list[SamplingParams],
    cache_salt: str | None = None,
    lora_request: LoRARequest | None = None,
) -> list[GenerateRequest]:
    """One engine request per prompt: ``request_id`` (one prompt) or ``request_id-<i>``.
    ``params``: every prompt's, or one per prompt (a chat batch: each conversation has its own
    max_tokens and reasoning state)."""
    per_prompt = params if isinstance(params, list) else [params] * len(prompts)
    if len(prompts) == 1:
        return [
            GenerateRequest(
                request_id, prompts[0].token_ids, per_prompt[0], 0, cache_salt, lora_request
            )
        ]
    return [
        GenerateRequest(f"{request_id}-{i}", p.token_ids, sp, 0, cache_salt, lora_request)
        for i, (p, sp) in enumerate(zip(prompts, per_prompt, strict=True))
    ]


async def _one(engine: GenerateClient, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
    async for output in engine.generate(request):
        if output.error is not None:
            raise EngineRequestFailed(output.error)
        yield output


async def generate_all(
    engine: GenerateClient, requests: list[GenerateRequest]
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Yields (request index, delta) until every request finished."""
    if len(requests) == 1:
        async with contextlib.aclosing(_one(engine, requests[0])) as outputs:
            async for output in outputs:
                yield 0, output
        return
    queue: asyncio.Queue = asyncio.Queue()
    has_room = asyncio.Event()
    has_room.set()

    async def pump(i: int) -> None:
        try:
            async for output in _one(engine, requests[i]):
                queue.put_nowait((i, output))
                if queue.qsize() >= MAX_BUFFERED_DELTAS:
                    has_room.clear()
                    await has_room.wait()
        except Exception as e:  # noqa: BLE001 - re-raised in the consumer
            queue.put_nowait(e)
        finally:
            queue.put_nowait(_DONE)

    tasks = [asyncio.create_task(pump(i)) for i in range(len(requests))]
    try:
        num_running = len(tasks)
        while num_running:
            item = await queue.get()
            if queue.qsize() < MAX_BUFFERED_DELTAS:
                has_room.set()
            if item is _DONE:
                num_running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()  # aborts the engine requests still running
        await asyncio.gather(*tasks, return_exceptions=True)
