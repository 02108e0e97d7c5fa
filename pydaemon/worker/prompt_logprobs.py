"""Prompt logprobs (vLLM's ``prompt_logprobs``): the log-probability of each prompt token
given the tokens before it, with the top-k alternatives, from the hidden states a prefill step
computes anyway. Row j of a prefill chunk predicts the token at position j + 1, so a chunk
gives the logprobs of the prompt tokens after each of its positions (the first prompt token
has none); the LM head runs on those rows only, for the sequences that ask.

Every tensor-parallel rank plans the same rows (the LM head's gather is collective); the rank
that samples turns their logits into host data: one more device-to-host copy, synchronous,
paid only by steps that hold such a sequence (rare: scoring and evaluation requests).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pydaemon.outputs import TokenLogprobs
from pydaemon.worker.input_batch import InputBatch, StepInput


@dataclass
class PromptLogprobsPlan:
    """The hidden rows whose logits give prompt logprobs, grouped by sequence."""

    seq_ids: list[int]
    first_positions: list[int]  # position of each sequence's first target token
    counts: list[int]  # its target tokens in this step
    num_logprobs: list[int]  # its top-k ask
    rows: np.ndarray  # [num_rows] int64, rows of the step's hidden states
    targets: np.ndarray  # [num_rows] int64, the prompt token each row predicts


def plan_prompt_logprobs(step: StepInput, batch: InputBatch) -> PromptLogprobsPlan | None:
    """The rows of the step's prefill chunks that predict a prompt token of a sequence that
    asks for prompt logprobs; None when there are none."""
    plan = PromptLogprobsPlan([], [], [], [], np.zeros(0, np.int64), np.zeros(0, np.int64))
    rows, targets = [], []
    for i in range(step.num_prefills):
        seq_id = step.seq_ids[i]
        state = batch.seqs[seq_id]
        k = state.params.prompt_logprobs
        if k is None:
            continue
        prompt = batch.prompt_token_ids(seq_id)
        start, end = int(step.query_start_loc[i]), int(step.query_start_loc[i + 1])
        positions = step.positions[start:end]
        keep = positions + 1 < len(prompt)  # the last prompt token predicts an output
        if not keep.any():
            continue
        chunk_rows = np.arange(start, end, dtype=np.int64)[keep]
        plan.seq_ids.append(seq_id)
        plan.first_positions.append(int(positions[keep][0]) + 1)
        plan.counts.append(len(chunk_rows))
        plan.num_logprobs.append(k)
        rows.append(chunk_rows)
        targets.append(np.asarray(prompt, dtype=np.int64)[positions[keep] + 1])
    if not plan.seq_ids:
        return None
    plan.rows, plan.targets = np.concatenate(rows), np.concatenate(targets)
    return plan


def prompt_logprobs(
    logits: torch.Tensor, plan: PromptLogprobsPlan
) -> dict[int, tuple[int, list[TokenLogprobs]]]:
    """logits: [len(plan.rows), vocab] float32 (the LM head on plan.rows) -> seq_id ->
    (first target position, per target token {token_id: logprob} of it and its top-k)."""
    logprobs = logits.log_softmax(dim=-1)
    targets = torch.from_numpy(plan.targets).to(logits.device)
    chosen = logprobs.gather(1, targets[:, None])[:, 0]
    k = min(max(plan.num_logprobs), logprobs.shape[1])
    top_values, top_ids = logprobs.topk(k, dim=-1)  # k = 0: [num_rows, 0]
    # One packed copy to the host: ids (< 2**53) and float32 logprobs are exact in float64.
    packed = torch.cat(
        [chosen[:, None].double(), top_ids.double(), top_values.double()], dim=1
    ).tolist()
    out: dict[int, tuple[int, list[TokenLogprobs]]] = {}
    row = 0
    for seq_id, first, count, asked in zip(
        plan.seq_ids, plan.first_positions, plan.counts, plan.num_logprobs, strict=True
    ):
        entries = []
        for r in range(row, row + count):
            values = packed[r]
            entry = {
                int(t): v
                for t, v in zip(values[1 : 1 + asked], values[1 + k : 1 + k + asked], strict=True)
            }
            entry[int(plan.targets[r])] = values[0]
            entries.append(entry)
        out[seq_id] = (first, entries)
        row += count
    return out
