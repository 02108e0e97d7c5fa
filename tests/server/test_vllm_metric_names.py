"""vLLM's Prometheus names beyond the router gauges (issue 46): token and prefix-cache
counters, request_success_total, TTFT / inter-token / end-to-end / queue-time histograms and
the per-request token histograms, each labelled with model_name, after requests through the
official openai client, streamed and not, and gRPC."""

from __future__ import annotations

from conftest import make_server_thread, shared_demo_engine
from http_helpers import MODEL, openai_client, scrape_metrics
from server_helpers import BidiClient

from pydaemon.proto.pagedd.v1 import generation_pb2 as pb

LABEL = f'model_name="{MODEL}"'


def test_vllm_counters_and_histograms():
    st = make_server_thread(shared_demo_engine, http_port=0, metrics_port=0)
    try:
        before = scrape_metrics(st)[0]
        client = openai_client(st)
        extra = {"ignore_eos": True}
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, extra_body=extra)
        list(client.chat.completions.create(model=MODEL, stream=True, max_tokens=3,
             messages=[{"role": "user", "content": "Hi"}], extra_body=extra))  # fmt: skip
        grpc_client = BidiClient(st.stub()).start(
            "g", [3, 4, 5], sampling=pb.SamplingParams(max_tokens=4, ignore_eos=True)
        )
        grpc_client.close_send().collect()
        st.wait_all_blocks_free()
        after = scrape_metrics(st)[0]
    finally:
        st.close()

    def grew(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert grew(f"vllm:generation_tokens_total{{{LABEL}}}") == 12
    assert grew(f"vllm:prompt_tokens_total{{{LABEL}}}") > 0
    assert f"vllm:prefix_cache_queries_total{{{LABEL}}}" in after
    assert f"vllm:prefix_cache_hits_total{{{LABEL}}}" in after
    assert f"vllm:num_preemptions_total{{{LABEL}}}" in after
    assert grew(f'vllm:request_success_total{{{LABEL},finished_reason="length"}}') == 3
    for name in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:request_queue_time_seconds", "vllm:request_prompt_tokens",
                 "vllm:request_generation_tokens"):  # fmt: skip
        assert grew(f"{name}_count{{{LABEL}}}") == 3, name
        assert grew(f'{name}_bucket{{{LABEL},le="+Inf"}}') == 3, name
    assert grew(f"vllm:request_generation_tokens_sum{{{LABEL}}}") == 12
    # intervals between tokens: 4 + 2 + 3, their sum the time from first to last token
    assert grew(f"vllm:inter_token_latency_seconds_count{{{LABEL}}}") == 9
    assert grew(f"vllm:inter_token_latency_seconds_sum{{{LABEL}}}") > 0
