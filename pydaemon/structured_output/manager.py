"""StructuredOutputManager: the engine core's side of constrained decoding (vLLM's name).

It owns the grammar compiler (built on the first constrained request: the model's tokenizer
is loaded in the core for its vocabulary), the requests waiting for their grammar and the
matchers of the running ones. A constrained request's grammar is built (its syntax checked:
ValueError, before any KV block) when it arrives and compiled in a background thread; the
request reaches the scheduler only once that compile is done, so the batch never waits for a
grammar. Each step's bitmask is made here (``grammar_output``) from the scheduler's sequences
and goes down to the rank that samples as plain data: workers hold no grammar state.
"""

from __future__ import annotations

import logging
from concurrent.futures import FIRST_COMPLETED, Future, wait

from pydaemon.core.messages import EngineCoreOutput
from pydaemon.core.request import Request
from pydaemon.core.sched.scheduler import Scheduler
from pydaemon.core.sched.scheduler_output import GrammarOutput, SchedulerOutput
from pydaemon.structured_output.compiler import GrammarCompiler
from pydaemon.structured_output.matchers import ConstrainedSeq, GrammarMatchers
from pydaemon.tokenizer.loader import load_tokenizer
from pydaemon.tokenizer.token_bytes import token_bytes

logger = logging.getLogger(__name__)


class StructuredOutputManager:
    def __init__(self, model: str, vocab_size: int, *, compile_timeout_s: float = 30.0) -> None:
        """model: the model directory or GGUF file (its tokenizer spells the grammars);
        vocab_size: the model's (the logits' width); compile_timeout_s: how long a grammar may
        compile before its requests fail."""
        self.model = model
        self.vocab_size = vocab_size
        self.compile_timeout_s = compile_timeout_s
        self.compiler: GrammarCompiler | None = None
        self.matchers: GrammarMatchers | None = None
        self._waiting: list[tuple[Request, Future]] = []  # in arrival order

    def prepare(self, eos_token_ids: list[int]) -> None:
        """Builds the grammar compiler now (the tokenizer's vocabulary, xgrammar's tokenizer
        info: seconds for a large vocabulary), so that the first constrained request does not
        stall every stream while it is built on the step's thread. The daemon's engine core
        calls it at start-up; a model without a tokenizer is left as it is."""
        if self.compiler is None and eos_token_ids:
            try:
                self._compiler(sorted(eos_token_ids))
            except ValueError:
                pass  # no tokenizer: a constrained request is refused when it comes

    def add_request(self, request: Request) -> None:
        """Starts compiling the request's grammar (a cached one is ready at once); ValueError
        for a constraint that does not parse."""
        compiler = self._compiler(sorted(request.eos_token_ids))
        self._waiting.append((request, compiler.submit(request.params.structured_outputs)))

    def has_waiting(self) -> bool:
        return bool(self._waiting)

    @property
    def waiting_requests(self) -> list[Request]:
        return [request for request, _ in self._waiting]

    @property
    def num_waiting(self) -> int:
        """Requests waiting for their grammar (not yet in the scheduler's queues)."""
        return len(self._waiting)

    def abort_request(self, request_id: str) -> bool:
        """Forgets a request that waits for its grammar; a compile that no other waiting
        request shares is stopped (its client left: its process is killed)."""
        kept = [(r, f) for r, f in self._waiting if r.request_id != request_id]
        gone = [f for r, f in self._waiting if r.request_id == request_id]
        self._waiting = kept
        for future in gone:
            if not future.done() and all(f is not future for _, f in kept):
                self.compiler.cancel(future)
        return bool(gone)

    def close(self) -> None:
        """Stops the compile server (the engine is shutting down)."""
        if self.compiler is not None:
            self.compiler.close()

    def admit_ready(self, scheduler: Scheduler) -> list[EngineCoreOutput]:
        """Hands the requests whose grammar is compiled to the scheduler, in arrival order;
        -> an error output for each whose compile failed."""
        failed: list[EngineCoreOutput] = []
        waiting = []
        for request, future in self._waiting:
            if not future.done():
                waiting.append((request, future))
                continue
            error = (
                RuntimeError("its compile was stopped (the engine is shutting down)")
                if future.cancelled()
                else future.exception()
            )
            if error is None:
                scheduler.add_request(request)
                continue
            logger.warning("request %s: its grammar did not compile: %s", request.request_id, error)
            failed.append(
                EngineCoreOutput(
                    request.request_id,
                    [],
                    finished=True,
                    error=str(error)
                    if isinstance(error, ValueError) and str(error).startswith("structured_outputs")
                    else f"structured_outputs: the grammar did not compile: {error}",
                )
            )
        self._waiting = waiting
        return failed

    def forget(self, request_ids: list[str]) -> None:
        """Drops the matchers of requests that ended (every step's finished_request_ids)."""
        if self.matchers is not None and request_ids:
            self.matchers.forget(request_ids)

    def grammar_output(
        self, scheduler_output: SchedulerOutput, requests: dict[str, Request]
    ) -> GrammarOutput | None:
        """The bitmask of the step's constrained sequences (None: none samples), from their
        tokens as the scheduler holds them; call once the previous step's output is
        processed (its tokens are the matchers' input). ``requests``: the scheduler's live
        ones; a sequence whose request ended since the step was scheduled gets no row."""
        matchers = self.matchers
        wanted = scheduler_output.structured_output_seq_ids
        if not wanted:
            return None
        if matchers is None:
            raise RuntimeError("a constrained sequence was scheduled before any grammar")
        rows: list[ConstrainedSeq] = []
        for seq_id, request_id in wanted.items():
            request = requests.get(request_id)
            if request is None or request.is_finished:
                continue
            seq = next((s for s in request.seqs if s.seq_id == seq_id), None)
            if seq is None:  # retired since (a stop string, say)
                continue
            spec = request.params.structured_outputs
            rows.append(ConstrainedSeq(seq_id, request_id, spec, seq.output_token_ids))
        return GrammarOutput([r.seq_id for r in rows], matchers.fill_bitmask(rows))

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
        self.compiler = GrammarCompiler(
            token_bytes(tokenizer),
            self.vocab_size,
            eos_token_ids,
            timeout_s=self.compile_timeout_s,
        )
        self.matchers = GrammarMatchers(self.compiler)
        return self.compiler
