"""GrammarCompiler: grammars compiled against one tokenizer, in a process that can stop them,
cached.

The compile cache is keyed by (constraint, tokenizer): one GrammarCompiler per tokenizer
vocabulary (the engine has one), holding an LRU of ``grammar_key -> Future`` bounded in bytes
(the compiled grammars' own sizes: a 500-property schema's is ~3 MiB, so 1,300 distinct
schemas grew a count-bounded cache to 3.5 GB) and in entries. A request's compile is submitted
when it arrives; the engine core schedules the request only once its future is done, so a
compile never stalls a step. Constraints are bounded in size first (grammar_limits.py) and
their syntax is checked here (ValueError before any KV block); the compile itself runs in the
compile server's child processes (compile_server.py), whose lanes (compile_lanes.py) keep one
client's slow compile from delaying another's by more than a couple of seconds, stop a compile
at its deadline, and stop one whose requests all left (``cancel``). The compiled grammar comes
back as xgrammar's JSON and is rebuilt here against the same tokenizer info. A constraint asked
for again (warm cache) costs a dictionary lookup.
"""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from concurrent.futures import Future, InvalidStateError

import xgrammar as xgr

from pydaemon.sampling_params import StructuredOutputsParams
from pydaemon.structured_output.compile_lanes import DEFAULT_DEADLINE_S, DEFAULT_FAST_BUDGET_S
from pydaemon.structured_output.compile_service import (
    CompileService,
    acquire_service,
    release_service,
)
from pydaemon.structured_output.grammar_limits import check_size
from pydaemon.structured_output.grammar_spec import build_grammar, grammar_key

DEFAULT_CACHE_SIZE = 1024  # compiled grammars kept at most
DEFAULT_CACHE_BYTES = 512 * 1024 * 1024  # and at most this much of them


class GrammarCompiler:
    def __init__(
        self,
        token_bytes: list[bytes],
        vocab_size: int,
        stop_token_ids: list[int],
        *,
        max_running: int = 2,
        fast_budget_s: float = DEFAULT_FAST_BUDGET_S,
        timeout_s: float = DEFAULT_DEADLINE_S,
        cache_size: int = DEFAULT_CACHE_SIZE,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
    ) -> None:
        """token_bytes: the bytes of each token id (b"" for special tokens;
        pydaemon.tokenizer.token_bytes); vocab_size: the model's (the logits' width, may
        exceed the tokenizer's); stop_token_ids: the ids that may end a finished grammar;
        max_running: compiles at once; fast_budget_s, timeout_s: compile_lanes.py."""
        if not stop_token_ids:
            raise ValueError("constrained decoding needs the model's EOS token id")
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(set(stop_token_ids))
        self.tokenizer_info = xgr.TokenizerInfo(
            token_bytes[:vocab_size],
            xgr.VocabType.RAW,
            vocab_size=vocab_size,
            stop_token_ids=self.stop_token_ids,
        )
        self.token_bytes = token_bytes[:vocab_size]
        if timeout_s <= 0 or timeout_s != timeout_s:
            raise ValueError(f"the grammar compile timeout must be > 0 s, not {timeout_s}")
        self._service_args = (
            self.tokenizer_info.serialize_json(),
            {"max_running": max_running, "fast_budget_s": fast_budget_s, "deadline_s": timeout_s},
        )
        self.service: CompileService | None = None
        self._jobs: dict[Future, Future] = {}  # pending grammar future -> its JSON's future
        self._cache: OrderedDict[tuple[str, str], Future[xgr.CompiledGrammar]] = OrderedDict()
        self._sizes: dict[tuple[str, str], int] = {}  # compiled grammars' bytes, once known
        self._cache_size = cache_size
        self._cache_bytes = cache_bytes
        self._lock = threading.Lock()

    def submit(self, spec: StructuredOutputsParams) -> Future[xgr.CompiledGrammar]:
        """Starts compiling ``spec`` (or finds it in the cache). The grammar is built (syntax
        checked) here, synchronously: ValueError naming what is wrong."""
        key = grammar_key(spec)
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
        check_size(spec)
        build_grammar(spec)  # its syntax, now: the compile server builds it again
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                return future
            future = Future()
            job = self._service().submit(spec)
            self._jobs[future] = job
            self._cache[key] = future
            self._evict()
        job.add_done_callback(lambda j: self._compiled(key, future, j))
        return future

    def _compiled(self, key: tuple[str, str], future: Future, job: Future) -> None:
        """The compile server answered (on its reader thread): the grammar, rebuilt from its
        JSON, or the compile's error. A grammar that failed stays cached as failed (asked for
        again, it fails at once: a constraint past the deadline does not compile again);
        one whose compile server died leaves the cache (it may be retried)."""
        with self._lock:
            self._jobs.pop(future, None)
        if job.cancelled():
            future.cancel()
            return
        try:
            compiled = xgr.CompiledGrammar.deserialize_json(job.result(), self.tokenizer_info)
        except BaseException as e:
            if isinstance(e, RuntimeError):
                with self._lock:
                    if self._cache.get(key) is future:
                        del self._cache[key]
            with contextlib.suppress(InvalidStateError):  # cancelled meanwhile
                future.set_exception(e)
            return
        try:
            future.set_result(compiled)
        except InvalidStateError:  # cancelled meanwhile
            return
        self._sized(key, future)

    def cancel(self, future: Future) -> None:
        """Nobody waits for ``future`` any more: its compile stops and the cache forgets it
        (a no-op once it is compiled)."""
        self._cancel(future, self._service())

    def _cancel(self, future: Future, service: CompileService) -> None:
        with self._lock:
            job = self._jobs.pop(future, None)
            if job is None:
                return
            for key, cached in list(self._cache.items()):
                if cached is future:
                    del self._cache[key]
        service.cancel(job)
        future.cancel()

    def start(self) -> None:
        """Starts the compile server now (else on the first compile)."""
        self._service().start()

    def _service(self) -> CompileService:
        if self.service is None:  # first use, or used again after close
            info_json, lanes = self._service_args
            self.service = acquire_service(info_json, **lanes)
        return self.service

    def close(self) -> None:
        """The engine is done: its compiles still running stop, and its compile server is
        released (kept for another engine of this tokenizer, or closed). Idempotent."""
        service, self.service = self.service, None
        if service is None:
            return
        with self._lock:
            pending = list(self._jobs)
        for future in pending:
            self._cancel(future, service)
        release_service(service)

    def _sized(self, key: tuple[str, str], future: Future) -> None:
        """A compile finished: its bytes count against the cache's budget."""
        if future.cancelled() or future.exception() is not None:
            return
        with self._lock:
            if self._cache.get(key) is future:
                self._sizes[key] = future.result().memory_size_bytes
                self._evict()

    def _evict(self) -> None:
        """Oldest first, while over either bound (the newest entry always stays). Matchers
        of running requests keep their grammar alive: eviction only forgets it."""
        while len(self._cache) > 1 and (
            len(self._cache) > self._cache_size or self.num_cached_bytes > self._cache_bytes
        ):
            key, _ = self._cache.popitem(last=False)
            self._sizes.pop(key, None)

    @property
    def num_cached_bytes(self) -> int:
        return sum(self._sizes.values())

    def get(self, spec: StructuredOutputsParams) -> xgr.CompiledGrammar:
        """The compiled grammar of ``spec``, waiting for its compile if it is still running."""
        return self.submit(spec).result()

    def __del__(self) -> None:
        if getattr(self, "service", None) is not None:
            try:
                self.close()
            except Exception:  # noqa: BLE001 - at interpreter exit the server ends by itself
                pass

    @property
    def num_cached(self) -> int:
        return len(self._cache)
