"""The scheduler's live StepPlan -> the plain SchedulerOutput the model runner reads.

A sequence the runner does not hold is sent whole; for one it holds, only the tokens it has
not seen (one per decode), the block ids that changed (a new block every ``block_size``
tokens, or a copy-on-write) and its computed length: O(1) per decode sequence. Under async
scheduling the token a decode computes may be a placeholder (``PLACEHOLDER_TOKEN_ID``): the
runner takes its value from the previous step's sampled ids on the device.
"""

from __future__ import annotations

from pydaemon.core.request import Request, Sequence
from pydaemon.core.sched.scheduler_output import NewSeqData, SchedulerOutput
from pydaemon.core.sched.step_plan import StepPlan
from pydaemon.core.seq_blocks import SeqBlocks


def build_scheduler_output(
    plan: StepPlan, blocks: SeqBlocks, finished_request_ids: list[str]
) -> SchedulerOutput:
    moves = blocks.take_tier_moves()  # ends the block manager's step
    out = SchedulerOutput(
        num_prefills=len(plan.prefills),
        blocks_to_swap_out=plan.blocks_to_swap_out,
        blocks_to_swap_in=plan.blocks_to_swap_in,
        blocks_to_copy=blocks.blocks_to_copy,
        finished_seq_ids=blocks.finished_seq_ids,
        finished_request_ids=finished_request_ids,
        blocks_to_save_to_cpu=moves.blocks_to_save_to_cpu,
        blocks_to_save_ahead_to_cpu=moves.blocks_to_save_ahead_to_cpu,
        blocks_to_load_from_cpu=moves.blocks_to_load_from_cpu,
        blocks_to_write_to_disk=moves.blocks_to_write_to_disk,
        disk_write_records=moves.disk_write_records,
        blocks_to_read_from_disk=moves.blocks_to_read_from_disk,
        disk_read_records=moves.disk_read_records,
    )
    blocks.blocks_to_copy, blocks.finished_seq_ids = [], []
    cached = out.scheduled_cached_seqs
    # The columns, appended to directly: this loop runs once per scheduled sequence.
    num_scheduled, new_seqs = out.num_scheduled_tokens, out.scheduled_new_seqs
    seq_ids, new_token_ids = cached.seq_ids, cached.new_token_ids
    new_block_ids, num_computed = cached.new_block_ids, cached.num_computed_tokens
    for scheduled in plan.scheduled:
        request, seq = scheduled.request, scheduled.seq
        num_scheduled[seq.seq_id] = scheduled.num_new_tokens
        num_tokens = len(seq.prompt_token_ids) + len(seq.output_token_ids)
        if not seq.is_in_runner:
            new_seqs.append(_new_seq_data(request, seq, blocks))
        else:
            seq_ids.append(seq.seq_id)
            num_unsent = num_tokens - seq.num_sent_tokens  # output tokens, one per decode
            new_token_ids.append(seq.output_token_ids[-num_unsent:] if num_unsent else [])
            seq.num_sent_tokens = num_tokens
            new_block_ids.append(
                None if seq.changed_block_start is None else blocks.take_block_delta(seq)
            )
            num_computed.append(seq.num_computed_tokens)
        if scheduled.num_draft_slots:
            out.num_draft_tokens[seq.seq_id] = scheduled.num_draft_slots
        is_sampled = seq.num_computed_tokens + scheduled.num_new_tokens == num_tokens
        if is_sampled and request.forks_at_first_sample:
            out.num_samples[seq.seq_id] = request.num_expected_seqs
        if is_sampled and request.params.structured_outputs is not None:
            out.structured_output_seq_ids[seq.seq_id] = request.request_id
    return out


def _new_seq_data(request: Request, seq: Sequence, blocks: SeqBlocks) -> NewSeqData:
    if seq.has_pending_token:  # only held sequences decode on a placeholder (async scheduling)
        raise RuntimeError(f"sequence {seq.seq_id} is sent whole with a placeholder token")
    seq.is_in_runner = True
    seq.num_sent_tokens = seq.num_tokens
    params = request.params
    barred: list[int] = []
    if params.min_tokens:
        ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            ids |= request.eos_token_ids
        barred = sorted(ids)
    return NewSeqData(
        seq_id=seq.seq_id,
        request_id=request.request_id,
        index=seq.index,
        params=params,
        num_prompt_tokens=len(seq.prompt_token_ids),
        token_ids=seq.token_ids(),
        block_ids=blocks.block_ids(seq),
        num_computed_tokens=seq.num_computed_tokens,
        min_tokens_stop_ids=barred,
        lora_request=request.lora_request,
    )
