"""SeqUpdater: the scheduler's half of a step after the model ran.

It records what the step computes (``advance``: ``num_computed_tokens``, full blocks offered
to the prefix cache, a placeholder token for every sequence that samples), then, once the
step's output is on the host (``update``), puts each sampled token in its placeholder's
place, checks token-level stops (EOS, stop token ids, min/max tokens, the model's length),
forks n > 1 requests at their first sample, runs beam steps, and frees finished sequences
at once. It reports per request the new token ids
(``EngineCoreOutputs``); text, stop strings and streaming are the front end's. An exception
while processing one request fails that request alone (its blocks are freed, its output
carries the error); the step and every other request go on.

Synchronous steps run both halves back to back (no placeholders: ``update`` appends the
tokens). Async scheduling (pydaemon/engine/async_stepper.py) runs ``advance`` as soon as the step is
launched, so that the next step can be scheduled with the placeholders, and ``update`` one
step later; a request that finished or was aborted in between
has its token of the step discarded.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from pydaemon.core.iteration_tokens import IterationTokens
from pydaemon.core.messages import EngineCoreOutput, EngineCoreOutputs, SeqOutput
from pydaemon.core.request import PLACEHOLDER_TOKEN_ID, Request, RequestStatus, Sequence
from pydaemon.core.runner_output import ModelRunnerOutput
from pydaemon.core.sched.beam_step import advance_beams
from pydaemon.core.sched.step_plan import ScheduledSeq, StepPlan
from pydaemon.core.seq_blocks import SeqBlocks
from pydaemon.core.stats import SpecDecodeStats
from pydaemon.outputs import TokenLogprobs

logger = logging.getLogger(__name__)


class SeqUpdater:
    def __init__(self, blocks: SeqBlocks, max_model_len: int) -> None:
        self.blocks = blocks
        self.max_model_len = max_model_len
        self.num_prompt_tokens = 0  # prefill tokens computed (cache hits excluded)
        self.num_generation_tokens = 0
        self._finished: list[Request] = []
        self.spec_stats = SpecDecodeStats()
        self.iteration_tokens = IterationTokens()  # tokens per updated step

    def take_finished(self) -> list[Request]:
        """Requests that finished or failed in the last update (their queues are the
        scheduler's to leave)."""
        finished, self._finished = self._finished, []
        return finished

    def advance(self, plan: StepPlan, placeholders: bool = True) -> None:
        """The step's tokens count as computed; with ``placeholders``, each sequence the step
        samples gets a placeholder token (only requests of one sequence: n > 1 and beam
        search run synchronous steps). Idempotent. Skips requests that ended since the step
        was scheduled."""
        if plan.is_advanced:
            return
        plan.is_advanced = True
        block_size = self.blocks.block_size
        finished = RequestStatus.FINISHED
        by_seq_id = plan.by_seq_id
        for scheduled in plan.scheduled:
            seq, request = scheduled.seq, scheduled.request
            by_seq_id[seq.seq_id] = scheduled
            if request.status is finished:
                continue  # aborted, or finished by the step before (async scheduling)
            before = seq.num_computed_tokens
            seq.num_computed_tokens = after = before + scheduled.num_new_tokens
            # Blocks below ``after`` hold real ids only: a placeholder is always the last token
            # and is replaced before the step that computes it is advanced.
            if after // block_size > before // block_size:  # a block just filled up
                self.blocks.mark_computed(seq)
            if self.blocks.releases_windows:
                # One step behind: the step before this one may still be running (async
                # scheduling), and its queries started at last_step_start.
                self.blocks.release_outside_window(seq, seq.last_step_start)
                seq.last_step_start = before
            if request.metrics.first_scheduled_time is None:
                request.metrics.first_scheduled_time = plan.scheduled_time
            if placeholders and request.has_one_seq:
                output_token_ids = seq.output_token_ids
                if after == len(seq.prompt_token_ids) + len(output_token_ids):  # it samples
                    output_token_ids.append(PLACEHOLDER_TOKEN_ID)
        self.num_prompt_tokens += sum(s.num_new_tokens for s in plan.prefills)

    def update(self, plan: StepPlan, runner_output: ModelRunnerOutput) -> EngineCoreOutputs:
        self.advance(plan, placeholders=False)  # a synchronous step appends the tokens
        now = time.monotonic()
        num_generated_before = self.num_generation_tokens
        by_seq_id = plan.by_seq_id
        outputs: dict[str, EngineCoreOutput] = {}
        touched: dict[str, Request] = {}
        for request, message in plan.rejected:
            outputs[request.request_id] = self._fail(request, message, now)
        ro = runner_output
        for seq_id, token_ids, chosen, logprobs in zip(
            ro.seq_ids, ro.sampled_token_ids, ro.chosen_logprobs, ro.logprobs, strict=True
        ):
            request = by_seq_id[seq_id].request
            if request.is_finished:
                continue  # failed earlier in this step, or ended after it was launched
            touched[request.request_id] = request
            output = outputs.get(request.request_id)
            if output is None:
                output = outputs[request.request_id] = EngineCoreOutput(request.request_id, [])
            try:
                scheduled = by_seq_id[seq_id]
                if scheduled.num_draft_slots:  # speculative decoding: a verified run
                    self._accept_drafts(scheduled, token_ids, ro.num_draft_tokens.get(seq_id, 0))
                self._append(request, scheduled.seq, token_ids, chosen, logprobs, output)
            except Exception as e:  # noqa: BLE001 - one request's failure is that request's
                outputs[request.request_id] = self._internal_error(request, e, now)
        for seq_id, (first, entries) in ro.prompt_logprobs.items():
            request = by_seq_id[seq_id].request
            if not request.is_finished:
                self._add_prompt_logprobs(request, first, entries, outputs)
        beams: dict[str, list[tuple[int, Sequence]]] = {}
        for row, seq_id in enumerate(ro.beam_seq_ids):
            scheduled = by_seq_id[seq_id]
            if scheduled.request.is_finished:
                continue
            beams.setdefault(scheduled.request.request_id, []).append((row, scheduled.seq))
        for request_id, items in beams.items():
            request = by_seq_id[items[0][1].seq_id].request
            touched[request_id] = request
            output = outputs.setdefault(request_id, EngineCoreOutput(request_id, []))
            rows = ro.beam_logprobs[[row for row, _ in items]]
            try:
                self._beam_step(request, [seq for _, seq in items], rows, output)
            except Exception as e:  # noqa: BLE001 - one request's failure is that request's
                outputs[request_id] = self._internal_error(request, e, now)
        for request_id, request in touched.items():
            if request.is_finished:
                continue  # failed: its output is already final
            output = outputs[request_id]
            if request.metrics.first_token_time is None:
                request.metrics.first_token_time = now
                output.metrics = request.metrics  # sent when it changes, not every step
            if not request.seqs:
                self._finish(request, now)
                output.finished = True
                output.metrics = request.metrics
        self.iteration_tokens.observe(
            sum(s.num_new_tokens for s in plan.prefills)
            + self.num_generation_tokens
            - num_generated_before
        )
        return EngineCoreOutputs(
            [o for o in outputs.values() if o.seqs or o.finished or o.new_prompt_logprobs]
        )

    # ---- one request ------------------------------------------------------------------------
    def _append(
        self,
        request: Request,
        seq: Sequence,
        token_ids: list[int],
        chosen_logprobs: list[float],
        logprobs: list[TokenLogprobs | None],
        output: EngineCoreOutput,
    ) -> None:
        """One sampled token per sequence; a forking sequence's n samples go to n sequences."""
        targets = [seq]
        is_run = len(token_ids) > 1 and not request.forks_at_first_sample  # accepted drafts
        if is_run:
            targets = [seq] * len(token_ids)
        elif len(token_ids) > 1:
            if not request.forks_at_first_sample:
                raise RuntimeError(f"{len(token_ids)} samples for a sequence that does not fork")
            targets += [self._fork(request, seq, k) for k in range(1, len(token_ids))]
            request.is_forked = True
        checker = request.stop_checker
        for target, token_id, chosen, top in zip(
            targets, token_ids, chosen_logprobs, logprobs, strict=True
        ):
            output_token_ids = target.output_token_ids
            if output_token_ids and output_token_ids[-1] == PLACEHOLDER_TOKEN_ID:
                output_token_ids[-1] = token_id  # the placeholder advance() put there
                num_tokens = len(target.prompt_token_ids) + len(output_token_ids)
                if target.num_slots == num_tokens:  # async: its slot was taken already
                    self.blocks.set_last_token(target)
            else:
                output_token_ids.append(token_id)
                num_tokens = len(target.prompt_token_ids) + len(output_token_ids)
            target.cumulative_logprob += chosen
            self.num_generation_tokens += 1
            finish_reason, stop_reason = checker.check_token(token_id, len(output_token_ids))
            if finish_reason is None and num_tokens >= self.max_model_len:
                finish_reason = "length"
            output.seqs.append(
                SeqOutput(
                    index=target.index,
                    new_token_ids=[token_id],
                    cumulative_logprob=target.cumulative_logprob,
                    new_logprobs=None if top is None else [top],
                    finish_reason=finish_reason,
                    stop_reason=stop_reason,
                )
            )
            if finish_reason is not None:
                target.finish_reason, target.stop_reason = finish_reason, stop_reason
                self.retire(request, target)
                if is_run:
                    break  # the run's later tokens are dropped with the sequence

    def _accept_drafts(
        self, scheduled: ScheduledSeq, token_ids: list[int], num_drafts: int
    ) -> None:
        """A verify step's result: ``token_ids`` is the accepted drafts, then one sampled token.
        The accepted drafts keep their slots and count as computed (their K/V was written);
        the other draft slots are dropped with the blocks only they used."""
        seq = scheduled.seq
        accepted = token_ids[:-1]
        if len(accepted) > min(num_drafts, scheduled.num_draft_slots):
            raise RuntimeError(
                f"sequence {seq.seq_id}: {len(accepted)} drafts accepted of {num_drafts} proposed"
            )
        self.blocks.accept_drafts(seq, seq.num_tokens, accepted)
        if accepted:
            seq.num_computed_tokens += len(accepted)
            self.blocks.mark_computed(seq)
        self.spec_stats.record(num_drafts, len(accepted))

    def _fork(self, request: Request, parent: Sequence, index: int) -> Sequence:
        child = Sequence.new(
            index,
            parent.prompt_token_ids,
            output_token_ids=list(parent.output_token_ids),
            num_computed_tokens=parent.num_computed_tokens,
            cumulative_logprob=parent.cumulative_logprob,
        )
        self.blocks.fork(parent, child)
        request.seqs.append(child)
        return child

    def _beam_step(
        self, request: Request, seqs: list[Sequence], rows: np.ndarray, output: EngineCoreOutput
    ) -> None:
        """rows: [len(seqs), vocab] float32 log-probabilities of the beams run this step."""
        result = advance_beams(self.blocks, request, seqs, rows)
        self.num_generation_tokens += result.num_new_tokens
        output.seqs.extend(result.finished)

    def retire(self, request: Request, seq: Sequence) -> None:
        """A sequence finished: its blocks are freed now."""
        self.blocks.free(seq)
        request.seqs.remove(seq)

    def _finish(self, request: Request, now: float) -> None:
        request.status = RequestStatus.FINISHED
        request.metrics.finished_time = now
        self._finished.append(request)

    @staticmethod
    def _add_prompt_logprobs(
        request: Request,
        first: int,
        entries: list[TokenLogprobs],
        outputs: dict[str, EngineCoreOutput],
    ) -> None:
        """Prompt logprobs of positions ``first``.. from one prefill chunk: those not sent
        yet go out in order (a recomputed prefill repeats positions)."""
        skip = request.num_prompt_logprobs + 1 - first
        if skip < 0 or skip >= len(entries):
            return
        new = entries[skip:]
        request.num_prompt_logprobs += len(new)
        output = outputs.setdefault(request.request_id, EngineCoreOutput(request.request_id, []))
        output.new_prompt_logprobs = (output.new_prompt_logprobs or []) + new

    def _fail(self, request: Request, message: str, now: float) -> EngineCoreOutput:
        """Ends a request with an error; no token of it is sent again."""
        self._finish(request, now)
        return EngineCoreOutput(
            request.request_id, [], finished=True, metrics=request.metrics, error=message
        )

    def _internal_error(self, request: Request, error: Exception, now: float) -> EngineCoreOutput:
        logger.exception("request %s failed inside the engine core", request.request_id)
        return self._fail(
            request,
            f"internal error while processing request {request.request_id!r}: {error!r}",
            now,
        )
