"""EngineCore: the scheduler, the model executor and the step loop's body. Token ids only.

A step is three calls (vLLM v1's shape): ``schedule()`` -> a plain ``SchedulerOutput``;
``execute_model()`` -> a ``ModelRunnerOutput`` (sampled on the device, one copy back);
``update_from_output()`` -> ``EngineCoreOutputs``. The scheduler alone owns the block
manager; the runner (every tensor-parallel rank) builds its inputs from the SchedulerOutput.
Requests arrive tokenized (``EngineCoreRequest``); detokenization and stop strings are the
front end's (``LLMEngine`` in-process, or the daemon's front end over a socket). With
async scheduling (on by default on CUDA) the next step is scheduled and launched before the
last one's results are processed: pydaemon.core.sched.async_stepper.
"""

from __future__ import annotations

import math
import time

from pydaemon import heap_freeze
from pydaemon.config.engine import EngineConfig
from pydaemon.config.lora import check_lora_fits_model, read_lora_config
from pydaemon.config.model import ModelConfig
from pydaemon.core.beam_search import BeamSearchState
from pydaemon.core.messages import EngineCoreOutputs, EngineCoreRequest
from pydaemon.core.model_info import ModelInfo
from pydaemon.core.request import Request, Sequence
from pydaemon.core.sched.async_stepper import AsyncStepper
from pydaemon.core.sched.lora_budget import LoRABudget
from pydaemon.core.sched.scheduler import Scheduler
from pydaemon.core.sched.scheduler_output import WARMUP_REQUEST_ID
from pydaemon.core.stats import EngineStats
from pydaemon.core.stop_checker import StopChecker
from pydaemon.engine.prompt_input import eos_token_ids
from pydaemon.engine.structured_outputs import StructuredOutputManager
from pydaemon.lora_request import LoRARequest, prefix_cache_salt
from pydaemon.outputs import RequestMetrics
from pydaemon.sampling_params import SamplingParams
from pydaemon.worker.model_runner import ModelRunner

# With nothing scheduled, a step waits this long at most for a grammar compile to finish.
GRAMMAR_POLL_S = 0.05


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        """``config.model`` must be a model directory (front ends resolve "demo")."""
        self.config = config
        if config.tensor_parallel_size > 1:
            from pydaemon.worker.tp_executor import TensorParallelExecutor

            self.executor = TensorParallelExecutor(config)
            self.runner = self.executor.runner  # rank 0's
        else:
            self.runner = ModelRunner(config)
            self.executor = self.runner
        runner = self.runner
        self.model_config: ModelConfig = runner.model_config
        self.max_model_len = runner.max_model_len
        self.vocab_size = runner.vocab_size
        if runner.max_num_batched_tokens < config.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({runner.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({config.max_num_seqs})"
            )
        self.scheduler = Scheduler(
            block_size=config.block_size,
            num_gpu_blocks=runner.num_gpu_blocks,
            num_cpu_blocks=runner.num_cpu_blocks,
            watermark=config.watermark,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=runner.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            preemption_mode=config.preemption_mode,
            enable_prefix_caching=config.enable_prefix_caching,
            speculative=config.speculative,
            max_loras=config.max_loras if config.enable_lora else None,
        )
        use_async = config.async_scheduling
        if use_async is None:  # auto: with one GPU to overlap with (TP: not measured on NCCL yet)
            use_async = runner.device.type == "cuda" and config.tensor_parallel_size == 1
        self.async_stepper = AsyncStepper(self.scheduler, self.executor) if use_async else None
        self._checked_lora_ids: set[int] = set()
        self.structured_outputs = StructuredOutputManager(config.model, runner)
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
            cache_salt=prefix_cache_salt(r.cache_salt, r.lora_request),
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
        if not token_ids:
            raise ValueError("prompt_token_ids is empty")
        bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"prompt token id {bad[0]!r} is outside the vocabulary [0, {self.vocab_size})"
            )
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens; the model's context is "
                f"{self.max_model_len} (prompt + at least one new token must fit)"
            )
        num_blocks = self.runner.num_gpu_blocks
        usable = num_blocks - int(self.config.watermark * num_blocks)
        needed = math.ceil((len(token_ids) + 1) / self.config.block_size)
        if needed > usable:
            raise ValueError(
                f"prompt needs {needed} KV blocks but the whole cache has {usable} usable blocks"
            )
        if r.lora_request is not None:
            self._check_lora(r.lora_request)
        params = r.params
        num_seqs = params.beam_width if params.is_beam_search else params.best_of
        if num_seqs > self.config.max_num_seqs:
            raise ValueError(
                f"the request needs {num_seqs} sequences; max_num_seqs is {self.config.max_num_seqs}"
            )

    def _check_lora(self, lora: LoRARequest) -> None:
        """The adapter's files fit this model (read once per adapter id: its header only)."""
        if not self.config.enable_lora:
            raise ValueError(
                f"the request asks for LoRA adapter {lora.lora_name!r} but LoRA is not enabled "
                "(EngineConfig.enable_lora)"
            )
        if lora.lora_int_id not in self._checked_lora_ids:
            adapter = read_lora_config(lora.lora_path, self.config.max_lora_rank)
            check_lora_fits_model(adapter, self.model_config)
            self._checked_lora_ids.add(lora.lora_int_id)

    def abort_request(self, request_id: str) -> bool:
        """Stops a request and frees its KV blocks now. False if unknown or finished."""
        return self.structured_outputs.abort_request(request_id) or self.scheduler.abort_request(
            request_id
        )

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

    # ---- the step ---------------------------------------------------------------------------
    def step(self) -> EngineCoreOutputs:
        """The outputs of one step: under async scheduling, of the step before the one this
        call launches (pydaemon.core.sched.async_stepper). Requests whose grammar finished
        compiling join the scheduler first."""
        failed = self.structured_outputs.admit_ready(self.scheduler)
        if not self._has_scheduled_work():
            self.structured_outputs.wait(GRAMMAR_POLL_S)  # only grammars to wait for
            return EngineCoreOutputs(outputs=failed)
        outputs = self._step()
        outputs.outputs[:0] = failed
        return outputs

    def _step(self) -> EngineCoreOutputs:
        if self.async_stepper is not None:
            return self.async_stepper.step()
        scheduler_output = self.scheduler.schedule()
        try:
            runner_output = self.executor.execute_model(scheduler_output)
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
        """Raises when a tensor-parallel worker died (no step can run any more)."""
        if self.executor is not self.runner:
            self.executor.check_health()

    def shutdown(self) -> None:
        """Stops the tensor-parallel workers, if any (idempotent; also run at exit): after the
        step in flight (async scheduling), so that no rank frees graphs or its communicator
        under it. That step's outputs are dropped."""
        heap_freeze.thaw()
        if self.executor is not self.runner:
            stepper = self.async_stepper
            try:
                if stepper is not None and self.executor.failure is None:
                    stepper.finish_in_flight()
            finally:
                self.executor.shutdown()

    def model_info(self, eos_token_ids: list[int]) -> ModelInfo:
        return ModelInfo(
            max_model_len=self.max_model_len,
            vocab_size=self.vocab_size,
            block_size=self.config.block_size,
            max_num_seqs=self.config.max_num_seqs,
            num_gpu_blocks=self.runner.num_gpu_blocks,
            num_cpu_blocks=self.runner.num_cpu_blocks,
            device=str(self.runner.device),
            dtype=str(self.runner.dtype).removeprefix("torch."),
            eos_token_ids=eos_token_ids,
        )

    def get_stats(self) -> EngineStats:
        sched = self.scheduler
        kv = sched.kv_cache_stats()
        return EngineStats(
            num_running=len(sched.running),
            num_waiting=len(sched.waiting) + self.structured_outputs.num_waiting,
            num_swapped=len(sched.swapped),
            num_gpu_blocks=kv.num_gpu_blocks,
            num_free_gpu_blocks=kv.num_free_gpu_blocks,
            num_cpu_blocks=kv.num_cpu_blocks,
            num_free_cpu_blocks=kv.num_free_cpu_blocks,
            kv_waste_slots=kv.kv_waste_slots,
            num_shared_blocks=kv.num_shared_blocks,
            prefix_cache_query_tokens=kv.prefix_cache_query_tokens,
            prefix_cache_hit_tokens=kv.prefix_cache_hit_tokens,
            num_preemptions=sched.stats.num_preemptions,
            num_swapped_out_blocks=sched.stats.num_swapped_out_blocks,
            num_swapped_in_blocks=sched.stats.num_swapped_in_blocks,
            num_prompt_tokens=sched.updater.num_prompt_tokens,
            num_generation_tokens=sched.updater.num_generation_tokens,
            spec_decode=sched.updater.spec_stats.snapshot(sched.drafts.governor.drafts_off_at())
            if sched.drafts
            else None,
            lora_requests=LoRABudget.count_by_adapter(sched.running, sched.waiting + sched.swapped)
            if sched.loras.max_loras
            else {},
            max_loras=sched.loras.max_loras or 0,
        )
