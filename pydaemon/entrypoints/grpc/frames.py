"""Engine outputs → GenerateResponse frames, and the per-request accounting behind Finished."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import grpc

from pydaemon.entrypoints.common.constraint_errors import (
    grpc_constraint_field,
    is_constraint_error,
    rename_constraint_field,
)
from pydaemon.entrypoints.common.reasoning_parsers import ReasoningStreams
from pydaemon.entrypoints.common.token_texts import TokenTexts
from pydaemon.entrypoints.common.tool_choice import ForcedToolParser
from pydaemon.entrypoints.common.tool_parsers import ToolParser
from pydaemon.outputs import RequestMetrics, RequestOutput
from pydaemon.proto.pagedd.v1 import generation_pb2 as pb

FINISH_REASONS = {
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORTED,
}


@dataclass
class RequestAccount:
    """What one request produced so far: enough to write its Finished frame."""

    request_id: str  # the client's id
    num_sequences: int = 1  # outputs the client asked for (n): each gets a finish reason
    max_tokens: int | None = None  # the engine request's max_tokens (None: none was made)
    num_prompt_tokens: int = 0
    num_completion_tokens: int = 0
    num_tokens_by_index: dict[int, int] = field(default_factory=dict)
    finish_reasons: dict[int, int] = field(default_factory=dict)  # index -> FinishReason
    stop_reason: str = ""
    abort_reason: str = ""  # the engine's message when it ended the request with an error
    metrics: RequestMetrics | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    # Chat with tools: reads each sequence's calls out of its text at the end.
    tool_parser: ToolParser | None = None
    texts: dict[int, list[str]] = field(default_factory=dict)  # kept only with a tool parser
    # Chat with a reasoning parser: each sequence's reasoning apart from its answer.
    reasoning: ReasoningStreams | None = None
    # Logprobs: each token's text in context (the model's tokenizer; None: "token_id:<id>").
    tokenizer: Any = None
    token_texts: dict[int, TokenTexts] = field(default_factory=dict)  # index -> its texts

    def frames(self, output: RequestOutput) -> list[pb.GenerateResponse]:
        """TokenDelta frames of one engine output; records counts and finish reasons."""
        self.num_prompt_tokens = len(output.prompt_token_ids)
        if output.error:
            self.abort_reason = self.user_facing(output.error)
        if output.metrics is not None:
            self.metrics = output.metrics
        frames = []
        for seq in output.outputs:
            if seq.finish_reason is not None:
                self.finish_reasons[seq.index] = FINISH_REASONS.get(
                    seq.finish_reason, pb.FINISH_REASON_ABORTED
                )
                if seq.stop_reason is not None and not self.stop_reason:
                    self.stop_reason = str(seq.stop_reason)
            reasoning = content = ""
            if self.reasoning is not None:
                reasoning, content = self.reasoning.feed(
                    seq.index, seq.text, seq.finish_reason is not None
                )
            if not seq.token_ids and not seq.text and not reasoning and not content:
                continue
            if self.tool_parser is not None:
                self.texts.setdefault(seq.index, []).append(seq.text)
            self.num_completion_tokens += len(seq.token_ids)
            self.num_tokens_by_index[seq.index] = self.num_tokens_by_index.get(seq.index, 0) + len(
                seq.token_ids
            )
            delta = pb.TokenDelta(
                index=seq.index,
                token_ids=seq.token_ids,
                text=seq.text,
                cumulative_logprob=seq.cumulative_logprob,
            )
            if self.reasoning is not None:  # set, even empty: the split is on
                delta.reasoning, delta.content = reasoning, content
            if seq.logprobs:
                delta.logprobs.extend(self._logprobs(output, seq.index, seq))
            frames.append(pb.GenerateResponse(request_id=self.request_id, delta=delta))
        return frames

    def user_facing(self, message: str) -> str:
        """An engine error naming the request's fields as the client wrote them (a constraint
        error names StartRequest.structured_output.*, or messages.tools for a forced call)."""
        if not is_constraint_error(message):
            return message
        if isinstance(self.tool_parser, ForcedToolParser):
            return rename_constraint_field(message, lambda kind: "messages.tools")
        return rename_constraint_field(message, grpc_constraint_field)

    def _logprobs(self, output: RequestOutput, index: int, seq) -> list[pb.TokenLogprobs]:
        """The delta's logprobs, each token and alternative with its text in context."""
        texts = self.token_texts.get(index)
        if texts is None:
            texts = self.token_texts[index] = TokenTexts(self.tokenizer, output.prompt_token_ids)
        out = []
        for token_id, position, names in zip(
            seq.token_ids, seq.logprobs, texts.texts(seq.token_ids, seq.logprobs), strict=False
        ):
            out.append(
                pb.TokenLogprobs(
                    token_id=token_id,
                    logprob=position.get(token_id, 0.0),
                    text=names[token_id],
                    top_logprobs=[
                        pb.TopLogprob(token_id=t, logprob=lp, text=names[t])
                        for t, lp in sorted(position.items(), key=lambda kv: -kv[1])
                    ],
                )
            )
        return out

    def finished(self, reason: int | None = None) -> pb.GenerateResponse:
        """The Finished frame; ``reason`` overrides the engine's (cancelled, time limit...)."""
        n = max(max(self.finish_reasons, default=-1) + 1, self.num_sequences)
        per_seq = [self.finish_reasons.get(i, reason or pb.FINISH_REASON_ABORTED) for i in range(n)]
        if reason is None:
            reason = per_seq[0] if per_seq else pb.FINISH_REASON_ABORTED
        return pb.GenerateResponse(
            request_id=self.request_id,
            finished=pb.Finished(
                finish_reason=reason,
                sequence_finish_reasons=per_seq,
                usage=pb.Usage(
                    prompt_tokens=self.num_prompt_tokens,
                    completion_tokens=self.num_completion_tokens,
                    cached_tokens=self.metrics.num_cached_tokens if self.metrics else 0,
                ),
                timings=pb.Timings(**self.timings_ms()),
                stop_reason=self.stop_reason if reason == pb.FINISH_REASON_STOP else "",
                tool_calls=self._tool_calls(),
                reasoning=self._reasoning(),
                abort_reason=self.abort_reason if reason == pb.FINISH_REASON_ABORTED else "",
            ),
        )

    def _answer(self, index: int) -> str:
        if self.reasoning is None:
            return "".join(self.texts.get(index, ()))
        return self.reasoning.split(index).content or ""

    def _reasoning(self) -> list[pb.SequenceReasoning]:
        if self.reasoning is None:
            return []
        out = []
        for index in sorted(self.num_tokens_by_index):
            split = self.reasoning.split(index)
            content = split.content or ""
            if self.tool_parser is not None and content:
                parsed = self.tool_parser.parse(content)
                content = content if not parsed.tool_calls else parsed.content or ""
            out.append(
                pb.SequenceReasoning(index=index, reasoning=split.reasoning, content=content)
            )
        return out

    def _tool_calls(self) -> list[pb.SequenceToolCalls]:
        if self.tool_parser is None:
            return []
        out = []
        for index in sorted(self.texts):
            if self.finish_reasons.get(index) != pb.FINISH_REASON_STOP:
                continue  # cut short: no complete calls
            calls = self.tool_parser.parse(self._answer(index)).tool_calls
            if calls:
                out.append(
                    pb.SequenceToolCalls(
                        index=index,
                        calls=[pb.ToolCall(id=c.id, name=c.name, arguments_json=c.arguments)
                               for c in calls],
                    )
                )  # fmt: skip
        return out

    def timings_ms(self) -> dict[str, float]:
        m = self.metrics
        arrival = m.arrival_time if m else self.arrival_time
        end = m.finished_time if m and m.finished_time else time.monotonic()
        out = {"total_ms": (end - arrival) * 1e3}
        if m and m.first_scheduled_time is not None:
            out["queue_ms"] = (m.first_scheduled_time - arrival) * 1e3
        if m and m.first_token_time is not None:
            out["time_to_first_token_ms"] = (m.first_token_time - arrival) * 1e3
        return out

    def time_per_output_token_s(self) -> float | None:
        m = self.metrics
        longest = max(self.num_tokens_by_index.values(), default=0)
        if not m or m.first_token_time is None or m.finished_time is None or longest < 2:
            return None
        return (m.finished_time - m.first_token_time) / (longest - 1)


def error_frame(request_id: str, code: grpc.StatusCode, message: str) -> pb.GenerateResponse:
    return pb.GenerateResponse(
        request_id=request_id, error=pb.RequestError(code=code.value[0], message=message)
    )
