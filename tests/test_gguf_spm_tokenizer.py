"""SentencePiece tokenizers from GGUF files (``tokenizer.ggml.model == "llama"``): Gemma's (no
prefix space, merges by file order, whitespace pieces written with real spaces) and Llama 2's
(a prefix space, merges by score). The same ids as transformers' GGUF tokenizer on the same
file, for text with spaces, runs of spaces, new lines, characters only the byte pieces cover
and special tokens; decoding gives the text back."""

from __future__ import annotations

import pytest
from gguf import GGUFWriter

from pydaemon.gguf import GGUFFile
from pydaemon.tokenizer.gguf import load_gguf_tokenizer
from pydaemon.tokenizer.gguf_spm import recover_merges

S = "\u2581"
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
PIECES = [S, "  ", "\n", "\n\n", "t", "h", "e", "a", "n", "i", "g", "o", "w", "r", "l",
          "d", ",", "!", "he", "in", "an", "er", S + "t", S + "the", "th", "the", "ing",
          S + "w", S + "wor", "or", "ld", S + "world", "ll", "lo", "hel", "hello", S + "hello",
          "é", S + "a", "ann", S + "an"]  # fmt: skip
TEXTS = [
    "hello world",
    "the  hello,   world!\n\nthe end",
    " leading space and trailing ",
    "naïve café — 東京 🙂",
    "<start_of_turn>user\nhello<end_of_turn>",
    "annnn ingering",
]


def _write(path, arch: str, *, prefix: bool | None, scores: list[float] | None = None):
    tokens = SPECIALS + [f"<0x{b:02X}>" for b in range(256)] + PIECES
    types = [3] * len(SPECIALS) + [6] * 256 + [1] * len(PIECES)
    types[SPECIALS.index("<unk>")] = 2
    writer = GGUFWriter(str(path), arch)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_scores(scores or [-float(i) for i in range(len(tokens))])
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_pad_token_id(0)
    if prefix is not None:
        writer.add_add_space_prefix(prefix)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _transformers(path):
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        convert_gguf_tokenizer,
        get_gguf_tokenizer,
    )

    arch, tokenizer_dict, _ = get_gguf_tokenizer(str(path))
    backend, _ = convert_gguf_tokenizer(arch, tokenizer_dict)
    return backend


@pytest.mark.parametrize("arch", ["gemma3", "gemma2"])
def test_gemma_ids_equal_transformers(tmp_path, arch):
    path = _write(tmp_path / "g.gguf", arch, prefix=False)
    ours, ref = load_gguf_tokenizer(GGUFFile(path)), _transformers(path)
    for text in TEXTS:
        ids = ours.encode(text, add_bos=False)
        assert ids == ref.encode(text, add_special_tokens=False).ids, text
        assert ours.decode(ids, skip_special_tokens=False) == text
    # A word with its space is one piece, so is a run of two spaces (written "  " in the file);
    # a character no piece covers falls back to its bytes.
    first = len(SPECIALS) + 256
    assert ours.encode(" world", add_bos=False) == [first + PIECES.index(S + "world")]
    assert ours.encode("a  a", add_bos=False) == [first + PIECES.index(p) for p in ("a", "  ", "a")]
    assert ours.encode("東", add_bos=False) == [6 + b for b in "東".encode()]
    assert ours.encode("hi", add_bos=True)[0] == 2  # BOS by default


def test_llama_prefix_space_and_score_order_equal_transformers(tmp_path):
    # Scores that disagree with the file order: "hel" outranks "he".
    tokens = SPECIALS + [None] * 256 + PIECES
    scores = [-float(i) for i in range(len(tokens))]
    scores[len(SPECIALS) + 256 + PIECES.index("hel")] = 10.0
    path = _write(tmp_path / "l.gguf", "llama", prefix=None, scores=scores)
    ours, ref = load_gguf_tokenizer(GGUFFile(path)), _transformers(path)
    for text in TEXTS:
        ids = ours.encode(text, add_bos=False)
        assert ids == ref.encode(text, add_special_tokens=False).ids, text
        # The prefix space is taken off again (a text that began with a space loses it, as
        # with transformers' Llama tokenizers).
        assert ours.decode(ids, skip_special_tokens=False) == ref.decode(
            ids, skip_special_tokens=False
        )
        assert ours.decode(ids, skip_special_tokens=False).strip() == text.strip()
    assert ours.encode("the", add_bos=False) == [
        len(SPECIALS) + 256 + PIECES.index(S + "the")
    ]  # the prefix space joins the first word


def test_recovered_merges_put_the_best_piece_first():
    vocab = {"a": 0, "b": 1, "ab": 2, "abb": 3, "bb": 4}
    merges = recover_merges(vocab, {t: -i for t, i in vocab.items()})
    assert merges == [("a", "b"), ("ab", "b"), ("a", "bb"), ("b", "b")]
