"""SpecDecoder: a verify step in the model runner (draft, then verify in one forward).

The scheduler reserved up to k draft slots for some decodes (``SchedulerOutput.
num_draft_tokens``). Before the forward pass the proposer drafts m <= k tokens for each; the
drafts are written past the sequence's tokens in its InputBatch row and the decode becomes a
short prefill of m + 1 tokens (the paged prefill path attends over the cached context plus
the new tokens), moved into the step's prefill group. Every verified position's logits are
sampled: the other sequences through the StepSampler as usual, the verified ones through the
RejectionSampler, whose accepted run (drafts, then one sampled token) becomes the sequence's
``sampled_token_ids`` entry. A verify step where every sequence has exactly k drafts (no
plain decode, no prefill beside them) replays a verify CUDA graph (cuda_graphs.py); other
verify steps run eagerly.

Padding (``pad_drafts``, on where verify graphs exist): in a step of decodes only, each with
k draft slots, where some sequence got drafts, every sequence's drafts are filled up to k by
repeating its last token (draft or not), so that the step replays a verify graph instead of
running eagerly (an eager step costs several graph replays: proposers rarely find k tokens
for every sequence). Fillers are drafts like any other: verification keeps the target
distribution whatever the drafts are; the counters count them. Verify steps run synchronously
(the scheduler must see the accepted run before planning the next step); under async
scheduling the steps without draft slots (more than ``disable_by_batch_size`` sequences)
still overlap (pydaemon/engine/async_stepper.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from pydaemon.config.speculative import SpeculativeConfig
from pydaemon.core.runner_output import ModelRunnerOutput
from pydaemon.core.sched.scheduler_output import GrammarOutput, SchedulerOutput
from pydaemon.sampling.sampling_metadata import SamplingMetadata
from pydaemon.worker.async_output import AsyncModelRunnerOutput
from pydaemon.worker.input_batch import InputBatch, StepInput
from pydaemon.worker.spec_decode.ngram_proposer import NgramProposer
from pydaemon.worker.spec_decode.proposer import DraftRequest, Proposer, TargetStep
from pydaemon.worker.spec_decode.rejection_sampler import RejectionSampler
from pydaemon.worker.step_sampler import StepSampler


@dataclass
class VerifyPlan:
    """The step as verified: ``out`` lists the sequences with drafts among the prefills."""

    out: SchedulerOutput
    drafts: dict[int, list[int]]  # seq_id -> its drafts (m >= 1), in batch order
    first: int  # batch index of the first sequence with drafts
    num_emitted: list[int] = dataclasses.field(default_factory=list)  # after sampling, per seq


class SpecDecoder:
    def __init__(
        self,
        spec: SpeculativeConfig,
        input_batch: InputBatch,
        step_sampler: StepSampler,
        proposer: Proposer | None = None,
    ) -> None:
        """``proposer``: the draft model's or the EAGLE head's (draft_model.py,
        eagle_proposer.py); None makes the n-gram one."""
        self.spec = spec
        self.input_batch = input_batch
        self.step_sampler = step_sampler
        self.proposer: Proposer = proposer or NgramProposer(
            spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max
        )
        self.rejection_sampler = RejectionSampler()
        self.pad_drafts = False  # the model runner turns it on when it has verify graphs

    def forget(self, seq_ids: list[int]) -> None:
        """The runner dropped these sequences (every step's ``finished_seq_ids``)."""
        if seq_ids:
            self.proposer.forget(seq_ids)

    # ---- before the forward -----------------------------------------------------------------
    def propose(self, out: SchedulerOutput) -> VerifyPlan | None:
        """Drafts for the decodes with draft slots; None when no sequence got any."""
        batch = self.input_batch
        requests = []
        for seq_id, k in out.num_draft_tokens.items():
            state = batch.seqs[seq_id]
            row = state.row
            tokens = batch.token_ids[row, : batch.num_tokens[row]]
            blocks = batch.block_table[row, : batch.num_blocks[row]]
            num_prompt = int(batch.num_prompt_tokens[row])
            requests.append(
                DraftRequest(
                    seq_id, tokens, k, blocks, state.params, num_prompt, state.min_tokens_stop_ids
                )
            )
        proposed = self.proposer.propose(requests)
        drafts = {
            r.seq_id: list(d[: r.max_drafts])
            for r, d in zip(requests, proposed, strict=True)
            if len(d)
        }
        if not drafts:
            return None
        if self.pad_drafts and self._fills_a_verify_graph(out, requests):
            drafts = {r.seq_id: _padded(r, drafts.get(r.seq_id, [])) for r in requests}
        for seq_id, ids in drafts.items():  # past the row's tokens: not counted as its own
            row = batch.seqs[seq_id].row
            n = int(batch.num_tokens[row])
            batch.token_ids[row, n : n + len(ids)] = ids
        scheduled = out.num_scheduled_tokens
        prefill_ids = list(scheduled)[: out.num_prefills]
        order = {s: scheduled[s] for s in prefill_ids}
        order.update((s, 1 + len(ids)) for s, ids in drafts.items())
        order.update((s, n) for s, n in scheduled.items() if s not in order)
        verified = dataclasses.replace(
            out, num_scheduled_tokens=order, num_prefills=out.num_prefills + len(drafts)
        )
        return VerifyPlan(verified, drafts, out.num_prefills)

    def _fills_a_verify_graph(self, out: SchedulerOutput, requests: list[DraftRequest]) -> bool:
        """Whether padding every sequence's drafts to k makes this a verify graph's step: only
        decodes, each with k draft slots (see the module docstring)."""
        k = self.spec.num_speculative_tokens
        return (
            out.num_prefills == 0
            and len(requests) == len(out.num_scheduled_tokens)
            and all(r.max_drafts == k for r in requests)
        )

    def prepare(self, plan: VerifyPlan) -> StepInput:
        """The step's inputs with the drafts; every verified position is a logits row."""
        batch = self.input_batch
        rows = np.fromiter((batch.seqs[s].row for s in plan.drafts), np.int64, len(plan.drafts))
        num_drafts = np.fromiter((len(d) for d in plan.drafts.values()), np.int32, len(rows))
        batch.num_tokens[rows] += num_drafts  # the drafts are inputs of this step only
        try:
            step = batch.prepare(plan.out)
        finally:
            batch.num_tokens[rows] -= num_drafts
        is_verified = np.zeros(len(step.seq_ids), dtype=bool)
        is_verified[plan.first : plan.first + len(plan.drafts)] = True
        counts = np.where(is_verified, step.query_lens, step.is_sampled.astype(np.int32))
        starts = np.where(is_verified, step.query_start_loc[:-1], step.query_start_loc[1:] - 1)
        offsets = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
        step.sample_index = (np.repeat(starts, counts) + offsets).astype(np.int64)
        step.is_sampled = step.is_sampled & ~is_verified  # the StepSampler's rows
        return step

    # ---- after the forward ------------------------------------------------------------------
    def observe(
        self,
        step: StepInput,
        hidden_states: torch.Tensor,
        input_ids: torch.Tensor,
        plan: VerifyPlan | None,
    ) -> None:
        """Hands the target's hidden states to a proposer that reads them (EAGLE), after the
        step's sampling: a verified sequence's valid rows are its emitted run's (the last
        real token and the accepted drafts). hidden_states: [>= num_tokens, hidden_size];
        input_ids: [>= num_tokens] int64, on the device."""
        num_valid = step.query_lens.copy()
        if plan is not None:
            num_valid[plan.first : plan.first + len(plan.drafts)] = plan.num_emitted
        self.proposer.observe_target(
            TargetStep(
                seq_ids=step.seq_ids,
                starts=step.positions[step.query_start_loc[:-1]],
                query_start_loc=step.query_start_loc,
                num_valid=num_valid,
                block_tables=step.block_tables,
                input_ids=input_ids,
                hidden_states=hidden_states,
            )
        )

    def sample(
        self,
        logits: torch.Tensor,
        step: StepInput,
        plan: VerifyPlan,
        num_samples: dict[int, int],
        grammar: GrammarOutput | None = None,
    ) -> AsyncModelRunnerOutput:
        """logits: [len(step.sample_index), vocab] float32 -> the step's output, on the host
        (a verify step is synchronous). grammar: the bitmask of its constrained rows (they
        never have drafts: pydaemon/core/sched/spec_slots.py)."""
        num_verify_rows = sum(len(d) + 1 for d in plan.drafts.values())
        # Logits rows in batch order: the prefills' before the verified, the decodes' after.
        num_before = int(step.is_sampled[: plan.first].sum())
        verify = logits[num_before : num_before + num_verify_rows]
        others = torch.cat([logits[:num_before], logits[num_before + num_verify_rows :]])
        out = self.step_sampler.sample(others, step, num_samples, grammar).get_output()
        self._verify(verify, plan, out)
        return AsyncModelRunnerOutput(out)

    def _verify(self, logits: torch.Tensor, plan: VerifyPlan, out: ModelRunnerOutput) -> None:
        batch, step_sampler = self.input_batch, self.step_sampler
        params, prompts, outputs, generators, stop_ids, draft_ids = [], [], [], [], [], []
        for seq_id, drafts in plan.drafts.items():
            state = batch.seqs[seq_id]
            prompt: list[int] = []
            output: list[int] = []  # read only where penalties or min_tokens need them
            if state.params.has_penalties or state.params.min_tokens:
                prompt = batch.prompt_token_ids(seq_id)
                output = batch.output_token_ids(seq_id)
            generator = step_sampler.generator(state, state.index)
            for j in range(len(drafts) + 1):  # row j follows drafts[:j]
                params.append(state.params)
                prompts.append(prompt)
                outputs.append(output + drafts[:j])
                generators.append(generator)
                stop_ids.append(state.min_tokens_stop_ids)
                draft_ids.append(drafts[j] if j < len(drafts) else -1)
        metadata = SamplingMetadata.build(
            params=params,
            prompt_token_ids=prompts,
            output_token_ids=outputs,
            generators=generators,
            device=logits.device,
            stop_ids_for_min_tokens=stop_ids,
        )
        ids = torch.tensor(draft_ids, dtype=torch.int64).to(logits.device)
        packed = self.rejection_sampler.verify(logits, ids, metadata)
        runs = self.rejection_sampler.accepted_runs(
            packed.cpu().tolist(),
            [len(d) for d in plan.drafts.values()],
            [batch.seqs[s].params.logprobs for s in plan.drafts],
        )
        plan.num_emitted = [len(run.token_ids) for run in runs]
        for seq_id, run in zip(plan.drafts, runs, strict=True):
            out.seq_ids.append(seq_id)
            out.sampled_token_ids.append(run.token_ids)
            out.chosen_logprobs.append(run.chosen_logprobs)
            out.logprobs.append(run.logprobs)
            out.num_draft_tokens[seq_id] = run.num_drafts


def _padded(request: DraftRequest, drafts: list[int]) -> list[int]:
    """drafts filled up to the request's k with its last token (a draft's, else its own)."""
    last = drafts[-1] if drafts else int(request.token_ids[-1])
    return drafts + [last] * (request.max_drafts - len(drafts))
