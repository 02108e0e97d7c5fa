"""LoRA's one control path (add_lora / remove_lora / list_loras on the engine, down to every
worker): a bad adapter is refused at load with a clear error and the engine serves on; what was
checked at load is what runs, whatever happens to the files later; unloading while requests
use the adapter lets them finish with it, refuses new ones, and then frees it on the worker."""

from __future__ import annotations

import json
import random
import shutil
import struct
import sys
from pathlib import Path

import pytest
import torch
from lora_utils import ALL_TARGETS, peft_greedy, save_peft_adapter
from model_utils import save_hf_model
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pydaemon import LLM, SamplingParams  # noqa: E402
from pydaemon.engine.prompt_input import to_core_request  # noqa: E402
from pydaemon.generate_request import GenerateRequest  # noqa: E402
from pydaemon.lora_request import LoRARequest  # noqa: E402

MAX_NEW = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
WEIGHTS = "adapter_model.safetensors"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora-control")
    model_dir = save_hf_model(tmp, "llama")
    good = save_peft_adapter(model_dir, tmp / "good", rank=8, targets=ALL_TARGETS, seed=1)
    other = save_peft_adapter(model_dir, tmp / "other", rank=4, targets=["q_proj"], seed=2)
    prompt = [random.Random(0).randrange(3, 256) for _ in range(9)]
    expected = {
        "good": peft_greedy(model_dir, good, [prompt], MAX_NEW)[0],
        "other": peft_greedy(model_dir, other, [prompt], MAX_NEW)[0],
        "base": peft_greedy(model_dir, None, [prompt], MAX_NEW)[0],
    }
    return model_dir, good, other, prompt, expected


def _llm(model_dir, **kw) -> LLM:
    return LLM(str(model_dir), device="cpu", dtype="float32", num_kv_blocks=64, enable_lora=True,
               max_lora_rank=16, **kw)  # fmt: skip


def _broken(good: Path, out: Path, how: str) -> Path:
    """A copy of ``good`` broken in one way."""
    shutil.copytree(good, out)
    weights = out / WEIGHTS
    if how == "truncated":
        data = weights.read_bytes()
        weights.write_bytes(data[: len(data) - 64])
    elif how in ("nan", "int"):
        tensors = load_file(str(weights))
        key = sorted(tensors)[3]
        if how == "nan":
            tensors[key][0, 0] = float("nan")
        else:
            tensors[key] = tensors[key].to(torch.int32)
        save_file(tensors, str(weights))
    elif how == "huge":  # issue 55, 13: finite values whose products are not (outputs were NaN)
        tensors = {k: torch.full_like(t, 1e30) for k, t in load_file(str(weights)).items()}
        save_file(tensors, str(weights))
    elif how == "wrong_shape":  # trained on another model: one projection's width differs
        tensors = load_file(str(weights))
        key = next(k for k in sorted(tensors) if "q_proj.lora_A" in k)
        tensors[key] = torch.zeros(tensors[key].shape[0], tensors[key].shape[1] + 8)
        save_file(tensors, str(weights))
    elif how == "header_lies":  # the header's size field points past the file
        data = weights.read_bytes()
        weights.write_bytes(struct.pack("<Q", 10**9) + data[8:])
    elif how == "huge_header":  # a valid header padded past the bound (a stall for the core)
        data = weights.read_bytes()
        (size,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + size])
        header["__metadata__"] = {"pad": "x" * (20 * 1024 * 1024)}
        text = json.dumps(header).encode()
        weights.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + size :])
    elif how == "pissa":  # PEFT's PiSSA init changes the base weights: not servable as LoRA
        config = json.loads((out / "adapter_config.json").read_text())
        config["init_lora_weights"] = "pissa"
        (out / "adapter_config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize(
    "how, message",
    [
        ("truncated", "cannot be read"),
        ("nan", "NaN or infinite"),
        ("huge", r"lora_B @ lora_A .* beyond torch.float32's range"),
        ("int", "not floating point"),
        ("wrong_shape", "do not fit the model"),
        ("header_lies", "unreadable adapter_model.safetensors"),
        ("huge_header", "header is missing, too large"),
        ("pissa", "pissa"),
    ],
)
def test_a_bad_adapter_is_refused_at_load_and_the_engine_serves_on(setup, tmp_path, how, message):
    model_dir, good, _, prompt, expected = setup
    llm = _llm(model_dir)
    engine = llm.engine
    bad = LoRARequest("bad", 1, str(_broken(good, tmp_path / how, how)))
    with pytest.raises(ValueError, match=message):
        engine.add_lora(bad)
    with pytest.raises(ValueError, match=message):  # a request naming it fails alone, at add
        llm.generate(prompt_token_ids=[prompt], sampling_params=GREEDY, lora_request=bad)
    assert engine.list_loras() == [] and engine.runner.lora_manager.loaded_lora_ids == []
    stats = engine.get_stats()
    assert stats.num_free_gpu_blocks == stats.num_gpu_blocks  # no block was taken
    ok = LoRARequest("good", 2, str(good))
    out = llm.generate(prompt_token_ids=[prompt], sampling_params=GREEDY, lora_request=ok)
    assert out[0].outputs[0].token_ids == expected["good"]
    assert [i.lora_name for i in engine.list_loras()] == ["good"]


def test_files_replaced_or_removed_after_load_change_nothing(setup, tmp_path):
    """The adapter is read and checked once; evicted from its device slot and brought back,
    it comes from the worker's host copy, not the (replaced, then deleted) files."""
    model_dir, good, other, prompt, expected = setup
    llm = _llm(model_dir, max_loras=1)
    path = shutil.copytree(good, tmp_path / "moving")
    first = LoRARequest("first", 1, str(path))
    second = LoRARequest("second", 2, str(other))

    def run(lora: LoRARequest) -> list[int]:
        out = llm.generate(prompt_token_ids=[prompt], sampling_params=GREEDY, lora_request=lora)
        return out[0].outputs[0].token_ids

    assert run(first) == expected["good"]
    shutil.copy(other / WEIGHTS, path / WEIGHTS)  # replaced by another adapter's weights
    assert run(second) == expected["other"]  # takes the only slot
    assert run(first) == expected["good"]
    shutil.rmtree(path)
    assert run(second) == expected["other"]
    assert run(first) == expected["good"]


def test_unload_while_running_finishes_the_request_then_frees_the_adapter(setup):
    model_dir, good, _, prompt, expected = setup
    llm = _llm(model_dir)
    engine = llm.engine
    lora = LoRARequest("good", 5, str(good))
    info = engine.add_lora(lora)
    assert (info.rank, info.lora_name) == (8, "good") and len(info.target_modules) == 7
    engine.add_request(GenerateRequest("r", prompt, GREEDY, lora_request=lora))
    tokens: list[int] = []
    for _ in range(3):
        for out in engine.step():
            tokens += out.outputs[0].token_ids
    assert engine.remove_lora(lora.lora_int_id)
    assert engine.list_loras() == []  # out of service at once
    assert engine.runner.lora_manager.loaded_lora_ids == [5]  # still used by "r"
    with pytest.raises(ValueError, match="being unloaded"):
        engine.add_request(GenerateRequest("new", prompt, GREEDY, lora_request=lora))
    assert not engine.remove_lora(lora.lora_int_id)  # already going
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.outputs[0].token_ids
    assert tokens == expected["good"]
    assert engine.runner.lora_manager.loaded_lora_ids == []  # freed after the last request
    assert engine.runner.lora_manager.host_bytes == 0
    again = llm.generate(prompt_token_ids=[prompt], sampling_params=GREEDY)[0]
    assert again.outputs[0].token_ids == expected["base"]


def test_unload_of_an_idle_adapter_is_immediate_and_ids_are_not_reused(setup):
    model_dir, good, other, _, _ = setup
    engine = _llm(model_dir).engine
    engine.add_lora(LoRARequest("a", 1, str(good)))
    engine.add_lora(LoRARequest("b", 2, str(other)))
    assert [i.lora_name for i in engine.list_loras()] == ["a", "b"]
    with pytest.raises(ValueError, match="already loaded"):
        engine.add_lora(LoRARequest("a", 3, str(other)))
    with pytest.raises(ValueError, match="id 2 is already loaded as 'b'"):
        engine.add_lora(LoRARequest("c", 2, str(good)))
    assert engine.remove_lora(1) and engine.runner.lora_manager.loaded_lora_ids == [2]
    assert not engine.remove_lora(1) and not engine.remove_lora(99)
    unloaded = GenerateRequest("x", [5, 6], GREEDY, lora_request=LoRARequest("a", 1, str(good)))
    with pytest.raises(ValueError, match="not loaded"):  # the core never loads on its own
        engine.core.add_request(to_core_request(unloaded, [5, 6], [], 0.0))


def test_max_cpu_loras_is_an_lru_of_held_adapters(setup, tmp_path):
    """Issue 55, item 22: as vLLM's flag, --max-cpu-loras bounds the adapters held in host
    memory (least recently used out), not the adapters loaded: every loaded adapter stays
    usable by name, an evicted one is read again when a request names it, and one whose files
    are gone by then fails that request, naming it, while the engine serves on."""
    model_dir, good, other, prompt, expected = setup
    llm = _llm(model_dir, max_loras=1, max_cpu_loras=1)
    engine = llm.engine
    path = shutil.copytree(good, tmp_path / "evicted")
    a, b = LoRARequest("a", 1, str(path)), LoRARequest("b", 2, str(other))

    def run(lora: LoRARequest) -> list[int]:
        out = llm.generate(prompt_token_ids=[prompt], sampling_params=GREEDY, lora_request=lora)
        return out[0].outputs[0].token_ids

    engine.add_lora(a)
    engine.add_lora(b)  # was a 400 "unload one first"
    assert [i.lora_name for i in engine.list_loras()] == ["a", "b"]
    assert engine.runner.lora_manager.loaded_lora_ids == [2]  # a was evicted
    assert run(a) == expected["good"]  # read again; b goes
    assert engine.runner.lora_manager.loaded_lora_ids == [1]
    assert run(b) == expected["other"]
    shutil.rmtree(path)  # a is evicted, and its files are gone
    with pytest.raises(ValueError, match="'a' was evicted from host memory.*could not be read"):
        run(a)
    assert run(b) == expected["other"]  # the engine serves on
    assert engine.runner.lora_manager.loaded_lora_ids == [2]
    assert engine.remove_lora(1) and [i.lora_name for i in engine.list_loras()] == ["b"]


def test_tensor_parallel_ranks_load_and_refuse_together(setup, tmp_path):
    """Under TP=2 (gloo) a bad adapter is refused on every rank (none keeps half of it) and a
    good one, loaded then unloaded and loaded again, gives PEFT's tokens."""
    model_dir, good, _, prompt, expected = setup
    llm = _llm(model_dir, tensor_parallel_size=2)
    try:
        engine = llm.engine
        with pytest.raises(ValueError, match="NaN or infinite"):
            engine.add_lora(LoRARequest("bad", 1, str(_broken(good, tmp_path / "nan", "nan"))))
        assert engine.core.executor.list_loras() == []
        lora = LoRARequest("good", 2, str(good))
        engine.add_lora(lora)
        assert engine.remove_lora(2)
        lora = LoRARequest("good", 3, str(good))
        out = llm.generate(prompt_token_ids=[prompt], sampling_params=GREEDY, lora_request=lora)
        assert out[0].outputs[0].token_ids == expected["good"]
    finally:
        llm.engine.shutdown()
