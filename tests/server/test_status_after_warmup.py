"""Issue 55 item 21: `pagedd status` (GetServerStatus) counted the warm-up request that
/metrics leaves out (4 prompt tokens, 2 generated, on a fresh daemon). Both now count what
was served since the daemon became ready."""

from __future__ import annotations

import io
import json
import re
import urllib.request

from server_helpers import BidiClient

from pydaemon.entrypoints.cli import build_parser
from pydaemon.entrypoints.grpc.admin import run_admin
from pydaemon.proto.pagedd.v1 import generation_pb2 as pb

COUNTERS = {  # GetServerStatus field -> /metrics counter
    "num_prompt_tokens": "pagedd_prompt_tokens_total",
    "num_generation_tokens": "pagedd_generation_tokens_total",
    "prefix_cache_query_tokens": "pagedd_prefix_cache_query_tokens_total",
    "num_preemptions": "pagedd_preemptions_total",
}


def _metrics(st) -> dict[str, int]:
    url = f"http://127.0.0.1:{st.server.metrics_server.port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    return {
        name: int(re.search(rf"^{name} (\d+)$", text, re.MULTILINE).group(1))
        for name in COUNTERS.values()
    }


def _status(st) -> dict[str, int]:
    args = build_parser().parse_args(["status", "--server", st.address, "--json"])
    out = io.StringIO()
    assert run_admin(args, out=out) == 0
    reply = json.loads(out.getvalue())
    return {field: reply[field] for field in COUNTERS}


def test_status_and_metrics_count_the_same_served_tokens(demo_server):
    st = demo_server(metrics_port=0)
    status = _status(st)
    assert status == {field: 0 for field in COUNTERS}  # the warm-up is not served work
    assert _metrics(st) == {COUNTERS[f]: v for f, v in status.items()}
    sampling = pb.SamplingParams(max_tokens=3, ignore_eos=True, temperature=0)
    BidiClient(st.stub()).start("a", [5, 6, 7, 8, 9], sampling=sampling).close_send().collect()
    st.wait_all_blocks_free()
    status = _status(st)
    assert (status["num_prompt_tokens"], status["num_generation_tokens"]) == (5, 3)
    assert _metrics(st) == {COUNTERS[f]: v for f, v in status.items()}


def test_since_serving_takes_the_warm_up_out_of_every_counter():
    import dataclasses

    from pydaemon.core.stats import EngineStats, SpecDecodeStats
    from pydaemon.entrypoints.common.metrics import Metrics

    required = [f.name for f in dataclasses.fields(EngineStats) if f.default is dataclasses.MISSING]
    zeros = {name: 0 for name in required}
    warmup = EngineStats(
        **{**zeros, "num_gpu_blocks": 8, "num_prompt_tokens": 4, "num_generation_tokens": 2},
        spec_decode=SpecDecodeStats(1, 3, 2, [1, 1]),
    )
    now = EngineStats(
        **{
            **zeros,
            "num_gpu_blocks": 8,
            "num_running": 2,
            "num_prompt_tokens": 14,
            "num_generation_tokens": 9,
        },
        spec_decode=SpecDecodeStats(4, 12, 7, [3, 3, 1], drafts_off_at=[8]),
    )
    metrics = Metrics(lambda: now)
    assert metrics.since_serving(now) is now  # not serving yet: nothing to take out
    metrics.set_baseline(warmup)
    served = metrics.since_serving(now)
    assert (served.num_prompt_tokens, served.num_generation_tokens) == (10, 7)
    assert (served.num_running, served.num_gpu_blocks) == (2, 8)  # gauges as they are
    assert served.spec_decode == SpecDecodeStats(3, 9, 5, [2, 2, 1], drafts_off_at=[8])
