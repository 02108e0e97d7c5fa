"""Per-request sampling parameters, validated at construction."""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_LOGPROB_TOKEN_IDS = 128  # vLLM's bound on logprob_token_ids
MAX_LOGIT_BIAS_TOKENS = 1024  # entries of one request's logit_bias
MAX_ABS_LOGIT_BIAS = 100.0  # OpenAI's range; vLLM clamps to it
MAX_N = 256
# Beam scores divide by length ** length_penalty; beyond this the scores carry no information.
MAX_ABS_LENGTH_PENALTY = 10.0

_STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")
REASONING_END_MAX_GAP = 20  # tokens between reasoning_end and its suffix (a channel header)


@dataclass
class StructuredOutputsParams:
    """A constraint on the text a request generates (vLLM's name and fields); exactly one of
    ``json`` (a JSON schema, as a dict or its JSON text), ``regex``, ``choice`` (the output is
    one of these strings), ``grammar`` (EBNF as xgrammar and GBNF write it, or Lark) or
    ``json_object`` (any JSON object). ``disable_any_whitespace``: JSON with no whitespace
    besides what the schema's strings hold (small models otherwise may write spaces forever).
    Syntax errors (a bad schema, regex or grammar) are found by the engine before the request
    takes any KV block: pydaemon.structured_output.grammar_spec."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    # Reasoning models: the grammar applies to the answer, not the reasoning before it. With
    # ``reasoning_end`` (token ids, e.g. those of "</think>") the sequence samples freely until
    # they appear in its output, and the grammar reads the tokens after them; with
    # ``reasoning_end_suffix`` too, after that suffix when it follows within
    # REASONING_END_MAX_GAP tokens (gpt-oss: "<|channel|>final", header tokens, "<|message|>").
    # With ``reasoning_start`` (Qwen3's "<think>", which the model may leave out) the first
    # token may be its first id or one the grammar allows: the first means reasoning until
    # ``reasoning_end``, anything else an answer under the grammar from the first token.
    # ``reasoning_end_text`` (without a suffix): the end marker's text, also found when the
    # model spells it in other pieces (' </' 'think' '>'), as the reasoning parser reads it;
    # the grammar then reads what follows the marker's last byte.
    # The chat front ends set them from the daemon's --reasoning-parser.
    reasoning_end: tuple[int, ...] | None = None
    reasoning_end_suffix: tuple[int, ...] | None = None
    reasoning_start: tuple[int, ...] | None = None
    reasoning_end_text: str | None = None

    def __post_init__(self) -> None:
        if self.choice is not None:
            self.choice = list(self.choice)
        kinds = [k for k in _STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(kinds) != 1:
            raise ValueError(
                "StructuredOutputsParams needs exactly one of json, regex, choice, grammar, "
                f"json_object (got {kinds or 'none'})"
            )
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError("StructuredOutputsParams.json must be a JSON schema (dict or str)")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"StructuredOutputsParams.{name} must be a non-empty string")
        if self.choice is not None and (
            not self.choice or any(not isinstance(c, str) or not c for c in self.choice)
        ):
            raise ValueError("StructuredOutputsParams.choice must be a list of non-empty strings")
        for name in ("reasoning_end", "reasoning_end_suffix", "reasoning_start"):
            ids = getattr(self, name)
            if ids is None:
                continue
            ids = tuple(ids)
            if not ids or any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in ids):
                raise ValueError(
                    f"StructuredOutputsParams.{name} must be a non-empty sequence of token ids"
                )
            setattr(self, name, ids)
        for name in ("reasoning_end_suffix", "reasoning_start", "reasoning_end_text"):
            if getattr(self, name) is not None and self.reasoning_end is None:
                raise ValueError(f"StructuredOutputsParams.{name} needs reasoning_end")
        if self.reasoning_end_text is not None and (
            not isinstance(self.reasoning_end_text, str) or not self.reasoning_end_text
        ):
            raise ValueError(
                "StructuredOutputsParams.reasoning_end_text must be a non-empty string"
            )

    @property
    def kind(self) -> str:
        return next(k for k in _STRUCTURED_KINDS if getattr(self, k) not in (None, False))


def logit_bias_out_of_vocab(logit_bias: dict[int, float], vocab_size: int) -> str:
    """vLLM's message for logit_bias ids outside the vocabulary (clients match on it)."""
    bad = sorted(t for t in logit_bias if not 0 <= t < vocab_size)
    return (
        f"token_id(s) {bad[:16]} in logit_bias contain out-of-vocab token ids. "
        f"Vocabulary size: {vocab_size}"
    )


@dataclass
class SamplingParams:
    """How to pick the next tokens of one request.

    Greedy when ``temperature == 0``. Every bad value raises ``ValueError`` naming the field.
    ``beam_width > 1`` selects beam search (deterministic, ``temperature`` must be 0); then
    ``n`` beams are returned, best first.
    """

    n: int = 1
    best_of: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    max_tokens: int = 16
    min_tokens: int = 0
    logprobs: int | None = None  # top-k logprobs per token, plus the chosen token's
    # vLLM's: the log-probability of each prompt token given those before it, plus its top-k
    # (RequestOutput.prompt_logprobs); the prompt is then computed whole (no prefix cache)
    prompt_logprobs: int | None = None
    # vLLM's: the logprobs of exactly these token ids at each position (plus the chosen
    # token's), in place of the top-k; logprobs is then their number
    logprob_token_ids: list[int] | None = None
    beam_width: int = 1
    length_penalty: float = 1.0
    early_stopping: bool = False
    # Constrained decoding (JSON schema, regex, choice, grammar): pydaemon.structured_output
    structured_outputs: StructuredOutputsParams | None = None
    # OpenAI's logit_bias: token id -> a value added to its logit before sampling (clamped to
    # [-100, 100], as vLLM does); logprobs stay those of the raw logits.
    logit_bias: dict[int, float] | None = None
    # Special tokens (an EOS, chat markers) left out of the text; False keeps them (a harmony
    # model's channels are special tokens that its parser reads).
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        if self.top_k == -1:
            self.top_k = 0
        if self.best_of is None:
            self.best_of = self.n
        if self.logit_bias is not None:
            self._normalize_logit_bias()
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if isinstance(self.logprob_token_ids, (list, tuple)):
            self.logprob_token_ids = list(self.logprob_token_ids)
            if self.logprobs is None:
                self.logprobs = len(self.logprob_token_ids)
        self._validate()

    def _check_logprob_token_ids(self, bad) -> None:
        """vLLM's rules: 1 to MAX_LOGPROB_TOKEN_IDS distinct token ids; ``logprobs``, when
        given, equal to their number."""
        ids = self.logprob_token_ids
        if (
            not isinstance(ids, list)
            or not 1 <= len(ids) <= MAX_LOGPROB_TOKEN_IDS
            or any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in ids)
        ):
            raise bad(
                "logprob_token_ids",
                f"must be a list of 1 to {MAX_LOGPROB_TOKEN_IDS} token ids (integers >= 0)",
            )
        if len(set(ids)) != len(ids):
            raise bad("logprob_token_ids", "must not repeat a token id")
        if self.logprobs != len(ids):
            raise bad("logprobs", f"must equal the number of logprob_token_ids ({len(ids)})")
        if self.is_beam_search:
            raise bad("logprob_token_ids", "is not supported with beam search")

    def _normalize_logit_bias(self) -> None:
        """Token ids (int keys, >= 0) -> finite values clamped to [-100, 100]."""
        bias = self.logit_bias
        if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS_TOKENS:
            raise ValueError(
                f"SamplingParams.logit_bias must be a dict of at most {MAX_LOGIT_BIAS_TOKENS} "
                "token ids"
            )
        normalized = {}
        for token_id, value in bias.items():
            if not isinstance(token_id, int) or isinstance(token_id, bool) or token_id < 0:
                raise ValueError(
                    f"SamplingParams.logit_bias keys must be token ids (got {token_id!r})"
                )
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
                raise ValueError(
                    f"SamplingParams.logit_bias values must be numbers (got {value!r} for "
                    f"token {token_id})"
                )
            normalized[token_id] = min(MAX_ABS_LOGIT_BIAS, max(-MAX_ABS_LOGIT_BIAS, float(value)))
        self.logit_bias = normalized or None

    def _validate(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"SamplingParams.{name} {why} (got {getattr(self, name)!r})")

        if not isinstance(self.n, int) or not 1 <= self.n <= MAX_N:
            raise bad("n", f"must be an integer in [1, {MAX_N}]")
        if not isinstance(self.best_of, int) or not self.n <= self.best_of <= MAX_N:
            raise bad("best_of", f"must be an integer in [n, {MAX_N}]")
        if not 0.0 <= self.temperature <= 100.0:
            raise bad("temperature", "must be in [0, 100]")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", "must be 0 or -1 (disabled) or a positive integer")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise bad(name, "must be in [-2, 2]")
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise bad("repetition_penalty", "must be in (0, 10]")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**64):
            raise bad("seed", "must be an integer in [0, 2**64) or None")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise bad("max_tokens", "must be a positive integer")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise bad("min_tokens", "must be an integer in [0, max_tokens]")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            # The upper bound is the server's --max-logprobs (pydaemon/logprobs_limit.py),
            # checked where the request enters the engine core.
            if value is not None and (not isinstance(value, int) or value < 0):
                raise bad(name, "must be None or a non-negative integer")
        if self.logprob_token_ids is not None:
            self._check_logprob_token_ids(bad)
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative integers")
        if not isinstance(self.beam_width, int) or not 1 <= self.beam_width <= MAX_N:
            raise bad("beam_width", f"must be an integer in [1, {MAX_N}]")
        if self.is_beam_search:
            if self.temperature != 0.0:
                raise bad("temperature", "must be 0 with beam search (beam_width > 1)")
            if self.n > self.beam_width:
                raise bad("n", "must not exceed beam_width with beam search")
        # `not a <= x <= b` is also true for NaN.
        if not -MAX_ABS_LENGTH_PENALTY <= self.length_penalty <= MAX_ABS_LENGTH_PENALTY:
            raise bad(
                "length_penalty",
                f"must be a finite number in [-{MAX_ABS_LENGTH_PENALTY:g}, "
                f"{MAX_ABS_LENGTH_PENALTY:g}]",
            )
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputsParams):
            raise bad("structured_outputs", "must be a StructuredOutputsParams (or its dict)")
        if so is not None and self.is_beam_search:
            raise bad("structured_outputs", "cannot be combined with beam search (beam_width > 1)")
        if so is not None and self.min_tokens > 0:
            raise bad(
                "min_tokens",
                "must be 0 with structured_outputs (the grammar decides where the output ends)",
            )
        if self.best_of > self.n and self.temperature == 0.0 and not self.is_beam_search:
            raise bad("best_of", "greater than n needs sampling (temperature > 0)")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def is_beam_search(self) -> bool:
        return self.beam_width > 1

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )
