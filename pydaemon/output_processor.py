"""After sampling: append tokens, detokenize incrementally, check stops, build output deltas."""

from __future__ import annotations

from pydaemon.detokenizer import IncrementalDetokenizer
from pydaemon.outputs import CompletionOutput, RequestOutput
from pydaemon.request import Request, Sequence
from pydaemon.stop_checker import StopChecker


class OutputProcessor:
    def __init__(self, tokenizer, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len

    def init_seq(self, request: Request, seq: Sequence) -> None:
        """Give a new (or forked, before its first token) sequence its streaming state."""
        if request.params.is_beam_search:
            return
        seq.stop_checker = StopChecker(request.params, request.eos_token_ids)
        if self.tokenizer is not None:
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids)
        if request.params.logprobs is not None:
            seq.logprobs = []

    def append_token(
        self,
        request: Request,
        seq: Sequence,
        token_id: int,
        logprob: float,
        top_logprobs: dict[int, float] | None,
    ) -> bool:
        """Add one sampled token; returns True when the sequence finished with it."""
        seq.output_token_ids.append(token_id)
        seq.cumulative_logprob += logprob
        if seq.logprobs is not None and top_logprobs is not None:
            seq.logprobs.append(top_logprobs)
        num_new_chars = 0
        full_text = ""
        if seq.detokenizer is not None:
            num_new_chars = len(seq.detokenizer.add([token_id]))
            full_text = seq.detokenizer.text
        decision = seq.stop_checker.check(
            token_id, len(seq.output_token_ids), full_text, num_new_chars
        )
        finish_reason, stop_reason = decision.finish_reason, decision.stop_reason
        if finish_reason is None and seq.num_tokens >= self.max_model_len:
            finish_reason = "length"
        if finish_reason is not None:
            seq.finish_reason, seq.stop_reason = finish_reason, stop_reason
            text_len = decision.text_len
            if seq.detokenizer is not None and decision.stop_reason not in request.params.stop:
                seq.detokenizer.flush()  # an incomplete character held back at the very end
                full_text = seq.detokenizer.text
                text_len = len(full_text)
            seq.text = full_text[:text_len]
        else:
            seq.text = full_text[: seq.stop_checker.safe_stream_len(full_text)]
        return finish_reason is not None

    def finish_beam_seq(self, seq: Sequence, finish_reason: str) -> None:
        seq.finish_reason = finish_reason
        if self.tokenizer is not None:
            seq.text = self.tokenizer.decode(seq.output_token_ids)

    def make_delta(self, request: Request) -> RequestOutput | None:
        """The new tokens and text of each sequence since the last delta (streaming requests)."""
        outputs = []
        for seq in request.seqs + request.finished_seqs:
            new_tokens = seq.output_token_ids[seq.num_streamed_tokens :]
            new_text = seq.text[seq.num_streamed_chars :]
            if not new_tokens and not new_text and not (seq.is_finished and not seq.final_sent):
                continue
            logprobs = None
            if seq.logprobs is not None:
                logprobs = seq.logprobs[seq.num_streamed_logprobs :]
                seq.num_streamed_logprobs = len(seq.logprobs)
            seq.num_streamed_tokens = len(seq.output_token_ids)
            seq.num_streamed_chars = len(seq.text)
            seq.final_sent = seq.is_finished
            outputs.append(
                CompletionOutput(
                    index=seq.index,
                    token_ids=new_tokens,
                    text=new_text,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                    cumulative_logprob=seq.cumulative_logprob,
                    logprobs=logprobs,
                )
            )
        if not outputs and not request.is_finished:
            return None
        outputs.sort(key=lambda o: o.index)
        return self._request_output(request, outputs)

    def make_final(self, request: Request) -> RequestOutput:
        """Non-streaming requests (beam search, best_of > n): the best n, whole."""
        seqs = sorted(request.finished_seqs, key=lambda s: s.index)
        outputs = [
            CompletionOutput(
                index=i,
                token_ids=list(seq.output_token_ids),
                text=seq.text,
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
                cumulative_logprob=seq.cumulative_logprob,
                logprobs=seq.logprobs,
            )
            for i, seq in enumerate(seqs[: request.params.n])
        ]
        return self._request_output(request, outputs)

    @staticmethod
    def _request_output(request: Request, outputs: list[CompletionOutput]) -> RequestOutput:
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=outputs,
            finished=request.is_finished,
            metrics=request.metrics,
        )
