"""Hugging Face fast tokenizer (``tokenizer.json``) through the ``tokenizers`` package.

Same interface as the SentencePiece :class:`pydaemon.tokenizer.sentencepiece.SentencePieceTokenizer`. Encoding and decoding
follow transformers' tokenizers backend: special tokens are added by the ``tokenizer.json``
post-processor, unless ``tokenizer_config.json`` sets ``add_bos_token``/``add_eos_token``
explicitly, in which case those decide; ``decode`` is the backend's, and
``clean_up_tokenization_spaces`` is honoured except for BPE models (transformers skips it there:
it would delete real spaces before punctuation).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import tokenizers

from pydaemon.tokenizer.chat_template import load_chat_template, render_chat_template
from pydaemon.tokenizer.files import (
    model_eos_token_ids,
    named_special_tokens,
    normalize_token_ids,
    read_tokenizer_config,
)

TOKENIZER_JSON = "tokenizer.json"
_CLEANUP = (
    (" .", "."),
    (" ?", "?"),
    (" !", "!"),
    (" ,", ","),
    (" ' ", "'"),
    (" n't", "n't"),
    (" 'm", "'m"),
    (" 's", "'s"),
    (" 've", "'ve"),
    (" 're", "'re"),
)


class HFTokenizer:
    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        config: dict[str, Any],
        chat_template: str | None = None,
        *,
        name: str = "model",
        extra_eos_token_ids: list[int] | None = None,
    ) -> None:
        """Prefer :meth:`from_dir` or :meth:`from_tokenizer_object`."""
        self.tokenizer = tokenizer
        self.name = name
        self.chat_template = chat_template
        self.init_kwargs: dict[str, Any] = dict(
            config
        )  # as transformers keeps it (/tokenizer_info)
        self.special_tokens_map: dict[str, str] = named_special_tokens(config)
        self._plain: tokenizers.Tokenizer | None = None  # see _plain_tokenizer
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = self._token_id("bos_token", config.get("bos_token_id"))
        eos_from_token = self._token_id("eos_token", None)
        eos = [
            *(extra_eos_token_ids or []),
            *normalize_token_ids(config.get("eos_token_id"), "eos_token_id"),
        ]
        if eos_from_token is not None:
            eos.append(eos_from_token)
        eos = list(dict.fromkeys(eos))
        self.eos_token_ids: set[int] = set(eos)
        self.eos_token_id: int | None = eos[0] if eos else None
        self.special_token_ids: set[int] = {
            i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special
        }
        # None: the tokenizer.json post-processor decides which special tokens to add.
        self._add_bos: bool | None = None
        if tokenizer.post_processor is None:
            self._add_bos = bool(config.get("add_bos_token", False))
        self._add_eos = bool(config.get("add_eos_token", False))
        is_bpe = isinstance(tokenizer.model, tokenizers.models.BPE)
        # Byte-fallback pieces (<0xE2>...): the decoder turns a whole run of them into text
        # or, when the run is not valid UTF-8, into one U+FFFD per byte.
        self.byte_run_token_ids: set[int] = set()
        if is_bpe and tokenizer.model.byte_fallback:
            vocab = tokenizer.get_vocab()
            self.byte_run_token_ids = {
                vocab[p] for p in (f"<0x{b:02X}>" for b in range(256)) if p in vocab
            }
        self._clean_up_spaces = bool(config.get("clean_up_tokenization_spaces", False)) and (
            not is_bpe
            or bool(
                config.get(
                    "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"
                )
            )
        )

    @classmethod
    def from_tokenizer_object(
        cls, tok: tokenizers.Tokenizer, config: dict[str, Any], chat_template: str | None = None
    ) -> HFTokenizer:
        """A tokenizer built in memory, configured by tokenizer_config-style fields.

        ``config`` keys read: ``bos_token``, ``eos_token`` (and the other named special tokens),
        each a string or ``{"content": ...}``; ``add_bos_token``, ``add_eos_token``,
        ``clean_up_tokenization_spaces``; ``bos_token_id`` and ``eos_token_id`` (an int or a
        list) where the ids are known but the token strings are not; ``name_or_path`` names
        the model in errors. ``chat_template`` defaults to ``config["chat_template"]``.
        """
        if chat_template is None:
            chat_template = config.get("chat_template")
        name = str(config.get("name_or_path") or "model")
        return cls(tok, config, chat_template, name=name)

    @classmethod
    def from_dir(cls, path: str | Path) -> HFTokenizer:
        """``tokenizer.json`` + ``tokenizer_config.json`` + ``special_tokens_map.json``, the chat
        template, and the EOS ids of ``generation_config.json`` and ``config.json``."""
        model_dir = Path(path)
        file = model_dir / TOKENIZER_JSON
        if not file.is_file():
            raise FileNotFoundError(f"tokenizer.json not found: {file}")
        try:
            tok = tokenizers.Tokenizer.from_file(str(file))
        except Exception as e:  # the tokenizers package raises a bare Exception on bad files
            raise ValueError(f"cannot load {file}: {e}") from e
        config = read_tokenizer_config(model_dir)
        return cls(
            tok,
            config,
            load_chat_template(model_dir, config),
            name=model_dir.name,
            extra_eos_token_ids=model_eos_token_ids(model_dir),
        )

    def _token_id(self, name: str, fallback: Any) -> int | None:
        content = self.special_tokens_map.get(name)
        if content is not None:
            token_id = self.tokenizer.token_to_id(content)
            if token_id is None:
                raise ValueError(f"{name} {content!r} is not in the vocabulary of {self.name!r}")
            return token_id
        ids = normalize_token_ids(fallback, f"{name}_id")
        return ids[0] if ids else None

    @property
    def special_token_texts(self) -> frozenset[str]:
        """Texts that ``encode`` turns into a special token (``<|im_start|>``, ...)."""
        return frozenset(
            t.content for t in self.tokenizer.get_added_tokens_decoder().values() if t.special
        )

    def encode_segments(self, segments: list[tuple[str, bool]]) -> list[int]:
        """One text given in consecutive parts, each ``(text, parse_special_tokens)``: a part
        with False is plain text even where it spells a special token. No BOS is added."""
        ids: list[int] = []
        for text, parse_special in segments:
            tokenizer = self.tokenizer if parse_special else self._plain_tokenizer()
            ids.extend(tokenizer.encode(text, add_special_tokens=False).ids)
        return ids

    def _plain_tokenizer(self) -> tokenizers.Tokenizer:
        """A copy that reads special-token text as plain text (built once, on first use)."""
        if self._plain is None:
            plain = tokenizers.Tokenizer.from_str(self.tokenizer.to_str())
            plain.encode_special_tokens = True
            self._plain = plain
        return self._plain

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_bos`` adds the model's special tokens (BOS) as
        transformers' ``encode(text, add_special_tokens=add_bos)`` does."""
        if self._add_bos is None:
            return self.tokenizer.encode(text, add_special_tokens=add_bos).ids
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if not add_bos:
            return ids
        if self._add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        if self._add_eos and self.eos_token_id is not None:
            ids = [*ids, self.eos_token_id]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        for i in ids:
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i} out of range [0, {self.vocab_size})")
        text = self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        if self._clean_up_spaces:
            for old, new in _CLEANUP:
                text = text.replace(old, new)
        return text

    def id_to_piece(self, token_id: int) -> str:
        piece = self.tokenizer.id_to_token(token_id)
        if piece is None:
            raise ValueError(f"token id {token_id} out of range [0, {self.vocab_size})")
        return piece

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list | None = None,
        **kwargs: Any,
    ) -> str:
        """The prompt text for ``messages``, as transformers' ``apply_chat_template(...,
        tokenize=False)`` renders it; encode it with ``add_bos=False`` (the template writes
        the BOS)."""
        return render_chat_template(
            self.chat_template,
            messages,
            model_name=self.name,
            special_tokens=self.special_tokens_map,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            **kwargs,
        )
