"""A GGUF file's SentencePiece tokenizer (``tokenizer.ggml.model == "llama"``: Gemma 2 / 3,
Llama 2, Mistral), built as a ``tokenizers`` BPE with byte fallback.

The file holds the pieces (spaces spelled ``▁``), their scores and types, but no merges: they
are recovered from the vocabulary, every split of a piece into two pieces, best piece first.
Which piece is best: its score (higher first), except for Gemma, whose scores do not follow
its merge order: there the piece's position in the file does (earlier first); ties go to the
longer left part, then to the split listed first. Gemma files spell their whitespace-only
pieces with real spaces (``"  "``); those are respelled ``▁▁``.

Text: spaces become ``▁``; with ``tokenizer.ggml.add_space_prefix`` (default: on, but off for
Gemma, as llama.cpp's converter writes it) one ``▁`` is put before the text. Characters no
piece covers fall back to the byte pieces ``<0xNN>`` (type BYTE). Decoding undoes both.
CONTROL (3) pieces are special added tokens, USER_DEFINED (4) plain added ones, both matched
whole in text. BOS is added unless ``tokenizer.ggml.add_bos_token`` says not (llama.cpp's
default for such vocabularies)."""

from __future__ import annotations

from tokenizers import AddedToken, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE

from pydaemon.gguf.reader import GGUFFile

SPACE = "\u2581"
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
_GEMMA_ARCHITECTURES = ("gemma", "gemma2", "gemma3")


def spm_tokenizer(f: GGUFFile) -> tuple[Tokenizer, bool]:
    """-> (the tokenizer, whether BOS is added by default)."""
    tokens: list[str] = list(f.require("tokenizer.ggml.tokens"))
    types: list[int] = f.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(types) != len(tokens):
        raise ValueError(
            f"{f.path.name}: tokenizer.ggml.token_type has {len(types)} entries for "
            f"{len(tokens)} tokens"
        )
    gemma = f.architecture in _GEMMA_ARCHITECTURES
    if gemma:  # whitespace-only pieces are written with real spaces
        tokens = [SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
        rank = {t: -i for i, t in enumerate(tokens)}
    else:
        scores = f.get("tokenizer.ggml.scores")
        if scores is None or len(scores) != len(tokens):
            raise ValueError(f"{f.path.name}: a SentencePiece vocabulary needs one score a token")
        rank = dict(zip(tokens, scores, strict=True))
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        vocab.setdefault(token, index)
    unk_id = f.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
    model = BPE(vocab, recover_merges(vocab, rank), unk_token=unk, fuse_unk=True,
                byte_fallback=True)  # fmt: skip
    tok = Tokenizer(model)
    prefix = bool(f.get("tokenizer.ggml.add_space_prefix", not gemma))
    if prefix:
        tok.normalizer = None
        tok.pre_tokenizer = pre_tokenizers.Metaspace(SPACE, prepend_scheme="first", split=False)
        steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse(),
                 decoders.Strip(" ", 1, 0)]  # fmt: skip
    else:
        tok.normalizer = normalizers.Replace(" ", SPACE)
        steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps)
    tok.add_special_tokens(
        [
            AddedToken(t, normalized=False, special=True)
            for t, kind in zip(tokens, types, strict=True)
            if kind == TOKEN_TYPE_CONTROL
        ]
    )
    tok.add_tokens(
        [
            AddedToken(t, normalized=False, special=False)
            for t, kind in zip(tokens, types, strict=True)
            if kind == TOKEN_TYPE_USER_DEFINED
        ]
    )
    return tok, bool(f.get("tokenizer.ggml.add_bos_token", True))


def recover_merges(vocab: dict[str, int], rank: dict[str, float]) -> list[tuple[str, str]]:
    """Every split of a piece into two pieces, best piece first (module docstring)."""
    found: list[tuple[float, int, int, str, str]] = []
    for piece in vocab:  # in file order: ties keep it
        score = rank[piece]
        splits = [
            (piece[:cut], piece[cut:])
            for cut in range(1, len(piece))
            if piece[:cut] in vocab and piece[cut:] in vocab
        ]
        splits.sort(key=lambda lr: (vocab[lr[0]], vocab[lr[1]]))
        found.extend((-score, -len(left), -len(right), left, right) for left, right in splits)
    found.sort(key=lambda m: m[:3])
    return [(left, right) for *_, left, right in found]
