"""Bounds on a constraint's size, checked before it is compiled: xgrammar compiles in C++ and
cannot be interrupted, and its compile time grows faster than a grammar's rule count (against
SmolLM2's 49,152-token vocabulary, on one CPU core: 200 rules of ``[a-z]* | ""`` in a sequence
0.13 s, 1,000 of them 14.5 s, the issue's 10,000 more than 180 s; 1,000 alternatives of
literals 0.01 s; a 500-property schema 0.04 s). A constraint past a bound is a ValueError
naming the bound, before any KV block is taken. Size does not tell compile time (a 24-byte
regex of nested repeats compiles for minutes): what passes here compiles in a process that is
stopped at a deadline (compile_lanes.py).
"""

from __future__ import annotations

import json
import re

from pydaemon.sampling_params import StructuredOutputsParams

MAX_GRAMMAR_BYTES = 64 * 1024
MAX_GRAMMAR_RULES = 512
MAX_GRAMMAR_ALTERNATIVES = 8192
MAX_REGEX_BYTES = 8 * 1024
MAX_CHOICES = 1024
MAX_CHOICE_BYTES = 64 * 1024
MAX_SCHEMA_BYTES = 128 * 1024
MAX_SCHEMA_DEPTH = 64

_LARK_RULE = re.compile(r"^\s*[?!]?[A-Za-z_][\w.]*\s*:", re.MULTILINE)


def _rules(text: str) -> int:
    return text.count("::=") if "::=" in text else len(_LARK_RULE.findall(text))


def _schema_text(spec: StructuredOutputsParams) -> str:
    return spec.json if isinstance(spec.json, str) else json.dumps(spec.json)


def _depth(value, limit: int) -> int:
    """Nesting depth of a JSON value, counting no further than ``limit + 1``."""
    stack = [(value, 1)]
    deepest = 0
    while stack:
        node, depth = stack.pop()
        deepest = max(deepest, depth)
        if deepest > limit:
            return deepest
        children = (
            node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        )
        stack.extend((child, depth + 1) for child in children)
    return deepest


def check_size(spec: StructuredOutputsParams) -> None:
    """ValueError naming the field and the bound a constraint exceeds."""
    kind = spec.kind

    def too_big(what: str, value: int, limit: int) -> ValueError:
        return ValueError(
            f"structured_outputs.{kind}: {what} {value} is above the limit of {limit} (a "
            "grammar compiles in time that grows faster than its size, and nothing can stop "
            "a compile once it runs)"
        )

    if kind == "grammar":
        size = len(spec.grammar.encode())
        if size > MAX_GRAMMAR_BYTES:
            raise too_big("the grammar's size in bytes,", size, MAX_GRAMMAR_BYTES)
        if _rules(spec.grammar) > MAX_GRAMMAR_RULES:
            raise too_big("the number of rules,", _rules(spec.grammar), MAX_GRAMMAR_RULES)
        alternatives = spec.grammar.count("|")
        if alternatives > MAX_GRAMMAR_ALTERNATIVES:
            raise too_big("the number of alternatives,", alternatives, MAX_GRAMMAR_ALTERNATIVES)
    elif kind == "regex":
        size = len(spec.regex.encode())
        if size > MAX_REGEX_BYTES:
            raise too_big("the regex's size in bytes,", size, MAX_REGEX_BYTES)
    elif kind == "choice":
        if len(spec.choice) > MAX_CHOICES:
            raise too_big("the number of choices,", len(spec.choice), MAX_CHOICES)
        size = sum(len(c.encode()) for c in spec.choice)
        if size > MAX_CHOICE_BYTES:
            raise too_big("the choices' size in bytes,", size, MAX_CHOICE_BYTES)
    elif kind == "json":
        size = len(_schema_text(spec).encode())
        if size > MAX_SCHEMA_BYTES:
            raise too_big("the schema's size in bytes,", size, MAX_SCHEMA_BYTES)
        if isinstance(spec.json, dict):
            depth = _depth(spec.json, MAX_SCHEMA_DEPTH)
            if depth > MAX_SCHEMA_DEPTH:
                raise too_big("the schema's nesting depth,", depth, MAX_SCHEMA_DEPTH)
