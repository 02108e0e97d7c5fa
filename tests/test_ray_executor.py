"""The ``ray`` executor backend on a local Ray cluster of two nodes (one machine), gloo, tiny
models: every rank a Ray actor placed by a placement group.

Greedy tokens of TP=2, PP=2 and TP=2 x PP=2 equal one process's, token for token (a dense
Llama with chunked prefill; a Qwen2-MoE with its experts partitioned over the ranks, EP=2);
the four ranks of TP=2 x PP=2 span both nodes, one stage per node. A rank killed under a
daemon ends every stream UNAVAILABLE, turns health NOT_SERVING within 10 s, and the daemon
exits non-zero with no rank left running. One cluster for the module (about 10 s to start).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

ray = pytest.importorskip("ray")

from pydaemon.entrypoints.llm import LLM  # noqa: E402
from pydaemon.sampling_params import SamplingParams  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent / "server"))
from engine_utils import make_hf_model  # noqa: E402
from moe_utils import save_hf_moe_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
# A 16-token budget chunks the 35-token prompt.
PROMPTS = [[5, 6, 7, 8, 9], [10, 20, 30], list(range(40, 75)), [3] * 17]
COMMON = dict(
    device="cpu", dtype="float32", max_num_seqs=4, block_size=8, max_num_batched_tokens=16
)


@pytest.fixture(scope="module")
def cluster():
    """Two Ray nodes of 2 CPUs each: a 4-rank placement group (PACK) fills both."""
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args=dict(num_cpus=2, include_dashboard=False))
    c.add_node(num_cpus=2)
    ray.init(address=c.address, logging_level="WARNING")
    yield c
    ray.shutdown()
    c.shutdown()


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    # Three layers: a PP=2 split is uneven (2 + 1).
    model_dir, _ = make_hf_model(
        tmp_path_factory.mktemp("llama"), num_layers=3, num_heads=4, num_kv_heads=2, vocab_size=255
    )
    return model_dir


def _tokens(llm: LLM) -> list[list[int]]:
    return [
        o.outputs[0].token_ids
        for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
    ]


def _is_gone(pid: int) -> bool:
    return not Path(f"/proc/{pid}").exists()


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2), (2, 2)], ids=["tp2", "pp2", "tp2xpp2"])
def test_dense_equals_one_process(cluster, llama_dir, tp, pp):
    expected = _tokens(LLM(str(llama_dir), **COMMON))
    llm = LLM(
        str(llama_dir),
        distributed_executor_backend="ray",
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        **COMMON,
    )
    executor = llm.engine.core.executor
    pids = [pid for _, _, pid, _ in executor.places]
    try:
        assert _tokens(llm) == expected
        if pp > 1:  # the stages overlapped: two batches were in flight at once
            assert llm.engine.core.async_stepper.max_num_in_flight == 2
        if tp * pp == 4:  # one stage per node, its TP pair within the node
            nodes = [node for node, _, _, _ in executor.places]
            assert nodes[0] == nodes[1] != nodes[2] == nodes[3]
    finally:
        llm.engine.shutdown()
    deadline = time.monotonic() + 10
    while not all(_is_gone(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(_is_gone(pid) for pid in pids), "shutdown left a rank running"


def test_one_rank_runs_in_this_process_in_a_bundle_ray_holds(cluster, llama_dir):
    """TP = PP = 1: the bundle lands on this node (the driver's) and the rank runs here, its
    actor only holding the bundle; Ray counts the CPU taken until shutdown gives it back."""
    expected = _tokens(LLM(str(llama_dir), **COMMON))
    llm = LLM(str(llama_dir), distributed_executor_backend="ray", **COMMON)
    executor = llm.engine.core.executor
    try:
        here = ray.get_runtime_context().get_node_id()
        assert executor.driver_runner is not None and executor.sampler is None
        assert [node for node, _, _, _ in executor.places] == [here]
        assert ray.available_resources().get("CPU") == 3.0
        assert _tokens(llm) == expected
    finally:
        llm.engine.shutdown()
    deadline = time.monotonic() + 10
    while ray.available_resources().get("CPU") != 4.0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ray.available_resources().get("CPU") == 4.0, "the bundle was not given back"


def test_moe_expert_parallel_tp2_x_pp2_equals_one_process(cluster, tmp_path):
    # Qwen2-MoE: 8 experts, a shared expert, sparse every second layer; EP=2: 4 per rank.
    model_dir = save_hf_moe_model(tmp_path, "qwen2_moe", num_hidden_layers=4)
    expected = _tokens(LLM(str(model_dir), **COMMON))
    llm = LLM(
        str(model_dir),
        distributed_executor_backend="ray",
        tensor_parallel_size=2,
        pipeline_parallel_size=2,
        enable_expert_parallel=True,
        **COMMON,
    )
    try:
        assert _tokens(llm) == expected
    finally:
        llm.engine.shutdown()


def test_a_cluster_too_small_is_a_clear_error(cluster, llama_dir, monkeypatch):
    from pydaemon.executor import ray_executor

    monkeypatch.setattr(ray_executor, "PLACEMENT_TIMEOUT_S", 1.0)
    with pytest.raises(ray_executor.RayExecutorError, match=r"could not place 6 ranks"):
        LLM(
            str(llama_dir),
            distributed_executor_backend="ray",
            tensor_parallel_size=2,
            pipeline_parallel_size=3,
            **COMMON,
        )
    assert ray.available_resources().get("CPU") == 4.0, "the placement group was not released"


def _health(port: int) -> int:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=1
            )
        except grpc.RpcError:
            return -1  # not answering: the daemon is gone
        return reply.status


def test_killed_rank_fails_the_daemon_cleanly(cluster, llama_dir):
    """SIGKILL a rank under streams in flight: each ends UNAVAILABLE, health NOT_SERVING
    within 10 s, the daemon exits non-zero and no rank process is left."""
    from server_helpers import BidiClient

    from pydaemon.proto.pagedd.v1 import generation_pb2 as pb
    from pydaemon.proto.pagedd.v1 import generation_pb2_grpc as pb_grpc
    from pydaemon.worker.rank_worker import free_port

    port = free_port()
    env = {
        **os.environ,
        "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "RAY_ADDRESS": cluster.address,
    }
    cmd = [
        sys.executable, "-m", "pydaemon.entrypoints.cli", "serve",
        "--model", str(llama_dir), "--device", "cpu", "--dtype", "float32",
        "--num-kv-blocks", "256", "--block-size", "8", "--max-num-seqs", "4",
        "--distributed-executor-backend", "ray", "--tensor-parallel-size", "2",
        "--port", str(port), "--grace-period", "2",
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    log: list[str] = []
    reader = threading.Thread(target=lambda: log.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 90
        while not any("ranks over gloo on" in line for line in log):  # the ranks are up
            assert proc.poll() is None and time.monotonic() < deadline, "".join(log)
            time.sleep(0.1)
        up = next(line for line in log if "ranks over gloo on" in line)
        rank_pids = [int(p) for p in re.findall(r"pid (\d+)", up)]
        assert len(rank_pids) == 2, up
        while _health(port) != 1:  # SERVING
            assert proc.poll() is None and time.monotonic() < deadline, "".join(log)
            time.sleep(0.1)
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        client = BidiClient(pb_grpc.GenerationStub(channel))
        sampling = pb.SamplingParams(max_tokens=400, ignore_eos=True, temperature=0)
        for i in range(3):
            client.start(f"r{i}", [3 + i, 4, 5], sampling=sampling)
        client.close_send()
        assert client.next().HasField("delta")
        os.kill(rank_pids[1], signal.SIGKILL)
        killed = time.monotonic()
        ends: dict[str, int] = {}
        try:
            for frame in client.call:
                if frame.HasField("error"):
                    ends[frame.request_id] = frame.error.code
                assert not frame.HasField("finished"), "a stream finished after its rank died"
        except grpc.RpcError as e:  # the call itself ended: every stream with it
            assert e.code() == grpc.StatusCode.UNAVAILABLE, e
            ends = {f"r{i}": grpc.StatusCode.UNAVAILABLE.value[0] for i in range(3)}
        assert ends == {f"r{i}": grpc.StatusCode.UNAVAILABLE.value[0] for i in range(3)}
        while _health(port) == 1:
            assert time.monotonic() - killed < 10, "still SERVING 10 s after a rank died"
            time.sleep(0.1)
        channel.close()
        code = proc.wait(timeout=60)
        reader.join(10)
        assert code != 0, "".join(log)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "Ray rank 1" in "".join(log), "".join(log)[-3000:]
    deadline = time.monotonic() + 10
    while not all(_is_gone(pid) for pid in rank_pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(_is_gone(pid) for pid in rank_pids), "a rank outlived the daemon"
