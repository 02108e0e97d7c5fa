"""SchedulerOutput: what one step computes, as plain data (vLLM v1's shape).

The scheduler hands this to the model runner (and, pickled, to every tensor-parallel
worker). It holds no live Request or Sequence objects: a runner keeps its own cached state
per sequence (``pydaemon.worker.input_batch``) and updates it from these deltas. A sequence the
runner does not hold yet (newly admitted, resumed after a preemption, a fork or a new beam)
arrives whole as ``NewSeqData``; a sequence it holds arrives as one column entry of
``CachedSeqData``: the tokens it has not seen, the block ids that changed, and where its
computed prefix ends. ``finished_seq_ids`` are sequences the runner must forget before it
adds new ones (finished, aborted, preempted, swapped out, or replaced beams).

KV tiers (block_manager.h, "Tiers"): the step's copies between the GPU cache, the CPU pool
and the disk tier go down as (src, dst) pairs, direction in the name. The runner issues the
swaps, ``blocks_to_save_to_cpu`` and ``blocks_to_copy`` before the step's K/V writes, and the
loads and ahead saves on its copy stream while the step runs (the next step waits for them);
the disk reads and writes (after the step's saves) run on its I/O thread. A load's GPU block
is read from the next step on; a block read from disk is loaded the step after its read. Each
disk read carries the record of the block its slot must hold (``disk_read_records``): the
rank serves the slot only if it holds that block as written.

``GrammarOutput`` is the step's other half for structured outputs: the engine core owns the
grammar matchers and sends, once the forward is launched, the bitmask of every constrained
sequence that samples (``SchedulerOutput.structured_output_seq_ids``); the rank that samples
only applies it (vLLM's GrammarOutput).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pydaemon.core.disk_blocks import DiskBlockRecord
from pydaemon.lora_request import LoRARequest
from pydaemon.sampling_params import SamplingParams

# The request the engine runs once before serving (engine.py, engine_core_proc.py): a few
# copies of one token, not a sample of real K/V (kv_scale_calibration.py skips it).
WARMUP_REQUEST_ID = "__warmup__"


@dataclass
class NewSeqData:
    """A sequence the runner does not hold: everything it needs, once."""

    seq_id: int
    request_id: str
    index: int  # output index; with the request's seed it selects the random stream
    params: SamplingParams
    num_prompt_tokens: int
    token_ids: list[int]  # prompt + output so far
    block_ids: list[int]  # the whole block table
    num_computed_tokens: int  # tokens whose K/V are in the cache before this step
    min_tokens_stop_ids: list[int]  # ids barred while output is shorter than min_tokens
    lora_request: LoRARequest | None = None  # the adapter it runs with; None: the base model


@dataclass
class CachedSeqData:
    """Deltas of sequences the runner already holds; column i is sequence ``seq_ids[i]``."""

    seq_ids: list[int] = field(default_factory=list)
    new_token_ids: list[list[int]] = field(default_factory=list)  # appended since last sent
    # (start, ids): block_table[start:] = ids (a copy-on-write replaces the last block); None
    # when the table did not change.
    new_block_ids: list[tuple[int, list[int]] | None] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)  # before this step


@dataclass
class SchedulerOutput:
    scheduled_new_seqs: list[NewSeqData] = field(default_factory=list)
    scheduled_cached_seqs: CachedSeqData = field(default_factory=CachedSeqData)
    # Batch order: sequences with prefill work first (``num_prefills`` of them), then decodes.
    # seq_id -> tokens whose K/V this step computes.
    num_scheduled_tokens: dict[int, int] = field(default_factory=dict)
    num_prefills: int = 0
    # A sampled sequence that forks into n (best_of) at its first sample: seq_id -> n.
    # The runner samples its logits row n times, with the streams of indices 0..n-1.
    num_samples: dict[int, int] = field(default_factory=dict)
    # Speculative decoding: decode seq_id -> k. The runner may propose up to k drafts for it
    # and verify them in this step (slots are reserved past its tokens); its query then
    # grows to 1 + drafts. The token budget counted the k.
    num_draft_tokens: dict[int, int] = field(default_factory=dict)
    finished_seq_ids: list[int] = field(default_factory=list)  # the runner forgets these
    finished_request_ids: list[str] = field(default_factory=list)  # ... and their streams
    # Block moves before this step's K/V writes: (src, dst) pairs, direction in the name.
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (gpu, cpu)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu, gpu)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) on GPU
    # KV tiers (see the module docstring).
    blocks_to_save_to_cpu: list[tuple[int, int]] = field(default_factory=list)  # (gpu, cpu)
    blocks_to_save_ahead_to_cpu: list[tuple[int, int]] = field(default_factory=list)  # (gpu, cpu)
    blocks_to_load_from_cpu: list[tuple[int, int]] = field(default_factory=list)  # (cpu, gpu)
    blocks_to_write_to_disk: list[tuple[int, int]] = field(default_factory=list)  # (cpu, disk)
    disk_write_records: list[DiskBlockRecord] = field(default_factory=list)  # one per write
    blocks_to_read_from_disk: list[tuple[int, int]] = field(default_factory=list)  # (disk, cpu)
    disk_read_records: list[DiskBlockRecord] = field(default_factory=list)  # one per read
    # Structured outputs: the constrained sequences that sample this step, in batch order
    # (seq_id -> request_id). The sampling waits for their GrammarOutput.
    structured_output_seq_ids: dict[int, str] = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return len(self.num_scheduled_tokens)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def has_block_moves(self) -> bool:
        return bool(
            self.blocks_to_swap_out
            or self.blocks_to_swap_in
            or self.blocks_to_copy
            or self.has_tier_moves
        )

    @property
    def has_tier_moves(self) -> bool:
        return bool(
            self.blocks_to_save_to_cpu
            or self.blocks_to_save_ahead_to_cpu
            or self.blocks_to_load_from_cpu
            or self.blocks_to_write_to_disk
            or self.blocks_to_read_from_disk
        )


@dataclass
class GrammarOutput:
    """The token bitmask of a step's constrained sequences (xgrammar's layout: bit ``t % 32``
    of word ``t // 32`` set when token ``t`` is allowed; a row of -1 is unconstrained)."""

    seq_ids: list[int]  # row i of the bitmask is sequence seq_ids[i]'s
    bitmask: np.ndarray  # [len(seq_ids), ceil(vocab_size / 32)] int32, host memory
