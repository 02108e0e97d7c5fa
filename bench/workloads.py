"""Benchmark workloads: lists of prompts (token ids or text) with their output lengths.

Every workload is a deterministic function of its arguments (and of ``seed``):

- ``w1``: workload W1 of bench/README.md, exactly: ``rng = random.Random(0)``; for each of 512
  requests, ``n = rng.randint(64, 1024)`` then ``[rng.randrange(100, 30000) for _ in
  range(n)]``; 256 output tokens, EOS ignored, greedy. A smaller ``num_requests`` takes the
  first requests of that same sequence.
- ``fixed``: every prompt ``input_len`` random tokens, every output ``output_len`` tokens.
- ``uniform``: input and output lengths uniform in ``[min, max]`` (inclusive).
- ``sharegpt``: a ShareGPT-like long tail without the data set: input lengths
  LogNormal(median 128, sigma 1.0) clipped to [4, 2048], output lengths LogNormal(median
  128, sigma 0.9) clipped to [4, 1024]; means about 210 and 190 tokens, p99 about 1300 and
  1000 (before clipping). ``--output-len`` overrides every output length (vLLM's
  ``--sharegpt-output-len``), the inputs keep their long tail.
- ``shared_prefix``: ``num_prefixes`` long "system prompts" of ``prefix_len`` tokens; each
  request is one of them (round robin) plus ``suffix_len`` tokens of its own.
- ``jsonl``: one JSON object per line with ``"prompt"`` (text) or ``"prompt_token_ids"``
  (ids), and optionally ``"output_len"`` (or ``"max_tokens"``).

Synthetic token ids are drawn from ``[token_low, token_high)``; pass the model's vocabulary
size as ``token_high`` for models smaller than W1's range.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

W1_NUM_REQUESTS = 512
W1_OUTPUT_LEN = 256
W1_TOKEN_LOW, W1_TOKEN_HIGH = 100, 30000
W1_MIN_LEN, W1_MAX_LEN = 64, 1024

WORKLOADS = ("auto", "w1", "fixed", "uniform", "sharegpt", "shared-prefix", "jsonl")


@dataclass
class WorkloadRequest:
    """One request: a text prompt or token ids, and how many tokens to generate."""

    prompt: str | list[int]
    output_len: int
    prompt_len: int | None = None  # known for token prompts; None for text until tokenized

    def __post_init__(self) -> None:
        if isinstance(self.prompt, list) and self.prompt_len is None:
            self.prompt_len = len(self.prompt)
        if not self.prompt:
            raise ValueError("a workload prompt is empty")
        if self.output_len < 1:
            raise ValueError(f"output_len must be >= 1 (got {self.output_len})")

    @property
    def is_text(self) -> bool:
        return isinstance(self.prompt, str)


def w1(
    num_requests: int = W1_NUM_REQUESTS, output_len: int = W1_OUTPUT_LEN
) -> list[WorkloadRequest]:
    """W1 of bench/README.md (the first ``num_requests`` of its 512 requests)."""
    _check_count(num_requests, W1_NUM_REQUESTS)
    rng = random.Random(0)
    out = []
    for _ in range(W1_NUM_REQUESTS):
        n = rng.randint(W1_MIN_LEN, W1_MAX_LEN)
        prompt = [rng.randrange(W1_TOKEN_LOW, W1_TOKEN_HIGH) for _ in range(n)]
        out.append(WorkloadRequest(prompt, output_len))
        if len(out) == num_requests:
            break
    return out


def fixed(
    num_requests: int, input_len: int, output_len: int, *, seed: int = 0,
    token_low: int = W1_TOKEN_LOW, token_high: int = W1_TOKEN_HIGH,
) -> list[WorkloadRequest]:  # fmt: skip
    return uniform(num_requests, (input_len, input_len), (output_len, output_len), seed=seed,
                   token_low=token_low, token_high=token_high)  # fmt: skip


def uniform(
    num_requests: int, input_range: tuple[int, int], output_range: tuple[int, int], *,
    seed: int = 0, token_low: int = W1_TOKEN_LOW, token_high: int = W1_TOKEN_HIGH,
) -> list[WorkloadRequest]:  # fmt: skip
    _check_count(num_requests)
    _check_range("input", input_range)
    _check_range("output", output_range)
    low, high = _token_range(token_low, token_high)
    rng = random.Random(seed)
    out = []
    for _ in range(num_requests):
        n = rng.randint(*input_range)
        prompt = [rng.randrange(low, high) for _ in range(n)]
        out.append(WorkloadRequest(prompt, rng.randint(*output_range)))
    return out


def _lognormal_len(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return int(min(hi, max(lo, round(rng.lognormvariate(math.log(median), sigma)))))


def sharegpt(
    num_requests: int, *, seed: int = 0, token_low: int = W1_TOKEN_LOW,
    token_high: int = W1_TOKEN_HIGH, max_input_len: int = 2048, max_output_len: int = 1024,
    output_len: int | None = None,
) -> list[WorkloadRequest]:  # fmt: skip
    """Long-tailed lengths like ShareGPT's (see the module docstring for the distribution);
    ``output_len``: every output that long instead (the inputs are the same either way)."""
    _check_count(num_requests)
    low, high = _token_range(token_low, token_high)
    rng = random.Random(seed)
    out = []
    for _ in range(num_requests):
        n = _lognormal_len(rng, 128, 1.0, 4, max_input_len)
        m = _lognormal_len(rng, 128, 0.9, 4, max_output_len)
        prompt = [rng.randrange(low, high) for _ in range(n)]
        out.append(WorkloadRequest(prompt, m if output_len is None else output_len))
    return out


def shared_prefix(
    num_requests: int, prefix_len: int, suffix_len: int, output_len: int, *,
    num_prefixes: int = 1, seed: int = 0, token_low: int = W1_TOKEN_LOW,
    token_high: int = W1_TOKEN_HIGH,
) -> list[WorkloadRequest]:  # fmt: skip
    _check_count(num_requests)
    if prefix_len < 1 or suffix_len < 0 or num_prefixes < 1:
        raise ValueError(
            f"shared-prefix needs prefix_len >= 1, suffix_len >= 0, num_prefixes >= 1 "
            f"(got {prefix_len}, {suffix_len}, {num_prefixes})"
        )
    low, high = _token_range(token_low, token_high)
    rng = random.Random(seed)
    prefixes = [[rng.randrange(low, high) for _ in range(prefix_len)] for _ in range(num_prefixes)]
    return [
        WorkloadRequest(
            prefixes[i % num_prefixes] + [rng.randrange(low, high) for _ in range(suffix_len)],
            output_len,
        )
        for i in range(num_requests)
    ]


def jsonl(
    path: str | Path, output_len: int, num_requests: int | None = None
) -> list[WorkloadRequest]:
    """Prompts from a JSONL file; a line's own ``output_len``/``max_tokens`` wins over ``output_len``."""
    out = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{line_no}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not JSON ({e})") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
            out.append(_jsonl_request(obj, output_len, where))
            if num_requests is not None and len(out) == num_requests:
                break
    if not out:
        raise ValueError(f"{path}: no prompts")
    return out


def _jsonl_request(obj: dict, output_len: int, where: str) -> WorkloadRequest:
    n = obj.get("output_len", obj.get("max_tokens", output_len))
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"{where}: output_len must be a positive integer (got {n!r})")
    if "prompt_token_ids" in obj:
        ids = obj["prompt_token_ids"]
        if (
            not isinstance(ids, list)
            or not ids
            or not all(isinstance(t, int) and t >= 0 for t in ids)
        ):
            raise ValueError(f"{where}: prompt_token_ids must be a non-empty list of ids >= 0")
        return WorkloadRequest(ids, n)
    text = obj.get("prompt")
    if not isinstance(text, str) or not text:
        raise ValueError(f"{where}: needs a non-empty 'prompt' string or 'prompt_token_ids'")
    return WorkloadRequest(text, n)


def _check_count(num_requests: int, most: int | None = None) -> None:
    if num_requests < 1 or (most is not None and num_requests > most):
        bound = f"in [1, {most}]" if most is not None else ">= 1"
        raise ValueError(f"num_requests must be {bound} (got {num_requests})")


def _check_range(what: str, r: tuple[int, int]) -> None:
    if not 1 <= r[0] <= r[1]:
        raise ValueError(f"{what} length range must satisfy 1 <= min <= max (got {r[0]}..{r[1]})")


def _token_range(low: int, high: int) -> tuple[int, int]:
    if not 0 <= low < high:
        raise ValueError(f"token id range [{low}, {high}) is empty or negative")
    return low, high


def summarize(requests: list[WorkloadRequest]) -> dict[str, int | None]:
    """Request count and token totals (prompt total is None when some prompts are text)."""
    lens = [r.prompt_len for r in requests]
    return {
        "num_requests": len(requests),
        "total_prompt_tokens": None if None in lens else sum(lens),  # type: ignore[arg-type]
        "total_output_tokens": sum(r.output_len for r in requests),
    }


# ---- command-line flags shared by loadgen.py and throughput.py -------------------------------


def add_workload_flags(parser) -> None:
    g = parser.add_argument_group("workload")
    g.add_argument("--workload", choices=WORKLOADS, default="auto",
                   help="auto (default): w1 when the model's vocabulary and context can take it, "
                        "else uniform lengths that fit the model (e.g. the demo model); "
                        "w1: W1 of bench/README.md (token ids in [100, 30000), 64..1024 long, 256 out); "
                        "fixed / uniform lengths; sharegpt: long-tailed lengths, input "
                        "LogNormal(median 128, sigma 1.0) clipped to [4, 2048], output "
                        "LogNormal(median 128, sigma 0.9) clipped to [4, 1024]; shared-prefix: "
                        "a long common system prompt plus a short own suffix; jsonl: --jsonl FILE")  # fmt: skip
    g.add_argument("--num-requests", type=int, default=None,
                   help="requests (default: 512; jsonl: every line); W1 takes its first N")  # fmt: skip
    g.add_argument("--output-len", type=int, default=None,
                   help="output tokens per request (default 256; W1 is 256; sharegpt: every "
                        "request's, instead of the long tail; uniform: use --output-range)")  # fmt: skip
    g.add_argument("--input-len", type=int, default=512, help="fixed: prompt tokens")
    g.add_argument("--input-range", default="64,1024", help="uniform: MIN,MAX prompt tokens")
    g.add_argument("--output-range", default="64,512", help="uniform: MIN,MAX output tokens")
    g.add_argument("--prefix-len", type=int, default=1024, help="shared-prefix: shared tokens")
    g.add_argument("--suffix-len", type=int, default=64, help="shared-prefix: own tokens")
    g.add_argument("--num-prefixes", type=int, default=1, help="shared-prefix: distinct prefixes")
    g.add_argument("--jsonl", default=None,
                   help='jsonl: a file of {"prompt": TEXT} or {"prompt_token_ids": [...]} lines, '
                        'each with an optional "output_len"')  # fmt: skip
    g.add_argument("--token-range", default=None,
                   help="LOW,HIGH: synthetic token ids (default 100,min(30000, vocab size))")  # fmt: skip


def _pair(text: str, flag: str) -> tuple[int, int]:
    try:
        a, b = (int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"{flag} must be MIN,MAX (got {text!r})") from None
    return a, b


def build_workload(
    args, vocab_size: int | None = None, max_model_len: int | None = None
) -> list[WorkloadRequest]:
    """The workload the flags describe; ``vocab_size`` bounds synthetic token ids and, with
    ``max_model_len``, decides what ``auto`` means."""
    n = args.num_requests
    out_len = args.output_len or W1_OUTPUT_LEN
    if args.workload == "uniform" and args.output_len is not None:
        raise ValueError(
            "--output-len does not apply to --workload uniform: give --output-range MIN,MAX "
            "(MIN = MAX for one length)"
        )
    if args.workload == "auto":
        w1_fits = (vocab_size is None or vocab_size >= W1_TOKEN_HIGH) and (
            max_model_len is None or max_model_len >= W1_MAX_LEN + out_len
        )
        if w1_fits:
            args.workload = "w1"
        else:  # uniform lengths, prompt + output within the context
            limit = max_model_len or W1_MAX_LEN + out_len
            args.workload = "uniform"
            args.input_range = f"4,{max(4, limit // 2)}"
            args.output_range = f"4,{max(4, min(out_len, limit // 4))}"
    if args.workload == "w1":
        if vocab_size is not None and vocab_size < W1_TOKEN_HIGH:
            raise ValueError(f"W1's token ids reach {W1_TOKEN_HIGH - 1} but the model's vocabulary "
                             f"has {vocab_size} tokens: use another --workload")  # fmt: skip
        return w1(n or W1_NUM_REQUESTS, out_len)
    if args.workload == "jsonl":
        if not args.jsonl:
            raise ValueError("--workload jsonl needs --jsonl FILE")
        return jsonl(args.jsonl, out_len, n)
    high = min(W1_TOKEN_HIGH, vocab_size) if vocab_size else W1_TOKEN_HIGH
    low, high = (
        _pair(args.token_range, "--token-range")
        if args.token_range
        else (min(W1_TOKEN_LOW, high - 1), high)
    )
    tokens = {"seed": args.seed, "token_low": low, "token_high": high}
    n = n or W1_NUM_REQUESTS
    if args.workload == "fixed":
        return fixed(n, args.input_len, out_len, **tokens)
    if args.workload == "uniform":
        return uniform(n, _pair(args.input_range, "--input-range"),
                       _pair(args.output_range, "--output-range"), **tokens)  # fmt: skip
    if args.workload == "sharegpt":
        return sharegpt(n, output_len=args.output_len, **tokens)
    return shared_prefix(n, args.prefix_len, args.suffix_len, out_len,
                         num_prefixes=args.num_prefixes, **tokens)  # fmt: skip
