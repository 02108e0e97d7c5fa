"""GrammarCompiler: grammars compiled against one tokenizer, in background threads, cached.

The compile cache is keyed by (constraint, tokenizer): one GrammarCompiler per tokenizer
vocabulary (the engine has one), holding an LRU of ``grammar_key -> Future`` bounded in bytes
(the compiled grammars' own sizes: a 500-property schema's is ~3 MiB, so 1,300 distinct
schemas grew a count-bounded cache to 3.5 GB) and in entries. A request's compile is submitted
when it arrives; the engine core schedules the request only once its future is done, so a
compile never stalls a step (xgrammar releases the GIL while it compiles). Constraints are
bounded in size first (grammar_limits.py); the larger ones compile on a thread of their own,
so a small grammar never waits behind a large one. A constraint asked for again (warm cache)
costs a dictionary lookup.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import xgrammar as xgr

from pydaemon.sampling_params import StructuredOutputsParams
from pydaemon.structured_output.grammar_limits import check_size, is_heavy
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
        max_threads: int = 2,
        cache_size: int = DEFAULT_CACHE_SIZE,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
    ) -> None:
        """token_bytes: the bytes of each token id (b"" for special tokens;
        pydaemon.tokenizer.token_bytes); vocab_size: the model's (the logits' width, may
        exceed the tokenizer's); stop_token_ids: the ids that may end a finished grammar."""
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
        self._compiler = xgr.GrammarCompiler(
            self.tokenizer_info, max_threads=max_threads, cache_enabled=False
        )
        # One thread for small constraints and one for large ones, idle between compiles (an
        # engine's shutdown leaves them: the engine may be served again, and an idle pool
        # thread ends with the process).
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
        self._heavy_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-heavy")
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
        grammar = build_grammar(spec)
        pool = self._heavy_pool if is_heavy(spec) else self._pool
        with self._lock:
            future = self._cache.get(key)
            if future is None:
                future = pool.submit(self._compile, grammar)
                self._cache[key] = future
                self._evict()
        future.add_done_callback(lambda f: self._sized(key, f))
        return future

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

    def _compile(self, grammar: xgr.Grammar) -> xgr.CompiledGrammar:
        """Compiles; ValueError for a grammar that accepts no text at all (``root ::= root``,
        a schema that only refers to itself): its request would end at once with "stop"."""
        compiled = self._compiler.compile_grammar(grammar)
        bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        matcher = xgr.GrammarMatcher(compiled)
        matcher.fill_next_token_bitmask(bitmask)
        if not bool(bitmask.any()) and not matcher.is_terminated():
            raise ValueError(
                "structured_outputs: the constraint can never be satisfied: its grammar "
                "accepts no text (a rule or schema defined only by itself, say)"
            )
        return compiled

    def get(self, spec: StructuredOutputsParams) -> xgr.CompiledGrammar:
        """The compiled grammar of ``spec``, waiting for its compile if it is still running."""
        return self.submit(spec).result()

    @property
    def num_cached(self) -> int:
        return len(self._cache)
