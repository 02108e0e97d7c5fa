"""Structured outputs through the engine (offline LLM, demo model on CPU): every output that
ends by itself obeys its constraint (JSON schemas validated with jsonschema, regexes, choices,
a grammar), greedy and sampled, with n > 1, under preemption by recompute and by swap, with
async scheduling and with prefix caching; bad constraints fail before any KV block is taken;
the compile cache is shared; a constrained request waits for its grammar, the batch does not."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from test_constraints import SCHEMAS

from pydaemon.entrypoints.llm import LLM
from pydaemon.sampling_params import SamplingParams, StructuredOutputsParams

SO = StructuredOutputsParams
PROMPTS = ["The quick brown fox", "Once upon a time", "PagedAttention stores", "Hello world!"]


def _llm(**kwargs) -> LLM:
    kwargs = {"num_kv_blocks": 256, "block_size": 8, "seed": 0, **kwargs}
    return LLM("demo", device="cpu", dtype="float32", **kwargs)


@pytest.fixture(scope="module")
def llm():
    return _llm()


def _checks():
    """(constraint, check(text)) pairs a random model always finishes."""
    out = []
    for schema in SCHEMAS:
        out.append(
            (
                SO(json=schema, disable_any_whitespace=True),
                lambda t, s=schema: jsonschema.validate(json.loads(t), s),
            )
        )
    regex = r"[0-9]{3}-[a-z]{1,5}"
    out.append((SO(regex=regex), lambda t: _assert(re.fullmatch(regex, t), t)))
    choices = ["yes", "no", "maybe not"]
    out.append((SO(choice=choices), lambda t: _assert(t in choices, t)))
    grammar = 'root ::= "(" [a-c]{1,8} ")"'
    out.append((SO(grammar=grammar), lambda t: _assert(re.fullmatch(r"\([a-c]{1,8}\)", t), t)))
    return out


def _few_checks():
    """Two schemas, the regex, the choice and the grammar: for the heavier engine set-ups."""
    checks = _checks()
    return [checks[0], checks[3], *checks[-3:]]


def _assert(ok, text):
    assert ok, text


def _check_all(outputs, checks):
    for output, (_, check) in zip(outputs, checks, strict=True):
        for seq in output.outputs:
            assert seq.finish_reason == "stop", (seq.text, seq.finish_reason)
            assert "\ufffd" not in seq.text, seq.text  # the constrained bytes are valid UTF-8
            check(seq.text)


def _free_blocks_are_back(llm):
    stats = llm.engine.get_stats()
    assert stats.num_free_gpu_blocks == stats.num_gpu_blocks


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_output_obeys_its_constraint(llm, temperature):
    checks = _checks()
    params = [
        SamplingParams(temperature=temperature, max_tokens=120, structured_outputs=so, seed=i)
        for i, (so, _) in enumerate(checks)
    ]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(checks))]
    _check_all(llm.generate(prompts, params), checks)
    _free_blocks_are_back(llm)


def test_n_greater_than_one_each_sequence_obeys(llm):
    checks = _few_checks()
    params = [
        SamplingParams(n=3, temperature=1.0, max_tokens=120, structured_outputs=so, seed=i)
        for i, (so, _) in enumerate(checks)
    ]
    outputs = llm.generate([PROMPTS[0]] * len(checks), params)
    assert all(len(o.outputs) == 3 for o in outputs)
    _check_all(outputs, checks)
    _free_blocks_are_back(llm)


def _precompile(llm, checks) -> None:
    """Compiles the checks' grammars before their requests come, so that the requests start
    together (a compile runs in the compile server: its timing varies, and requests whose
    grammars finish at different times would trickle in and never press the KV cache)."""
    manager = llm.engine.core.structured_outputs
    manager.prepare(sorted(llm.tokenizer.eos_token_ids))
    for so, _ in checks:
        manager.compiler.get(so)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_constraints_survive_preemption(mode):
    llm = _llm(num_kv_blocks=20, preemption_mode=mode, watermark=0.0, swap_space=0.01)
    checks = _few_checks()
    _precompile(llm, checks)
    params = [
        SamplingParams(
            n=2,
            temperature=1.0,
            max_tokens=120,
            structured_outputs=so,
            seed=i,
        )
        for i, (so, _) in enumerate(checks)
    ]
    outputs = llm.generate([PROMPTS[i % 4] * 3 for i in range(len(checks))], params)
    assert llm.engine.get_stats().num_preemptions > 0
    _check_all(outputs, checks)
    _free_blocks_are_back(llm)


def test_async_scheduling_and_prefix_caching():
    llm = _llm(async_scheduling=True)
    checks = _few_checks()
    params = [
        SamplingParams(temperature=0.8, max_tokens=120, structured_outputs=so, seed=3)
        for so, _ in checks
    ]
    # The same long prompt: later requests hit the prefix cache.
    prompt = " ".join(PROMPTS) * 2
    first = llm.generate([prompt] * len(checks), params)
    _check_all(first, checks)
    again = llm.generate([prompt] * len(checks), params)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in first]
    assert llm.engine.get_stats().prefix_cache_hit_tokens > 0
    _free_blocks_are_back(llm)


def test_async_scheduling_overlaps_constrained_steps_and_changes_nothing():
    """Under async scheduling a constrained step is launched before the previous step's
    tokens are on the host and sampled once they are (its bitmask needs them): the same
    tokens as synchronous steps, greedy and seeded, with constrained steps really overlapped
    and every bitmask made on the engine side."""
    checks = _few_checks()
    params = [
        SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=so) for so, _ in checks
    ]
    params += [
        SamplingParams(temperature=0.9, max_tokens=60, structured_outputs=so, seed=11)
        for so, _ in checks
    ]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(params))]
    runs = {}
    for overlap in (False, True):
        llm = _llm(async_scheduling=overlap)
        outs = llm.generate(prompts, params)
        _check_all(outs, checks + checks)
        runs[overlap] = [o.outputs[0].token_ids for o in outs]
        core = llm.engine.core
        assert core.structured_outputs.matchers.stats.num_steps > 0
        stepper = core.async_stepper
        assert (stepper is not None and stepper.num_overlapped_steps > 0) == overlap
        _free_blocks_are_back(llm)
    assert runs[True] == runs[False]


def test_unconstrained_requests_are_unchanged_beside_constrained_ones(llm):
    plain = SamplingParams(temperature=0.0, max_tokens=12)
    alone = llm.generate(PROMPTS, plain)
    so = SamplingParams(temperature=0.0, max_tokens=12, structured_outputs=SO(choice=["yes"]))
    mixed = llm.generate(PROMPTS + PROMPTS, [plain] * 4 + [so] * 4)
    assert [o.outputs[0].token_ids for o in mixed[:4]] == [o.outputs[0].token_ids for o in alone]
    assert all(o.outputs[0].text == "yes" for o in mixed[4:])


@pytest.mark.parametrize(
    ("so", "match"),
    [
        (SO(json={"type": "objec"}), "structured_outputs.json: invalid or unsupported"),
        (SO(regex="a(b"), "structured_outputs.regex: invalid regex"),
        (SO(grammar="root ::= nothing"), "structured_outputs.grammar"),
    ],
)
def test_bad_constraint_fails_before_any_block(llm, so, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(PROMPTS[0], SamplingParams(max_tokens=4, structured_outputs=so))
    _free_blocks_are_back(llm)
    assert not llm.engine.core.structured_outputs.has_waiting()


def test_compile_cache_is_keyed_by_constraint(llm):
    compiler = llm.engine.core.structured_outputs.compiler
    schema = {"type": "object", "properties": {"k": {"enum": [1, 2]}}, "required": ["k"]}
    before = compiler.num_cached
    for _ in range(3):
        out = llm.generate(
            PROMPTS[0], SamplingParams(max_tokens=40, structured_outputs=SO(json=schema))
        )
        assert json.loads(out[0].outputs[0].text)["k"] in (1, 2)
    assert compiler.num_cached == before + 1


def test_json_object_and_ignore_eos_finish(llm):
    """json_object: any object; with ignore_eos a finished grammar lets the sequence run on
    unconstrained up to max_tokens (it never hangs)."""
    so = SO(json={"enum": ["done"]})
    out = llm.generate(
        PROMPTS[0], SamplingParams(max_tokens=20, ignore_eos=True, structured_outputs=so)
    )[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 20
    assert out.text.startswith('"done"')


def test_llm_chat_with_tools_required_and_named(llm):
    """Offline LLM.chat: a forced tool choice constrains the reply to the call(s)."""
    from pydaemon.entrypoints.common.tool_choice import forced_tool_calls, tool_choice_constraint

    weather = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 6}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    }
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    params = SamplingParams(max_tokens=150, seed=2)
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        [out] = llm.chat(
            messages, params, tools=[weather], tool_choice=choice, parallel_tool_calls=False
        )
        text = out.outputs[0].text
        schema = tool_choice_constraint([weather], choice, parallel_tool_calls=False).json
        jsonschema.validate(json.loads(text), schema)
        calls = forced_tool_calls(text, [weather], choice)
        assert calls and all(c.name == "get_weather" for c in calls)


def test_beside_speculative_decoding():
    """With n-gram speculation on, constrained requests take no drafts (their matcher does not
    roll back) and still obey; plain requests beside them speculate as before."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}
    llm = _llm(speculative_config=spec)
    checks = _few_checks()
    plain = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    params = [SamplingParams(temperature=0.0, max_tokens=120, structured_outputs=so)
              for so, _ in checks]  # fmt: skip
    prompt = "the cat sat on the mat, the cat sat on the mat, the cat"
    outputs = llm.generate([PROMPTS[0]] * len(checks) + [prompt], params + [plain])
    _check_all(outputs[:-1], checks)
    assert len(outputs[-1].outputs[0].token_ids) == 24
    _free_blocks_are_back(llm)


def test_tensor_parallel_gives_the_tokens_of_one_rank():
    """The engine core fills the bitmask and the rank that samples applies it: under TP=2
    (gloo, one spawned worker) constrained requests, greedy and seeded, with async
    scheduling on, give TP=1's tokens."""
    checks = _few_checks()
    params = [
        SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=so) for so, _ in checks
    ]
    params += [
        SamplingParams(temperature=0.8, max_tokens=40, structured_outputs=so, seed=5)
        for so, _ in checks[:2]
    ]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(params))]
    ref = [o.outputs[0].token_ids for o in _llm().generate(prompts, params)]
    tp2 = _llm(tensor_parallel_size=2, async_scheduling=True)
    try:
        outs = tp2.generate(prompts, params)
        _check_all(outs, checks + checks[:2])
        assert [o.outputs[0].token_ids for o in outs] == ref
        assert tp2.engine.core.async_stepper.num_overlapped_steps > 0
        _free_blocks_are_back(tp2)
    finally:
        tp2.engine.shutdown()


def test_the_grammar_compiler_can_be_built_before_any_request():
    """Issue 46: the first constrained request on a fresh daemon stalled every stream ~4 s
    while the compiler was built on the step's thread; the daemon's core builds it at
    start-up (pydaemon/engine/core_proc.py) with prepare()."""
    from pydaemon.model_loader.model_paths import resolve_model_dir
    from pydaemon.structured_output.manager import StructuredOutputManager

    manager = StructuredOutputManager(str(resolve_model_dir("demo")), 512)
    assert manager.compiler is None
    manager.prepare([2])
    assert manager.compiler is not None and manager.matchers is not None
    compiler = manager.compiler
    manager.prepare([2])  # idempotent
    assert manager.compiler is compiler
