"""The messages between a front end and the engine core: plain dataclasses, token ids only.

A front end (``LLMEngine`` in-process, or the daemon's front-end process) tokenizes, sends an
``EngineCoreRequest``, and gets back per step one ``EngineCoreOutputs`` with the new token
ids of every sequence that moved; it detokenizes and checks stop strings itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pydaemon.engine_stats import EngineStats
from pydaemon.outputs import RequestMetrics, TokenLogprobs
from pydaemon.sampling_params import SamplingParams


@dataclass
class EngineCoreRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: list[int]
    arrival_time: float
    priority: int = 0
    cache_salt: str = ""


@dataclass
class SeqOutput:
    """One sequence's news in one step. For beam search (reported once, at the end) the
    whole hypotheses, ``index`` being the rank."""

    index: int
    new_token_ids: list[int]
    cumulative_logprob: float
    new_logprobs: list[TokenLogprobs] | None = None  # one entry per new token when asked
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | None = None  # the stop token id that matched


@dataclass
class EngineCoreOutput:
    request_id: str
    seqs: list[SeqOutput]
    finished: bool = False  # no more outputs for this request
    metrics: RequestMetrics | None = None
    error: str | None = None  # the core failed or rejected the request


@dataclass
class EngineCoreOutputs:
    outputs: list[EngineCoreOutput] = field(default_factory=list)
    stats: EngineStats | None = None  # set when asked for (the process transport)
