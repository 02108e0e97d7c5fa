"""The load generator's OpenAI HTTP side: one streamed ``POST /v1/completions`` per request
(server-sent events read as they arrive), the server's counters from ``GET /metrics``, the
model from ``GET /v1/models``, readiness from ``GET /health``.

Token counts per chunk come from vLLM's ``return_token_ids`` extra, so the per-chunk timings
and the token timeline mean the same as through gRPC; totals come from the final ``usage``
chunk (``stream_options.include_usage``). Every request has its own HTTP/1.1 connection
(kept alive and reused), as streaming needs. ``/metrics`` is read in pagedd's series or in
vLLM's (``vllm:*``, summed over their labels), so a sweep against ``vllm serve`` records the
same server counters.
"""

from __future__ import annotations

import asyncio
import json
import re
import ssl
import time

import aiohttp

from bench.loadgen_client import STATUS_FIELDS, ClientOptions
from bench.loadgen_metrics import RequestRecord
from bench.workloads import WorkloadRequest

# /metrics series -> the gRPC GetServerStatus field of the same meaning.
_METRICS = {
    "pagedd_num_requests_running": "num_running",
    "pagedd_num_requests_waiting": "num_waiting",
    "pagedd_num_requests_swapped": "num_swapped",
    "pagedd_kv_blocks_total": "num_gpu_blocks",
    "pagedd_kv_waste_slots": "kv_waste_slots",
    "pagedd_preemptions_total": "num_preemptions",
    "pagedd_prefix_cache_query_tokens_total": "prefix_cache_query_tokens",
    "pagedd_prefix_cache_hit_tokens_total": "prefix_cache_hit_tokens",
    "pagedd_prompt_tokens_total": "num_prompt_tokens",
    "pagedd_generation_tokens_total": "num_generation_tokens",
}
# vLLM's /metrics series -> the same fields (counters carry prometheus' _total suffix).
_VLLM_METRICS = {
    "vllm:num_requests_running": "num_running",
    "vllm:num_requests_waiting": "num_waiting",
    "vllm:num_preemptions_total": "num_preemptions",
    "vllm:prefix_cache_queries_total": "prefix_cache_query_tokens",
    "vllm:prefix_cache_hits_total": "prefix_cache_hit_tokens",
    "vllm:prompt_tokens_total": "num_prompt_tokens",
    "vllm:generation_tokens_total": "num_generation_tokens",
}
_VLLM_BLOCKS = re.compile(r'num_gpu_blocks="(\d+)"')


def parse_metrics(text: str) -> dict:
    """GetServerStatus' fields from a /metrics page of pagedd or of vLLM (absent ones are 0;
    vLLM's KV blocks in use come from its usage fraction times cache_config_info's blocks)."""
    values: dict[str, float] = {}
    blocks = 0
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        series, _, value = line.rpartition(" ")
        name = series.split("{", 1)[0]
        if name == "vllm:cache_config_info":
            m = _VLLM_BLOCKS.search(series)
            blocks = int(m.group(1)) if m else blocks
        elif name in _METRICS or name in _VLLM_METRICS or name in (
            "pagedd_kv_blocks_used", "vllm:kv_cache_usage_perc"
        ):  # fmt: skip
            values[name] = values.get(name, 0.0) + float(value)
    out = {field: 0 for field in STATUS_FIELDS}
    # pagedd exports a few gauges under vLLM's names too: its own series win when present.
    is_pagedd = any(name.startswith("pagedd_") for name in values)
    if not is_pagedd and any(name.startswith("vllm:") for name in values):
        out.update({f: int(values.get(s, 0)) for s, f in _VLLM_METRICS.items()})
        out["num_gpu_blocks"] = blocks
        used = round(values.get("vllm:kv_cache_usage_perc", 0.0) * blocks)
    else:
        out.update({f: int(values.get(s, 0)) for s, f in _METRICS.items()})
        used = int(values.get("pagedd_kv_blocks_used", 0))
    out["num_free_gpu_blocks"] = out["num_gpu_blocks"] - used
    return out


class OpenAIPool:
    """The same surface as loadgen_client.ChannelPool, over the OpenAI HTTP API."""

    def __init__(self, options: ClientOptions, model: str | None = None) -> None:
        self._ssl = ssl.create_default_context(cafile=options.tls_ca) if options.tls_ca else None
        self.base_url = f"{'https' if options.tls_ca else 'http'}://{options.target}"
        self.model = model
        self.timeout_s = options.timeout_s
        headers = {"Authorization": f"Bearer {options.api_key}"} if options.api_key else {}
        self._headers = headers
        self._session: aiohttp.ClientSession | None = None
        self.cache_salt: str | None = None  # set per run by loadgen.py (--cache-salt)

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:  # created on the running loop
            # One connection per request in flight.
            connector = aiohttp.TCPConnector(limit=0, ssl=self._ssl if self._ssl else True)
            timeout = aiohttp.ClientTimeout(total=self.timeout_s)
            self._session = aiohttp.ClientSession(
                headers=self._headers, connector=connector, timeout=timeout
            )
        return self._session

    @staticmethod
    def sampling(temperature: float, ignore_eos: bool) -> dict:
        return {"temperature": temperature, "ignore_eos": ignore_eos}

    async def send(self, request_id: str, req: WorkloadRequest, sampling: dict,
                   record: RequestRecord, t0: float, timeout_s: float | None) -> None:  # fmt: skip
        """Sends one request and fills ``record`` from its event stream."""
        body = {"model": self.model, "prompt": req.prompt, "max_tokens": req.output_len,
                "stream": True, "stream_options": {"include_usage": True},
                "return_token_ids": True, **sampling}  # fmt: skip
        if self.cache_salt:
            body["cache_salt"] = self.cache_salt
        record.start_s = time.perf_counter() - t0
        try:
            async with self.session.post(f"{self.base_url}/v1/completions", json=body) as resp:
                if resp.status != 200:
                    _fail(record, t0, f"HTTP_{resp.status}", await _error_message(resp))
                    return
                await _read_events(resp, record, t0)
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            _fail(record, t0, type(e).__name__, str(e))
            return
        if record.end_s is None:
            _fail(record, t0, "NO_FINISHED_FRAME", "the stream ended without a usage chunk")
        elif record.finish_reason == "abort":
            record.error_code = "FINISHED_ABORT"

    async def status(self) -> dict | None:
        try:
            async with self.session.get(f"{self.base_url}/metrics") as resp:
                if resp.status != 200:
                    return None
                text = await resp.text()
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return None
        return parse_metrics(text)

    async def info(self) -> dict:
        async with self.session.get(f"{self.base_url}/v1/models") as resp:
            if resp.status != 200:
                raise OSError(f"{self.base_url}/v1/models: HTTP {resp.status}")
            models = (await resp.json())["data"]
        card = next((m for m in models if m["id"] == self.model), None) if self.model else None
        if card is None:
            if self.model is not None:
                names = [m["id"] for m in models]
                raise ValueError(f"the server has no model {self.model!r} (it has {names})")
            card = models[0]
            self.model = card["id"]
        return {"model_name": card["id"], "max_model_len": card.get("max_model_len"),
                "vocab_size": card.get("vocab_size")}  # fmt: skip

    async def wait_ready(self, timeout_s: float) -> None:
        """Waits until GET /health answers 200, or raises TimeoutError."""
        deadline = time.monotonic() + timeout_s
        last = "no answer"
        while time.monotonic() < deadline:
            try:
                async with self.session.get(f"{self.base_url}/health") as resp:
                    if resp.status == 200:
                        return
                    last = f"HTTP {resp.status}"
            except aiohttp.ClientError as e:
                last = type(e).__name__
            await asyncio.sleep(0.5)
        raise TimeoutError(f"{self.base_url}/health was not 200 within {timeout_s:.0f} s ({last})")

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


async def _read_events(resp: aiohttp.ClientResponse, record: RequestRecord, t0: float) -> None:
    async for raw in resp.content:
        if not raw.startswith(b"data: "):
            continue
        now = time.perf_counter() - t0
        payload = raw[len(b"data: ") :].strip()
        if payload == b"[DONE]":
            return
        event = json.loads(payload)
        if "error" in event:
            _fail(record, t0, f"HTTP_{event['error'].get('type')}", event["error"]["message"])
            return
        for choice in event["choices"]:
            n = len(choice.get("token_ids") or ())
            if n:
                record.chunk_times_s.append(now)
                record.chunk_num_tokens.append(n)
            if choice.get("finish_reason"):
                record.finish_reason = choice["finish_reason"]
        usage = event.get("usage")
        if usage:
            record.end_s = now
            record.num_output_tokens = usage["completion_tokens"]
            record.num_cached_tokens = (usage.get("prompt_tokens_details") or {}).get(
                "cached_tokens", 0
            )
            if record.prompt_len is None:
                record.prompt_len = usage["prompt_tokens"]


async def _error_message(resp: aiohttp.ClientResponse) -> str:
    try:
        return (await resp.json())["error"]["message"]
    except (aiohttp.ContentTypeError, KeyError, ValueError):
        return await resp.text()


def _fail(record: RequestRecord, t0: float, code: str, message: str) -> None:
    record.end_s = time.perf_counter() - t0
    record.error_code = code
    record.error_message = message
