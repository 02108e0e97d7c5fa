"""vLLM's metric families of issue 55 (item 23), fed by real requests on the demo engine:
tokens per engine step (``vllm:iteration_tokens_total``), waiting requests by reason, the
cache config as an info gauge, the n / max_tokens parameter histograms and the request phase
histograms (prefill, decode, inference), after requests through HTTP and gRPC."""

from __future__ import annotations

import re

from conftest import DEMO_NUM_KV_BLOCKS, make_server_thread, shared_demo_engine
from http_helpers import MODEL, openai_client, scrape_metrics
from server_helpers import BidiClient

from pydaemon.core.stats import EngineStats
from pydaemon.entrypoints.common.vllm_metrics import vllm_waiting_by_reason
from pydaemon.proto.pagedd.v1 import generation_pb2 as pb

LABEL = f'model_name="{MODEL}"'


def test_vllm_engine_and_request_families():
    engine = shared_demo_engine()
    st = make_server_thread(lambda: engine, http_port=0, metrics_port=0)
    try:
        before, _ = scrape_metrics(st)
        client = openai_client(st)
        extra = {"ignore_eos": True}
        client.completions.create(
            model=MODEL, prompt="Hello there", n=2, max_tokens=5, extra_body=extra
        )
        list(client.chat.completions.create(model=MODEL, stream=True, max_tokens=3,
             messages=[{"role": "user", "content": "Hi"}], extra_body=extra))  # fmt: skip
        grpc_client = BidiClient(st.stub()).start(
            "g", [3, 4, 5, 6], sampling=pb.SamplingParams(max_tokens=4, ignore_eos=True)
        )
        grpc_client.close_send().collect()
        st.wait_all_blocks_free()
        after, text = scrape_metrics(st)
    finally:
        st.close()

    def grew(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    # Tokens per step: every step's computed prompt tokens plus generated tokens, so the
    # histogram's sum grows by exactly what the token counters grew by.
    steps = grew(f"vllm:iteration_tokens_total_count{{{LABEL}}}")
    tokens = grew(f"vllm:prompt_tokens_total{{{LABEL}}}") + grew(
        f"vllm:generation_tokens_total{{{LABEL}}}"
    )
    assert grew(f"vllm:generation_tokens_total{{{LABEL}}}") == 10 + 3 + 4
    assert grew(f"vllm:iteration_tokens_total_sum{{{LABEL}}}") == tokens
    assert 5 <= steps <= tokens  # at least the longest request's steps, none empty of tokens
    assert grew(f'vllm:iteration_tokens_total_bucket{{{LABEL},le="+Inf"}}') == steps

    # Waiting by reason: idle now; the reasons add up to the waiting gauge.
    capacity = after[f'vllm:num_requests_waiting_by_reason{{{LABEL},reason="capacity"}}']
    deferred = after[f'vllm:num_requests_waiting_by_reason{{{LABEL},reason="deferred"}}']
    assert capacity + deferred == after[f"vllm:num_requests_waiting{{{LABEL}}}"] == 0

    # The cache config: the engine's own settings and block counts.
    (labels,) = re.findall(r"^vllm:cache_config_info\{(.*)\} 1\.0$", text, re.MULTILINE)
    info = dict(re.findall(r'(\w+)="([^"]*)"', labels))
    config = engine.config
    assert info["block_size"] == str(config.block_size)
    assert info["cache_dtype"] == config.kv_cache_dtype
    assert info["enable_prefix_caching"] == str(config.enable_prefix_caching)
    assert info["gpu_memory_utilization"] == str(config.gpu_memory_utilization)
    assert info["num_gpu_blocks"] == str(DEMO_NUM_KV_BLOCKS)
    assert info["num_gpu_blocks_override"] == str(config.num_kv_blocks)
    assert info["engine"] == "0"

    # The request parameters: three requests, n 2 + 1 + 1, max_tokens 5 + 3 + 4.
    assert grew(f"vllm:request_params_n_count{{{LABEL}}}") == 3
    assert grew(f"vllm:request_params_n_sum{{{LABEL}}}") == 4
    assert grew(f'vllm:request_params_n_bucket{{{LABEL},le="1.0"}}') == 2
    assert grew(f"vllm:request_params_max_tokens_count{{{LABEL}}}") == 3
    assert grew(f"vllm:request_params_max_tokens_sum{{{LABEL}}}") == 12

    # The phases: once per request; running = prefill then decode, within end-to-end.
    sums = {}
    for phase in ("prefill", "decode", "inference"):
        name = f"vllm:request_{phase}_time_seconds"
        assert grew(f"{name}_count{{{LABEL}}}") == 3, name
        assert grew(f'{name}_bucket{{{LABEL},le="+Inf"}}') == 3, name
        sums[phase] = grew(f"{name}_sum{{{LABEL}}}")
        assert sums[phase] > 0, name
    assert abs(sums["inference"] - sums["prefill"] - sums["decode"]) < 1e-6
    assert sums["inference"] <= grew(f"vllm:e2e_request_latency_seconds_sum{{{LABEL}}}")


def test_waiting_by_reason_splits_the_waiting_gauge():
    zeros = {name: 0 for name in EngineStats.__dataclass_fields__ if name.startswith("num_")}
    stats = EngineStats(
        **{**zeros, "kv_waste_slots": 0, "prefix_cache_query_tokens": 0,
           "prefix_cache_hit_tokens": 0, "num_waiting": 5, "num_waiting_deferred": 2}
    )  # fmt: skip
    lines = vllm_waiting_by_reason(stats, "m")
    assert 'vllm:num_requests_waiting_by_reason{model_name="m",reason="capacity"} 3' in lines
    assert 'vllm:num_requests_waiting_by_reason{model_name="m",reason="deferred"} 2' in lines
