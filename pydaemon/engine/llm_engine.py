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
from pydaemon.core.model_info import ModelInfo
from pydaemon.core.stats import EngineStats
from pydaemon.engine.engine_core import EngineCore
from pydaemon.engine.output_processor import OutputProcessor
from pydaemon.engine.prompt_input import to_core_request, tokenize_prompt
from pydaemon.engine.startup import prepare_front_end
from pydaemon.generate_request import GenerateRequest
from pydaemon.lora_request import LoRAAdapterInfo, LoRARequest
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
        """The rank-0 model runner in this process (tests and benchmarks look inside)."""
        return self.core.executor.driver_runner

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
        return self.core.executor.info.device

    @property
    def dtype(self) -> str:
        return self.core.executor.info.dtype

    def model_info(self) -> ModelInfo:
        return self.core.model_info(self.eos_token_ids)

    # ---- requests ---------------------------------------------------------------------------
    def add_request(self, request: GenerateRequest, arrival_time: float | None = None) -> None:
        """Tokenizes and hands the request to the core (ValueError naming what is wrong). A
        LoRA adapter not loaded yet is loaded first (offline use: the daemon's front ends load
        adapters explicitly, through ``add_lora``)."""
        params = request.params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        if request.request_id in self.output_processor.requests:
            raise ValueError(f"request id {request.request_id!r} is already running")
        prompt_text, token_ids = tokenize_prompt(request.prompt, self.tokenizer)
        lora = request.lora_request
        if lora is not None and not self.core.loras.is_loaded(lora):
            self.core.add_lora(lora)
        core_request = to_core_request(
            request, token_ids, self.eos_token_ids, arrival_time or time.monotonic()
        )
        self.core.add_request(core_request)
        self.output_processor.add_request(
            request.request_id,
            prompt_text,
            token_ids,
            params,
            set(self.eos_token_ids),
            RequestMetrics(arrival_time=core_request.arrival_time),  # the core's replace it
        )

    def abort_request(self, request_id: str) -> bool:
        """Stop a request and free its KV blocks now. False if it is unknown or finished."""
        self.output_processor.abort_request(request_id)
        return self.core.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    # ---- LoRA adapters ----------------------------------------------------------------------
    def add_lora(self, lora_request: LoRARequest) -> LoRAAdapterInfo:
        return self.core.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        return self.core.remove_lora(lora_int_id)

    def list_loras(self) -> list[LoRAAdapterInfo]:
        return self.core.list_loras()

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
