"""--max-model-len above the model's own context is refused before the weights load (issue 46:
it was silently capped to the model's), as vLLM refuses it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from pydaemon.config.engine import EngineConfig
from pydaemon.engine import engine_core
from pydaemon.engine.llm_engine import LLMEngine

sys.path.insert(0, str(Path(__file__).parent))
from engine_utils import make_hf_model  # noqa: E402


def test_above_the_models_context_is_refused_before_loading(tmp_path, monkeypatch):
    model, _ = make_hf_model(tmp_path / "m")  # max_position_embeddings 512
    context = engine_core.load_model_config(model).max_model_len

    def no_loading(config):
        raise AssertionError("the executor (and the weights) must not be built")

    monkeypatch.setattr(engine_core, "make_executor", no_loading)
    with pytest.raises(ValueError, match=f"greater than the model's context \\({context}"):
        LLMEngine(EngineConfig(model=str(model), device="cpu", max_model_len=context + 1))


def test_up_to_the_context_is_served(tmp_path):
    model, _ = make_hf_model(tmp_path / "m")
    context = 512  # make_hf_model's max_position_embeddings
    engine = LLMEngine(
        EngineConfig(model=str(model), device="cpu", num_kv_blocks=64, max_model_len=context)
    )
    assert engine.max_model_len == context
