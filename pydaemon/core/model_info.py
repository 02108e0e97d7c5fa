"""ModelInfo: what the engine core tells a front end about the model it serves."""

from __future__ import annotations

from dataclasses import dataclass


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
