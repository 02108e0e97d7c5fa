"""EagleProposer: drafts with an EAGLE-1 head (vLLM's ``method: "eagle"``; the head and its
math: pydaemon/models/eagle.py).

The head's row at position p reads the target's hidden state h_p and the token t_{p+1}, and
writes its K/V into the slot of position p in its own paged KV cache (as many blocks as the
target's, addressed by the target's block tables, like the draft model's: the scheduler's one
block manager covers it, and nothing is allocated or freed here). Per sequence the proposer
keeps ``num_computed`` (the head's K/V is real for positions below it) and ``pending``: the
target's h at position num_computed, waiting for the token after it.

- ``observe_target`` (after every target forward): for each sequence, the rows whose token
  was real (a verify step: the accepted drafts and the row before them; rejected rows are
  never read) extend the head: the pending state with the step's first token, then each
  row but the last with the next row's token; the last row's h becomes the new pending one
  (copied: a CUDA graph's output buffer is rewritten by its next replay). The head thus
  lags the target by one position until the next token is known.
- ``propose`` (a decode of N tokens): the pending h_{N-2} with t_{N-1} gives the first draft;
  each further draft feeds the head's own output g and the last draft back in, at the next
  position, writing K/V into the reserved draft slots (overwritten with real states by the
  next ``observe_target``). Drafts are the argmax: a point-mass draft distribution.

A sequence seen for the first time, or whose rows do not continue its state (a prefix-cache
hit, a recompute after preemption: the runner forgot it), starts over at its first row: the
head's K/V below it is whatever its cache holds (a cached prefix's, written when another
sequence computed it; stale after a swap), which can lower acceptance but never changes the
output, since verification keeps the target's distribution.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pydaemon.config.model import ModelConfig
from pydaemon.config.runner import RunnerConfig
from pydaemon.layers.attention_metadata import chunk_metadata, to_device
from pydaemon.model_loader.eagle_head import load_eagle_head
from pydaemon.model_loader.model_paths import resolve_model_dir
from pydaemon.worker.kv_cache import KVCacheSpec
from pydaemon.worker.spec_decode.proposer import DraftRequest, Proposer, TargetStep


@dataclass
class _HeadState:
    num_computed: int  # positions [0, num_computed) hold the head's real K/V
    pending: torch.Tensor | None  # [hidden_size]: the target's h at position num_computed


class EagleProposer(Proposer):
    needs_target_hidden_states = True

    def __init__(
        self,
        config: RunnerConfig,
        device: torch.device,
        target: nn.Module,
        target_config: ModelConfig,
    ) -> None:
        """Loads the head (before the target's KV cache is sized, so that its weights are
        counted); ``allocate_cache`` gives it its KV cache once the block count is known."""
        spec = config.speculative
        if config.tensor_parallel_size > 1:
            raise ValueError(
                "speculative_config.method eagle runs with tensor_parallel_size 1 only"
            )
        loaded = load_eagle_head(
            resolve_model_dir(spec.model),
            target,
            target_config,
            config.dtype,
            device,
            config.load_format,
            config.seed,
        )
        self.head = loaded.head
        self.embed_tokens = loaded.embed_tokens
        self.lm_head_weight = loaded.lm_head_weight
        self.target = target
        self.device = device
        self.block_size = config.block_size
        hc = loaded.config
        dtype = next(self.head.parameters()).dtype
        self.kv_spec = KVCacheSpec(
            hc.num_hidden_layers, hc.num_key_value_heads, config.block_size, hc.head_dim, dtype
        )
        self.kv_cache: torch.Tensor | None = None
        self._states: dict[int, _HeadState] = {}

    def allocate_cache(self, num_blocks: int) -> None:
        self.kv_cache = self.kv_spec.allocate(num_blocks, self.device)

    def forget(self, seq_ids: list[int]) -> None:
        for seq_id in seq_ids:
            self._states.pop(seq_id, None)

    # ---- after each target forward ----------------------------------------------------------
    @torch.inference_mode()
    def observe_target(self, step: TargetStep) -> None:
        hidden_rows, token_rows, pending_at, pendings = [], [], [], []
        starts, lens, tables = [], [], []
        num_rows = 0
        for i, seq_id in enumerate(step.seq_ids):
            first, valid = int(step.query_start_loc[i]), int(step.num_valid[i])
            start = int(step.starts[i])
            state = self._states.get(seq_id)
            rows_h = np.arange(first, first + valid - 1)
            rows_t = rows_h + 1
            if state is not None and state.pending is not None and state.num_computed == start - 1:
                pending_at.append(num_rows)  # its h goes first, with the step's first token
                pendings.append(state.pending)
                rows_h = np.concatenate([[first], rows_h])  # placeholder row, overwritten
                rows_t = np.concatenate([[first], rows_t])
                start -= 1
            if len(rows_h):
                hidden_rows.append(rows_h)
                token_rows.append(rows_t)
                starts.append(start)
                lens.append(len(rows_h))
                tables.append(step.block_tables[i])
                num_rows += len(rows_h)
        last = step.query_start_loc[:-1] + step.num_valid - 1
        # Indexing copies: the hidden states may be a CUDA graph's buffer, rewritten next step.
        pending = step.hidden_states[_index(last, self.device)]
        for i, seq_id in enumerate(step.seq_ids):
            position = int(step.starts[i] + step.num_valid[i] - 1)
            self._states[seq_id] = _HeadState(position, pending[i])
        if not num_rows:
            return
        hidden = step.hidden_states[_index(np.concatenate(hidden_rows), self.device)]
        if pendings:
            hidden[_index(np.array(pending_at), self.device)] = torch.stack(pendings)
        ids = step.input_ids[_index(np.concatenate(token_rows), self.device)]
        self._run(ids, hidden, np.array(tables), np.array(starts), np.array(lens))

    # ---- before a verify step ---------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> list[list[int]]:
        ready = []
        for i, r in enumerate(requests):
            state = self._states.get(r.seq_id)
            n = len(r.token_ids)
            if state is not None and state.pending is not None and state.num_computed == n - 2:
                ready.append(i)
        drafts: list[list[int]] = [[] for _ in requests]
        if not ready:
            return drafts
        reqs = [requests[i] for i in ready]
        positions = np.array([len(r.token_ids) - 2 for r in reqs], dtype=np.int64)
        max_drafts = np.array([r.max_drafts for r in reqs])
        tables = [r.block_table for r in reqs]
        ids = _index(np.array([r.token_ids[-1] for r in reqs]), self.device)
        hidden = torch.stack([self._states[r.seq_id].pending for r in reqs])
        for r in reqs:  # the pending state is computed now: real K/V at N - 2
            state = self._states[r.seq_id]
            state.num_computed, state.pending = state.num_computed + 1, None
        out = torch.full((len(reqs), int(max_drafts.max())), -1, device=self.device)
        live = np.arange(len(reqs))
        for j in range(out.shape[1]):
            if j > 0:  # the sequences that want more drafts: g and the last draft, one on
                keep = _index(np.flatnonzero(max_drafts[live] > j), self.device)
                live = live[max_drafts[live] > j]
                ids, hidden = out[_index(live, self.device), j - 1], hidden[keep]
            hidden = self._run(ids, hidden, [tables[k] for k in live], positions[live] + j)
            out[_index(live, self.device), j] = self._logits(hidden).argmax(dim=-1)
        # One host copy for every draft.
        for r_index, row in zip(ready, out.tolist(), strict=True):
            drafts[r_index] = [t for t in row if t >= 0][: requests[r_index].max_drafts]
        return drafts

    # ---- the head ---------------------------------------------------------------------------
    def _run(
        self,
        ids: torch.Tensor,
        hidden: torch.Tensor,
        block_tables: np.ndarray | list[np.ndarray],
        starts: np.ndarray,
        query_lens: np.ndarray | None = None,
    ) -> torch.Tensor:
        """ids [T] int64, hidden [T, hidden_size] on the device; each sequence's rows are
        query_lens[i] (default 1) consecutive positions from starts[i]. Writes their K/V;
        -> the head's output g [T, hidden_size]."""
        if query_lens is None:
            query_lens = np.ones(len(starts), dtype=np.int32)
        meta, positions = chunk_metadata(
            block_tables, starts, query_lens, self.block_size, self.device
        )
        return self.head(
            self.embed_tokens(ids), hidden, _index(positions, self.device), self.kv_cache, meta
        )

    def _logits(self, g: torch.Tensor) -> torch.Tensor:
        """g: [R, hidden_size] -> [R, vocab_size] float32."""
        if self.lm_head_weight is None:
            return self.target.compute_logits(g)
        return F.linear(g, self.lm_head_weight).float()


def _index(array: np.ndarray, device: torch.device) -> torch.Tensor:
    return to_device(np.ascontiguousarray(array, dtype=np.int64), device)
