"""Strings a JSON schema bounds (minLength/maxLength: pydaemon's own pattern) hold only
well-formed UTF-8, byte by byte: with one token per byte (what SentencePiece byte fallback
``<0xNN>`` and byte-level BPE give a model), the bytes the grammar allows after every prefix of
a character are exactly those of the Unicode standard's table 3-7 (no overlong form, no
surrogate, nothing past U+10FFFF), and no control character, quote or backslash."""

from __future__ import annotations

import pytest
import xgrammar as xgr

from pydaemon.sampling_params import StructuredOutputsParams
from pydaemon.structured_output.compiler import GrammarCompiler

EOS = 256
CONT = set(range(0x80, 0xC0))
# Table 3-7: the second byte's range depends on the lead byte; later bytes are 80..BF.
SECOND = {
    **{lead: CONT for lead in range(0xC2, 0xE0)},
    0xE0: set(range(0xA0, 0xC0)),
    **{lead: CONT for lead in [*range(0xE1, 0xED), 0xEE, 0xEF]},
    0xED: set(range(0x80, 0xA0)),
    0xF0: set(range(0x90, 0xC0)),
    0xF1: CONT,
    0xF2: CONT,
    0xF3: CONT,
    0xF4: set(range(0x80, 0x90)),
}
LENGTH = {lead: 2 if lead < 0xE0 else 3 if lead < 0xF0 else 4 for lead in SECOND}
ASCII = set(range(0x20, 0x7F)) | {0x7F}  # a JSON string's printable ASCII, DEL included


@pytest.fixture(scope="module")
def byte_compiler():
    return GrammarCompiler([bytes([b]) for b in range(256)] + [b""], 257, [EOS])


def _allowed(matcher: xgr.GrammarMatcher) -> set[int]:
    """-> the byte tokens the grammar allows next."""
    bitmask = xgr.allocate_token_bitmask(1, 257)
    matcher.fill_next_token_bitmask(bitmask)
    words = bitmask[0].tolist()
    return {b for b in range(256) if (words[b // 32] >> (b % 32)) & 1}


def _after(compiled, data: bytes) -> xgr.GrammarMatcher:
    matcher = xgr.GrammarMatcher(compiled)
    for b in data:
        assert matcher.accept_token(b), data
    return matcher


@pytest.mark.parametrize(
    "schema, prefix, may_close",
    [
        ({"type": "string", "maxLength": 6}, b'"', True),
        ({"type": "string", "minLength": 2, "maxLength": 4}, b'"a', False),
        (
            {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}}},
            b'{"name": "\xc3\xa9',
            True,
        ),
    ],
)
def test_bounded_string_allows_only_well_formed_utf8(byte_compiler, schema, prefix, may_close):
    spec = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    compiled = byte_compiler.get(spec)
    # A character may start with printable ASCII or a lead byte; never with a backslash escape,
    # a control byte, a stray continuation byte or the leads C0, C1, F5..FF.
    start = (ASCII - {ord("\\"), ord('"')}) | set(SECOND)
    first = _allowed(_after(compiled, prefix))
    expected = start | ({ord('"')} if may_close else set())
    assert first == expected, sorted(hex(b) for b in first ^ expected)
    for lead, second in SECOND.items():
        got = _allowed(_after(compiled, prefix + bytes([lead])))
        assert got == second, (hex(lead), sorted(hex(b) for b in got ^ second))
        for middle in (min(second), max(second)):
            partial = bytes([lead, middle])
            for _ in range(LENGTH[lead] - 2):
                got = _allowed(_after(compiled, prefix + partial))
                assert got == CONT, (partial.hex(), sorted(hex(b) for b in got ^ CONT))
                partial += b"\x80"
            # A complete character (minLength is met now): a new one or the closing quote.
            assert _allowed(_after(compiled, prefix + partial)) == start | {ord('"')}
