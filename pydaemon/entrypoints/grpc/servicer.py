"""The Generation service: validates, converts and forwards; never touches engine internals.

The streaming calls (Generate, GenerateBatched) are pydaemon/entrypoints/grpc/generate_calls.py,
the LoRA calls pydaemon/entrypoints/grpc/adapters.py; this module holds the service's options
and its unary calls (GetModelInfo, Tokenize, GetServerStatus).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from pydaemon import __version__
from pydaemon.engine.engine_client import EngineClient
from pydaemon.entrypoints.grpc.adapters import AdapterCalls
from pydaemon.entrypoints.grpc.generate_calls import GenerateCalls
from pydaemon.entrypoints.grpc.tokenize import tokenize
from pydaemon.entrypoints.grpc.validation import RequestInvalid, check_text_size
from pydaemon.proto.pagedd.v1 import generation_pb2 as pb
from pydaemon.proto.pagedd.v1 import generation_pb2_grpc as pb_grpc


@dataclass
class ServingOptions:
    max_queued_requests: int = 1024  # beyond this many unscheduled sequences: RESOURCE_EXHAUSTED
    stall_timeout_s: float = 30.0  # a client not reading this long has its requests aborted
    tool_call_parser: str | None = None  # vLLM's names; None: from the chat template
    reasoning_parser: str | None = None  # vLLM's names; None: harmony templates' own, or none
    status_timeout_s: float = 5.0  # GetServerStatus waits this long for the core's stats
    # Special-token text in chat messages parsed as control tokens (role injection): off.
    parse_special_tokens_in_chat: bool = False
    # HTTP logprobs name tokens "token_id:<id>" (vLLM's --return-tokens-as-token-ids)
    return_tokens_as_token_ids: bool = False


class GenerationServicer(GenerateCalls, AdapterCalls, pb_grpc.GenerationServicer):
    def __init__(self, options: ServingOptions, metrics=None) -> None:
        self.engine: EngineClient | None = None  # set once the model is loaded and warmed
        self.options = options
        self.metrics = metrics
        self.is_admitting = False  # True once ready, False again when draining
        self._started_at = time.monotonic()
        self.is_stalled: Callable[[], bool] = lambda: False  # the core missed its heartbeat
        self.init_streams()

    async def _require_engine(self, context) -> EngineClient:
        if self.engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the model is still loading")
        return self.engine

    async def GetModelInfo(self, request, context) -> pb.ModelInfo:
        info = (await self._require_engine(context)).model_info
        stats = self.engine.latest_stats
        return pb.ModelInfo(
            model_name=info.model_name,
            max_model_len=info.max_model_len,
            vocab_size=info.vocab_size,
            block_size=info.block_size,
            num_gpu_blocks=stats.num_gpu_blocks,
            num_cpu_blocks=stats.num_cpu_blocks,
            # The resolved device and dtype (the config may say "auto"), from the core.
            device=info.device,
            dtype=info.dtype,
            eos_token_id=info.eos_token_id,
            has_tokenizer=info.has_tokenizer,
            server_version=__version__,
            eos_token_ids=info.eos_token_ids,
            generation_defaults=pb.GenerationDefaults(**info.generation_defaults.as_dict()),
            has_chat_template=info.has_chat_template,
        )

    async def Tokenize(self, request, context) -> pb.TokenizeResponse:
        client = await self._require_engine(context)
        tokenizer = client.tokenizer
        if tokenizer is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this model has no tokenizer")
        try:
            check_text_size(request.text, client.model_info.max_model_len, "Tokenize text")
        except RequestInvalid as e:
            await context.abort(e.code, e.message)

        # Off the event loop: a long text must not stall every other stream.
        return await asyncio.get_running_loop().run_in_executor(None, tokenize, tokenizer, request)

    async def GetServerStatus(self, request, context) -> pb.ServerStatus:
        engine = await self._require_engine(context)
        try:  # a stuck core never answers: its last stats, and is_serving false
            s = await asyncio.wait_for(engine.stats(), self.options.status_timeout_s)
            is_stuck = False
        except asyncio.TimeoutError:
            s, is_stuck = engine.latest_stats, True
        if self.metrics is not None:  # counters since serving began, as /metrics counts them
            s = self.metrics.since_serving(s)
        fields = {
            name: getattr(s, name)
            for name in pb.ServerStatus.DESCRIPTOR.fields_by_name
            if hasattr(s, name) and name not in ("spec_decode", "kv_tiers")
        }
        tiers = getattr(s, "kv_tiers", None)
        if tiers is not None:  # --kv-offloading-size: the same fields, as plain data
            fields["kv_tiers"] = pb.KVTierStatus(
                **{name: getattr(tiers, name) for name in pb.KVTierStatus.DESCRIPTOR.fields_by_name}
            )
        spec = getattr(s, "spec_decode", None)
        if spec is not None:  # speculative decoding is on
            fields["spec_decode"] = pb.SpecDecodeStatus(
                num_drafts=spec.num_drafts,
                num_draft_tokens=spec.num_draft_tokens,
                num_accepted_tokens=spec.num_accepted_tokens,
                accepted_per_position=spec.accepted_per_position,
                drafts_off_at=spec.drafts_off_at,
            )
        return pb.ServerStatus(
            is_serving=(
                self.is_admitting and engine.is_alive and not is_stuck and not self.is_stalled()
            ),
            uptime_s=time.monotonic() - self._started_at,
            adapters=self.adapter_loads(s),
            **fields,
        )
