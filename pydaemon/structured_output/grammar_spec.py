"""A StructuredOutputsParams -> an xgrammar Grammar (no tokenizer needed: cheap, done before a
request takes any KV block), and the key that names it in the compile cache.

Every error is a ValueError naming the field: an invalid JSON schema (or one using a feature
xgrammar cannot enforce), an invalid regex, an EBNF/Lark grammar that does not parse.
"""

from __future__ import annotations

import json
import re

import xgrammar as xgr

from pydaemon.sampling_params import StructuredOutputsParams
from pydaemon.structured_output.schema_support import check_enforceable

# Whitespace a JSON grammar allows in one run: pretty-printed JSON fits; a small model cannot
# loop on spaces or newlines forever (xgrammar's any_whitespace otherwise has no bound).
MAX_WHITESPACE_RUN = 16

# xgrammar's errors start "[05:25:57] /project/cpp/regex_converter.cc:94: ": drop the prefix.
_XGR_PREFIX = re.compile(r"^\[[^\]]*\]\s+\S+:\d+:\s*")


def _message(e: Exception) -> str:
    return _XGR_PREFIX.sub("", str(e).strip().splitlines()[0] if str(e).strip() else repr(e))


def grammar_key(spec: StructuredOutputsParams) -> tuple[str, str]:
    """(kind, canonical text): equal constraints share one compiled grammar."""
    kind = spec.kind
    if kind == "json":
        value = spec.json
        text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    elif kind == "choice":
        text = json.dumps(spec.choice)
    elif kind == "json_object":
        text = ""
    else:
        text = getattr(spec, kind)
    if kind in ("json", "json_object") and spec.disable_any_whitespace:
        kind += ":compact"
    return kind, text


def build_grammar(spec: StructuredOutputsParams) -> xgr.Grammar:
    """-> the grammar of ``spec``; ValueError naming what is wrong."""
    kind = spec.kind
    any_whitespace = not spec.disable_any_whitespace
    try:
        if kind == "json":
            schema = spec.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as e:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
            if not isinstance(schema, dict):
                raise ValueError("structured_outputs.json must be a JSON schema object")
            check_enforceable(schema)
            return xgr.Grammar.from_json_schema(
                json.dumps(_plain_bounded_strings(schema)),
                any_whitespace=any_whitespace,
                strict_mode=True,
                max_whitespace_cnt=MAX_WHITESPACE_RUN if any_whitespace else None,
            )
        if kind == "json_object":
            return xgr.Grammar.from_json_schema(
                '{"type": "object"}',
                any_whitespace=any_whitespace,
                strict_mode=False,
                max_whitespace_cnt=MAX_WHITESPACE_RUN if any_whitespace else None,
            )
        if kind == "regex":
            return xgr.Grammar.from_regex(spec.regex)
        if kind == "choice":
            return xgr.Grammar.from_ebnf(
                "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choice)
            )
        text = spec.grammar
        if "::=" in text:
            return xgr.Grammar.from_ebnf(text)
        return xgr.Grammar.from_lark(text)
    except ValueError:
        raise
    except Exception as e:  # xgrammar raises RuntimeError (and its own types) on bad input
        what = {
            "json": "invalid or unsupported JSON schema",
            "json_object": "cannot build the JSON grammar",
            "regex": "invalid regex",
            "choice": "invalid choice",
            "grammar": "invalid grammar",
        }[kind]
        raise ValueError(f"structured_outputs.{kind}: {what}: {_message(e)}") from None


# A JSON string character: any Unicode scalar value but '"', '\\' and control characters,
# as a positive class of literal code points (U+0020-0021, U+0023-005B, U+005D-D7FF,
# U+E000-10FFFF). Not a negated class: xgrammar 0.2.9 compiles a negated class in a JSON
# string pattern into bytes that also accept overlong UTF-8 (E0 80..9F xx, F0 80..8F xx xx),
# and its own string rule accepts encoded surrogates (ED A0..BF xx); no decoder takes either.
_STRING_CHAR = "[ !#-\\[\\]-\ud7ff\ue000-\U0010ffff]"


def _plain_bounded_strings(schema):
    """The schema with every ``{"type": "string", "minLength"/"maxLength": ...}`` that has no
    pattern, format, enum or const rewritten as a pattern of plain JSON string characters:
    xgrammar 0.2.9 lets such strings hold raw control characters (invalid JSON) and encoded
    surrogates (invalid UTF-8), and a negated-class pattern overlong UTF-8 (see _STRING_CHAR)."""
    if isinstance(schema, list):
        return [_plain_bounded_strings(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _plain_bounded_strings(v) for k, v in schema.items()}
    is_bounded = "minLength" in out or "maxLength" in out
    if (
        out.get("type") == "string"
        and is_bounded
        and not {"pattern", "format", "enum", "const"} & out.keys()
    ):
        low = int(out.pop("minLength", 0))
        high = out.pop("maxLength", None)
        out["pattern"] = f"^{_STRING_CHAR}{{{low},{'' if high is None else int(high)}}}$"
    return out
