"""StructuredOutputManager: the engine core's side of constrained decoding (vLLM's name).

It owns the grammar compiler (built on the first constrained request: the model's tokenizer
is loaded in the core for its vocabulary) and the requests waiting for their grammar. A
constrained request's grammar is built (its syntax checked: ValueError, before any KV block)
when it arrives and compiled in a background thread; the request reaches the scheduler only
once that compile is done, so the batch never waits for a grammar. Rank 0's runner gets the
matchers (pydaemon.sampling.constraints.matchers) that mask its logits.
"""

from __future__ import annotations

import logging
from concurrent.futures import FIRST_COMPLETED, Future, wait

from pydaemon.core.messages import EngineCoreOutput
from pydaemon.core.request import Request
from pydaemon.core.sched.scheduler import Scheduler
from pydaemon.sampling.constraints.compiler import GrammarCompiler
from pydaemon.sampling.constraints.matchers import GrammarMatchers
from pydaemon.tokenizer.loader import load_tokenizer
from pydaemon.tokenizer.token_bytes import token_bytes
from pydaemon.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class StructuredOutputManager:
    def __init__(self, model: str, runner: ModelRunner) -> None:
        """model: the model directory or GGUF file (its tokenizer spells the grammars);
        runner: rank 0's, the one that samples."""
        self.model = model
        self.runner = runner
        self.compiler: GrammarCompiler | None = None
        self._waiting: list[tuple[Request, Future]] = []  # in arrival order

    def add_request(self, request: Request) -> None:
        """Starts compiling the request's grammar (a cached one is ready at once); ValueError
        for a constraint that does not parse."""
        compiler = self._compiler(sorted(request.eos_token_ids))
        self._waiting.append((request, compiler.submit(request.params.structured_outputs)))

    def has_waiting(self) -> bool:
        return bool(self._waiting)

    @property
    def num_waiting(self) -> int:
        """Requests waiting for their grammar (not yet in the scheduler's queues)."""
        return len(self._waiting)

    def abort_request(self, request_id: str) -> bool:
        kept = [(r, f) for r, f in self._waiting if r.request_id != request_id]
        found = len(kept) < len(self._waiting)
        self._waiting = kept
        return found

    def admit_ready(self, scheduler: Scheduler) -> list[EngineCoreOutput]:
        """Hands the requests whose grammar is compiled to the scheduler, in arrival order;
        -> an error output for each whose compile failed."""
        failed: list[EngineCoreOutput] = []
        waiting = []
        for request, future in self._waiting:
            if not future.done():
                waiting.append((request, future))
                continue
            error = future.exception()
            if error is None:
                scheduler.add_request(request)
                continue
            logger.warning("request %s: its grammar did not compile: %s", request.request_id, error)
            failed.append(
                EngineCoreOutput(
                    request.request_id,
                    [],
                    finished=True,
                    error=f"structured_outputs: the grammar did not compile: {error}",
                )
            )
        self._waiting = waiting
        return failed

    def wait(self, timeout_s: float) -> None:
        """Blocks until some waiting compile is done, at most ``timeout_s`` (nothing else to
        do: no request is running)."""
        if self._waiting:
            wait([f for _, f in self._waiting], timeout=timeout_s, return_when=FIRST_COMPLETED)

    def _compiler(self, eos_token_ids: list[int]) -> GrammarCompiler:
        if self.compiler is not None:
            return self.compiler
        tokenizer = load_tokenizer(self.model)
        if tokenizer is None:
            raise ValueError(
                "structured outputs need the model's tokenizer (tokenizer.json, tokenizer.model "
                "or a GGUF vocabulary), and this model has none"
            )
        runner = self.runner
        self.compiler = GrammarCompiler(token_bytes(tokenizer), runner.vocab_size, eos_token_ids)
        sampler = runner.step_sampler
        sampler.grammar_matchers = GrammarMatchers(
            self.compiler, sampler.input_batch.host_output_token_ids, runner.device
        )
        return self.compiler
