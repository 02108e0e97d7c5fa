"""Grammar compiles in a process that can stop them (issue 55, item 6): a compile that runs
for minutes is stopped at its deadline with an error naming the flag, while another client's
small constraint compiles meanwhile; a compile nobody waits for is killed; a dead compile
server fails its compiles clearly and the next compile starts a new one. Real processes, the
demo model's tokenizer."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import CancelledError

import pytest
import xgrammar as xgr

from pydaemon.model_loader.demo_model import demo_model_dir
from pydaemon.sampling_params import StructuredOutputsParams
from pydaemon.structured_output.compiler import GrammarCompiler
from pydaemon.tokenizer.loader import load_tokenizer
from pydaemon.tokenizer.token_bytes import token_bytes


def _stars(n: int) -> StructuredOutputsParams:
    """One rule of ``n`` ``[a-z]*`` (the issue's 2,000 took 19.8 s on SmolLM2's vocabulary):
    within every size bound, ~10 s to compile against the demo vocabulary on this box's CPU
    for 9,300 (time grows with the square of ``n``)."""
    return StructuredOutputsParams(grammar="root ::= " + " ".join(["[a-z]*"] * n))


SLOW = _stars(9300)
SLOW_TOO = _stars(9200)
SMALL = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}})


@pytest.fixture
def compiler():
    tok = load_tokenizer(demo_model_dir())
    c = GrammarCompiler(
        token_bytes(tok), 520, sorted(tok.eos_token_ids), fast_budget_s=0.3, timeout_s=2.5
    )
    yield c
    c.close()


def _children(pid: int) -> list[int]:
    """The compile server's live children (its compiles)."""
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            out += [int(x) for x in f.read().split()]
    return out


def _wait_for(predicate, timeout_s: float = 10.0) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def test_a_slow_compile_is_stopped_at_its_deadline_while_a_small_one_compiles(compiler):
    slow = compiler.submit(SLOW)
    time.sleep(0.6)  # past the fast budget: the slow compile holds the slow slot
    small = compiler.submit(SMALL)
    assert isinstance(small.result(timeout=10), xgr.CompiledGrammar)
    assert not slow.done()  # the small one did not wait for it
    with pytest.raises(ValueError, match=r"did not compile within 2.5 s.*compile-timeout"):
        slow.result(timeout=30)
    assert _wait_for(lambda: _children(compiler.service.pid) == [])
    # Asked again, the failed grammar fails at once (cached), and compiles nothing.
    again = compiler.submit(SLOW)
    assert again.done() and isinstance(again.exception(), ValueError)
    assert _children(compiler.service.pid) == []


def test_a_compile_nobody_waits_for_is_killed(compiler):
    slow = compiler.submit(SLOW)
    server = compiler.service.pid
    assert _wait_for(lambda: len(_children(server)) == 1)
    child = _children(server)[0]
    compiler.cancel(slow)
    assert slow.cancelled()
    assert _wait_for(lambda: _children(server) == [])
    assert not os.path.exists(f"/proc/{child}") or _state(child) == "Z"
    assert compiler.num_cached == 0  # forgotten: asked again, it compiles again
    assert compiler.service.num_pending == 0
    assert isinstance(compiler.get(SMALL), xgr.CompiledGrammar)


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_a_dead_compile_server_fails_its_compiles_and_the_next_starts_a_new_one(compiler):
    slow = compiler.submit(SLOW)
    first = compiler.service.pid
    assert _wait_for(lambda: len(_children(first)) == 1)
    child = _children(first)[0]
    os.kill(first, signal.SIGKILL)
    with pytest.raises(RuntimeError, match="grammar compile process ended"):
        slow.result(timeout=10)
    assert _wait_for(lambda: not os.path.exists(f"/proc/{child}") or _state(child) == "Z")
    assert isinstance(compiler.get(SMALL), xgr.CompiledGrammar)
    assert compiler.service.pid != first


def test_compile_errors_come_back_with_their_message(compiler):
    # Syntax is checked in this process, before anything is sent.
    with pytest.raises(ValueError, match="structured_outputs.regex"):
        compiler.submit(StructuredOutputsParams(regex="(unclosed"))
    # A grammar that accepts no text fails in the compile process, with its message.
    never = compiler.submit(StructuredOutputsParams(grammar="root ::= root"))
    with pytest.raises(ValueError, match="can never be satisfied"):
        never.result(timeout=30)


def test_closing_stops_its_compiles_and_the_idle_server_serves_the_next_engine(compiler):
    slow = compiler.submit(SLOW)
    server = compiler.service.pid
    assert _wait_for(lambda: len(_children(server)) == 1)
    child = _children(server)[0]
    compiler.close()
    with pytest.raises(CancelledError):
        slow.result(timeout=10)
    assert _wait_for(lambda: _children(server) == [])
    assert not os.path.exists(f"/proc/{child}") or _state(child) == "Z"
    # Its server (~3 s to start) is kept idle: the next engine of this tokenizer takes it.
    tok = load_tokenizer(demo_model_dir())
    again = GrammarCompiler(
        token_bytes(tok), 520, sorted(tok.eos_token_ids), fast_budget_s=0.3, timeout_s=2.5
    )
    try:
        assert isinstance(again.get(SMALL), xgr.CompiledGrammar)
        assert again.service.pid == server
    finally:
        again.close()


def test_through_the_engine_others_are_served_and_an_abort_stops_the_compile():
    from pydaemon import LLM, SamplingParams
    from pydaemon.generate_request import GenerateRequest

    llm = LLM(
        "demo",
        device="cpu",
        dtype="float32",
        num_kv_blocks=64,
        block_size=8,
        structured_outputs_compile_timeout=3.0,
    )
    engine = llm.engine
    try:

        def params(spec):
            return SamplingParams(temperature=0, max_tokens=4, structured_outputs=spec)

        engine.add_request(GenerateRequest("slow", [5, 6, 7], params(SLOW)))
        engine.add_request(GenerateRequest("gone", [5, 6, 8], params(SLOW_TOO)))
        engine.add_request(GenerateRequest("small", [5, 6, 9], params(SMALL)))
        compiler = engine.core.structured_outputs.compiler
        assert _wait_for(lambda: len(_children(compiler.service.pid)) >= 1)
        assert engine.abort_request("gone")  # its client left: its compile stops
        finished: dict[str, object] = {}
        end = time.monotonic() + 60
        while engine.has_unfinished_requests() and time.monotonic() < end:
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = (out, time.monotonic())
        assert set(finished) == {"slow", "small"}
        small, small_at = finished["small"]
        slow, slow_at = finished["slow"]
        assert small.error is None and small_at < slow_at  # served while the other compiled
        assert "did not compile within 3 s" in slow.error
        assert compiler.service.num_pending == 0
        assert _wait_for(lambda: _children(compiler.service.pid) == [])
    finally:
        engine.shutdown()
