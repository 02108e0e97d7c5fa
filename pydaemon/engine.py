"""LLMEngine: add requests, step, get outputs. Not thread-safe: one thread drives it.

A step is: schedule (policy, blocks) -> run the model on the scheduled tokens -> sample ->
append tokens, check stops, free finished sequences -> output deltas.
"""

from __future__ import annotations

import logging
import math
import time

from pydaemon import _core
from pydaemon.config import EngineConfig
from pydaemon.engine_stats import EngineStats, resolve_model_dir
from pydaemon.generation_config import GenerationDefaults
from pydaemon.model_runner import ModelRunner, SampleRow
from pydaemon.output_processor import OutputProcessor
from pydaemon.outputs import RequestMetrics, RequestOutput
from pydaemon.request import Request, RequestStatus, Sequence
from pydaemon.sampling import make_generator
from pydaemon.sampling_params import SamplingParams
from pydaemon.scheduler import ScheduledSeq, Scheduler
from pydaemon.tokenizer import load_tokenizer
from pydaemon.tokenizer_files import model_eos_token_ids

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        model_dir = resolve_model_dir(config.model)
        self.model_name = "demo" if config.model == "demo" else model_dir.name
        runner_config = config.__class__(**{**config.__dict__, "model": str(model_dir)})
        self.tp_executor = None  # TensorParallelExecutor when tensor_parallel_size > 1
        if config.tensor_parallel_size > 1:
            from pydaemon.distributed.executor import TensorParallelExecutor

            self.tp_executor = TensorParallelExecutor(runner_config)
            self.runner = self.tp_executor.runner  # rank 0's: samples from the gathered logits
        else:
            self.runner = ModelRunner(runner_config)
        self.model_executor = self.tp_executor or self.runner
        self.model_config = self.runner.model_config
        self.max_model_len = self.runner.max_model_len
        self.vocab_size = self.runner.vocab_size
        self.tokenizer = load_tokenizer(model_dir)
        self.generation_defaults = GenerationDefaults.from_model_dir(model_dir)
        if self.runner.max_num_batched_tokens < config.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.runner.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({config.max_num_seqs})"
            )
        self.block_manager = _core.BlockManager(
            config.block_size,
            self.runner.num_gpu_blocks,
            self.runner.num_cpu_blocks,
            config.watermark,
            config.enable_prefix_caching,
        )
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=self.runner.max_num_batched_tokens,
            preemption_mode=config.preemption_mode,
            enable_prefix_caching=config.enable_prefix_caching,
        )
        self.output_processor = OutputProcessor(self.tokenizer, self.max_model_len)
        self.eos_token_ids = self._eos_token_ids(model_dir)
        self.requests: dict[str, Request] = {}
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.peak_used_blocks = 0

    def _eos_token_ids(self, model_dir) -> set[int]:
        """Every id that ends a sequence: generation_config.json's, config.json's, the tokenizer's."""
        ids = set(model_eos_token_ids(model_dir)) | set(self.model_config.eos_token_ids)
        if self.tokenizer is not None:
            ids |= self.tokenizer.eos_token_ids
        return ids

    # ---- requests ---------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
    ) -> None:
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already running")
        prompt_text, token_ids = self._tokenize(prompt)
        self._check_fits(token_ids, params)
        request = Request(
            request_id=request_id,
            prompt=prompt_text,
            prompt_token_ids=token_ids,
            params=params,
            eos_token_ids=self.eos_token_ids,
            priority=priority,
            cache_salt=cache_salt or "",
            metrics=RequestMetrics(arrival_time=arrival_time or time.monotonic()),
        )
        first = Sequence.new(0, token_ids, generator=self._generator(params, 0))
        self.output_processor.init_seq(request, first)
        request.seqs.append(first)
        if params.is_beam_search:
            from pydaemon.beam_search import BeamSearchState

            request.beam = BeamSearchState(
                beam_width=params.beam_width,
                num_return=params.n,
                length_penalty=params.length_penalty,
                early_stopping=params.early_stopping,
                eos_token_ids=set() if params.ignore_eos else self.eos_token_ids,
                prompt_len=len(token_ids),
                max_new_tokens=min(params.max_tokens, self.max_model_len - len(token_ids)),
                min_new_tokens=params.min_tokens,
            )
        self.requests[request_id] = request
        self.scheduler.add_request(request)

    def _tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            if self.tokenizer is None:
                raise ValueError(
                    "this model has no tokenizer (tokenizer.json or tokenizer.model): "
                    "send the prompt as token ids"
                )
            return prompt, self.tokenizer.encode(prompt)
        token_ids = list(prompt)
        if not token_ids:
            raise ValueError("prompt_token_ids is empty")
        bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"prompt token id {bad[0]!r} is outside the vocabulary [0, {self.vocab_size})"
            )
        return None, token_ids

    def _check_fits(self, token_ids: list[int], params: SamplingParams) -> None:
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens; the model's context is "
                f"{self.max_model_len} (prompt + at least one new token must fit)"
            )
        usable = self.runner.num_gpu_blocks - int(
            self.config.watermark * self.runner.num_gpu_blocks
        )
        needed = math.ceil((len(token_ids) + 1) / self.config.block_size)
        if needed > usable:
            raise ValueError(
                f"prompt needs {needed} KV blocks but the whole cache has {usable} usable blocks"
            )
        num_seqs = params.beam_width if params.is_beam_search else params.best_of
        if num_seqs > self.config.max_num_seqs:
            raise ValueError(
                f"the request needs {num_seqs} sequences; max_num_seqs is {self.config.max_num_seqs}"
            )

    def _generator(self, params: SamplingParams, index: int):
        if params.is_greedy:
            return None
        return make_generator(params.seed, index, self.runner.device)

    def abort_request(self, request_id: str) -> bool:
        """Stop a request and free its KV blocks now. False if it is unknown or finished."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        self.scheduler.remove_request(request)
        for seq in request.seqs:
            seq.finish_reason = "abort"
        request.finished_seqs.extend(request.seqs)
        request.seqs = []
        request.status = RequestStatus.FINISHED
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- the step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        out = self.scheduler.schedule()
        outputs: list[RequestOutput] = []
        for request, message in out.rejected:
            outputs.append(self._fail(request, message))
        if not out.scheduled:
            if out.blocks_to_swap_out:
                self.model_executor.execute(out, self.block_manager)
            return outputs
        now = time.monotonic()
        for scheduled in out.scheduled:
            if scheduled.request.metrics.first_scheduled_time is None:
                scheduled.request.metrics.first_scheduled_time = now
        logits = self.model_executor.execute(out, self.block_manager)
        sampling = [s for s in out.scheduled if s.do_sample]  # before num_computed moves
        self.scheduler.update_after_step(out)
        self.peak_used_blocks = max(
            self.peak_used_blocks, self.block_manager.num_used_blocks(_core.Device.GPU)
        )
        self.num_prompt_tokens += sum(s.num_new_tokens for s in out.prefills)
        touched = self._sample_and_append(sampling, logits)
        now = time.monotonic()
        for request in touched:
            if request.metrics.first_token_time is None:
                request.metrics.first_token_time = now
            if not request.seqs:
                self._finish(request)
                request.metrics.finished_time = now
            if request.streams_deltas:
                delta = self.output_processor.make_delta(request)
                if delta is not None:
                    outputs.append(delta)
            elif request.is_finished:
                outputs.append(self.output_processor.make_final(request))
        return outputs

    def _sample_and_append(self, sampling: list[ScheduledSeq], logits) -> list[Request]:
        rows: list[SampleRow] = []
        owners: list[tuple[Request, Sequence]] = []
        beams: dict[str, list[tuple[int, Sequence]]] = {}
        for row, scheduled in enumerate(sampling):
            request, seq = scheduled.request, scheduled.seq
            if request.params.is_beam_search:
                beams.setdefault(request.request_id, []).append((row, seq))
                continue
            seqs = [seq]
            if not request.is_forked and request.num_expected_seqs > 1:
                seqs += [self._fork(request, seq, k) for k in range(1, request.num_expected_seqs)]
                request.is_forked = True
            for target in seqs:
                rows.append(self._sample_row(request, target, row))
                owners.append((request, target))
        touched: dict[str, Request] = {}
        if rows:
            result = self.runner.sample(logits, rows)
            for (request, seq), token, chosen, top in zip(
                owners,
                result.sampled_token_ids,
                result.chosen_logprobs,
                result.logprobs,
                strict=False,
            ):
                touched[request.request_id] = request
                self.num_generation_tokens += 1
                if self.output_processor.append_token(request, seq, token, chosen, top):
                    self._retire_seq(request, seq)
        for request_id, items in beams.items():
            request = self.requests[request_id]
            touched[request_id] = request
            logprobs = self.runner.log_softmax_rows(logits, [row for row, _ in items])
            self._beam_step(request, [seq for _, seq in items], logprobs)
        return list(touched.values())

    def _sample_row(self, request: Request, seq: Sequence, row: int) -> SampleRow:
        params = request.params
        barred = set(params.stop_token_ids)
        if not params.ignore_eos:
            barred |= request.eos_token_ids
        return SampleRow(
            logits_index=row,
            params=params,
            prompt_token_ids=seq.prompt_token_ids,
            output_token_ids=seq.output_token_ids,
            generator=seq.generator,
            stop_ids_for_min_tokens=barred,
        )

    def _fork(
        self, request: Request, parent: Sequence, index: int, register: bool = True
    ) -> Sequence:
        child = Sequence.new(
            index,
            parent.prompt_token_ids,
            output_token_ids=list(parent.output_token_ids),
            num_computed_tokens=parent.num_computed_tokens,
            num_slots=parent.num_slots,
            generator=self._generator(request.params, index),
            cumulative_logprob=parent.cumulative_logprob,
        )
        self.block_manager.fork(parent.seq_id, child.seq_id)
        self.output_processor.init_seq(request, child)
        if register:
            request.seqs.append(child)
        return child

    def _retire_seq(self, request: Request, seq: Sequence) -> None:
        self.scheduler.free_seq(seq)
        request.seqs.remove(seq)
        request.finished_seqs.append(seq)

    def _beam_step(self, request: Request, seqs: list[Sequence], logprobs) -> None:
        from pydaemon.beam_step import advance_beams

        advance_beams(self, request, seqs, logprobs)

    def _finish(self, request: Request) -> None:
        request.status = RequestStatus.FINISHED
        self.scheduler.remove_request(request)
        self.requests.pop(request.request_id, None)
        if not request.params.is_beam_search and request.params.best_of > request.params.n:
            ranked = sorted(request.finished_seqs, key=lambda s: -s.cumulative_logprob)
            for rank, seq in enumerate(ranked):
                seq.index = rank

    def _fail(self, request: Request, message: str) -> RequestOutput:
        self.abort_request(request.request_id)
        output = self.output_processor.make_final(request)
        output.error = message
        return output

    # ---- life cycle -------------------------------------------------------------------------
    def check_health(self) -> None:
        """Raises when a tensor-parallel worker died (no step can run any more)."""
        if self.tp_executor is not None:
            self.tp_executor.check_health()

    def shutdown(self) -> None:
        """Stops the tensor-parallel workers, if any (idempotent; also run at exit)."""
        if self.tp_executor is not None:
            self.tp_executor.shutdown()

    # ---- introspection ----------------------------------------------------------------------
    def get_stats(self) -> EngineStats:
        bm, sched = self.block_manager, self.scheduler
        return EngineStats(
            num_running=len(sched.running),
            num_waiting=len(sched.waiting),
            num_swapped=len(sched.swapped),
            num_gpu_blocks=bm.num_total_blocks(_core.Device.GPU),
            num_free_gpu_blocks=bm.num_free_blocks(_core.Device.GPU),
            num_cpu_blocks=bm.num_total_blocks(_core.Device.CPU),
            num_free_cpu_blocks=bm.num_free_blocks(_core.Device.CPU),
            kv_waste_slots=bm.kv_waste(),
            num_shared_blocks=bm.num_shared_blocks(),
            prefix_cache_query_tokens=bm.prefix_cache_query_tokens(),
            prefix_cache_hit_tokens=bm.prefix_cache_hit_tokens(),
            num_preemptions=sched.stats.num_preemptions,
            num_swapped_out_blocks=sched.stats.num_swapped_out_blocks,
            num_swapped_in_blocks=sched.stats.num_swapped_in_blocks,
            num_prompt_tokens=self.num_prompt_tokens,
            num_generation_tokens=self.num_generation_tokens,
        )

    def warmup(self) -> None:
        """One tiny request end to end, so the first real request pays no start-up costs."""
        request_id = "__warmup__"
        self.add_request(
            request_id,
            [min(1, self.vocab_size - 1)] * 4,
            SamplingParams(temperature=0.0, max_tokens=2),
        )
        while request_id in self.requests:
            self.step()
