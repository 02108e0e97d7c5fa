"""A synthetic byte-level BPE tokenizer of any vocabulary size, for benchmarks of dummy-weight
models that ship no tokenizer (structured outputs need one to spell grammars).

Like Llama 3's: 256 byte tokens in GPT-2's alphabet, then merged tokens up to
``vocab_size - num_special`` (pieces of 2 to 12 characters built from word-like letters,
spaces and punctuation, deterministic from ``seed``), then ``num_special`` special tokens whose
ids match Llama 3's (<|begin_of_text|> 128000, <|end_of_text|> 128001, <|eot_id|> 128009 at
vocabulary 128256). A grammar's mask cost depends on the vocabulary's size and the token
lengths, not on how natural the merges are.

    python bench/synthetic_tokenizer.py DIR [--vocab-size 128256]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

LETTERS = "etaoinshrdlucmfwypvbgkqjxz"
PUNCT = " .,;:!?\"'(){}[]-_/0123456789\n"


def build_tokenizer_json(vocab_size: int, num_special: int = 256, seed: int = 0) -> str:
    from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_chars = sorted(alphabet)
    vocab: dict[str, int] = {c: i for i, c in enumerate(byte_chars)}
    space = "\u0120"  # GPT-2's spelling of a space
    weighted = list(LETTERS * 4 + PUNCT.replace(" ", "").replace("\n", "")) + [space] * 12
    rng = random.Random(seed)
    merges: list[tuple[str, str]] = []
    pieces = [c for c in weighted]
    num_merged = vocab_size - num_special - len(vocab)
    while len(merges) < num_merged:
        left = rng.choice(pieces)
        right = rng.choice(LETTERS) if rng.random() < 0.7 else rng.choice(pieces)
        new = left + right
        if new in vocab or not 2 <= len(new) <= 12 or (left not in vocab or right not in vocab):
            continue
        vocab[new] = len(vocab)
        merges.append((left, right))
        pieces.append(new)
    tok = Tokenizer(BPE(vocab, merges, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    base = len(vocab)
    names = {0: "<|begin_of_text|>", 1: "<|end_of_text|>", 9: "<|eot_id|>"}
    tok.add_special_tokens(
        [AddedToken(names.get(i, f"<|reserved_special_token_{i}|>"), special=True)
         for i in range(num_special)]
    )  # fmt: skip
    assert tok.get_vocab_size() == vocab_size, (tok.get_vocab_size(), vocab_size, base)
    return tok.to_str()


def write_tokenizer(directory: str | Path, vocab_size: int, seed: int = 0) -> Path:
    """tokenizer.json and tokenizer_config.json (EOS <|eot_id|>) into ``directory``."""
    path = Path(directory)
    (path / "tokenizer.json").write_text(build_tokenizer_json(vocab_size, seed=seed))
    config = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return path


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("directory")
    parser.add_argument("--vocab-size", type=int, default=128256)
    args = parser.parse_args()
    print(write_tokenizer(args.directory, args.vocab_size))
