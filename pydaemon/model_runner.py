"""Turns a SchedulerOutput into tensors, moves KV blocks, runs the model, samples.

The only part of the engine that touches tensors. It never decides policy: the scheduler says
which tokens to compute and which blocks to swap or copy; the runner does exactly that.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import numpy as np
import torch

from pydaemon.attention_metadata import AttentionMetadata
from pydaemon.config import EngineConfig
from pydaemon.distributed import parallel_state as ps
from pydaemon.kv_cache import GiB, KVCacheSpec
from pydaemon.layers.attention import uses_kernels
from pydaemon.model_loader import load_model
from pydaemon.sampling import Sampler, SamplingMetadata
from pydaemon.sampling_params import SamplingParams
from pydaemon.scheduler import SchedulerOutput
from pydaemon.step_input import StepInput

logger = logging.getLogger(__name__)


@dataclass
class SampleRow:
    """One sequence to sample from a row of this step's logits."""

    logits_index: int
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None
    stop_ids_for_min_tokens: set[int]  # ids barred while fewer than min_tokens are out


def resolve_device(device: str, tp_rank: int = 0, tp_size: int = 1) -> torch.device:
    """Under tensor parallelism rank r runs on cuda:r."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for but torch sees no CUDA device")
    if device == "cuda" and tp_size > 1:
        if tp_size > torch.cuda.device_count():
            raise ValueError(
                f"tensor_parallel_size ({tp_size}) is larger than the number of visible CUDA "
                f"devices ({torch.cuda.device_count()})"
            )
        return torch.device("cuda", tp_rank)
    return torch.device(device)


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if ps.get_tp_world_size() != config.tensor_parallel_size:
            raise RuntimeError(
                f"this process is a rank of a tensor-parallel group of size "
                f"{ps.get_tp_world_size()}, but tensor_parallel_size is "
                f"{config.tensor_parallel_size}: shut the other engine down first"
            )
        self.device = resolve_device(config.device, ps.get_tp_rank(), ps.get_tp_world_size())
        self.model, self.model_config = load_model(
            config.model,
            dtype=config.dtype,
            device=self.device,
            load_format=config.load_format,
            seed=config.seed,
        )
        self.model.eval()
        self.dtype = next(self.model.parameters()).dtype
        mc = self.model_config
        self.max_model_len = min(config.max_model_len or mc.max_model_len, mc.max_model_len)
        self.vocab_size = mc.vocab_size
        default_budget = max(4096 if self.device.type == "cuda" else 512, config.max_num_seqs)
        self.max_num_batched_tokens = config.max_num_batched_tokens or default_budget
        self.spec = KVCacheSpec(
            num_layers=mc.num_hidden_layers,
            num_kv_heads=mc.num_key_value_heads // config.tensor_parallel_size,  # this rank's
            block_size=config.block_size,
            head_dim=mc.head_dim,
            dtype=self.dtype,
        )
        self.num_gpu_blocks = config.num_kv_blocks or self._profile_num_blocks()
        # Tensor parallel: one block manager drives every rank, so all hold as many blocks.
        self.num_gpu_blocks = ps.min_across_ranks(self.num_gpu_blocks)
        max_useful = config.max_num_seqs * math.ceil(self.max_model_len / config.block_size) + 1
        self.num_cpu_blocks = min(
            self.spec.num_blocks_for_bytes(config.swap_space * GiB), max_useful
        )
        pin = self.device.type == "cuda"
        self.kv_cache = self.spec.allocate(self.num_gpu_blocks, self.device)
        self.cpu_kv_cache = self.spec.allocate(
            self.num_cpu_blocks, torch.device("cpu"), pin_memory=pin
        )
        self.sampler = Sampler()
        self.swap_stream = None
        if uses_kernels(self.kv_cache):
            from pydaemon.ops import SwapStream

            self.swap_stream = SwapStream(self.kv_cache, self.cpu_kv_cache)
        logger.info(
            "KV cache: %d blocks of %d tokens on %s (%.2f GiB), %d swap blocks on the CPU",
            self.num_gpu_blocks,
            config.block_size,
            self.device,
            self.num_gpu_blocks * self.spec.block_bytes / GiB,
            self.num_cpu_blocks,
        )

    # ---- sizing -----------------------------------------------------------------------------
    def _profile_num_blocks(self) -> int:
        cfg = self.config
        max_useful = cfg.max_num_seqs * math.ceil(self.max_model_len / cfg.block_size) + 1
        if self.device.type != "cuda":
            return max(
                1, min(self.spec.num_blocks_for_bytes(cfg.cpu_kv_cache_space * GiB), max_useful)
            )
        # Run the largest step once on a throw-away cache to measure peak activation memory.
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        num_tokens = min(self.max_num_batched_tokens, self.max_model_len)
        probe_blocks = math.ceil(num_tokens / cfg.block_size) + 1
        self.kv_cache = self.spec.allocate(probe_blocks, self.device)
        self._dummy_forward(num_tokens)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        del self.kv_cache
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        other_procs = total - free - torch.cuda.memory_reserved(self.device)
        # Sampling needs a few float32 [max_num_seqs, vocab] buffers on top.
        sampling = 4 * cfg.max_num_seqs * self.vocab_size * 4
        budget = total * cfg.gpu_memory_utilization - peak - other_procs - sampling
        blocks = self.spec.num_blocks_for_bytes(budget)
        if blocks < 1:
            raise RuntimeError(
                f"no memory left for the KV cache: peak activations {peak / GiB:.2f} GiB, "
                f"gpu_memory_utilization={cfg.gpu_memory_utilization}; lower max_num_batched_tokens "
                "or raise gpu_memory_utilization"
            )
        return min(blocks, max_useful)

    @torch.inference_mode()
    def _dummy_forward(self, num_tokens: int) -> None:
        bs = self.config.block_size
        num_blocks = math.ceil(num_tokens / bs)
        ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        positions = torch.arange(num_tokens, device=self.device)
        meta = AttentionMetadata(
            num_prefills=1,
            num_prefill_tokens=num_tokens,
            num_decode_tokens=0,
            slot_mapping=torch.arange(num_tokens, device=self.device),
            block_tables=torch.arange(num_blocks, dtype=torch.int32, device=self.device)[None],
            seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=self.device),
            query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=self.device),
            max_seq_len=num_tokens,
            max_query_len=num_tokens,
            seq_lens_cpu=[num_tokens],
            query_lens_cpu=[num_tokens],
        )
        hidden = self.model(ids, positions, self.kv_cache, meta)
        self.model.compute_logits(hidden[-1:])

    # ---- the step ---------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, block_manager) -> torch.Tensor | None:
        """Run one step; returns logits [num_sampling_seqs, vocab] (float32) in the order of
        out.scheduled's sequences that sample (None when nothing was scheduled)."""
        return self.execute_step(self.prepare_step(out, block_manager))

    def prepare_step(self, out: SchedulerOutput, block_manager) -> StepInput:
        """The step's plain host-side input (no tensors)."""
        step = StepInput(
            blocks_to_swap_out=out.blocks_to_swap_out,
            blocks_to_swap_in=out.blocks_to_swap_in,
            blocks_to_copy=out.blocks_to_copy,
        )
        scheduled = out.scheduled
        if not scheduled:
            return step
        num_seqs = len(scheduled)
        seq_ids = np.fromiter((s.seq.seq_id for s in scheduled), dtype=np.int64, count=num_seqs)
        query_start = np.fromiter(
            (s.seq.num_computed_tokens for s in scheduled), dtype=np.int32, count=num_seqs
        )
        query_len = np.fromiter(
            (s.num_new_tokens for s in scheduled), dtype=np.int32, count=num_seqs
        )
        num_tokens = int(query_len.sum())
        # Whole block tables (a chunked prefill holds blocks past this step's tokens).
        max_blocks = math.ceil(max(s.seq.num_slots for s in scheduled) / self.config.block_size)
        block_tables = np.empty((num_seqs, max_blocks), dtype=np.int32)
        slot_mapping = np.empty(num_tokens, dtype=np.int64)
        seq_lens_out = np.empty(num_seqs, dtype=np.int32)
        block_manager.build_step_metadata(
            seq_ids, query_start, query_len, block_tables, slot_mapping, seq_lens_out
        )
        input_ids: list[int] = []
        positions = np.empty(num_tokens, dtype=np.int64)
        cursor = 0
        for s, start, n in zip(scheduled, query_start.tolist(), query_len.tolist(), strict=True):
            seq = s.seq
            if n == 1:
                input_ids.append(
                    seq.last_token_id if start == seq.num_tokens - 1 else seq.token_ids()[start]
                )
            else:
                input_ids.extend(seq.token_ids()[start : start + n])
            positions[cursor : cursor + n] = np.arange(start, start + n)
            cursor += n
        query_start_loc = np.zeros(num_seqs + 1, dtype=np.int32)
        np.cumsum(query_len, out=query_start_loc[1:])
        step.num_prefills = len(out.prefills)
        step.input_ids = input_ids
        step.positions = positions
        step.slot_mapping = slot_mapping
        step.block_tables = block_tables
        step.seq_lens = seq_lens_out
        step.query_lens = query_len
        step.query_start_loc = query_start_loc
        step.sample_index = [
            int(query_start_loc[i + 1]) - 1 for i, s in enumerate(scheduled) if s.do_sample
        ]
        return step

    @torch.inference_mode()
    def execute_step(self, step: StepInput) -> torch.Tensor | None:
        """Moves blocks, runs the forward pass; -> logits [len(step.sample_index), vocab]
        (float32), None on tensor-parallel ranks > 0 or when the step only moves blocks."""
        self._move_blocks(step)
        if step.num_seqs == 0:
            return None
        query_len = step.query_lens
        p = step.num_prefills
        dev = self.device
        meta = AttentionMetadata(
            num_prefills=p,
            num_prefill_tokens=int(query_len[:p].sum()),
            num_decode_tokens=step.num_seqs - p,
            slot_mapping=_to(step.slot_mapping, dev),
            block_tables=_to(step.block_tables, dev),
            seq_lens=_to(step.seq_lens, dev),
            query_start_loc=_to(step.query_start_loc, dev),
            max_seq_len=int(step.seq_lens.max()),
            max_query_len=int(query_len.max()),
            seq_lens_cpu=step.seq_lens.tolist(),
            query_lens_cpu=query_len.tolist(),
        )
        hidden = self.model(
            torch.tensor(step.input_ids, dtype=torch.long).to(dev, non_blocking=True),
            _to(step.positions, dev),
            self.kv_cache,
            meta,
        )
        if not step.sample_index:
            return hidden.new_empty((0, self.vocab_size), dtype=torch.float32)
        index = _to(np.asarray(step.sample_index, dtype=np.int64), dev)
        return self.model.compute_logits(hidden[index])

    def _move_blocks(self, out: SchedulerOutput | StepInput) -> None:
        """Swap out, swap in, then copy-on-write, before this step's K/V writes."""
        if self.swap_stream is not None:
            from pydaemon import ops

            # Batched copies on their own stream; the compute stream waits on an event
            # (no host sync) before it reuses swapped-out blocks or reads swapped-in ones.
            self.swap_stream.swap_out(out.blocks_to_swap_out)
            self.swap_stream.swap_in(out.blocks_to_swap_in)
            self.swap_stream.wait()
            if out.blocks_to_copy:
                ops.copy_blocks(self.kv_cache, out.blocks_to_copy)
            return
        if out.blocks_to_swap_out:
            src, dst = _pairs(out.blocks_to_swap_out)
            self.cpu_kv_cache[dst] = self.kv_cache[src.to(self.device)].to("cpu")
        if out.blocks_to_swap_in:
            src, dst = _pairs(out.blocks_to_swap_in)
            self.kv_cache[dst.to(self.device)] = self.cpu_kv_cache[src].to(self.device)
        if out.blocks_to_copy:
            src, dst = _pairs(out.blocks_to_copy)
            self.kv_cache[dst.to(self.device)] = self.kv_cache[src.to(self.device)]

    # ---- sampling ---------------------------------------------------------------------------
    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, rows: list[SampleRow]):
        """logits: [num_sampling_seqs, vocab]; rows may repeat a logits row (n > 1)."""
        index = [r.logits_index for r in rows]
        if index != list(range(logits.shape[0])):
            logits = logits[torch.tensor(index, device=logits.device)]
        metadata = SamplingMetadata.build(
            params=[r.params for r in rows],
            prompt_token_ids=[r.prompt_token_ids for r in rows],
            output_token_ids=[r.output_token_ids for r in rows],
            generators=[r.generator for r in rows],
            device=logits.device,
            stop_ids_for_min_tokens=[r.stop_ids_for_min_tokens for r in rows],
        )
        return self.sampler(logits, metadata)

    @torch.inference_mode()
    def log_softmax_rows(self, logits: torch.Tensor, index: list[int]) -> torch.Tensor:
        """[len(index), vocab] float32 log-probabilities on the CPU (beam search)."""
        rows = logits[torch.tensor(index, device=logits.device)].float()
        return torch.log_softmax(rows, dim=-1).cpu()


def _to(array: np.ndarray, device: torch.device) -> torch.Tensor:
    tensor = torch.from_numpy(array)
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor


def _pairs(pairs: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    both = torch.tensor(pairs, dtype=torch.long)
    return both[:, 0], both[:, 1]
