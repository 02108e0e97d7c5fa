"""GrammarCompiler: grammars compiled against one tokenizer, in background threads, cached.

The compile cache is keyed by (constraint, tokenizer): one GrammarCompiler per tokenizer
vocabulary (the engine has one), holding a bounded LRU of ``grammar_key -> Future``. A
request's compile is submitted when it arrives; the engine core schedules the request only
once its future is done, so a compile never stalls a step (xgrammar releases the GIL while it
compiles). A constraint asked for again (warm cache) costs a dictionary lookup.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import xgrammar as xgr

from pydaemon.sampling.constraints.grammar_spec import build_grammar, grammar_key
from pydaemon.sampling_params import StructuredOutputsParams

DEFAULT_CACHE_SIZE = 1024  # compiled grammars kept (a JSON schema's: tens of KiB to a MiB)


class GrammarCompiler:
    def __init__(
        self,
        token_bytes: list[bytes],
        vocab_size: int,
        stop_token_ids: list[int],
        *,
        max_threads: int = 2,
        cache_size: int = DEFAULT_CACHE_SIZE,
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
        # One thread, idle between compiles (an engine's shutdown leaves it: the engine may be
        # served again, and an idle pool thread ends with the process).
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
        self._cache: OrderedDict[tuple[str, str], Future[xgr.CompiledGrammar]] = OrderedDict()
        self._cache_size = cache_size
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
        grammar = build_grammar(spec)
        with self._lock:
            future = self._cache.get(key)
            if future is None:
                future = self._pool.submit(self._compile, grammar)
                self._cache[key] = future
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
        return future

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
