"""JSON-schema keywords the grammar does not enforce are refused (issue 46: they were
accepted and the output then violated the schema while finishing "stop"). Each refused case
is checked against xgrammar itself: its grammar accepts an instance that violates the schema,
so refusing is the only honest answer; the allowed look-alikes are enforced."""

from __future__ import annotations

import json

import pytest
import xgrammar as xgr

from pydaemon.structured_output.schema_support import check_enforceable

_VOCAB = [chr(i).encode() for i in range(32, 127)] + [b"<eos>"]
_EOS = len(_VOCAB) - 1
_COMPILER = xgr.GrammarCompiler(xgr.TokenizerInfo(_VOCAB, stop_token_ids=[_EOS]))


def _grammar_accepts(schema: dict, text: str) -> bool:
    grammar = xgr.Grammar.from_json_schema(json.dumps(schema), strict_mode=True)
    matcher = xgr.GrammarMatcher(_COMPILER.compile_grammar(grammar))
    return all(matcher.accept_string(ch) for ch in text) and matcher.accept_token(_EOS)


OBJ = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
REFUSED = [  # (schema, an instance that violates it, the keyword the error names)
    ({"allOf": [{**OBJ, "required": ["a"]}, {**OBJ, "required": ["b"]}]}, '{"a":1}', "allOf"),
    ({"type": "integer", "not": {"const": 3}}, "3", "not"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1,1]", "uniqueItems"),
    ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 5}}, "[1]", "contains"),
    ({"oneOf": [{"type": "integer"}, {"type": "integer", "minimum": 0}]}, "3", "oneOf"),
    ({**OBJ, "dependentRequired": {"a": ["b"]}}, '{"a":1}', "dependentRequired"),
    ({"type": "integer", "if": {"minimum": 5}, "then": {"maximum": 6}}, "9", "'if'"),
    ({"type": "number", "multipleOf": 0.5}, "0.3", "multipleOf"),
    ({"type": "string", "format": "regex"}, '"("', "format"),
    ({"type": "string", "pattern": "^a+$", "maxLength": 2}, '"aaaa"', "maxLength"),
    (
        {"type": "object", "properties": {"x": {"type": "string", "format": "idn-email"}}},
        '{"x":"no"}',
        "idn-email",
    ),  # fmt: skip
    # Issue 55, item 9: names that hid refused keywords from a walk by key names, and
    # keywords xgrammar reads past.
    (
        {
            "$ref": "#/$defs/enum",
            "$defs": {"enum": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}},
        },
        "[1,1]",
        "uniqueItems",
    ),  # fmt: skip
    (
        {
            "type": "array",
            "items": {"$ref": "#/$defs/default"},
            "$defs": {"default": {"type": "integer", "not": {"const": 3}}},
        },
        "[3]",
        "not",
    ),  # fmt: skip
    (
        {
            "type": "object",
            "properties": {
                "required": {
                    "type": "array",
                    "items": {"type": "integer"},
                    "contains": {"const": 5},
                }
            },
        },
        '{"required":[1]}',
        "contains",
    ),  # fmt: skip
    ({**OBJ, "required": ["c"]}, '{"a":1}', "'required' names"),
    ({"type": "string", "const": None}, "null", "'const'"),
]


@pytest.mark.parametrize(("schema", "violating", "keyword"), REFUSED)
def test_unenforced_keywords_are_refused_by_name(schema, violating, keyword):
    assert _grammar_accepts(schema, violating)  # why: xgrammar lets the violation through
    with pytest.raises(ValueError, match=keyword) as e:
        check_enforceable(schema)
    assert str(e.value).startswith("structured_outputs.json: the JSON schema uses")


DISCRIMINATED = {  # a pydantic discriminated union: branches told apart by "kind"
    "oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}],
    "$defs": {
        "Cat": {"type": "object", "properties": {"kind": {"const": "cat"}, "x": {"type": "integer"}},
                "required": ["kind", "x"]},
        "Dog": {"type": "object", "properties": {"kind": {"const": "dog"}, "y": {"type": "string"}},
                "required": ["kind", "y"]},
    },
}  # fmt: skip
ALLOWED = [  # (schema, an instance that violates it: the grammar refuses it)
    (DISCRIMINATED, '{"kind":"cat","y":"s"}'),
    ({"oneOf": [{"type": "string"}, {"type": "null"}]}, "1"),
    ({"allOf": [{"type": "integer"}]}, '"s"'),
    ({"type": "string", "format": "email"}, '"x"'),
    ({"type": "integer", "multipleOf": 3}, "4"),
    ({"type": "string", "maxLength": 2}, '"abc"'),
]


@pytest.mark.parametrize(("schema", "violating"), ALLOWED)
def test_enforced_look_alikes_pass(schema, violating):
    check_enforceable(schema)
    assert not _grammar_accepts(schema, violating)


@pytest.mark.parametrize(
    ("schema", "keyword"),
    [
        ({"$ref": "#foo", "$defs": {"x": {"$anchor": "foo", "type": "integer"}}}, "'#foo'"),
        ({"$defs": {"x": {"$anchor": "foo", "type": "integer"}}}, "'\\$anchor'"),
        ({"$ref": "https://example.com/s.json"}, "only local"),
        (
            {"type": "object", "patternProperties": {"description": {"allOf": [OBJ, OBJ]}}},
            "allOf",
        ),  # fmt: skip
        ({"type": "object", "additionalProperties": {"title": 1, "uniqueItems": True}}, "unique"),
    ],
)
def test_schemas_are_walked_as_schemas_not_as_names(schema, keyword):
    """Issue 55, item 9: every place a schema holds schemas is walked whatever its names, and
    references xgrammar cannot follow are refused by name."""
    with pytest.raises(ValueError, match=keyword):
        check_enforceable(schema)


def test_data_keywords_are_not_read_as_schemas():
    """An enum, const, default or examples value that looks like a schema is data."""
    schema = {
        "type": "object",
        "properties": {"a": {"enum": [{"not": 1}], "default": {"uniqueItems": True}}},
        "examples": [{"allOf": [1, 2]}],
    }
    check_enforceable(schema)
