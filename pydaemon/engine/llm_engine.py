"""LLMEngine: an in-process front end over an EngineCore (``LLM`` and tests use it).

It does what the daemon's front-end process does, in the caller's thread: tokenizes prompts,
hands the core token ids, and turns the core's per-step token ids into RequestOutputs
(incremental detokenization, stop strings, streaming deltas). Not thread-safe: one thread
drives it.
"""

from __future__ import annotations

import time

from pydaemon import _core
from pydaemon.config.engine import EngineConfig
from pydaemon.core.messages import EngineCoreRequest
from pydaemon.core.model_info import ModelInfo
from pydaemon.core.stats import EngineStats
from pydaemon.engine.engine_core import EngineCore
from pydaemon.engine.output_processor import OutputProcessor
from pydaemon.engine.prompt_input import tokenize_prompt
from pydaemon.engine.startup import prepare_front_end
from pydaemon.lora_request import LoRARequest
from pydaemon.outputs import RequestMetrics, RequestOutput
from pydaemon.sampling_params import SamplingParams


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        front = prepare_front_end(config)
        self.model_name = front.model_name
        self.generation_defaults = front.generation_defaults
        self.core = EngineCore(front.core_config)
        self.tokenizer = front.tokenizer
        self.max_model_len = self.core.max_model_len
        self.vocab_size = self.core.vocab_size
        self.eos_token_ids = self.core.resolve_eos_token_ids(front.eos_token_ids)
        self.output_processor = OutputProcessor(self.tokenizer, self.max_model_len)
        self.peak_used_blocks = 0

    # The core's pieces, for tests and benchmarks that look inside.
    @property
    def block_manager(self) -> _core.BlockManager:
        return self.core.scheduler.block_manager

    @property
    def scheduler(self):
        return self.core.scheduler

    @property
    def runner(self):
        return self.core.runner

    @property
    def model_config(self):
        return self.core.model_config

    @property
    def requests(self):
        return self.core.scheduler.requests

    @property
    def num_prompt_tokens(self) -> int:
        return self.core.scheduler.updater.num_prompt_tokens

    @property
    def device(self) -> str:
        return str(self.core.runner.device)

    @property
    def dtype(self) -> str:
        return str(self.core.runner.dtype).removeprefix("torch.")

    def model_info(self) -> ModelInfo:
        return self.core.model_info(self.eos_token_ids)

    # ---- requests ---------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
        arrival_time: float | None = None,
    ) -> None:
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        if request_id in self.output_processor.requests:
            raise ValueError(f"request id {request_id!r} is already running")
        prompt_text, token_ids = tokenize_prompt(prompt, self.tokenizer)
        request = EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=token_ids,
            params=params,
            eos_token_ids=self.eos_token_ids,
            arrival_time=arrival_time or time.monotonic(),
            priority=priority,
            cache_salt=cache_salt or "",
            lora_request=lora_request,
        )
        self.core.add_request(request)
        self.output_processor.add_request(
            request_id,
            prompt_text,
            token_ids,
            params,
            set(self.eos_token_ids),
            RequestMetrics(arrival_time=request.arrival_time),  # the core's replace it
        )

    def abort_request(self, request_id: str) -> bool:
        """Stop a request and free its KV blocks now. False if it is unknown or finished."""
        self.output_processor.abort_request(request_id)
        return self.core.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    # ---- the step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs, stopped = self.output_processor.process(self.core.step())
        for request_id, index in stopped:  # a stop string matched: free the sequence now
            self.core.finish_seq(request_id, index)
        used = self.core.scheduler.blocks.num_used_gpu_blocks()
        self.peak_used_blocks = max(self.peak_used_blocks, used)
        return outputs

    # ---- life cycle -------------------------------------------------------------------------
    def check_health(self) -> None:
        self.core.check_health()

    def shutdown(self) -> None:
        self.core.shutdown()

    def get_stats(self) -> EngineStats:
        return self.core.get_stats()

    def warmup(self) -> None:
        """One tiny request through the core, so the first real request pays no start-up costs
        (EngineCore.warmup: the same warm-up the daemon's engine-core process runs)."""
        self.core.warmup(self.eos_token_ids)
