"""TPOT at batch 1 by difference through an engine's offline ``generate``: one method for every
backend of throughput.py (pagedd and vLLM), run on the engine that has just run the workload.

Each run times two single-request calls on fresh random prompts (no prefix-cache hit): one
that makes ``output_len`` tokens and one that makes a single token. Both pay the same prefill
and the same per-call overhead, so

    TPOT = (t_output_len - t_1) / (output_len - 1),   TTFT ~ t_1.

A warm-up call comes first; medians over ``runs`` are reported with every run's figures.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable

# generate_one(prompt token ids, max_tokens) -> how many tokens it returned (greedy, EOS ignored)
GenerateOne = Callable[[list[int], int], int]


def token_range_for(vocab_size: int | None) -> tuple[int, int]:
    """Prompt ids for the runs: W1's range [100, 30000) cut to the vocabulary."""
    high = min(30000, vocab_size) if vocab_size else 30000
    return (100 if high > 200 else 0), high


def measure_tpot_batch1(
    generate_one: GenerateOne,
    runs: int,
    *,
    prompt_len: int = 1024,
    output_len: int = 128,
    token_range: tuple[int, int] = (100, 30000),
    seed: int = 1,
) -> dict:
    """Median TPOT and TTFT (ms) at batch 1 over ``runs`` pairs of calls (see the module doc)."""
    if runs < 1 or prompt_len < 1 or output_len < 2:
        raise ValueError(
            f"tpot needs runs >= 1, prompt_len >= 1, output_len >= 2 "
            f"(got {runs}, {prompt_len}, {output_len})"
        )
    low, high = token_range
    if not 0 <= low < high:
        raise ValueError(f"token id range [{low}, {high}) is empty or negative")
    rng = random.Random(seed)

    def fresh() -> list[int]:
        return [rng.randrange(low, high) for _ in range(prompt_len)]

    def timed(max_tokens: int) -> float:
        start = time.perf_counter()
        n = generate_one(fresh(), max_tokens)
        elapsed = time.perf_counter() - start
        if n != max_tokens:
            raise RuntimeError(f"asked for {max_tokens} tokens, the engine returned {n}")
        return elapsed

    timed(8)  # warm-up: the single-request shapes, outside the timed runs
    per_run = []
    for _ in range(runs):
        t_full, t_one = timed(output_len), timed(1)
        per_run.append(
            {
                "full_ms": t_full * 1e3,
                "one_token_ms": t_one * 1e3,
                "tpot_ms": (t_full - t_one) / (output_len - 1) * 1e3,
            }
        )
    return {
        "method": "difference of generate() calls: (t_n - t_1) / (n - 1)",
        "batch_size": 1,
        "prompt_len": prompt_len,
        "output_len": output_len,
        "runs": per_run,
        "tpot_ms": statistics.median(r["tpot_ms"] for r in per_run),
        "ttft_ms": statistics.median(r["one_token_ms"] for r in per_run),
    }


# generate_batch(prompts, max_tokens) -> the tokens each request returned (greedy, EOS ignored)
GenerateBatch = Callable[[list[list[int]], int], list[int]]


def measure_tpot_batch(
    generate_batch: GenerateBatch,
    runs: int,
    batch_size: int,
    *,
    prompt_len: int = 1024,
    output_len: int = 128,
    token_range: tuple[int, int] = (100, 30000),
    seed: int = 2,
) -> dict:
    """TPOT at batch ``batch_size``, by the same difference as measure_tpot_batch1: one call
    of ``batch_size`` fresh prompts making ``output_len`` tokens each, one making one token
    each; the requests decode in lockstep, so (t_n - t_1) / (n - 1) is each one's TPOT (and
    the decode step's time)."""
    if batch_size < 1:
        raise ValueError(f"tpot batch size must be >= 1, got {batch_size}")
    low, high = token_range
    rng = random.Random(f"batch-{seed}")  # the other prompts: not the first one's stream

    def generate_one(prompt: list[int], max_tokens: int) -> int:
        prompts = [prompt] + [
            [rng.randrange(low, high) for _ in range(prompt_len)] for _ in range(batch_size - 1)
        ]
        counts = generate_batch(prompts, max_tokens)
        return max_tokens if all(n == max_tokens for n in counts) else min(counts)

    result = measure_tpot_batch1(
        generate_one, runs, prompt_len=prompt_len, output_len=output_len,
        token_range=token_range, seed=seed,
    )  # fmt: skip
    result["batch_size"] = batch_size
    return result
