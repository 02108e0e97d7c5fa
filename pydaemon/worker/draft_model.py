"""DraftModelProposer: a second, smaller model drafts tokens greedily (vLLM's ``draft_model``).

The draft model (any model pagedd loads with the target's vocabulary; TP=1, on the target's
device) has its own paged KV cache with as many blocks as the target's, addressed by the
target's block tables: a draft token's K/V sits in the same slot as the target's, so the
scheduler's one block manager covers both and rejected slots are dropped for both at once.

Per sequence and step (``propose``): the draft first catches its cache up on the tokens it has
not computed (the whole prompt the first time; after a verify step, from the first draft the
target rejected), which also yields the first draft, then decodes the others one position at
a time, writing their K/V into the reserved draft slots. Drafts are the argmax (a point-mass
draft distribution, as the rejection sampler expects) of the logits after the request's own
processors, those verification applies (min_tokens mask, logit bias, penalties, with the
drafts before counted as output): a greedy row keeps a draft only where it is that argmax,
so a raw argmax is rejected wherever a penalty or a bias moves it (the demo model as its own
draft, greedy with repetition penalty 1.3: 59 of 117 drafts accepted on the raw argmax, 72 of
72 on the processed one). Its K/V below the sequence's verified tokens stays valid from step
to step; a sequence the runner forgets (finished, preempted) starts over.
"""

from __future__ import annotations

import numpy as np
import torch

from pydaemon.config.runner import RunnerConfig
from pydaemon.layers.attention_metadata import chunk_metadata
from pydaemon.model_loader.loader import load_model
from pydaemon.model_loader.model_paths import resolve_model_dir
from pydaemon.sampling.logits_processing import processed_logits
from pydaemon.sampling.sampling_metadata import SamplingMetadata
from pydaemon.sampling_params import SamplingParams
from pydaemon.worker.kv_cache import KVCacheSpec
from pydaemon.worker.spec_decode.proposer import DraftRequest, Proposer


class DraftModelProposer(Proposer):
    def __init__(self, config: RunnerConfig, device: torch.device, vocab_size: int) -> None:
        """Loads the draft model (before the target's KV cache is sized, so that its weights
        are counted); ``allocate_cache`` gives it its KV cache once the block count is known."""
        spec = config.speculative
        if config.tensor_parallel_size > 1:
            raise ValueError(
                "speculative_config.method draft_model runs with tensor_parallel_size 1 only"
            )
        path = resolve_model_dir(spec.model)
        self.model, mc = load_model(
            path,
            dtype=config.dtype,
            device=device,
            load_format=config.load_format,
            seed=config.seed,
        )
        self.model.eval()
        if mc.vocab_size != vocab_size:
            raise ValueError(
                f"speculative_config.model {spec.model!r} has a vocabulary of {mc.vocab_size} "
                f"tokens, the target {vocab_size}: a draft model must share the vocabulary"
            )
        self.device = device
        self.block_size = config.block_size
        dtype = next(self.model.parameters()).dtype
        self.kv_spec = KVCacheSpec(
            mc.num_hidden_layers, mc.num_key_value_heads, config.block_size, mc.head_dim, dtype
        )
        self.kv_cache: torch.Tensor | None = None
        # seq_id -> (tokens known when it last drafted, its drafts): its K/V is valid below
        # that count, and past it for the drafts the sequence then kept.
        self._drafted: dict[int, tuple[int, list[int]]] = {}

    def allocate_cache(self, num_blocks: int) -> None:
        self.kv_cache = self.kv_spec.allocate(num_blocks, self.device)

    def forget(self, seq_ids: list[int]) -> None:
        for seq_id in seq_ids:
            self._drafted.pop(seq_id, None)

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> list[list[int]]:
        if not requests:
            return []
        starts, ends = [], []
        for r in requests:
            n = len(r.token_ids)
            start = 0
            if r.seq_id in self._drafted:
                # Valid K/V: the tokens known then, and the drafts the sequence kept (but the
                # last draft, whose K/V was never written).
                known, drafts = self._drafted[r.seq_id]
                kept = 0
                while (
                    kept < len(drafts) - 1
                    and known + kept < n - 1
                    and drafts[kept] == r.token_ids[known + kept]
                ):
                    kept += 1
                start = known + kept
            starts.append(min(start, n - 1))
            ends.append(n)
        # Catch up (a prefill of each sequence's uncomputed tokens): the first draft.
        tokens = [r.token_ids[s:e] for r, s, e in zip(requests, starts, ends, strict=True)]
        next_ids = self._forward(requests, tokens, starts, [[] for _ in requests])
        drafts = [[t] for t in next_ids]
        # The other drafts, one position at a time, for the sequences that want more.
        for j in range(1, max(r.max_drafts for r in requests)):
            live = [i for i, r in enumerate(requests) if r.max_drafts > j]
            if not live:
                break
            next_ids = self._forward(
                [requests[i] for i in live],
                [np.array([drafts[i][-1]]) for i in live],
                [ends[i] + j - 1 for i in live],
                [drafts[i] for i in live],
            )
            for i, t in zip(live, next_ids, strict=True):
                drafts[i].append(t)
        for r, n, d in zip(requests, ends, drafts, strict=True):
            self._drafted[r.seq_id] = (n, d)
        return drafts

    def _forward(
        self,
        requests: list[DraftRequest],
        tokens: list[np.ndarray],
        starts: list[int],
        drafts: list[list[int]],
    ) -> list[int]:
        """Runs the draft model over ``tokens[i]`` at positions starts[i].. of each sequence,
        writing their K/V in its slots; -> the argmax after each sequence's last token, of
        the logits after its processors (``drafts[i]``: its drafts before this one)."""
        query_lens = np.array([len(t) for t in tokens], dtype=np.int32)
        tables = [r.block_table for r in requests]
        meta, positions = chunk_metadata(
            tables, np.array(starts), query_lens, self.block_size, self.device
        )
        dev = self.device
        input_ids = torch.from_numpy(np.concatenate(tokens).astype(np.int64)).to(dev)
        hidden = self.model(input_ids, torch.from_numpy(positions).to(dev), self.kv_cache, meta)
        last = (meta.query_start_loc[1:] - 1).long()
        logits = self.model.compute_logits(hidden[last])
        metadata = _processors(requests, drafts, logits.device)
        if metadata is not None:
            logits = processed_logits(logits, metadata)
        return logits.argmax(dim=-1).tolist()


_NO_PROCESSORS = SamplingParams(temperature=0.0)


def _processors(
    requests: list[DraftRequest], drafts: list[list[int]], device: torch.device
) -> SamplingMetadata | None:
    """The rows' logits processors as the verify step builds them (spec_decoder.py: the
    drafts before a row count as output); None when no request has any."""
    params = [r.params or _NO_PROCESSORS for r in requests]
    if not any(p.has_penalties or p.logit_bias or p.min_tokens for p in params):
        return None
    prompts = [r.token_ids[: r.num_prompt_tokens].tolist() for r in requests]
    outputs = [
        r.token_ids[r.num_prompt_tokens :].tolist() + d
        for r, d in zip(requests, drafts, strict=True)
    ]
    return SamplingMetadata.build(
        params=params,
        prompt_token_ids=prompts,
        output_token_ids=outputs,
        generators=[None] * len(requests),
        device=device,
        stop_ids_for_min_tokens=[set(r.min_tokens_stop_ids) for r in requests],
    )
