"""Tensor parallelism on CPU: 2 ranks over gloo (this process is rank 0, one spawned worker).

Greedy output of TP=2 must equal TP=1 token for token: through LLM.generate (GQA Llama with a
padded vocabulary, chunked prefill and swap preemption; Qwen2 with q/k/v bias and tied
embeddings; dummy weights) and through the daemon. A dead worker is a clear error, never a
hang; shutdown leaves no worker process behind.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from pydaemon.config.engine import EngineConfig
from pydaemon.entrypoints.llm import LLM
from pydaemon.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).parent))
from engine_utils import make_hf_model  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
# Lengths chosen so that a 16-token budget chunks the long prompt.
PROMPTS = [[5, 6, 7, 8, 9], [10, 20, 30], list(range(40, 75)), [3] * 17]
COMMON = dict(device="cpu", dtype="float32", max_num_seqs=4, block_size=8)


def _is_gone(pid: int) -> bool:
    return not Path(f"/proc/{pid}").exists()


def _worker_pids(llm_or_engine) -> list[int]:
    engine = getattr(llm_or_engine, "engine", llm_or_engine)
    return [p.pid for p in engine.core.executor.workers]


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def _tp1_and_tp2(model_dir: Path, **kw) -> tuple[list, list, LLM]:
    ref = _tokens(
        LLM(str(model_dir), **COMMON, **kw).generate(
            prompt_token_ids=PROMPTS, sampling_params=GREEDY
        )
    )
    llm = LLM(str(model_dir), tensor_parallel_size=2, **COMMON, **kw)
    got = _tokens(llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY))
    return ref, got, llm


def test_llama_gqa_padded_vocab_chunked_and_swapped(tmp_path):
    # 4 query heads / 2 KV heads: one KV head per rank; vocab 255 pads the last rank's slice.
    model_dir, _ = make_hf_model(tmp_path / "llama", num_heads=4, num_kv_heads=2, vocab_size=255)
    # 9 blocks of 8 tokens cannot hold all four sequences: swap preemption moves blocks on
    # both ranks; a 16-token budget chunks the 35-token prompt.
    ref, got, llm = _tp1_and_tp2(
        model_dir, num_kv_blocks=9, max_num_batched_tokens=16, preemption_mode="swap"
    )
    # Rank 0 holds half the heads, half the MLP columns, half the vocabulary, one KV head.
    layer = llm.engine.runner.model.model.layers[0]
    assert layer.self_attn.qkv_proj.weight.shape == ((2 + 1 + 1) * 16, 64)  # q, k, v heads
    assert layer.mlp.gate_up_proj.weight.shape == (2 * 64, 64)
    assert layer.mlp.down_proj.weight.shape == (64, 64)
    assert llm.engine.runner.model.model.embed_tokens.weight.shape == (128, 64)
    assert llm.engine.runner.kv_cache.shape[3] == 1
    stats = llm.engine.get_stats()
    assert stats.num_swapped_out_blocks > 0 and stats.num_swapped_in_blocks > 0
    assert got == ref
    pids = _worker_pids(llm)
    assert len(pids) == 1 and not _is_gone(pids[0])
    llm.engine.shutdown()
    assert all(_is_gone(pid) for pid in pids), "shutdown left a worker process"
    llm.engine.shutdown()  # idempotent


def test_qwen2_bias_tied_embeddings(tmp_path):
    model_dir, _ = make_hf_model(tmp_path / "qwen", arch="qwen2", tie_word_embeddings=True)
    ref, got, llm = _tp1_and_tp2(model_dir, num_kv_blocks=64)
    assert got == ref
    llm.engine.shutdown()


def test_dummy_weights_do_not_depend_on_tp(tmp_path):
    model_dir, _ = make_hf_model(tmp_path / "dummy", vocab_size=255)
    ref, got, llm = _tp1_and_tp2(model_dir, num_kv_blocks=64, load_format="dummy", seed=3)
    assert got == ref
    llm.engine.shutdown()


def test_kv_heads_not_divisible_is_a_clear_error(tmp_path):
    model_dir, _ = make_hf_model(tmp_path / "m", hidden_size=48, num_heads=6, num_kv_heads=3)
    with pytest.raises(ValueError, match=r"num_key_value_heads \(3\).*tensor_parallel_size \(2\)"):
        LLM(str(model_dir), tensor_parallel_size=2, **COMMON, num_kv_blocks=16)


def test_flag_and_toml_key(tmp_path):
    from pydaemon.entrypoints.cli import build_parser
    from pydaemon.entrypoints.daemon.settings import resolve

    toml = tmp_path / "pagedd.toml"
    toml.write_text("tensor-parallel-size = 4\n")
    args = build_parser().parse_args(["serve", "--config", str(toml)])
    assert resolve(args)[0]["tensor_parallel_size"] == 4
    args = build_parser().parse_args(
        ["serve", "--config", str(toml), "--tensor-parallel-size", "2"]
    )
    assert resolve(args)[0]["tensor_parallel_size"] == 2


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_tensor_parallel_size_is_validated(bad):
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(tensor_parallel_size=bad)


def test_worker_killed_mid_generation_fails_the_engine_without_hanging(tmp_path):
    from pydaemon.executor.multiproc_executor import TensorParallelError

    model_dir, _ = make_hf_model(tmp_path / "m")
    llm = LLM(str(model_dir), tensor_parallel_size=2, **COMMON, num_kv_blocks=256)
    (pid,) = _worker_pids(llm)
    long_run = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    result: dict = {}

    def generate():
        try:
            result["outputs"] = llm.generate(prompt_token_ids=PROMPTS, sampling_params=long_run)
        except BaseException as e:  # noqa: BLE001
            result["error"] = e

    thread = threading.Thread(target=generate, daemon=True)
    thread.start()
    time.sleep(1.0)  # well inside the ~1600 steps of work
    os.kill(pid, signal.SIGKILL)
    thread.join(30)
    assert not thread.is_alive(), "a step hung after the worker died"
    error = result.get("error")
    assert isinstance(error, TensorParallelError), repr(result)
    assert f"rank 1 (pid {pid})" in str(error) and "died" in str(error)
    with pytest.raises(TensorParallelError, match="died"):  # and every later step
        llm.generate(prompt_token_ids=PROMPTS[:1], sampling_params=GREEDY)
    llm.engine.shutdown()
    assert _is_gone(pid)


def test_daemon_streams_like_tp1_then_fails_cleanly_when_a_worker_dies():
    sys.path.insert(0, str(Path(__file__).parent / "server"))
    from server_helpers import BidiClient, ServerThread, joined_ids

    from pydaemon.engine.llm_engine import LLMEngine
    from pydaemon.entrypoints.daemon.app import ServerOptions
    from pydaemon.proto.pagedd.v1 import generation_pb2 as pb

    prompt, max_tokens = "The capital of France is", 12
    expected = (
        LLM("demo", device="cpu", num_kv_blocks=64)
        .generate([prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens))[0]
        .outputs[0]
    )
    engines: list[LLMEngine] = []

    def factory() -> LLMEngine:
        config = EngineConfig(model="demo", device="cpu", num_kv_blocks=64, tensor_parallel_size=2)
        engines.append(LLMEngine(config))
        return engines[-1]

    server = ServerThread(ServerOptions(port=0, grace_period_s=2.0)).start(factory, timeout=90)
    try:
        client = BidiClient(server.stub())
        client.start("r0", prompt, sampling=pb.SamplingParams(temperature=0, max_tokens=max_tokens))
        client.close_send()
        frames = client.collect()["r0"]
        assert frames[-1].HasField("finished"), frames[-1]
        assert joined_ids(frames) == expected.token_ids

        # The daemon is idle: a dead worker fails the engine within its idle heartbeat.
        (pid,) = _worker_pids(engines[0])
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 15
        while server.server.async_engine.is_alive and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not server.server.async_engine.is_alive
        assert f"rank 1 (pid {pid})" in str(server.server.async_engine.error)
    finally:
        server.close()
    assert engines[0].core.executor._is_closed, "the drain did not shut the engine down"
    assert all(_is_gone(pid) for pid in _worker_pids(engines[0]))


def test_script_without_main_guard_gets_an_error_that_says_so(tmp_path):
    """A spawned worker imports the script again; without the guard it cannot start."""
    import subprocess

    script = tmp_path / "unguarded.py"
    script.write_text(
        "from pydaemon import LLM\n"
        "LLM('demo', device='cpu', num_kv_blocks=16, tensor_parallel_size=2)\n"
    )
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode != 0
    assert 'if __name__ == "__main__":' in done.stderr, done.stderr[-2000:]
