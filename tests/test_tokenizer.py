"""Tokenizer round trips, BOS/EOS resolution, streaming detokenization, the demo model."""

from __future__ import annotations

import json
import shutil

import pytest
from model_utils import Driver

from pydaemon.engine.detokenizer import IncrementalDetokenizer
from pydaemon.model_loader.demo_model import build_demo_model, demo_model_dir
from pydaemon.model_loader.loader import load_model
from pydaemon.tokenizer.loader import load_tokenizer
from pydaemon.tokenizer.sentencepiece import SentencePieceTokenizer

TEXTS = [
    "Hello world, how are you today?",
    " leading space and  two spaces",
    "The price is 5€, or 10 € for two.",
    "Emoji 😀🎉 in the middle of a sentence 👍",
    "日本語のテキストと中文 mixed with English.",
    "Lines\nwith\ttabs and newlines\n",
    "ü ß é ñ — “quotes” …",
]


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    return demo_model_dir(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def tok(demo_dir) -> SentencePieceTokenizer:
    t = load_tokenizer(demo_dir)
    assert t is not None
    return t


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id == 1
    assert tok.encode(text, add_bos=False) == ids[1:]
    assert tok.decode(ids) == text
    assert all(0 <= i < tok.vocab_size for i in ids)


def test_byte_fallback_pieces(tok):
    ids = tok.encode("€", add_bos=False)
    pieces = [tok.id_to_piece(i) for i in ids]
    assert pieces[-3:] == ["<0xE2>", "<0x82>", "<0xAC>"]


def test_special_tokens(tok):
    ids = tok.encode("Hello") + [tok.eos_token_id]
    assert tok.eos_token_ids == {2}
    assert tok.decode(ids) == "Hello"
    assert tok.decode(ids, skip_special_tokens=False) == "<s>Hello</s>"
    with pytest.raises(ValueError, match="out of range"):
        tok.decode([tok.vocab_size])


def test_bos_eos_preference(demo_dir, tmp_path):
    shutil.copy(demo_dir / "tokenizer.model", tmp_path / "tokenizer.model")
    assert load_tokenizer(tmp_path).eos_token_ids == {2}  # from the sp model
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 3, "bos_token_id": 4}))
    t = load_tokenizer(tmp_path)
    assert t.eos_token_ids == {3} and t.bos_token_id == 4
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5]}))
    t = load_tokenizer(tmp_path)
    # Every EOS id of both files, generation_config.json's first.
    assert t.eos_token_ids == {2, 3, 5} and t.eos_token_id == 2 and t.bos_token_id == 4


def test_no_tokenizer_is_none(tmp_path):
    assert load_tokenizer(tmp_path) is None
    with pytest.raises(FileNotFoundError, match="tokenizer.model"):
        SentencePieceTokenizer(tmp_path / "tokenizer.model")


def _stream(tok, prompt, output):
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = [detok.add([t]) for t in output]
    deltas.append(detok.flush())
    return detok, deltas


@pytest.mark.parametrize("text", TEXTS)
def test_streaming_deltas_match_full_decode(tok, text):
    ids = tok.encode(text)
    for split in range(1, len(ids)):
        prompt, output = ids[:split], ids[split:]
        if tok.decode(prompt).endswith("\ufffd"):
            continue  # a prompt ending inside a character has no well-defined text
        detok, deltas = _stream(tok, prompt, output)
        expected = tok.decode(ids)[len(tok.decode(prompt)) :]
        assert "".join(deltas) == expected == detok.text, f"split {split}"
        assert not any("\ufffd" in d for d in deltas)


def test_multibyte_char_emitted_once_complete(tok):
    prompt = tok.encode("Price:")
    euro = tok.encode("Price: €", add_bos=False)[len(prompt) - 1 :]
    assert [tok.id_to_piece(i) for i in euro] == ["▁", "<0xE2>", "<0x82>", "<0xAC>"]
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = [detok.add([i]) for i in euro]
    assert deltas in (["", "", "", " €"], [" ", "", "", "€"])
    assert detok.text == " €"


def test_first_token_keeps_leading_space(tok):
    prompt = tok.encode("Hello")
    world = tok.encode("Hello world", add_bos=False)[len(prompt) - 1 :]
    assert tok.id_to_piece(world[0]).startswith("▁")
    detok = IncrementalDetokenizer(tok, prompt)
    assert detok.add(world).startswith(" w")


def test_incomplete_tail_held_back_then_flushed(tok):
    prompt = tok.encode("a")
    e2 = tok.sp.piece_to_id("<0xE2>")
    detok = IncrementalDetokenizer(tok, prompt)
    assert detok.add([e2]) == ""
    assert detok.flush() == "\ufffd"


def test_demo_model_deterministic(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    build_demo_model(a)
    build_demo_model(b)
    names = sorted(p.name for p in a.iterdir())
    assert names == [
        "chat_template.jinja",
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.model",
    ]
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_demo_model_dir_cached_and_runs(demo_dir, tok):
    assert demo_model_dir(demo_dir.parent) == demo_dir
    assert not [p for p in demo_dir.parent.iterdir() if p.name.startswith(".")]
    model, cfg = load_model(demo_dir)
    assert cfg.vocab_size == tok.vocab_size
    out = Driver(model, block_size=16).generate([tok.encode("Once upon a time")], 8)[0]
    assert len(out) == 8 and isinstance(tok.decode(out), str)


def test_sentencepiece_equals_transformers(demo_dir, tmp_path):
    """Same ids and text as transformers' LlamaTokenizer on the same tokenizer.model.

    (Texts that start with a space or hold special-token text are left out: there
    transformers 5's conversion of the model departs from SentencePiece, which we follow.)"""
    transformers = pytest.importorskip("transformers")
    shutil.copy(demo_dir / "tokenizer.model", tmp_path / "tokenizer.model")
    config = {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "add_bos_token": True}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    ours = load_tokenizer(tmp_path)
    for text in [t for t in TEXTS if not t[0].isspace()]:
        assert ours.encode(text) == ref.encode(text), text
        ids = ours.encode(text) + [ours.eos_token_id]
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("legacy", [None, True, False])
def test_special_token_text_encodes_like_transformers(demo_dir, tmp_path, legacy):
    """``<s>`` / ``</s>`` written in the text (as chat templates write them) become their ids,
    and the text around them is split as transformers' LlamaTokenizer splits it, with and
    without ``legacy``."""
    transformers = pytest.importorskip("transformers")
    shutil.copy(demo_dir / "tokenizer.model", tmp_path / "tokenizer.model")
    config = {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>"}
    if legacy is not None:
        config["legacy"] = legacy
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    ours = load_tokenizer(tmp_path)
    texts = ["<s>[INST] Hello there [/INST]", "Hi</s><s>next", "a <s> b", "<s>x", "x</s>",
             "<s> leading space", "a<unk>b", "<s>  two spaces</s>", "x <s>  y"]  # fmt: skip
    for text in texts:
        assert ours.encode(text, add_bos=False) == ref.encode(text, add_special_tokens=False), text
    bos, eos = ours.bos_token_id, ours.eos_token_id
    assert ours.encode("Hi</s><s>next", add_bos=False).count(eos) == 1
    assert ours.encode("<s>x", add_bos=False)[0] == bos
