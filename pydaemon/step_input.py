"""StepInput: one step's model input as plain host data (numpy arrays and lists).

Built by the model runner on rank 0 from the SchedulerOutput and the block manager, turned
into tensors by ``ModelRunner.execute_step``. Plain data on purpose: under tensor
parallelism rank 0 pickles it to every worker, which runs the very same step on its shard.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class StepInput:
    # Block moves before this step's K/V writes: (src, dst) pairs, direction in the name.
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # GPU -> CPU
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # CPU -> GPU
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # GPU -> GPU (COW)
    # The forward pass; num_seqs == 0 means "only move blocks".
    num_prefills: int = 0
    input_ids: list[int] = field(default_factory=list)  # [num_tokens]
    positions: np.ndarray | None = None  # [num_tokens] int64
    slot_mapping: np.ndarray | None = None  # [num_tokens] int64
    block_tables: np.ndarray | None = None  # [num_seqs, max_blocks] int32
    seq_lens: np.ndarray | None = None  # [num_seqs] int32
    query_lens: np.ndarray | None = None  # [num_seqs] int32
    query_start_loc: np.ndarray | None = None  # [num_seqs + 1] int32
    sample_index: list[int] = field(default_factory=list)  # token rows whose logits are sampled

    @property
    def num_seqs(self) -> int:
        return 0 if self.seq_lens is None else len(self.seq_lens)
