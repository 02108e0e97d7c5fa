"""Grammar bombs (issue 46): a constraint past a size bound is refused before it compiles
(its compile time grows faster than its size); the compiled-grammar cache is bounded in bytes.
A compile's deadline and lanes: test_grammar_compile_server.py."""

from __future__ import annotations

import pytest

from pydaemon.model_loader.demo_model import demo_model_dir
from pydaemon.sampling_params import StructuredOutputsParams
from pydaemon.structured_output import grammar_limits
from pydaemon.structured_output.compiler import GrammarCompiler
from pydaemon.tokenizer.loader import load_tokenizer
from pydaemon.tokenizer.token_bytes import token_bytes


def _seq_star(num_rules: int) -> str:
    """The shape measured at 14.5 s for 1,000 rules on SmolLM2's vocabulary."""
    rules = "\n".join(f'r{i} ::= [a-z]* | ""' for i in range(num_rules))
    return "root ::= " + " ".join(f"r{i}" for i in range(num_rules)) + "\n" + rules


def _compiler(**kw) -> GrammarCompiler:
    tok = load_tokenizer(demo_model_dir())
    return GrammarCompiler(token_bytes(tok), 520, sorted(tok.eos_token_ids), **kw)


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        (StructuredOutputsParams(grammar=_seq_star(10_000)), "grammar: .*above the limit"),
        (StructuredOutputsParams(grammar=_seq_star(600)), "number of rules, 601"),
        (
            StructuredOutputsParams(grammar="root ::= " + " | ".join(['"a"'] * 9000)),
            "number of alternatives",
        ),  # fmt: skip
        (StructuredOutputsParams(regex="a" * 10_000), "regex: the regex's size"),
        (StructuredOutputsParams(choice=[str(i) for i in range(2000)]), "number of choices"),
        (
            StructuredOutputsParams(
                json={"properties": {f"p{i}": {"type": "string"} for i in range(5000)}}
            ),
            "schema's size in bytes",
        ),  # fmt: skip
    ],
)
def test_constraints_past_a_bound_are_refused_before_compiling(spec, match):
    with pytest.raises(ValueError, match=match) as e:
        grammar_limits.check_size(spec)
    assert str(e.value).startswith("structured_outputs.")
    with pytest.raises(ValueError, match=match):
        _compiler().submit(spec)  # the compiler checks before building


def test_a_deep_schema_is_refused():
    schema: dict = {"type": "string"}
    for _ in range(100):
        schema = {"type": "object", "properties": {"x": schema}}
    with pytest.raises(ValueError, match="nesting depth"):
        grammar_limits.check_size(StructuredOutputsParams(json=schema))


def test_the_cache_is_bounded_in_bytes():
    compiler = _compiler(cache_bytes=1)  # every finished grammar is over budget alone
    for i in range(4):
        compiler.get(StructuredOutputsParams(regex=f"[a-z]{{{i + 1}}}"))
    assert compiler.num_cached == 1  # the newest stays
    big = _compiler()
    for i in range(4):
        big.get(StructuredOutputsParams(regex=f"[a-z]{{{i + 1}}}"))
    assert big.num_cached == 4 and big.num_cached_bytes > 0
