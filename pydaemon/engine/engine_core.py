"""EngineCore: the scheduler, the executor and the step loop's body. Token ids only.

A step is schedule -> launch -> sample -> update (vLLM v1's shape): ``schedule()`` -> a plain
``SchedulerOutput``; ``Executor.execute_model`` launches the forward pass on every rank;
``Executor.sample_tokens`` samples it, with the grammar bitmask of its constrained rows that
the engine core (which owns the grammar matchers) fills meanwhile; ``update_from_output()`` ->
``EngineCoreOutputs``. The scheduler alone owns the block manager; the executor is the only way
to the workers (pydaemon/executor/abstract.py): every resource below it (the model, the KV
cache, LoRA slots) is reached through its calls, with plain data. Requests arrive tokenized
(``EngineCoreRequest``); detokenization and stop strings are the front end's (``LLMEngine``
in-process, or the daemon's front end over a socket). With async scheduling (on by default on
CUDA) the next step is scheduled and launched before the last one's results are processed:
pydaemon/engine/async_stepper.py; with pipeline parallelism one batch per stage is in
flight: pydaemon/engine/batch_queue.py.
"""

from __future__ import annotations

import math
import time

from pydaemon import heap_freeze
from pydaemon.config.engine import EngineConfig
from pydaemon.config.model import ModelConfig
from pydaemon.core.beam_search import BeamSearchState
from pydaemon.core.messages import EngineCoreOutputs, EngineCoreRequest
from pydaemon.core.model_info import ModelInfo
from pydaemon.core.request import Request, Sequence
from pydaemon.core.sched.scheduler import Scheduler
from pydaemon.core.sched.scheduler_output import WARMUP_REQUEST_ID
from pydaemon.core.stats import EngineStats
from pydaemon.core.stop_checker import StopChecker
from pydaemon.engine.async_stepper import AsyncStepper, launch, sample
from pydaemon.engine.batch_queue import BatchQueueStepper
from pydaemon.engine.layer_configs import runner_config, scheduler_config
from pydaemon.engine.loaded_loras import LoadedLoRAs
from pydaemon.engine.prompt_input import eos_token_ids
from pydaemon.executor.abstract import Executor
from pydaemon.executor.factory import make_executor
from pydaemon.logprobs_limit import logprobs_over_limit, resolve_max_logprobs
from pydaemon.lora_request import LoRAAdapterInfo, LoRARequest, prefix_cache_salt
from pydaemon.model_loader.model_paths import load_model_config
from pydaemon.outputs import RequestMetrics
from pydaemon.sampling_params import SamplingParams, logit_bias_out_of_vocab
from pydaemon.structured_output.manager import StructuredOutputManager

# With nothing scheduled, a step waits this long at most for a grammar compile to finish.
GRAMMAR_POLL_S = 0.05


def _cache_salt(r: EngineCoreRequest) -> str:
    """The salt the prefix cache hashes the request's blocks with. Prompt logprobs need every
    prompt position computed: a salt of its own, so that it reads no cached block (vLLM skips
    the cache for them too) and no other request reads its blocks."""
    salt = prefix_cache_salt(r.cache_salt, r.lora_request)
    if r.params.prompt_logprobs is not None:
        salt += f"\x00prompt_logprobs:{r.request_id}"
    return salt


def check_max_model_len(config: EngineConfig) -> None:
    """ValueError when ``max_model_len`` exceeds the model's own context (vLLM refuses it
    too: positions past what the model was trained on give wrong output)."""
    if config.max_model_len is None:
        return
    model_len = load_model_config(config.model).max_model_len
    if config.max_model_len > model_len:
        raise ValueError(
            f"max_model_len {config.max_model_len} is greater than the model's context "
            f"({model_len}: max_position_embeddings in config.json, or the GGUF file's "
            "context_length); give a value up to it, or leave it unset"
        )


class EngineCore:
    def __init__(self, config: EngineConfig, executor: Executor | None = None) -> None:
        """``config.model`` must be a model directory (front ends resolve "demo");
        ``executor``: the one ``config`` asks for unless given."""
        self.config = config
        if executor is None:
            check_max_model_len(config)  # before any weight is loaded
        self.executor = executor if executor is not None else make_executor(runner_config(config))
        info = self.executor.info
        self.model_config: ModelConfig = self.executor.model_config
        self.max_model_len = info.max_model_len
        self.vocab_size = info.vocab_size
        self.max_logprobs = resolve_max_logprobs(config.max_logprobs, self.vocab_size)
        if info.max_num_batched_tokens < config.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({info.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({config.max_num_seqs})"
            )
        self.scheduler_config = scheduler_config(config, info, self.model_config)
        self.scheduler = Scheduler(self.scheduler_config)
        self.structured_outputs = StructuredOutputManager(
            config.model,
            self.vocab_size,
            compile_timeout_s=config.structured_outputs_compile_timeout,
        )
        self.loras = LoadedLoRAs(
            self.executor,
            self.model_config,
            config.max_lora_rank,
            config.enable_lora,
            config.max_cpu_loras,
        )
        use_async = config.async_scheduling
        if use_async is None:  # auto: with one GPU to overlap with (TP: not measured on NCCL yet)
            use_async = info.device.startswith("cuda") and config.tensor_parallel_size == 1
        self.async_stepper: AsyncStepper | BatchQueueStepper | None = None
        if config.pipeline_parallel_size > 1:  # a batch per stage in flight, no placeholders
            self.async_stepper = BatchQueueStepper(
                self.scheduler,
                self.executor,
                self.structured_outputs,
                config.pipeline_parallel_size,
            )
        elif use_async:
            self.async_stepper = AsyncStepper(
                self.scheduler, self.executor, self.structured_outputs
            )
        heap_freeze.freeze_startup_heap()  # last: everything built so far is long-lived

    # ---- requests ---------------------------------------------------------------------------
    def add_request(self, r: EngineCoreRequest) -> None:
        """Raises ValueError (naming what is wrong) for a request that can never run."""
        self._check_fits(r)
        params = r.params
        request = Request(
            request_id=r.request_id,
            prompt_token_ids=r.prompt_token_ids,
            params=params,
            eos_token_ids=set(r.eos_token_ids),
            priority=r.priority,
            cache_salt=_cache_salt(r),
            lora_request=r.lora_request,
            metrics=RequestMetrics(arrival_time=r.arrival_time),
        )
        request.stop_checker = StopChecker(params, request.eos_token_ids)
        request.seqs.append(Sequence.new(0, r.prompt_token_ids))
        if params.is_beam_search:
            num_prompt = len(r.prompt_token_ids)
            request.beam = BeamSearchState(
                beam_width=params.beam_width,
                num_return=params.n,
                length_penalty=params.length_penalty,
                early_stopping=params.early_stopping,
                eos_token_ids=set() if params.ignore_eos else request.eos_token_ids,
                prompt_len=num_prompt,
                max_new_tokens=min(params.max_tokens, self.max_model_len - num_prompt),
                min_new_tokens=params.min_tokens,
            )
        if params.structured_outputs is not None:  # scheduled once its grammar is compiled
            self.structured_outputs.add_request(request)
            return
        self.scheduler.add_request(request)

    def _check_fits(self, r: EngineCoreRequest) -> None:
        token_ids = r.prompt_token_ids
        if not token_ids:  # vLLM's messages, which clients match on
            raise ValueError("The decoder prompt cannot be empty (prompt_token_ids is empty)")
        bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"Token id {bad[0]!r} is out of vocabulary (the prompt's ids must be in "
                f"[0, {self.vocab_size}))"
            )
        bias_ids = r.params.logit_bias or {}
        if any(t >= self.vocab_size for t in bias_ids):
            raise ValueError(logit_bias_out_of_vocab(bias_ids, self.vocab_size))
        self._check_logprobs(r.params)
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens; the model's context is "
                f"{self.max_model_len} (prompt + at least one new token must fit)"
            )
        num_blocks = self.executor.info.num_gpu_blocks
        usable = num_blocks - int(self.config.watermark * num_blocks)
        # One table per layer group (core/kv_groups.py), each holding the whole prompt at
        # admission, all from one pool: the scheduler's test (can_allocate_group) counts them all.
        groups = self.scheduler_config.kv_groups
        num_tables = 1 if groups is None else groups.num_groups
        per_table = math.ceil((len(token_ids) + 1) / self.config.block_size)
        needed = per_table * num_tables
        if needed > usable:
            tables = (
                "" if num_tables == 1 else f" ({per_table} in each of {num_tables} layer groups)"
            )
            raise ValueError(
                f"prompt needs {needed} KV blocks{tables} but the whole cache has {usable} "
                "usable blocks"
            )
        if r.lora_request is not None:
            self.loras.check_request(r.lora_request, self._lora_ids_in_use())
        params = r.params
        num_seqs = params.beam_width if params.is_beam_search else params.best_of
        if num_seqs > self.config.max_num_seqs:
            raise ValueError(
                f"the request needs {num_seqs} sequences; max_num_seqs is {self.config.max_num_seqs}"
            )

    def _check_logprobs(self, params: SamplingParams) -> None:
        """--max-logprobs bounds top-k asks; logprob_token_ids (whose count is ``logprobs``)
        are bounded by SamplingParams, and must be in the vocabulary."""
        asked_ids = params.logprob_token_ids
        sample = None if asked_ids else params.logprobs
        for kind, asked in (("sample", sample), ("prompt", params.prompt_logprobs)):
            over = asked is not None and logprobs_over_limit(kind, asked, self.max_logprobs)
            if over:
                raise ValueError(over)
        if not asked_ids:
            return
        outside = [t for t in asked_ids if t >= self.vocab_size]
        if outside:
            raise ValueError(
                f"logprob_token_ids {outside[:8]} are outside the vocabulary [0, {self.vocab_size})"
            )
        if self.config.speculative_config is not None:
            raise ValueError(
                "logprob_token_ids is not supported with speculative decoding "
                "(--speculative-config): ask for top logprobs instead"
            )

    def abort_request(self, request_id: str) -> bool:
        """Stops a request and frees its KV blocks now. False if unknown or finished."""
        found = self.structured_outputs.abort_request(request_id) or self.scheduler.abort_request(
            request_id
        )
        if found and self.loras.needs_release:
            self.loras.release_unused(self._lora_ids_in_use())
        return found

    def finish_seq(self, request_id: str, index: int) -> bool:
        """The front end matched a stop string in sequence ``index``: free it now."""
        return self.scheduler.finish_seq(request_id, index)

    def has_unfinished_requests(self) -> bool:
        """Requests to run, or a step still in flight (async scheduling)."""
        return self.structured_outputs.has_waiting() or self._has_scheduled_work()

    def _has_scheduled_work(self) -> bool:
        stepper = self.async_stepper
        return self.scheduler.has_unfinished_requests() or (
            stepper is not None and stepper.has_step_in_flight
        )

    # ---- LoRA adapters: the control path to every worker ------------------------------------
    def add_lora(self, lora_request: LoRARequest) -> LoRAAdapterInfo:
        """Loads the adapter on every rank; ValueError naming what is wrong with it."""
        return self.loras.add(lora_request, self._lora_ids_in_use())

    def remove_lora(self, lora_int_id: int) -> bool:
        """Unloads it: at once when no live request uses it, else after the last one ends."""
        return self.loras.remove(lora_int_id, self._lora_ids_in_use())

    def list_loras(self) -> list[LoRAAdapterInfo]:
        return self.loras.list()

    def _lora_ids_in_use(self) -> set[int]:
        """Adapters of the live requests (scheduled, queued, or waiting for their grammar)."""
        requests = [*self.scheduler.requests.values(), *self.structured_outputs.waiting_requests]
        return {r.lora_request.lora_int_id for r in requests if r.lora_request is not None}

    # ---- the step ---------------------------------------------------------------------------
    def step(self) -> EngineCoreOutputs:
        """The outputs of one step: under async scheduling, of the step before the one this
        call launches (pydaemon/engine/async_stepper.py). Requests whose grammar finished
        compiling join the scheduler first."""
        failed = self.structured_outputs.admit_ready(self.scheduler)
        if not self._has_scheduled_work():
            self.structured_outputs.wait(GRAMMAR_POLL_S)  # only grammars to wait for
            return EngineCoreOutputs(outputs=failed)
        outputs = self._step()
        outputs.outputs[:0] = failed
        if self.loras.needs_release:
            self.loras.release_unused(self._lora_ids_in_use())
        return outputs

    def _step(self) -> EngineCoreOutputs:
        if self.async_stepper is not None:
            return self.async_stepper.step()
        scheduler_output = self.scheduler.schedule()
        try:
            step = launch(self.executor, self.structured_outputs, scheduler_output)
            sample(self.executor, self.structured_outputs, self.scheduler, step)
            runner_output = step.runner_output.get_output()
        except BaseException:
            self.scheduler.discard(scheduler_output)  # else every later step fails on it
            raise
        return self.scheduler.update_from_output(scheduler_output, runner_output)

    # ---- life cycle and introspection -------------------------------------------------------
    def resolve_eos_token_ids(self, front_end_eos_token_ids: list[int]) -> list[int]:
        """Every id that ends a sequence: the front end's (its tokenizer and the model's JSON
        files) and the model config's (a GGUF file's metadata, say); sorted, each once."""
        return eos_token_ids(None, self.model_config, None, extra=front_end_eos_token_ids)

    def warmup(self, eos_token_ids: list[int]) -> None:
        """One tiny request end to end, so the first real request pays no start-up costs (both
        front ends run it: LLMEngine.warmup and the engine-core process before it is ready)."""
        self.add_request(
            EngineCoreRequest(
                request_id=WARMUP_REQUEST_ID,
                prompt_token_ids=[min(1, self.vocab_size - 1)] * 4,
                params=SamplingParams(temperature=0.0, max_tokens=2),
                eos_token_ids=eos_token_ids,
                arrival_time=time.monotonic(),
            )
        )
        try:
            while self.has_unfinished_requests():
                self.step()
        except BaseException:
            self.abort_request(WARMUP_REQUEST_ID)  # so that a later warm-up can run
            raise
        heap_freeze.freeze_startup_heap()  # again: what the first request's paths built

    def check_health(self) -> None:
        """Raises when a rank died (no step can run any more)."""
        self.executor.check_health()

    def shutdown(self) -> None:
        """Stops the ranks, if any (idempotent; also run at exit): after the step in flight
        (async scheduling), so that no rank frees graphs or its communicator under it. That
        step's outputs are dropped."""
        heap_freeze.thaw()
        self.structured_outputs.close()
        stepper = self.async_stepper
        try:
            if stepper is not None and not self.executor.is_failed:
                stepper.finish_in_flight()
        finally:
            self.executor.shutdown()

    def model_info(self, eos_token_ids: list[int]) -> ModelInfo:
        info = self.executor.info
        return ModelInfo(
            max_model_len=self.max_model_len,
            vocab_size=self.vocab_size,
            block_size=self.config.block_size,
            max_num_seqs=self.config.max_num_seqs,
            num_gpu_blocks=info.num_gpu_blocks,
            num_cpu_blocks=info.num_cpu_blocks,
            device=info.device,
            dtype=info.dtype,
            eos_token_ids=eos_token_ids,
            max_logprobs=self.max_logprobs,
        )

    def get_stats(self) -> EngineStats:
        return self.scheduler.make_stats(num_waiting_elsewhere=self.structured_outputs.num_waiting)
