"""What every OpenAI endpoint shares: the engine client, the tokenizer, the served model, the
admission rules (503 not serving, 404 unknown model, 429 queue full), tokenization with the
context-length check, the live requests (for the drain) and the latency metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from pydaemon.config.generation import GenerationDefaults
from pydaemon.entrypoints.common.limits import (
    EMPTY_PROMPT,
    EMPTY_TEXT_PROMPT,
    check_text_size,
    check_texts_size,
    iter_strings,
)
from pydaemon.entrypoints.common.lora_adapters import AdapterNotFound, LoRAAdapters
from pydaemon.entrypoints.common.metrics import Metrics
from pydaemon.entrypoints.common.request_phases import request_phases
from pydaemon.entrypoints.common.tool_choice import ToolsNotRendered, encode_chat_with_tools
from pydaemon.entrypoints.openai.accumulator import Accumulator
from pydaemon.entrypoints.openai.engine_stream import GenerateClient
from pydaemon.entrypoints.openai.errors import ApiError, bad_request
from pydaemon.entrypoints.openai.request_fields import InvalidParam
from pydaemon.logprobs_limit import DEFAULT_MAX_LOGPROBS
from pydaemon.lora_request import LoRARequest


@dataclass(frozen=True)
class ServedModel:
    name: str  # what clients put in "model"
    max_model_len: int  # prompt + output tokens
    vocab_size: int
    # generation_config.json's sampling defaults, for the fields a request leaves unset
    generation_defaults: GenerationDefaults = field(default_factory=GenerationDefaults)
    created: int = field(default_factory=lambda: int(time.time()))
    aliases: tuple[str, ...] = ()  # more names of the base model (--served-model-name)
    max_logprobs: int = DEFAULT_MAX_LOGPROBS  # --max-logprobs in force (-1 resolved)

    def is_named(self, name: str) -> bool:
        return name == self.name or name in self.aliases


@dataclass
class HttpOptions:
    host: str = "127.0.0.1"
    port: int = 8000  # 0: any free port (see HttpServer.port)
    api_key: str | None = None
    metrics_auth: bool = True  # with api_key: /metrics requires it too
    tls_cert: str | None = None  # PEM files: serve HTTPS (the same pair as gRPC's TLS)
    tls_key: str | None = None
    max_queued_requests: int = 1024  # beyond this many unscheduled sequences: 429
    stall_timeout_s: float = 30.0  # a streaming client not reading this long is dropped
    # An idle connection, or one whose request head or body stops arriving, is closed after
    # this long (a slow-loris client must not hold a file descriptor for ever).
    idle_timeout_s: float = 15.0
    # Special-token text in chat messages parsed as control tokens (role injection): off.
    parse_special_tokens_in_chat: bool = False
    max_body_bytes: int = 16 * 1024 * 1024
    tool_call_parser: str | None = None  # vLLM's names; None: the chat template's syntax
    reasoning_parser: str | None = None  # vLLM's names; None: harmony templates' own, or none
    root_path: str | None = None  # vLLM's --root-path: the routes are also served under it
    return_tokens_as_token_ids: bool = False  # logprobs' tokens as "token_id:<id>" by default
    enable_tokenizer_info_endpoint: bool = False  # vLLM's flag: serve GET /tokenizer_info


@dataclass(eq=False)
class LiveRequest:
    task: asyncio.Task
    is_aborted_by_server: bool = False  # cancelled by the drain, not by the client leaving
    is_failed: bool = False  # answered with an error (not counted as a finished request)
    has_output: bool = False  # the engine has answered it at least once
    failure: ApiError | None = None  # cancelled to be answered with this error


def engine_stalled() -> ApiError:
    return ApiError(
        503,
        "the engine core has stopped making progress (no step or heartbeat within the "
        "stall timeout): retry later or on another replica",
        code="engine_stalled",
    )


class OpenAIServing:
    """``engine``: the engine client; ``tokenizer``: the model's (``encode``, ``decode``,
    ``apply_chat_template``), or None; ``metrics``: the daemon's Prometheus registry;
    ``num_queued``: requests posted to the engine and not yet scheduled (from every front
    end), for admission control; ``is_stalled``: the engine core has missed its heartbeat
    (``/health`` answers 503)."""

    def __init__(
        self,
        engine: GenerateClient,
        tokenizer: Any,
        model: ServedModel,
        options: HttpOptions,
        metrics: Metrics | None = None,
        num_queued: Callable[[], int] | None = None,
        is_stalled: Callable[[], bool] | None = None,
        adapters: LoRAAdapters | None = None,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.model = model
        self.options = options
        self.metrics = metrics
        self.num_queued = num_queued or (lambda: 0)
        self.is_stalled = is_stalled or (lambda: False)  # the engine core missed its heartbeat
        self.adapters = adapters or LoRAAdapters(model.name, engine=None, is_enabled=False)
        self.is_admitting = True
        self.live: set[LiveRequest] = set()

    @property
    def is_serving(self) -> bool:
        return self.is_admitting and self.engine is not None and self.engine.is_alive

    def close(self) -> None:
        """Drops the engine, tokenizer and metrics once the server has stopped: aiohttp keeps
        the handlers (and so this object) in a module-level cache for the process's life."""
        self.is_admitting = False
        self.engine = self.tokenizer = self.metrics = None
        self.num_queued = lambda: 0

    def admit(self, model_name: str, num_sequences: int = 1) -> LoRARequest | None:
        """Checks that the request may be served now -> the LoRA adapter its ``model`` names,
        or None for the base model. ``num_sequences``: what the request adds to the queue
        (prompts x best_of)."""
        if not self.is_serving:
            raise ApiError(
                503, "the server is not serving (draining or failed)", code="not_serving"
            )
        if self.is_stalled():  # fail fast: the request would wait for a core that is not moving
            raise engine_stalled()
        lora_request = self.resolve_model(model_name)
        num_queued = self.num_queued()
        limit = self.options.max_queued_requests
        if num_queued + num_sequences > limit:
            raise ApiError(
                429,
                f"{num_queued} sequences are queued and this request adds {num_sequences} "
                f"(prompts x n); --max-queued-requests is {limit}: retry later"
                + ("" if num_sequences <= limit else ", with fewer prompts or a smaller n"),
                code="queue_full",
            )
        return lora_request

    def resolve_model(self, model_name: str) -> LoRARequest | None:
        """The adapter ``model_name`` names, None for the base model (one of its names);
        404 for anything else."""
        if self.model.is_named(model_name):
            return None
        try:
            return self.adapters.get(model_name)
        except AdapterNotFound:
            raise ApiError(
                404,
                f"model {model_name!r} does not exist; this server serves "
                f"{self.model.name!r}" + self.adapters.names_hint(),
                param="model",
                code="model_not_found",
            ) from None

    def model_name(self, lora_request: LoRARequest | None) -> str:
        """The ``model`` a response names: the adapter's, or the base model's."""
        return self.model.name if lora_request is None else lora_request.lora_name

    async def read_body(self, request: web.Request) -> bytes:
        """The request body, which must arrive within the idle timeout (else 408, and the
        connection is closed: aiohttp would otherwise linger reading the rest); it must be JSON,
        by its Content-Type when it has one (415 otherwise)."""
        content_type = request.content_type
        is_json = content_type == "application/json" or content_type.endswith("+json")
        if "Content-Type" in request.headers and not is_json:
            raise ApiError(415, f"Content-Type must be application/json (got {content_type!r})")
        try:
            return await asyncio.wait_for(request.read(), self.options.idle_timeout_s)
        except asyncio.TimeoutError:
            request.protocol.force_close()
            raise ApiError(
                408, f"the request body did not arrive within {self.options.idle_timeout_s} s"
            ) from None

    # ---- prompts -----------------------------------------------------------------------

    async def encode(self, text: str, *, add_bos: bool, param: str) -> list[int]:
        """Token ids of a prompt, tokenized off the event loop (a long prompt takes ms); a text
        too long to fit is refused before tokenizing (it would take seconds)."""
        if self.tokenizer is None:
            raise bad_request("this model has no tokenizer: send the prompt as token ids", param)
        if not text:
            raise bad_request(
                EMPTY_TEXT_PROMPT if param == "prompt" else f"{EMPTY_PROMPT} ({param} is empty)",
                param,
            )
        check_text_size(text, self.model.max_model_len, param)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, self.tokenizer.encode, text, add_bos)

    async def encode_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list | None,
        add_generation_prompt: bool,
        chat_template_kwargs: dict[str, Any] | None,
        continue_final_message: bool = False,
        must_render_tools: bool = False,
        param: str = "messages",
    ) -> list[int]:
        """Token ids of a conversation rendered by the chat template. Its size is checked first;
        rendering and tokenizing run off the event loop (a big conversation takes seconds).
        ``must_render_tools`` (tool_choice auto): a 400 naming ``tools`` when the template
        leaves them out. ``param``: the field errors name (``messages.<i>`` in a batch)."""
        if self.tokenizer is None:
            raise bad_request("this model has no tokenizer, so no chat template", param)
        check_texts_size(list(iter_strings((messages, tools))), self.model.max_model_len, param)
        loop = asyncio.get_running_loop()
        encode = functools.partial(
            encode_chat_with_tools,
            self.tokenizer,
            messages,
            add_generation_prompt,
            tools,
            must_render_tools=must_render_tools,
            chat_template_kwargs=chat_template_kwargs,
            parse_special_tokens_in_content=self.options.parse_special_tokens_in_chat,
            continue_final_message=continue_final_message,
        )
        try:
            _, ids = await loop.run_in_executor(None, encode)
        except ToolsNotRendered as e:
            raise bad_request(str(e), "tools") from None
        except ValueError as e:  # no template, or the template refused the messages
            raise bad_request(f"cannot apply the chat template: {e}", param) from None
        return ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def resolve_max_tokens(
        self,
        num_prompt_tokens: int,
        max_tokens: int | None,
        *,
        prompt_param: str,
        max_tokens_param: str,
    ) -> int:
        """``max_tokens`` checked against the context (None: all of what is left); errors
        name the request field (``prompt_param``, ``max_tokens_param``)."""
        room = self.model.max_model_len - num_prompt_tokens
        if room < 1:
            raise bad_request(
                f"the prompt has {num_prompt_tokens} tokens; this model's maximum context "
                f"length is {self.model.max_model_len}, which leaves no room for output",
                prompt_param,
            )
        if max_tokens is None:
            return room
        if max_tokens < 1:
            raise InvalidParam(
                f"{max_tokens_param} must be a positive integer (got {max_tokens})",
                max_tokens_param,
            )
        if max_tokens > room:
            raise bad_request(
                f"this model's maximum context length is {self.model.max_model_len} tokens; "
                f"you requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in "
                f"the prompt, {max_tokens} for the output)",
                max_tokens_param,
            )
        return max_tokens

    # ---- live requests -----------------------------------------------------------------

    @contextlib.contextmanager
    def track(self) -> Iterator[LiveRequest]:
        live = LiveRequest(asyncio.current_task())
        self.live.add(live)
        try:
            yield live
        finally:
            self.live.discard(live)

    def abort_all(self) -> None:
        """Ends every live request (drain past its grace period); each answers "abort"."""
        for live in list(self.live):
            live.is_aborted_by_server = True
            live.task.cancel()

    def fail_waiting(self) -> int:
        """The engine core stalled: every live request with no output yet answers 503 now.
        -> how many."""
        waiting = [live for live in self.live if not live.has_output and live.failure is None]
        for live in waiting:
            live.failure = engine_stalled()
            live.task.cancel()
        return len(waiting)

    def observe(self, acc: Accumulator, cancel_reason: str | None = None) -> None:
        """Feeds the latency histograms, once per engine request."""
        if self.metrics is None:
            return
        now = time.monotonic()
        for i, prompt in enumerate(acc.prompts):
            m = prompt.metrics
            arrival = m.arrival_time if m is not None else prompt.arrival_time
            end = m.finished_time if m is not None and m.finished_time else now
            ttft = None
            if m is not None and m.first_token_time is not None:
                ttft = m.first_token_time - arrival
            longest = acc.longest_output(i)
            tpot = None
            if prompt.is_finished and ttft is not None and longest > 1:
                tpot = (end - m.first_token_time) / (longest - 1)
            if prompt.is_finished:
                reason = acc.choices[i * acc.n].finish_reason or "stop"
            else:
                reason = cancel_reason or "cancelled"
            queue = None
            if m is not None and m.first_scheduled_time is not None:
                queue = m.first_scheduled_time - arrival
            choices = acc.choices[i * acc.n : (i + 1) * acc.n]
            self.metrics.observe(
                "aborted" if reason == "abort" else reason,
                ttft_s=ttft,
                tpot_s=tpot,
                e2e_s=end - arrival,
                queue_s=queue,
                num_prompt_tokens=prompt.num_prompt_tokens,
                num_generation_tokens=sum(len(c.token_ids) for c in choices),
                num_intervals=max(longest - 1, 0),
                phases=request_phases(m),
                n=acc.n,
                max_tokens=acc.max_tokens[i]
                if isinstance(acc.max_tokens, list)
                else acc.max_tokens,
            )
