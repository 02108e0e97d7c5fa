"""CUDA graphs for decode and verify steps: capture once per padded shape, replay each step.

A decode step of 8B-class models launches ~15 kernels per layer; launched one by one from
Python that is milliseconds of host time per token at batch 1. A graph replays the whole
forward pass (embedding to final norm, every layer's kernels and, under tensor parallelism,
its NCCL all-reduces) with one launch.

- Shapes (batch buckets, seq-len tiers, verify query lengths) and the static input buffer:
  cuda_graph_inputs.py. A verify step (speculative decoding: each sequence's last token and
  its k drafts, q = k + 1 rows over the cached context) runs the same forward with every row
  a prefill row of q tokens; its logits rows, like decode's, are computed outside the graph
  and the rejection sampler runs after it.
- Capture: after the KV cache exists (the graphs hold its pointers), largest shape first,
  all graphs sharing one memory pool (they never run at once, so the pool is about the
  largest graph's activations). Each capture is preceded by one eager run of the same shape
  on the capture stream (lazy cuBLAS / NCCL set-up must not happen inside a capture).
- Replay: one host-to-device copy of the padded inputs into the static buffer, then the
  graph, both on the current stream: no host-device sync. The output is the graph's hidden
  state buffer; the runner takes the real rows and computes the logits outside the graph
  (see ``CUDAGraphRunner.run``).
- Tensor parallelism: every rank builds its own runner from the same config and replays the
  same graph for the same SchedulerOutput, so the captured collectives match across ranks.
- Memory: ``measure_graph_memory`` captures the largest and the smallest graph on the
  profiling cache before the KV cache is sized and extrapolates to all of them.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from pydaemon.layers.attention_metadata import AttentionMetadata
from pydaemon.worker.cuda_graph_inputs import (
    GraphKey,
    GraphPlan,
    graph_input_views,
    pack_graph_inputs,
)
from pydaemon.worker.input_batch import StepInput
from pydaemon.worker.kv_cache import GiB

logger = logging.getLogger(__name__)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    hidden: torch.Tensor  # [num_tokens, hidden_size]: the graph's output, rewritten by replay


class CUDAGraphRunner:
    """Holds the captured decode and verify graphs of one model and one KV cache (one TP rank)."""

    def __init__(
        self, model: nn.Module, kv_cache: torch.Tensor, plan: GraphPlan, model_cache=None
    ) -> None:
        """``model_cache``: what the model reads the cache through (a LayerSlotCache with
        per-layer-group tables); default ``kv_cache``."""
        self.model = model
        self.kv_cache = kv_cache  # [num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim]
        self.model_cache = kv_cache if model_cache is None else model_cache
        self.plan = plan
        self.device = kv_cache.device
        # The static inputs of every graph: one buffer, each graph its own views of it.
        self.buffer = torch.zeros(plan.max_buffer_words, dtype=torch.int64, device=self.device)
        self.pool = None  # the memory pool all graphs share, made by the first capture
        self.stream: torch.cuda.Stream | None = None  # the capture stream
        self.graphs: dict[GraphKey, _Graph] = {}
        self.num_replays = 0
        self.num_verify_replays = 0  # of num_replays: verify graphs (query_len > 1)
        # Padding rows attend to block 0's first slots: they must hold finite values from the
        # start (torch.empty may hold NaN bit patterns); a real sequence only writes K/V there.
        kv_cache[0].zero_()

    # ---- capture ----------------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self, keys: list[GraphKey] | None = None) -> None:
        """Captures ``keys`` (default: the plan's, largest first)."""
        if self.stream is None:
            self.stream = torch.cuda.Stream(self.device)
            self.pool = torch.cuda.graph_pool_handle()
        # torch.cuda.graph runs gc.collect() before every capture; with the objects alive now
        # frozen out of collection, those calls cost microseconds instead of a full pass each.
        # A heap frozen before (a capture after the engine started: the KV scales' first
        # step, pydaemon/heap_freeze.py) stays frozen.
        was_frozen = gc.get_freeze_count() > 0
        gc.collect()
        gc.freeze()
        try:
            for key in self.plan.keys() if keys is None else keys:
                self.graphs[key] = self._capture_one(key)
        finally:
            if not was_frozen:
                gc.unfreeze()

    def _capture_one(self, key: GraphKey) -> _Graph:
        # An all-padding batch: no cache writes, finite activations.
        empty = np.zeros(0, dtype=np.int64)
        self.load_inputs(
            empty, empty, empty, np.zeros((0, 1), np.int32), empty.astype(np.int32), key
        )
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            self.forward(key)  # warm-up: lazy library and communicator set-up, outside capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
            hidden = self.forward(key)
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        return _Graph(graph, hidden)

    def load_inputs(
        self,
        input_ids: np.ndarray,  # [n * q] int64
        positions: np.ndarray,  # [n * q] int64
        slot_mapping: np.ndarray,  # [n * q] int64
        block_tables: np.ndarray,  # [n, any width] int32
        seq_lens: np.ndarray,  # [n] int32
        key: GraphKey,
    ) -> None:
        """Writes a decode or verify batch, padded to ``key``, into the static buffer (one copy)."""
        host = torch.from_numpy(
            pack_graph_inputs(
                input_ids,
                positions,
                slot_mapping,
                block_tables,
                seq_lens,
                key,
                self.plan.num_groups,
            )  # fmt: skip
        )
        if self.device.type == "cuda":
            # Pinned through the caching host allocator, which keeps the page until the copy
            # is done: no host sync, and the next step never overwrites a copy in flight.
            self.buffer[: host.numel()].copy_(host.pin_memory(), non_blocking=True)
        else:
            self.buffer[: host.numel()].copy_(host)

    def forward(self, key: GraphKey) -> torch.Tensor:
        """The model on the static buffer's views for ``key``: what a graph captures.
        -> hidden [key.num_tokens, hidden_size].

        A verify key (query_len q > 1): every row is a prefill row of q tokens, so attention is
        one paged-prefill launch whose grid depends on b and q only (max_query_len = q)."""
        views = graph_input_views(self.buffer, key, self.plan.num_groups)
        b, q = key.batch_size, key.query_len
        is_verify = q > 1
        meta = AttentionMetadata(
            num_prefills=b if is_verify else 0,
            num_prefill_tokens=b * q if is_verify else 0,
            num_decode_tokens=0 if is_verify else b,
            slot_mapping=views["slot_mapping"],
            block_tables=views["block_tables"],
            seq_lens=views["seq_lens"],
            query_start_loc=views["query_start_loc"],
            max_seq_len=key.max_seq_len,  # the tier: sizes the split-KV grid for any step in it
            max_query_len=q,
            # Bounds, not the step's values. Only the torch attention path reads them, and
            # never in a graph (cuda_graph_plan in cuda_graph_inputs.py); its decode sizes a gather with them and masks
            # with the device seq_lens, so this forward is also exact on a CPU cache.
            seq_lens_cpu=[key.max_seq_len] * b,
            query_lens_cpu=[q] * b,
        )
        if self.plan.num_groups > 1:
            meta.with_groups(views["group_slot_mapping"], views["group_block_tables"])
        return self.model(views["input_ids"], views["positions"], self.model_cache, meta)

    # ---- replay -----------------------------------------------------------------------------
    def key_for(self, step: StepInput) -> GraphKey | None:
        """The graph serving this step, or None when it must run eagerly (prefill work, more
        sequences than the largest bucket, or a context past the last tier). A step whose
        rows all have q tokens (a verify step: every sequence a decode with k = q - 1
        drafts, all of them prefill rows) is served by a verify graph of that q."""
        num_seqs = len(step.seq_ids)
        if num_seqs == 0:
            return None
        query_len = 1
        if step.num_prefills != 0:
            query_len = int(step.query_lens[0])
            if step.num_prefills != num_seqs or query_len == 1:
                return None
            if not (step.query_lens == query_len).all():
                return None
        if len(step.input_ids) != num_seqs * query_len:
            return None
        key = self.plan.key_for(num_seqs, int(step.seq_lens.max()), query_len)
        return key if key in self.graphs else None

    def run(
        self,
        step: StepInput,
        key: GraphKey,
        fill_input_ids: Callable[[torch.Tensor], None] | None = None,
    ) -> torch.Tensor:
        """-> hidden [num_tokens, hidden_size]: a view of the graph's output buffer, valid until
        the next replay (stream order makes the caller's LM head read it first).

        The logits stay outside the graph: under tensor parallelism they are gathered to
        rank 0 only (a different output per rank), the sampler wants the real rows only, and
        a [batch, vocab] float32 buffer per graph would pin up to ~0.26 GB of pool memory at
        batch 512 for one GEMM launch saved.
        """
        grouped = step.group_slot_mapping is not None
        self.load_inputs(
            step.input_ids,
            step.positions,
            step.group_slot_mapping if grouped else step.slot_mapping,
            step.group_block_tables if grouped else step.block_tables,
            step.seq_lens,
            key,
        )
        if fill_input_ids is not None:  # async scheduling: placeholders filled on the device
            fill_input_ids(graph_input_views(self.buffer, key)["input_ids"])
        entry = self.graphs[key]
        entry.graph.replay()
        self.num_replays += 1
        self.num_verify_replays += key.query_len > 1
        return entry.hidden[: len(step.input_ids)]

    def release(self) -> None:
        """Drops the graphs and their pool (empty_cache returns the memory afterwards)."""
        for entry in self.graphs.values():
            entry.graph.reset()
        self.graphs.clear()


def capture_all(runner: CUDAGraphRunner) -> CUDAGraphRunner | None:
    """``runner`` with every graph of its plan captured; logs the time and memory they took.
    A runner may be made at start-up (it zeroes block 0 then) and captured later (after
    calculate_kv_scales' first step: graphs bake the KV scales in).

    A capture that fails (an operation CUDA cannot capture) is logged as an error with its
    traceback and the engine runs every step eagerly rather than not at all.
    """
    device, plan = runner.device, runner.plan
    torch.cuda.synchronize(device)
    free_before = torch.cuda.mem_get_info(device)[0]
    start = time.perf_counter()
    try:
        runner.capture()
    except RuntimeError:
        logger.exception("CUDA graph capture failed: every step runs eagerly (--enforce-eager)")
        runner.release()
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        return None
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()  # the warm-ups' blocks, cached on the capture stream
    used = free_before - torch.cuda.mem_get_info(device)[0]
    logger.info(
        "CUDA graphs: captured %d graphs in %.1f s, %.3f GiB (batch sizes %s; seq-len "
        "tiers %s for batch sizes %s; verify query lengths %s for batch sizes %s)",
        len(runner.graphs),
        time.perf_counter() - start,
        used / GiB,
        ",".join(map(str, plan.batch_sizes)),
        ",".join(map(str, plan.seq_len_tiers)),
        ",".join(map(str, sorted(plan.tiered))) or "none",
        ",".join(map(str, plan.verify_query_lens)) or "none",
        ",".join(map(str, plan.verify_batch_sizes)) or "none",
    )
    return runner


def measure_graph_memory(
    model: nn.Module, kv_cache: torch.Tensor, plan: GraphPlan, model_cache=None
) -> int:
    """Bytes of device memory the plan's graphs will take, measured before the KV cache is
    sized: the largest graph on ``kv_cache`` (the profiling cache) holds the shared pool plus
    one graph's own memory; the smallest one, captured next into the same pool, costs about
    what each further graph costs, plus its output rows (every graph keeps its hidden-state
    output alive). Everything is released again before returning."""
    keys = plan.keys()
    device = kv_cache.device
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free0 = torch.cuda.mem_get_info(device)[0]
    probe = CUDAGraphRunner(model, kv_cache, plan, model_cache)
    try:
        probe.capture(keys[:1])
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()  # the warm-up's blocks, cached on the capture stream
        free1 = torch.cuda.mem_get_info(device)[0]
        hidden = probe.graphs[keys[0]].hidden
        row_bytes = hidden.shape[1] * hidden.element_size()
        del hidden
        each = 0
        if len(keys) > 1:
            probe.capture(keys[-1:])
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
            each = max(0, free1 - torch.cuda.mem_get_info(device)[0])
    except RuntimeError:
        logger.exception("CUDA graph capture failed while measuring; capture_all will say more")
        free1, each, row_bytes = free0, 0, 0
    probe.release()
    del probe
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    outputs = sum(k.num_tokens for k in keys[1:]) * row_bytes
    total = max(0, free0 - free1) + each * (len(keys) - 1) + outputs
    logger.info(
        "CUDA graphs: %d to capture; measured %.3f GiB for the largest, %.1f MiB for the "
        "smallest, %.1f MiB of outputs: %.2f GiB kept out of the KV cache",
        len(keys),
        (free0 - free1) / GiB,
        each / (1 << 20),
        outputs / (1 << 20),
        total / GiB,
    )
    return total
