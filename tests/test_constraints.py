"""The constraint engine (pydaemon.structured_output) without the engine: grammar specs and
their errors, token bytes of every tokenizer kind, the device bitmask against xgrammar's own,
and matchers driven by random logits: every finished output obeys its constraint."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
import xgrammar as xgr
from tokenizer_utils import STYLES, TEXTS, build_hf_tokenizer

from pydaemon.model_loader.demo_model import demo_model_dir
from pydaemon.sampling.bitmask import apply_grammar_bitmask
from pydaemon.sampling_params import SamplingParams, StructuredOutputsParams
from pydaemon.structured_output.compiler import GrammarCompiler
from pydaemon.structured_output.grammar_spec import build_grammar, grammar_key
from pydaemon.structured_output.matchers import ConstrainedSeq, GrammarMatchers
from pydaemon.tokenizer.hf import HFTokenizer
from pydaemon.tokenizer.loader import load_tokenizer
from pydaemon.tokenizer.token_bytes import token_bytes

SO = StructuredOutputsParams

# Schemas a random model finishes: every string, number and array is bounded.
SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "age": {"type": "integer", "minimum": 0, "maximum": 130},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "tags": {
                "type": "array",
                "items": {"enum": ["a", "b", "c"]},
                "minItems": 1,
                "maxItems": 3,
            },
            "ok": {"type": "boolean"},
        },
        "required": ["tags"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "point": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": -9, "maximum": 9},
                    "y": {"type": "integer", "minimum": -9, "maximum": 9},
                },
                "required": ["x", "y"],
                "additionalProperties": False,
            },
            "label": {"type": "string", "pattern": "^[a-z]{1,4}$"},
            "kind": {"enum": ["circle", "square", None]},
        },
        "required": ["point", "label", "kind"],
        "additionalProperties": False,
    },
    {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": 99},
        "minItems": 2,
        "maxItems": 4,
    },
    {"enum": ["red", "green", "blue"]},
    {
        "type": "object",
        "properties": {
            "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{2}$"},
            "score": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["code"],
        "additionalProperties": False,
    },
]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"json": {"type": "objec"}}, "structured_outputs.json: invalid or unsupported"),
        ({"json": "{not json"}, "structured_outputs.json is not valid JSON"),
        ({"json": {"type": "object", "properties": 3}}, "properties must be an object"),
        ({"regex": "a(b"}, "structured_outputs.regex: invalid regex"),
        ({"grammar": "root ::= foo"}, 'structured_outputs.grammar: .*"foo" is not defined'),
    ],
)
def test_bad_constraints_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        build_grammar(SO(**kwargs))


def test_structured_outputs_params_checks():
    with pytest.raises(ValueError, match="exactly one of"):
        SO()
    with pytest.raises(ValueError, match="exactly one of"):
        SO(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="choice must be a list of non-empty strings"):
        SO(choice=[])
    with pytest.raises(ValueError, match="beam search"):
        SamplingParams(beam_width=2, temperature=0, structured_outputs=SO(regex="a"))
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=2, structured_outputs=SO(regex="a"))
    params = SamplingParams(structured_outputs={"choice": ["x", "y"]})
    assert params.structured_outputs == SO(choice=["x", "y"])


def test_grammar_key_is_canonical():
    a = grammar_key(SO(json={"type": "object", "properties": {"a": {}, "b": {}}}))
    b = grammar_key(SO(json={"properties": {"b": {}, "a": {}}, "type": "object"}))
    assert a == b
    assert grammar_key(SO(json_object=True)) != grammar_key(
        SO(json_object=True, disable_any_whitespace=True)
    )


def test_bitmask_equals_xgrammar():
    gen = torch.Generator().manual_seed(0)
    vocab = 1000
    words = -(-vocab // 32)
    full = torch.randint(-(2**31), 2**31 - 1, (9, words), dtype=torch.int32, generator=gen)
    logits = torch.randn(9, vocab, generator=gen)
    rows = torch.tensor([8, 0, 3, 4])
    ours, ref = logits.clone(), logits.clone()
    apply_grammar_bitmask(ours, full[rows], rows)
    xgr.apply_token_bitmask_inplace(ref, full, indices=rows.tolist())
    assert torch.equal(ours, ref)
    ours, ref = logits.clone(), logits.clone()
    apply_grammar_bitmask(ours, full)
    xgr.apply_token_bitmask_inplace(ref, full)
    assert torch.equal(ours, ref)


def _hf(tmp_path_factory, style):
    return HFTokenizer.from_dir(build_hf_tokenizer(tmp_path_factory.mktemp(style), style))


@pytest.mark.parametrize("style", STYLES)
def test_token_bytes_spell_the_text_hf(tmp_path_factory, style):
    tok = _hf(tmp_path_factory, style)
    table = token_bytes(tok)
    assert len(table) == tok.vocab_size
    for text in TEXTS:
        ids = tok.encode(text, add_bos=False)
        spelled = b"".join(table[i] for i in ids).decode("utf-8")
        # Special tokens spell nothing; SentencePiece-style pieces write a leading space
        # that the decoder strips.
        expected = tok.decode(ids, skip_special_tokens=True)
        assert spelled.lstrip(" ") == expected.lstrip(" "), (style, text)
    for i in tok.special_token_ids:
        assert table[i] == b""


def test_token_bytes_spell_the_text_sentencepiece():
    tok = load_tokenizer(demo_model_dir())
    table = token_bytes(tok)
    for text in TEXTS:
        ids = tok.encode(text, add_bos=False)
        expected = tok.decode(ids, skip_special_tokens=True)
        assert b"".join(table[i] for i in ids).decode("utf-8").lstrip(" ") == expected.lstrip(" ")
    assert table[tok.eos_token_id] == b"" and table[tok.bos_token_id] == b""


@pytest.fixture(scope="module")
def demo_compiler():
    tok = load_tokenizer(demo_model_dir())
    # A model vocabulary wider than the tokenizer's: the extra ids are never allowed.
    return tok, GrammarCompiler(token_bytes(tok), 520, sorted(tok.eos_token_ids))


def _mask(matchers, logits, logits_row, seq_id, request_id, spec):
    """The engine side fills the row's bitmask; the worker side masks logits row
    ``logits_row`` with it."""
    rows = [ConstrainedSeq(seq_id, request_id, spec, matchers.outputs[seq_id])]
    bitmask = torch.from_numpy(matchers.fill_bitmask(rows).copy())
    apply_grammar_bitmask(logits, bitmask, torch.tensor([logits_row]))


def _walk(matchers, spec, seq_id, gen, steps=120, greedy=False):
    """Samples one sequence under ``spec`` from random logits -> its token ids."""
    outputs = matchers.outputs.setdefault(seq_id, [])
    for _ in range(steps):
        logits = torch.randn(2, 520, generator=gen)
        _mask(matchers, logits, 1, seq_id, str(seq_id), spec)
        row = logits[1]
        token = (
            int(row.argmax())
            if greedy
            else int(torch.multinomial(row.softmax(-1), 1, generator=gen))
        )
        assert row[token] > float("-inf")
        outputs.append(token)
        if token == 2:
            break
    return outputs


def _matchers(compiler):
    outputs: dict[int, list[int]] = {}
    matchers = GrammarMatchers(compiler)
    matchers.outputs = outputs
    return matchers


@pytest.mark.parametrize("greedy", [False, True])
def test_random_logits_obey_every_constraint(demo_compiler, greedy):
    tok, compiler = demo_compiler
    matchers = _matchers(compiler)
    gen = torch.Generator().manual_seed(1)
    specs = [(SO(json=s, disable_any_whitespace=True), s) for s in SCHEMAS]
    specs += [
        (SO(regex=r"[0-9]{3}-[a-z]{1,5}"), re.compile(r"[0-9]{3}-[a-z]{1,5}")),
        (SO(choice=["yes", "no", "maybe not"]), {"yes", "no", "maybe not"}),
        (SO(grammar='root ::= "(" [a-c]{1,8} ")"'), re.compile(r"\([a-c]{1,8}\)")),
        (SO(json_object=True, disable_any_whitespace=True), None),
    ]
    seq_id = 0
    for _ in range(4 if greedy else 6):
        for spec, check in specs:
            seq_id += 1
            ids = _walk(matchers, spec, seq_id, gen, greedy=greedy)
            text = tok.decode(ids)
            if spec.json_object:
                if ids[-1] == 2:
                    assert isinstance(json.loads(text), dict)
                continue
            assert ids[-1] == 2, (spec, text)  # finished: EOS once the grammar is complete
            if isinstance(check, dict):
                jsonschema.validate(json.loads(text), check)
            elif isinstance(check, set):
                assert text in check
            else:
                assert check.fullmatch(text), text
    matchers.forget([str(s) for s in range(1, seq_id + 1)])
    assert not matchers._matchers


def test_matcher_replays_tokens_of_a_new_sequence(demo_compiler):
    """A fork or a recomputed sequence: its matcher is built by replaying its outputs."""
    tok, compiler = demo_compiler
    spec = SO(regex=r"ab[0-9]{4}")
    matchers = _matchers(compiler)
    matchers.outputs[7] = [tok.sp.piece_to_id(f"<0x{b:02X}>") for b in b"ab12"]  # byte pieces
    ids = _walk(matchers, spec, 7, torch.Generator().manual_seed(0))
    text = tok.decode(ids)
    assert text.startswith("ab12") and re.fullmatch(r"ab[0-9]{4}", text), text


def test_rejected_token_only_lets_the_sequence_end(demo_compiler):
    tok, compiler = demo_compiler
    matchers = _matchers(compiler)
    matchers.outputs[1] = tok.encode("zz", add_bos=False)
    logits = torch.zeros(1, 520)
    _mask(matchers, logits, 0, 1, "r", SO(regex="ab"))
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [2]


def test_bounded_strings_refuse_control_characters_and_surrogates(demo_compiler):
    """xgrammar 0.2.9 lets a maxLength string hold raw control characters and encoded UTF-16
    surrogates (ED A0 80): neither is valid JSON text; the rewritten pattern refuses both."""
    tok, compiler = demo_compiler
    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 4}}}
    matcher = xgr.GrammarMatcher(compiler.get(SO(json=schema, disable_any_whitespace=True)))

    def byte(b: int) -> int:
        return tok.sp.piece_to_id(f"<0x{b:02X}>")

    assert all(matcher.accept_token(byte(b)) for b in b'{"s": "')
    assert not matcher.accept_token(byte(0x1B))
    assert matcher.accept_token(byte(0xED)) and not matcher.accept_token(byte(0xA0))
    assert matcher.accept_token(byte(0x9F)) and matcher.accept_token(byte(0xBF))  # U+D7FF
