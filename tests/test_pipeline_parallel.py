"""Pipeline parallelism with the ``mp`` backend on CPU (gloo; the spawned process is stage 0,
this process the last stage, which samples), and the checks of every parallel size.

Greedy tokens of PP=2 equal one process's, token for token: a Llama of three layers (an
uneven split) with chunked prefill, and dummy weights of a Qwen2 with tied embeddings (the
last stage keeps the embedding as its LM head; its dummy draws are the whole model's). The
batch queue keeps two batches in flight. Bad sizes are errors that name what is wrong.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from pydaemon.config.engine import EngineConfig
from pydaemon.entrypoints.llm import LLM
from pydaemon.models.pipeline import pp_layer_range
from pydaemon.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).parent))
from engine_utils import make_hf_model  # noqa: E402
from moe_utils import save_hf_moe_model  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9], [10, 20, 30], list(range(40, 75)), [3] * 17]
COMMON = dict(
    device="cpu", dtype="float32", max_num_seqs=4, block_size=8, max_num_batched_tokens=16
)


def _tokens(llm: LLM) -> list[list[int]]:
    outputs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize(
    "num_layers, pp, expected",
    [
        (4, 2, [(0, 2), (2, 4)]),
        (3, 2, [(0, 2), (2, 3)]),
        (5, 3, [(0, 2), (2, 4), (4, 5)]),
        (2, 2, [(0, 1), (1, 2)]),
        (7, 1, [(0, 7)]),
    ],
)
def test_layer_ranges_are_contiguous_and_even(num_layers, pp, expected):
    assert [pp_layer_range(num_layers, r, pp) for r in range(pp)] == expected


def test_llama_pp2_equals_one_process(tmp_path):
    model_dir, _ = make_hf_model(tmp_path / "llama", num_layers=3, vocab_size=255)
    expected = _tokens(LLM(str(model_dir), **COMMON))
    llm = LLM(str(model_dir), pipeline_parallel_size=2, **COMMON)
    try:
        assert _tokens(llm) == expected
        # This process is the last stage: layer 2 only, its KV cache, the norm and LM head.
        runner = llm.engine.runner
        model = runner.model.model
        assert (model.start_layer, model.end_layer) == (2, 3)
        assert model.embed_tokens is None and model.norm is not None
        assert runner.model.lm_head is not None
        assert runner.kv_cache.shape[1] == 1  # one layer's K/V
        assert [n for n, _ in runner.model.named_parameters() if ".layers." in n][0].startswith(
            "model.layers.2."
        )
        assert llm.engine.core.async_stepper.max_num_in_flight == 2
    finally:
        llm.engine.shutdown()


def test_tied_embeddings_and_dummy_weights_do_not_depend_on_pp(tmp_path):
    model_dir, _ = make_hf_model(
        tmp_path / "qwen2", arch="qwen2", num_layers=2, tie_word_embeddings=True
    )
    kw = dict(COMMON, load_format="dummy", seed=3)
    expected = _tokens(LLM(str(model_dir), **kw))
    llm = LLM(str(model_dir), pipeline_parallel_size=2, **kw)
    try:
        assert _tokens(llm) == expected
        assert llm.engine.runner.model.model.embed_tokens is not None  # the tied LM head
    finally:
        llm.engine.shutdown()


def test_sizes_that_do_not_split_the_model_are_clear_errors(tmp_path):
    model_dir, _ = make_hf_model(tmp_path / "llama", num_layers=2, vocab_size=255)
    with pytest.raises(ValueError, match=r"pipeline_parallel_size \(3\).*num_hidden_layers \(2\)"):
        LLM(str(model_dir), pipeline_parallel_size=3, **COMMON)
    with pytest.raises(ValueError, match="not a mixture-of-experts"):
        LLM(str(model_dir), tensor_parallel_size=2, enable_expert_parallel=True, **COMMON)
    moe_dir = save_hf_moe_model(tmp_path, "mixtral")
    with pytest.raises(ValueError, match=r"tensor_parallel_size >= 2"):
        LLM(str(moe_dir), enable_expert_parallel=True, **COMMON)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(pipeline_parallel_size=0), "pipeline_parallel_size must be a positive integer"),
        (dict(pipeline_parallel_size=True), "pipeline_parallel_size must be a positive integer"),
        (dict(distributed_executor_backend="mpi"), "distributed_executor_backend must be one"),
        (dict(enable_expert_parallel="yes"), "enable_expert_parallel must be true or false"),
        (
            dict(pipeline_parallel_size=2, enable_lora=True),
            "pipeline_parallel_size cannot be combined with enable_lora",
        ),
        (
            dict(
                pipeline_parallel_size=2,
                speculative_config={"method": "ngram", "num_speculative_tokens": 2},
            ),
            "cannot be combined with speculative decoding",
        ),
    ],
)
def test_engine_config_refuses_bad_parallel_settings(kw, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kw)


def test_flags_and_toml_keys(tmp_path):
    from pydaemon.entrypoints.cli import build_parser
    from pydaemon.entrypoints.daemon.settings import resolve

    toml = tmp_path / "pagedd.toml"
    toml.write_text(
        'pipeline_parallel_size = 2\ndistributed_executor_backend = "ray"\n'
        "enable_expert_parallel = true\n"
    )
    engine_kwargs, _, _ = resolve(build_parser().parse_args(["serve", "--config", str(toml)]))
    assert engine_kwargs["pipeline_parallel_size"] == 2
    assert engine_kwargs["distributed_executor_backend"] == "ray"
    assert engine_kwargs["enable_expert_parallel"] is True
    args = build_parser().parse_args(
        ["serve", "--config", str(toml), "--pipeline-parallel-size", "4",
         "--distributed-executor-backend", "mp", "--no-enable-expert-parallel"]
    )  # fmt: skip
    engine_kwargs, _, _ = resolve(args)
    assert engine_kwargs["pipeline_parallel_size"] == 4
    assert engine_kwargs["distributed_executor_backend"] == "mp"
    assert engine_kwargs["enable_expert_parallel"] is False


def test_structured_outputs_under_the_batch_queue():
    """Constrained rows sampled on the last stage with the bitmask sent with each batch:
    outputs obey their constraints and equal one process's, greedy and seeded."""
    import re

    from pydaemon.sampling_params import StructuredOutputsParams as SO

    regex, choices = r"[0-9]{3}-[a-z]{1,5}", ["yes", "no", "maybe not"]
    params = [
        SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=SO(regex=regex)),
        SamplingParams(
            temperature=0.9, max_tokens=40, structured_outputs=SO(choice=choices), seed=5
        ),
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
    ]
    prompts = ["The quick brown fox", "Once upon a time", "Hello world!"]
    kw = dict(device="cpu", dtype="float32", num_kv_blocks=128, block_size=8)
    expected = [o.outputs[0].token_ids for o in LLM("demo", **kw).generate(prompts, params)]
    llm = LLM("demo", pipeline_parallel_size=2, **kw)
    try:
        outputs = llm.generate(prompts, params)
        assert [o.outputs[0].token_ids for o in outputs] == expected
        assert re.fullmatch(regex, outputs[0].outputs[0].text), outputs[0].outputs[0].text
        assert outputs[1].outputs[0].text in choices
    finally:
        llm.engine.shutdown()
