"""A stand-in LLMEngine with the engine contract's interface, for server tests.

Deterministic: sequence i of a request emits tokens (last_prompt_id + 1 + i + k) % vocab for
k = 0, 1, ...; token t decodes to chr(ord('a') + t % 26). KV blocks come from a fixed pool
(ceil(tokens / block_size) per sequence) and are freed at once on finish or abort.
``step_delay_s`` slows steps down so tests can act mid-flight; ``fail_on_step`` makes step
number k raise, to simulate an internal failure.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pydaemon.config.generation import GenerationDefaults
from pydaemon.generate_request import GenerateRequest
from pydaemon.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pydaemon.sampling_params import SamplingParams
from pydaemon.tokenizer.chat_template import render_chat_template


class FakeTokenizer:
    eos_token_id = 2
    eos_token_ids = {2}
    bos_token_id = 1
    vocab_size = 64
    chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<a>"
    special_token_texts: frozenset[str] = frozenset()

    def apply_chat_template(
        self, messages, add_generation_prompt=True, tools=None, **kwargs
    ) -> str:
        return render_chat_template(
            self.chat_template,
            messages,
            model_name="fake",
            special_tokens={},
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            **kwargs,
        )

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = [3 + ord(c) % 61 for c in text]
        return [self.bos_token_id, *ids] if add_bos else ids

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(ord("a") + t % 26) for t in ids)


@dataclass
class FakeStats:
    num_running: int = 0
    num_waiting: int = 0
    num_swapped: int = 0
    num_gpu_blocks: int = 0
    num_free_gpu_blocks: int = 0
    num_cpu_blocks: int = 0
    num_free_cpu_blocks: int = 0
    kv_waste_slots: int = 0
    prefix_cache_query_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    num_preemptions: int = 0
    num_swapped_out_blocks: int = 0
    num_swapped_in_blocks: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    lora_requests: dict[str, tuple[int, int]] = field(default_factory=dict)
    max_loras: int = 0
    spec_decode: None = None  # as EngineStats: no speculative decoding, no KV tiers
    kv_tiers: None = None


@dataclass
class FakeConfig:
    model: str = "fake"
    device: str = "cpu"
    dtype: str = "float32"
    block_size: int = 4


@dataclass
class FakeRunner:
    device: str = "cpu"
    dtype: str = "float32"


@dataclass
class _Req:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    generated: list[list[int]] = field(default_factory=list)  # per sequence
    finish: list[str | None] = field(default_factory=list)
    num_blocks: int = 0


class FakeEngine:
    def __init__(
        self,
        num_gpu_blocks: int = 64,
        max_model_len: int = 64,
        step_delay_s: float = 0.0,
        fail_on_step: int | None = None,
    ) -> None:
        self.config = FakeConfig()
        self.runner = FakeRunner()
        self.tokenizer = FakeTokenizer()
        self.eos_token_ids = FakeTokenizer.eos_token_ids
        self.generation_defaults = GenerationDefaults()
        self.max_model_len = max_model_len
        self.vocab_size = FakeTokenizer.vocab_size
        self.model_name = "fake"
        self.device = "cpu"
        self.dtype = "float32"
        self.num_gpu_blocks = num_gpu_blocks
        self.step_delay_s = step_delay_s
        self.fail_on_step = fail_on_step
        self.num_steps = 0
        self.stats = FakeStats(num_gpu_blocks=num_gpu_blocks, num_free_gpu_blocks=num_gpu_blocks)
        self._reqs: dict[str, _Req] = {}
        self.added: list[tuple[list[int], SamplingParams]] = []  # (prompt ids, params) each
        self.warmed_up = False

    def warmup(self) -> None:
        self.warmed_up = True

    def add_request(self, request: GenerateRequest, arrival_time: float | None = None) -> None:
        """LLMEngine's interface."""
        request_id, prompt, params = request.request_id, request.prompt, request.params
        if request.lora_request is not None:
            raise ValueError("the fake engine serves no LoRA adapters")
        if request_id in self._reqs:
            raise ValueError(f"request_id {request_id!r} is already live")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids or prompt == "":
            raise ValueError("prompt is empty")
        if len(ids) > self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens, max_model_len is {self.max_model_len}")
        if any(not 0 <= t < self.vocab_size for t in ids):
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size})")
        bs = self.config.block_size
        num_blocks = params.n * -(-(len(ids) + params.max_tokens) // bs)
        if num_blocks > self.num_gpu_blocks:
            raise ValueError("prompt does not fit in the whole KV cache")
        if num_blocks > self.stats.num_free_gpu_blocks:
            raise ValueError("fake engine: out of blocks (tests should size the pool)")
        self.stats.num_free_gpu_blocks -= num_blocks
        metrics = RequestMetrics(arrival_time=arrival_time or time.monotonic())
        self._reqs[request_id] = _Req(
            request_id,
            prompt if isinstance(prompt, str) else None,
            ids,
            params,
            metrics,
            generated=[[] for _ in range(params.n)],
            finish=[None] * params.n,
            num_blocks=num_blocks,
        )
        self.stats.num_prompt_tokens += len(ids)
        self.added.append((ids, params))

    def add_lora(self, lora_request):
        raise ValueError("the fake engine serves no LoRA adapters")

    def remove_lora(self, lora_int_id: int) -> bool:
        return False

    def list_loras(self) -> list:
        return []

    def abort_request(self, request_id: str) -> bool:
        req = self._reqs.pop(request_id, None)
        if req is None:
            return False
        self.stats.num_free_gpu_blocks += req.num_blocks
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self._reqs)

    def get_stats(self) -> FakeStats:
        self.stats.num_running = len(self._reqs)
        return FakeStats(**vars(self.stats))

    def step(self) -> list[RequestOutput]:
        self.num_steps += 1
        if self.fail_on_step is not None and self.num_steps >= self.fail_on_step:
            raise RuntimeError("fake engine: simulated internal failure")
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        now = time.monotonic()
        outputs = []
        for req in list(self._reqs.values()):
            req.metrics.first_scheduled_time = req.metrics.first_scheduled_time or now
            req.metrics.first_token_time = req.metrics.first_token_time or now
            deltas = []
            for i, gen in enumerate(req.generated):
                if req.finish[i] is not None:
                    continue
                tok = (req.prompt_token_ids[-1] + 1 + i + len(gen)) % self.vocab_size
                gen.append(tok)
                self.stats.num_generation_tokens += 1
                if len(gen) >= req.params.max_tokens:
                    req.finish[i] = "length"
                deltas.append(
                    CompletionOutput(
                        index=i,
                        token_ids=[tok],
                        text=self.tokenizer.decode([tok]),
                        finish_reason=req.finish[i],
                        cumulative_logprob=-0.5 * len(gen),
                        logprobs=[{tok: -0.5}] if req.params.logprobs is not None else None,
                    )
                )
            finished = all(f is not None for f in req.finish)
            if finished:
                req.metrics.finished_time = now
                self.abort_request(req.request_id)
            outputs.append(
                RequestOutput(
                    req.request_id, req.prompt, req.prompt_token_ids, deltas, finished, req.metrics
                )
            )
        return outputs
