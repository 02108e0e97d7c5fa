"""Proto messages → engine arguments, with INVALID_ARGUMENT messages that name the field."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from pydaemon.config.generation import GenerationDefaults
from pydaemon.entrypoints.common.limits import (
    EMPTY_PROMPT,
    MAX_CACHE_SALT_LEN,
    MAX_REQUEST_ID_LEN,
    MAX_STOP_TOKEN_IDS,
    LimitError,
    check_stop,
    check_texts_size,
    check_token_ids,
    out_of_vocabulary,
)
from pydaemon.entrypoints.common.tool_parsers import ToolParser
from pydaemon.generate_request import GenerateRequest
from pydaemon.lora_request import LoRARequest
from pydaemon.proto.pagedd.v1 import generation_pb2 as pb
from pydaemon.sampling_params import (
    MAX_LOGIT_BIAS_TOKENS,
    MAX_LOGPROB_TOKEN_IDS,
    SamplingParams,
    StructuredOutputsParams,
    logit_bias_out_of_vocab,
)

# The proto's optional sampling fields (unset and zero differ), each the SamplingParams field
# of its name, read from the message itself: a field added to both needs nothing here. The
# repeated and map fields (stop, stop_token_ids, logit_bias, logprob_token_ids) are converted
# below.
_OPTIONAL_SAMPLING_FIELDS = tuple(
    f.name for f in pb.SamplingParams.DESCRIPTOR.fields if f.has_presence
)


class RequestInvalid(Exception):
    """A request refused before it reaches the engine; carries its gRPC status code."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def _invalid(message: str) -> RequestInvalid:
    return RequestInvalid(grpc.StatusCode.INVALID_ARGUMENT, message)


@dataclass
class EngineArgs:
    """One StartRequest, converted and checked."""

    prompt: str | list[int]
    params: SamplingParams
    priority: int
    cache_salt: str | None
    time_limit_s: float | None
    lora_request: LoRARequest | None = None  # set by the servicer from StartRequest.adapter
    tool_parser: ToolParser | None = None  # chat with tools: reads the calls of the output

    def engine_request(self, request_id: str) -> GenerateRequest:
        """The engine's request, under the servicer's unique ``request_id``."""
        return GenerateRequest(
            request_id, self.prompt, self.params, self.priority, self.cache_salt, self.lora_request
        )


def check_request_id(request_id: str) -> str | None:
    """The stream-level problem with a request_id, or None when it is fine."""
    if not request_id:
        return "request_id is empty"
    if len(request_id) > MAX_REQUEST_ID_LEN:
        return f"request_id is longer than {MAX_REQUEST_ID_LEN} characters"
    return None


def to_sampling_params(
    msg: pb.SamplingParams,
    vocab_size: int,
    structured_outputs: StructuredOutputsParams | None = None,
    defaults: GenerationDefaults | None = None,
) -> SamplingParams:
    """The request's fields over the model's generation ``defaults`` (the one merge every
    front end makes: ``GenerationDefaults.sampling_params``)."""
    kwargs: dict = {
        name: getattr(msg, name) for name in _OPTIONAL_SAMPLING_FIELDS if msg.HasField(name)
    }
    kwargs["structured_outputs"] = structured_outputs
    try:
        check_stop(msg.stop, "sampling.stop")
        check_token_ids(
            msg.stop_token_ids, vocab_size, "sampling.stop_token_ids", MAX_STOP_TOKEN_IDS
        )
    except LimitError as e:
        raise _invalid(e.message) from None
    kwargs["stop"] = list(msg.stop)
    kwargs["stop_token_ids"] = list(msg.stop_token_ids)
    if msg.logit_bias:
        if len(msg.logit_bias) > MAX_LOGIT_BIAS_TOKENS:  # before copying: 1M entries take 1 s
            raise _invalid(
                f"sampling.logit_bias has {len(msg.logit_bias)} entries; at most "
                f"{MAX_LOGIT_BIAS_TOKENS} token ids may be biased"
            )
        bias = dict(msg.logit_bias)
        if any(t >= vocab_size for t in bias):
            raise _invalid(f"sampling.logit_bias: {logit_bias_out_of_vocab(bias, vocab_size)}")
        kwargs["logit_bias"] = bias
    if msg.logprob_token_ids:
        try:
            check_token_ids(
                msg.logprob_token_ids,
                vocab_size,
                "sampling.logprob_token_ids",
                MAX_LOGPROB_TOKEN_IDS,
            )
        except LimitError as e:
            raise _invalid(e.message) from None
        kwargs["logprob_token_ids"] = list(msg.logprob_token_ids)
    try:
        return (defaults or GenerationDefaults()).sampling_params(**kwargs)
    except ValueError as e:
        raise _invalid(f"sampling: {e}") from None


def to_structured_outputs(msg: pb.StructuredOutput) -> StructuredOutputsParams:
    """ValueError naming what is wrong (the grammar's own syntax is the engine's to check)."""
    kind = msg.WhichOneof("kind")
    if kind is None:
        raise ValueError("set one of json_schema, regex, choice, grammar, json_object")
    kwargs: dict = {"disable_any_whitespace": msg.disable_any_whitespace}
    if kind == "json_schema":
        kwargs["json"] = msg.json_schema
    elif kind == "choice":
        kwargs["choice"] = list(msg.choice.choices)
    else:
        kwargs[kind] = getattr(msg, kind)
    return StructuredOutputsParams(**kwargs)


def check_text_size(
    text: str | Sequence[str], max_model_len: int, what: str = "prompt text"
) -> None:
    """Refuses a text (or the texts of one prompt together, as chat messages) too long for any
    prompt of this model, before rendering or tokenizing it."""
    try:
        check_texts_size((text,) if isinstance(text, str) else text, max_model_len, what)
    except LimitError as e:
        raise _invalid(e.message) from None


def to_engine_args(
    start: pb.StartRequest,
    *,
    vocab_size: int,
    has_tokenizer: bool,
    max_model_len: int,
    defaults: GenerationDefaults | None = None,
) -> EngineArgs:
    """Checks what can be checked without the engine, cheapest first; the engine checks the
    exact token length."""
    which = start.WhichOneof("prompt")
    if which is None:
        raise _invalid("prompt is not set: give prompt text or token_ids")
    if which == "text":
        if not start.text:
            raise _invalid(f"{EMPTY_PROMPT} (prompt text is empty)")
        if not has_tokenizer:
            raise _invalid("this model has no tokenizer: send token_ids, not text")
        check_text_size(start.text, max_model_len)
        prompt: str | list[int] = start.text
    else:
        num_ids = len(start.token_ids.ids)
        if not num_ids:
            raise _invalid(f"{EMPTY_PROMPT} (prompt token_ids is empty)")
        if num_ids > max_model_len:
            raise _invalid(
                f"prompt token_ids has {num_ids} tokens, longer than the context "
                f"(max_model_len {max_model_len})"
            )
        ids = list(start.token_ids.ids)
        bad = [t for t in ids if t >= vocab_size]
        if bad:
            raise _invalid(out_of_vocabulary(bad, vocab_size, "prompt token_ids"))
        prompt = ids
    if len(start.cache_salt) > MAX_CACHE_SALT_LEN:
        raise _invalid(f"cache_salt is longer than {MAX_CACHE_SALT_LEN} characters")
    structured_outputs = None
    if start.HasField("structured_output"):
        try:
            structured_outputs = to_structured_outputs(start.structured_output)
        except ValueError as e:
            raise _invalid(f"structured_output: {e}") from None
    params = to_sampling_params(start.sampling, vocab_size, structured_outputs, defaults)
    return EngineArgs(
        prompt=prompt,
        params=params,
        priority=start.priority,
        cache_salt=start.cache_salt or None,
        time_limit_s=start.time_limit_ms / 1000.0 if start.time_limit_ms else None,
    )
