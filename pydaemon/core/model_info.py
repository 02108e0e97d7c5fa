"""ModelInfo: what the engine core tells a front end about the model it serves."""

from __future__ import annotations

from dataclasses import dataclass, field

from pydaemon.core.disk_blocks import DiskBlockRecord
from pydaemon.core.kv_groups import KVGroups
from pydaemon.logprobs_limit import DEFAULT_MAX_LOGPROBS


@dataclass
class ModelInfo:
    """What a front end needs to know about the served model (plain, picklable)."""

    max_model_len: int
    vocab_size: int
    block_size: int
    max_num_seqs: int
    num_gpu_blocks: int
    num_cpu_blocks: int
    device: str  # the real one, e.g. "cuda:0", never "auto"
    dtype: str  # e.g. "bfloat16"
    eos_token_ids: list[int]  # from the model's config (the front end's tokenizer may add)
    max_logprobs: int = (
        DEFAULT_MAX_LOGPROBS  # --max-logprobs in force (-1 resolved to the vocabulary size)
    )


@dataclass
class RunnerInfo:
    """What the rank that samples reports once its model and KV cache are built: the engine
    core sizes its scheduler and checks requests with it (plain, picklable)."""

    max_model_len: int
    vocab_size: int
    max_num_batched_tokens: int  # the step's token budget
    num_gpu_blocks: int  # KV blocks on the device (the same on every rank)
    num_cpu_blocks: int  # host memory blocks: swap space and the CPU tier (one pool)
    num_cpu_tier_blocks: int  # of those, the CPU tier's (0: no KV tiers)
    device: str  # the real one, e.g. "cuda:0", never "auto"
    dtype: str  # e.g. "bfloat16"
    kv_block_bytes: int = 0  # one KV block on this rank
    num_disk_blocks: int = 0  # the disk tier's blocks (0: none)
    # A warm restart: the blocks found whole in the disk tier (of every rank).
    disk_records: list[DiskBlockRecord] = field(default_factory=list)
    # Per-layer-group tables (core/kv_groups.py) as the runner laid out its cache; the
    # scheduler keeps one table per group. None: one table per sequence.
    kv_groups: KVGroups | None = None
