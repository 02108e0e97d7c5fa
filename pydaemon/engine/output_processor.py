"""The front end's half of a step: token ids from the engine core in, RequestOutputs out.

Per request it keeps each sequence's tokens, incremental detokenizer and text; it checks stop
strings (the core checks EOS, stop token ids and lengths itself, with the same StopChecker)
and streams only text that can no longer turn into a stop string. A sequence that a stop
string ended is reported in ``process``'s second result so that the caller frees it in the
core (``EngineCore.finish_seq``); tokens the core made for it meanwhile are dropped.

Streaming requests (``best_of == n``, no beam search) get deltas; best_of > n and beam search
only know their outputs at the end and get one whole, final RequestOutput.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pydaemon.core.messages import EngineCoreOutput, EngineCoreOutputs, SeqOutput
from pydaemon.core.stop_checker import StopChecker
from pydaemon.engine.detokenizer import IncrementalDetokenizer
from pydaemon.outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprobs
from pydaemon.sampling_params import SamplingParams


@dataclass
class _SeqState:
    index: int
    detokenizer: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    cumulative_logprob: float = 0.0
    text: str = ""  # text known not to be part of a stop string
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_streamed_tokens: int = 0
    num_streamed_chars: int = 0
    num_streamed_logprobs: int = 0
    final_sent: bool = False


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    stop_checker: StopChecker
    metrics: RequestMetrics
    seqs: dict[int, _SeqState] = field(default_factory=dict)
    is_finished: bool = False
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=list)  # [None, ...]
    num_sent_prompt_logprobs: int = 0

    @property
    def streams_deltas(self) -> bool:
        return not self.params.is_beam_search and self.params.best_of == self.params.n

    @property
    def num_seqs(self) -> int:
        """Sequences the request ends with (beam search: reported whole at the end)."""
        return self.params.n if self.params.is_beam_search else self.params.best_of


class OutputProcessor:
    def __init__(self, tokenizer, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.requests: dict[str, RequestState] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        eos_token_ids: set[int],
        metrics: RequestMetrics,
    ) -> None:
        checker = StopChecker(params, eos_token_ids)
        self.requests[request_id] = RequestState(
            request_id, prompt, prompt_token_ids, params, checker, metrics
        )

    def abort_request(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def process(
        self, core_outputs: EngineCoreOutputs
    ) -> tuple[list[RequestOutput], list[tuple[str, int]]]:
        """-> (the outputs to deliver, the (request_id, index) sequences a stop string ended)."""
        outputs: list[RequestOutput] = []
        stopped: list[tuple[str, int]] = []
        for core_output in core_outputs.outputs:
            state = self.requests.get(core_output.request_id)
            if state is None:
                continue  # aborted by the front end since
            if core_output.metrics is not None:
                state.metrics = core_output.metrics
            if core_output.new_prompt_logprobs:
                if not state.prompt_logprobs:
                    state.prompt_logprobs.append(None)  # the first prompt token: no context
                state.prompt_logprobs += core_output.new_prompt_logprobs
            for seq_output in core_output.seqs:
                if self._update_seq(state, seq_output):
                    stopped.append((state.request_id, seq_output.index))
            finished_seqs = sum(s.finish_reason is not None for s in state.seqs.values())
            state.is_finished = core_output.finished or finished_seqs == state.num_seqs
            if core_output.error is not None:
                for seq in state.seqs.values():
                    if seq.finish_reason is None:
                        seq.finish_reason = "abort"
            output = self._make_output(state, core_output)
            if output is not None:
                outputs.append(output)
            if state.is_finished:
                del self.requests[state.request_id]
        return outputs, stopped

    def _update_seq(self, state: RequestState, out: SeqOutput) -> bool:
        """Applies one sequence's news; True when a stop string ended it here."""
        seq = state.seqs.get(out.index)
        if seq is None:
            detokenizer = None
            if self.tokenizer is not None and not state.params.is_beam_search:
                detokenizer = IncrementalDetokenizer(
                    self.tokenizer, state.prompt_token_ids, state.params.skip_special_tokens
                )
            seq = state.seqs[out.index] = _SeqState(out.index, detokenizer)
            if state.params.logprobs is not None:
                seq.logprobs = []
        if seq.finish_reason is not None:
            return False  # a stop string ended it; the core had made more meanwhile
        seq.cumulative_logprob = out.cumulative_logprob
        if state.params.is_beam_search:  # a whole hypothesis, once
            seq.token_ids = list(out.new_token_ids)
            seq.finish_reason = out.finish_reason
            if self.tokenizer is not None:
                seq.text = self.tokenizer.decode(
                    seq.token_ids, skip_special_tokens=state.params.skip_special_tokens
                )
            return False
        if seq.logprobs is not None and out.new_logprobs is not None:
            seq.logprobs.extend(out.new_logprobs)
        checker = state.stop_checker
        full_text = seq.detokenizer.text if seq.detokenizer is not None else ""
        for token_id in out.new_token_ids:
            seq.token_ids.append(token_id)
            num_new_chars = 0
            if seq.detokenizer is not None:
                num_new_chars = len(seq.detokenizer.add([token_id]))
                full_text = seq.detokenizer.text
            decision = checker.check(token_id, len(seq.token_ids), full_text, num_new_chars)
            if decision.finished:
                seq.finish_reason, seq.stop_reason = decision.finish_reason, decision.stop_reason
                seq.text = full_text[: decision.text_len]
                if isinstance(decision.stop_reason, str):
                    return out.finish_reason is None  # the core does not know yet
                break
        if seq.finish_reason is None and out.finish_reason is not None:
            seq.finish_reason, seq.stop_reason = out.finish_reason, out.stop_reason
        if seq.finish_reason is not None:
            if seq.detokenizer is not None:
                seq.detokenizer.flush()  # an incomplete character held back at the very end
                full_text = seq.detokenizer.text
            seq.text = full_text
        else:
            seq.text = full_text[: checker.safe_stream_len(full_text)]
        return False

    def _make_output(
        self, state: RequestState, core_output: EngineCoreOutput
    ) -> RequestOutput | None:
        if state.streams_deltas:
            return self._make_delta(state, core_output.error)
        if state.is_finished:
            return self._make_final(state, core_output.error)
        return None

    def _make_delta(self, state: RequestState, error: str | None) -> RequestOutput | None:
        """The new tokens and text of each sequence since the last delta."""
        outputs = []
        for seq in sorted(state.seqs.values(), key=lambda s: s.index):
            new_tokens = seq.token_ids[seq.num_streamed_tokens :]
            new_text = seq.text[seq.num_streamed_chars :]
            is_finished = seq.finish_reason is not None
            if not new_tokens and not new_text and not (is_finished and not seq.final_sent):
                continue
            logprobs = None
            if seq.logprobs is not None:
                logprobs = seq.logprobs[seq.num_streamed_logprobs :]
                seq.num_streamed_logprobs = len(seq.logprobs)
            seq.num_streamed_tokens = len(seq.token_ids)
            seq.num_streamed_chars = len(seq.text)
            seq.final_sent = is_finished
            outputs.append(_completion(seq, new_tokens, new_text, logprobs))
        if not outputs and not state.is_finished:
            return None
        return _request_output(state, outputs, error)

    def _make_final(self, state: RequestState, error: str | None) -> RequestOutput:
        """The best n, whole: beam search ranked by the core, best_of > n by cumulative
        logprob."""
        seqs = list(state.seqs.values())
        if state.params.is_beam_search:
            seqs.sort(key=lambda s: s.index)
        else:
            seqs.sort(key=lambda s: -s.cumulative_logprob)
        outputs = [
            _completion(seq, list(seq.token_ids), seq.text, seq.logprobs, index=rank)
            for rank, seq in enumerate(seqs[: state.params.n])
        ]
        return _request_output(state, outputs, error)


def _completion(
    seq: _SeqState,
    token_ids: list[int],
    text: str,
    logprobs: list[TokenLogprobs] | None,
    index: int | None = None,
) -> CompletionOutput:
    return CompletionOutput(
        index=seq.index if index is None else index,
        token_ids=token_ids,
        text=text,
        finish_reason=seq.finish_reason,
        stop_reason=seq.stop_reason,
        cumulative_logprob=seq.cumulative_logprob,
        logprobs=logprobs,
    )


def _request_output(
    state: RequestState, outputs: list[CompletionOutput], error: str | None
) -> RequestOutput:
    """The prompt logprobs not delivered yet ride along (all of them before the first token)."""
    prompt_logprobs = None
    if len(state.prompt_logprobs) > state.num_sent_prompt_logprobs:
        prompt_logprobs = state.prompt_logprobs[state.num_sent_prompt_logprobs :]
        state.num_sent_prompt_logprobs = len(state.prompt_logprobs)
    return RequestOutput(
        request_id=state.request_id,
        prompt=state.prompt,
        prompt_token_ids=state.prompt_token_ids,
        outputs=outputs,
        finished=state.is_finished,
        metrics=state.metrics,
        error=error,
        prompt_logprobs=prompt_logprobs,
    )
