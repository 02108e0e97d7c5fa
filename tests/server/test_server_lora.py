"""LoRA adapters through the daemon (gRPC and the OpenAI HTTP API) on a tiny random model with
PEFT adapters: tokens equal transformers + PEFT's, adapters listed as models, unknown ones
refused (404 / NOT_FOUND) before they are queued, loaded at runtime behind the API key, and
unloaded while a request runs (it finishes; new ones are refused)."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import grpc
import pytest
from conftest import make_server_thread
from http_helpers import post, request
from server_helpers import BidiClient, joined_ids

sys.path.insert(0, str(Path(__file__).parents[1]))
from lora_utils import ALL_TARGETS, peft_greedy, save_peft_adapter  # noqa: E402
from model_utils import save_hf_model  # noqa: E402

from pydaemon.entrypoints.common.lora_adapters import LoRAOptions  # noqa: E402
from pydaemon.proto.pagedd.v1 import generation_pb2 as pb  # noqa: E402

KEY = "s3cret"
AUTH = (("authorization", f"Bearer {KEY}"),)
HEADERS = {"Authorization": f"Bearer {KEY}"}
MAX_NEW = 24


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora-server")
    model_dir = save_hf_model(tmp, "llama")
    a0 = save_peft_adapter(model_dir, tmp / "a0", rank=8, targets=ALL_TARGETS, seed=1)
    a1 = save_peft_adapter(model_dir, tmp / "a1", rank=4, targets=["q_proj", "v_proj"], seed=2)
    prompt = [random.Random(0).randrange(3, 256) for _ in range(7)]
    expected = {
        "base": peft_greedy(model_dir, None, [prompt], MAX_NEW)[0],
        "a0": peft_greedy(model_dir, a0, [prompt], MAX_NEW)[0],
        "a1": peft_greedy(model_dir, a1, [prompt], MAX_NEW)[0],
    }
    assert len({tuple(t) for t in expected.values()}) == 3  # the adapters change the tokens
    return model_dir, {"a0": str(a0), "a1": str(a1)}, prompt, expected


@pytest.fixture(scope="module")
def server(setup):
    model_dir, paths, _, _ = setup
    from pydaemon.config.engine import EngineConfig
    from pydaemon.engine.llm_engine import LLMEngine

    engine = LLMEngine(
        EngineConfig(
            model=str(model_dir),
            device="cpu",
            dtype="float32",
            num_kv_blocks=64,
            enable_lora=True,
            max_loras=2,
        )
    )
    st = make_server_thread(
        lambda: engine,
        http_port=0,
        api_key=KEY,
        lora=LoRAOptions({"a0": paths["a0"]}, is_enabled=True),
    )
    yield st
    st.close()


def _greedy(stub, prompt, adapter: str = "", max_tokens: int = MAX_NEW):
    sampling = pb.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    call = BidiClient(stub, metadata=AUTH).start("r", prompt, sampling=sampling, adapter=adapter)
    return call.close_send().collect()["r"]


def test_adapters_serve_and_are_listed(server, setup):
    _, paths, prompt, expected = setup
    stub = server.stub()
    assert joined_ids(_greedy(stub, prompt)) == expected["base"]
    assert joined_ids(_greedy(stub, prompt, "a0")) == expected["a0"]
    models = request(server, "GET", "/v1/models", headers=HEADERS).json()["data"]
    base = models[0]["id"]
    assert [(m["id"], m.get("parent")) for m in models] == [(base, None), ("a0", base)]
    r = post(server, "/v1/completions", {"model": "a0", "prompt": prompt, "max_tokens": 3},
             headers=HEADERS)  # fmt: skip
    assert r.status == 200 and r.json()["model"] == "a0"
    status = stub.GetServerStatus(pb.GetServerStatusRequest(), metadata=AUTH)
    assert status.max_loras == 2
    server.wait_all_blocks_free()


def test_unknown_adapter_is_refused_before_the_engine(server, setup):
    _, _, prompt, _ = setup
    [frame] = _greedy(server.stub(), prompt, "nope")
    assert frame.error.code == grpc.StatusCode.NOT_FOUND.value[0]
    assert "'nope' is not loaded" in frame.error.message
    r = post(server, "/v1/completions", {"model": "nope", "prompt": prompt}, headers=HEADERS)
    assert r.status == 404 and r.json()["error"]["code"] == "model_not_found"
    assert request(server, "GET", "/v1/models/nope", headers=HEADERS).status == 404
    stats = server.wait_all_blocks_free()
    assert stats.num_free_gpu_blocks == stats.num_gpu_blocks


def test_load_at_runtime_then_serve(server, setup):
    _, paths, prompt, expected = setup
    body = {"lora_name": "a1", "lora_path": paths["a1"]}
    assert post(server, "/v1/load_lora_adapter", body).status == 401  # same auth as /v1/*
    r = post(server, "/v1/load_lora_adapter", body, headers=HEADERS)
    assert r.status == 200, r.text
    assert post(server, "/v1/load_lora_adapter", body, headers=HEADERS).status == 400  # taken
    bad = {"lora_name": "bad", "lora_path": "/nonexistent"}
    r = post(server, "/v1/load_lora_adapter", bad, headers=HEADERS)
    assert r.status == 400 and "no adapter_config.json" in r.json()["error"]["message"]
    stub = server.stub()
    assert joined_ids(_greedy(stub, prompt, "a1")) == expected["a1"]
    listed = stub.ListAdapters(pb.ListAdaptersRequest(), metadata=AUTH).adapters
    assert [(a.name, a.rank) for a in listed] == [("a0", 8), ("a1", 4)]
    assert list(listed[1].target_modules) == ["q_proj", "v_proj"]
    r = post(server, "/v1/unload_lora_adapter", {"lora_name": "a1"}, headers=HEADERS)
    assert r.status == 200
    assert (
        post(server, "/v1/unload_lora_adapter", {"lora_name": "a1"}, headers=HEADERS).status == 404
    )


def test_grpc_load_needs_the_key_and_unload_while_running(server, setup):
    _, paths, prompt, expected = setup
    stub = server.stub()
    with pytest.raises(grpc.RpcError) as e:
        stub.LoadAdapter(pb.LoadAdapterRequest(name="g", path=paths["a1"]))
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    info = stub.LoadAdapter(pb.LoadAdapterRequest(name="g", path=paths["a1"]), metadata=AUTH)
    assert (info.name, info.rank) == ("g", 4)
    sampling = pb.SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
    call = BidiClient(stub, metadata=AUTH).start("run", prompt, sampling=sampling, adapter="g")
    first = call.next()
    assert first.HasField("delta")
    stub.UnloadAdapter(pb.UnloadAdapterRequest(name="g"), metadata=AUTH)
    [refused] = _greedy(stub, prompt, "g")
    assert refused.error.code == grpc.StatusCode.NOT_FOUND.value[0]
    frames = [first, *call.close_send().collect()["run"]]
    assert joined_ids(frames) == expected["a1"]
    assert frames[-1].finished.finish_reason == pb.FINISH_REASON_LENGTH
    with pytest.raises(grpc.RpcError) as e:
        stub.UnloadAdapter(pb.UnloadAdapterRequest(name="g"), metadata=AUTH)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    stats = server.wait_all_blocks_free()
    assert stats.num_free_gpu_blocks == stats.num_gpu_blocks
