"""Structured outputs of a reasoning model apply to the answer, not the reasoning: the matcher
leaves the row free until the reasoning's end marker is in the output (with gpt-oss's suffix
within REASONING_END_MAX_GAP tokens), then reads only the tokens after it."""

from __future__ import annotations

import re

import pytest
import torch
from test_constraints import _mask, _matchers, _walk

from pydaemon.entrypoints.llm import LLM
from pydaemon.model_loader.demo_model import demo_model_dir
from pydaemon.sampling_params import REASONING_END_MAX_GAP, SamplingParams
from pydaemon.sampling_params import StructuredOutputsParams as SO
from pydaemon.structured_output.compiler import GrammarCompiler
from pydaemon.tokenizer.loader import load_tokenizer
from pydaemon.tokenizer.token_bytes import token_bytes

END = (300, 301)  # two ids standing for "</think>"


@pytest.fixture(scope="module")
def demo_compiler():
    tok = load_tokenizer(demo_model_dir())
    return tok, GrammarCompiler(token_bytes(tok), 520, sorted(tok.eos_token_ids))


def _free(matchers, seq_id, spec) -> bool:
    logits = torch.zeros(1, 520)
    _mask(matchers, logits, 0, seq_id, str(seq_id), spec)
    return bool(torch.isfinite(logits[0]).all())


def test_the_row_is_free_until_the_marker_then_the_grammar_reads_what_follows(demo_compiler):
    tok, compiler = demo_compiler
    spec = SO(regex=r"[0-9]{3}", reasoning_end=END)
    matchers = _matchers(compiler)
    out = matchers.outputs[1] = []
    for token in (5, 300, 7, 300):  # reasoning, with half a marker: free every step
        out.append(token)
        assert _free(matchers, 1, spec)
    out.append(301)  # the marker is complete: the answer starts, under the grammar
    assert not _free(matchers, 1, spec)
    ids = _walk(matchers, spec, 1, torch.Generator().manual_seed(0))
    answer = tok.decode(ids[ids.index(301) + 1 :])
    assert re.fullmatch(r"[0-9]{3}", answer), answer


def test_a_marker_already_in_the_output_of_a_new_sequence_is_found(demo_compiler):
    """A fork, or a sequence recomputed after preemption: replayed from its outputs."""
    tok, compiler = demo_compiler
    spec = SO(regex=r"ab", reasoning_end=END)
    matchers = _matchers(compiler)
    matchers.outputs[3] = [9, 9, *END, tok.sp.piece_to_id("<0x61>")]  # a byte piece: "a"
    ids = _walk(matchers, spec, 3, torch.Generator().manual_seed(0))
    assert tok.decode(ids[4:]) == "ab" and ids[-1] == 2


def test_the_suffix_must_follow_within_the_gap(demo_compiler):
    _, compiler = demo_compiler
    spec = SO(regex=r"[0-9]", reasoning_end=(300,), reasoning_end_suffix=(301,))
    matchers = _matchers(compiler)
    out = matchers.outputs[1] = [300] + [7] * (REASONING_END_MAX_GAP + 1) + [301]
    assert _free(matchers, 1, spec)  # too far from its marker: still reasoning
    out += [300, 7, 7]
    assert _free(matchers, 1, spec)
    out.append(301)  # within the gap of the second marker
    assert not _free(matchers, 1, spec)


def test_with_a_start_marker_the_first_token_decides(demo_compiler):
    """Qwen3 may answer without thinking: the first row allows the grammar's tokens and the
    start marker; the start marker means reasoning, anything else the grammar from token 0."""
    tok, compiler = demo_compiler
    spec = SO(regex=r"[0-9]{3}", reasoning_end=END, reasoning_start=(299,))
    matchers = _matchers(compiler)
    matchers.outputs[1] = []
    logits = torch.zeros(1, 520)
    _mask(matchers, logits, 0, 1, "1", spec)
    allowed = torch.isfinite(logits[0]).nonzero().flatten().tolist()
    digits = {t for t in allowed if t != 299}
    assert 299 in allowed and digits and all(tok.decode([t]).strip().isdigit() for t in digits)
    matchers.outputs[1] = [299, 5, 6]  # it thinks: free until the end marker
    assert _free(matchers, 1, spec)
    first = min(digits)
    matchers.outputs[2] = [first]  # it answers at once: the grammar read that first token
    ids = _walk(matchers, spec, 2, torch.Generator().manual_seed(3))
    assert re.fullmatch(r"[0-9]{3}", tok.decode(ids)), tok.decode(ids)


@pytest.mark.parametrize("bad", [(), (-1,), ("a",)])
def test_bad_markers_are_refused(bad):
    with pytest.raises(ValueError, match="reasoning_end must be a non-empty sequence of token"):
        SO(regex="a", reasoning_end=bad)
    with pytest.raises(ValueError, match="reasoning_end_suffix needs reasoning_end"):
        SO(regex="a", reasoning_end_suffix=(1,))
    with pytest.raises(ValueError, match="reasoning_start needs reasoning_end"):
        SO(regex="a", reasoning_start=(1,))


def test_through_the_engine_the_grammar_waits_for_the_marker():
    """Greedy, random weights: a logit bias makes the model write the marker first; without
    the marker the constraint holds from the first token, with it the reasoning is free and
    the answer after the marker obeys the constraint."""
    llm = LLM("demo", device="cpu", dtype="float32", num_kv_blocks=64, block_size=8, seed=0)
    tok = llm.engine.tokenizer
    marker = tok.encode(" zebra", add_bos=False)[-1:]
    bias = {marker[0]: 100.0}
    spec = SO(regex=r"[0-9]{4}", reasoning_end=tuple(marker))
    params = SamplingParams(temperature=0, max_tokens=12, logit_bias=bias, structured_outputs=spec)
    [out] = llm.generate(["Count:"], params)
    ids = out.outputs[0].token_ids
    assert ids[0] == marker[0], ids  # the reasoning is free: the bias wins
    answer = tok.decode(ids[1:])
    assert re.fullmatch(r"[0-9]{4}", answer), answer
    plain = SamplingParams(
        temperature=0, max_tokens=12, logit_bias=bias, structured_outputs=SO(regex=r"[0-9]{4}")
    )
    [out] = llm.generate(["Count:"], plain)
    assert re.fullmatch(r"[0-9]{4}", out.outputs[0].text)  # no marker: the grammar from the start


def _pieces_of(tok, text: str) -> list[int]:
    """``text`` spelled one byte piece per character (not the marker's own ids)."""
    return [tok.sp.piece_to_id(f"<0x{b:02X}>") for b in text.encode()]


def test_the_end_marker_is_found_in_the_text_however_it_is_spelled(demo_compiler):
    """Issue 55, item 10: a model that writes ' </' 'think' '>' in other pieces than the
    marker's own ids still gets its grammar after the marker, as the parser reads the text."""
    tok, compiler = demo_compiler
    spec = SO(regex=r"[0-9]{3}", reasoning_end=END, reasoning_end_text="</think>")
    matchers = _matchers(compiler)
    out = matchers.outputs[1] = []
    for token in (5, *_pieces_of(tok, " </think")):  # reasoning, half the marker: free
        out.append(token)
        assert _free(matchers, 1, spec)
    out.extend(_pieces_of(tok, ">"))  # the marker's last byte: the answer starts
    assert not _free(matchers, 1, spec)
    n = len(out)
    ids = _walk(matchers, spec, 1, torch.Generator().manual_seed(0))
    answer = tok.decode(ids[n:])
    assert re.fullmatch(r"[0-9]{3}", answer), answer
    # Without the text, the same pieces are not the marker: the row stays free.
    plain = SO(regex=r"[0-9]{3}", reasoning_end=END)
    matchers.outputs[2] = [5, *_pieces_of(tok, " </think>")]
    assert _free(matchers, 2, plain)


def test_the_rest_of_the_token_that_ends_the_marker_is_the_grammars_first_input(demo_compiler):
    tok, compiler = demo_compiler
    vocab = token_bytes(tok)
    # A piece of two or more letters: the marker ends with its first, the rest is the answer's.
    piece_id = next(i for i, b in enumerate(vocab) if len(b) >= 2 and b.isalpha())
    piece = vocab[piece_id].decode()
    spec = SO(
        regex=re.escape(piece[1:]) + r"[0-9]{2}",
        reasoning_end=END,
        reasoning_end_text="</" + piece[0],
    )
    matchers = _matchers(compiler)
    matchers.outputs[4] = [5, *_pieces_of(tok, "</"), piece_id]
    assert not _free(matchers, 4, spec)
    ids = _walk(matchers, spec, 4, torch.Generator().manual_seed(1))
    assert re.fullmatch(r"[0-9]{2}", tok.decode(ids[4:])), tok.decode(ids[4:])
    # A marker followed by text the grammar refuses: the sequence may only end.
    matchers.outputs[5] = [5, *_pieces_of(tok, "</" + piece[0] + "!")]
    logits = torch.zeros(1, 520)
    _mask(matchers, logits, 0, 5, "5", spec)
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == sorted(tok.eos_token_ids)
