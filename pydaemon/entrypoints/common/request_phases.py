"""A finished request's phases from its engine timestamps (RequestMetrics), as vLLM splits
them: prefill from its first scheduling to its first token, decode from the first token to the
last, inference (running) from its first scheduling to its last token. None where a timestamp
is missing (never scheduled, no token, cut short before the engine finished it)."""

from __future__ import annotations

from dataclasses import dataclass

from pydaemon.outputs import RequestMetrics


@dataclass
class RequestPhases:
    prefill_s: float | None = None
    decode_s: float | None = None
    inference_s: float | None = None


def request_phases(m: RequestMetrics | None) -> RequestPhases:
    if m is None:
        return RequestPhases()
    scheduled, first, last = m.first_scheduled_time, m.first_token_time, m.finished_time
    return RequestPhases(
        prefill_s=first - scheduled if scheduled is not None and first is not None else None,
        decode_s=last - first if first is not None and last is not None else None,
        inference_s=last - scheduled if scheduled is not None and last is not None else None,
    )
