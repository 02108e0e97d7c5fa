"""JSON-schema keywords the grammar does not enforce (xgrammar 0.2.9, measured: a violating
instance passes the compiled grammar), refused before compiling with a ValueError naming the
keyword and where it is, so that a request never ends ``stop`` with output that violates its
schema. vLLM falls back to another backend for these; pagedd has none, so it says no.

Refused: ``allOf`` of several schemas (one is enforced), ``not``, ``if``/``then``/``else``,
``uniqueItems``, ``contains``/``minContains``/``maxContains``, ``dependentRequired``,
``dependentSchemas``, ``dependencies``, ``contentEncoding``/``contentMediaType``/
``contentSchema``, a non-integer ``multipleOf``, ``minLength``/``maxLength`` beside a
``pattern`` or ``format``, the formats xgrammar does not check (``idn-email``,
``idn-hostname``, ``iri``, ``iri-reference``, ``regex`` and unknown ones), and ``oneOf``
whose branches may overlap (xgrammar reads it as ``anyOf``): allowed when the branches have
distinct JSON types, or all require one property with distinct ``const`` values (a pydantic
discriminated union). Also refused: ``required`` names that ``properties`` does not define,
``$anchor`` and any ``$ref`` that is not a local JSON pointer (``#/...``), and a ``const`` its
node's ``type`` does not allow.

The schema is walked as a schema, not as a dict of names: the values of ``$defs``,
``properties``, ``patternProperties``... are schemas whatever their names (a definition named
``enum`` or a pattern ``description`` is walked), and data keywords (``enum``, ``const``,
``default``, ``examples``...) are never read as schemas.
"""

from __future__ import annotations

from typing import Any

ENFORCED_FORMATS = frozenset(
    {
        "date", "time", "date-time", "duration", "email", "hostname", "ipv4", "ipv6", "uri",
        "uri-reference", "uuid", "uri-template", "json-pointer", "relative-json-pointer",
    }
)  # fmt: skip
UNENFORCED = {
    "not": "'not'",
    "if": "'if' / 'then' / 'else'",
    "then": "'if' / 'then' / 'else'",
    "else": "'if' / 'then' / 'else'",
    "contains": "'contains'",
    "minContains": "'minContains'",
    "maxContains": "'maxContains'",
    "dependentRequired": "'dependentRequired'",
    "dependentSchemas": "'dependentSchemas'",
    "dependencies": "'dependencies'",
    "contentEncoding": "'contentEncoding'",
    "contentMediaType": "'contentMediaType'",
    "contentSchema": "'contentSchema'",
}
# Where a schema holds schemas: maps of name -> schema, lists of schemas, one schema.
_SCHEMA_MAPS = frozenset(
    {"$defs", "definitions", "properties", "patternProperties", "dependentSchemas"}
)
_SCHEMA_LISTS = frozenset({"allOf", "anyOf", "oneOf", "prefixItems"})
_SCHEMA_ONE = frozenset(
    {
        "items", "additionalItems", "additionalProperties", "propertyNames", "not", "if",
        "then", "else", "contains", "unevaluatedItems", "unevaluatedProperties",
    }
)  # fmt: skip
_JSON_TYPES = {
    type(None): {"null"},
    bool: {"boolean"},
    int: {"integer", "number"},
    float: {"number"},
    str: {"string"},
    list: {"array"},
    dict: {"object"},
}
# JSON types no value has two of ("integer" is also a "number").
_DISJOINT_TYPES = ("string", "boolean", "null", "object", "array")


def check_enforceable(schema: Any) -> None:
    """ValueError naming the first keyword the grammar would not enforce."""
    _walk(schema, "#", schema)


def _walk(node: Any, path: str, root: Any) -> None:
    """One schema (a dict, or a boolean schema) at ``path``, then the schemas it holds."""
    if not isinstance(node, dict):
        return
    for key, value in node.items():
        if key in UNENFORCED:
            _refuse(UNENFORCED[key], path)
        if key == "uniqueItems" and value is True:
            _refuse("'uniqueItems'", path)
        if key == "allOf" and isinstance(value, list) and len(value) > 1:
            _refuse("'allOf' of several schemas", path)
        if key == "multipleOf" and not (isinstance(value, int) or float(value).is_integer()):
            _refuse("a non-integer 'multipleOf'", path)
        if key == "format" and value not in ENFORCED_FORMATS:
            _refuse(f"the format {str(value)[:40]!r}", path)
        if key == "oneOf" and isinstance(value, list) and not _disjoint(value, root):
            _refuse("'oneOf' with branches that may overlap (it is enforced as 'anyOf')", path)
        if key == "$anchor":
            _refuse("'$anchor'", path)
        if key == "$ref" and not (isinstance(value, str) and (value == "#" or value[:2] == "#/")):
            _refuse(f"the $ref {str(value)[:60]!r} (only local '#/...' pointers)", path)
    _check_required(node, path)
    _check_const(node, path)
    if ({"minLength", "maxLength"} & node.keys()) and ({"pattern", "format"} & node.keys()):
        _refuse("'minLength' / 'maxLength' beside a 'pattern' or 'format'", path)
    for key, value in node.items():
        where = f"{path}/{key}"
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            for name, sub in value.items():
                _walk(sub, f"{where}/{name}", root)
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            for i, sub in enumerate(value):
                _walk(sub, f"{where}/{i}", root)
        elif key in _SCHEMA_ONE:
            if isinstance(value, list):  # draft 4's tuple "items"
                for i, sub in enumerate(value):
                    _walk(sub, f"{where}/{i}", root)
            else:
                _walk(value, where, root)


def _check_required(node: dict, path: str) -> None:
    required = node.get("required")
    if not isinstance(required, list) or not required:
        return
    properties = node.get("properties")
    defined = properties.keys() if isinstance(properties, dict) else ()
    missing = [name for name in required if name not in defined]
    if missing:
        _refuse(
            f"'required' names that 'properties' does not define ({str(missing[0])[:40]!r})", path
        )


def _check_const(node: dict, path: str) -> None:
    if "const" not in node or "type" not in node:
        return
    allowed = node["type"] if isinstance(node["type"], list) else [node["type"]]
    value = node["const"]
    kinds = _JSON_TYPES.get(type(value), set())
    if isinstance(value, float) and value.is_integer():
        kinds = {"integer", "number"}
    if not kinds & set(allowed):
        _refuse(f"a 'const' its 'type' does not allow ({str(node['type'])[:40]})", path)


def _refuse(what: str, path: str) -> None:
    raise ValueError(
        f"structured_outputs.json: the JSON schema uses {what} (at {path}), which the grammar "
        "does not enforce, so outputs could violate the schema; remove it or express it "
        "otherwise"
    )


def _resolved(schema: Any, root: Any) -> Any:
    """A local "$ref" one level deep (what a oneOf branch usually is)."""
    if isinstance(schema, dict) and isinstance(schema.get("$ref"), str):
        ref = schema["$ref"]
        if ref.startswith("#/"):
            node = root
            for part in ref[2:].split("/"):
                node = node.get(part) if isinstance(node, dict) else None
            if isinstance(node, dict):
                return node
    return schema


def _disjoint(branches: list[Any], root: Any) -> bool:
    branches = [_resolved(b, root) for b in branches]
    if len(branches) < 2 or not all(isinstance(b, dict) for b in branches):
        return len(branches) < 2
    types = [b.get("type") for b in branches]
    if all(t in _DISJOINT_TYPES for t in types) and len(set(types)) == len(types):
        return True
    # a discriminator: one property every branch requires, with distinct const values
    common = set.intersection(*(set(b.get("required") or ()) for b in branches))
    for name in sorted(common):
        values = []
        for b in branches:
            prop = _resolved((b.get("properties") or {}).get(name), root)
            if not isinstance(prop, dict):
                break
            if "const" in prop:
                values.append(repr(prop["const"]))
            elif isinstance(prop.get("enum"), list) and len(prop["enum"]) == 1:
                values.append(repr(prop["enum"][0]))
            else:
                break
        else:
            if len(set(values)) == len(values):
                return True
    return False
