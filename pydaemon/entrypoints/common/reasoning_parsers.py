"""Reasoning parsers: a reasoning model's text -> its reasoning and its answer, whole or streamed.

Named as vLLM's ``--reasoning-parser`` values:
- ``deepseek_r1`` (DeepSeek R1, QwQ): the output reasons until ``</think>`` (an opening
  ``<think>`` is optional: the template may have written it); no ``</think>`` means all of it
  was reasoning;
- ``qwen3``: reasoning only inside ``<think>...</think>``; an output that does not open with
  ``<think>`` (``enable_thinking`` false, or the model chose not to) is all answer;
- ``openai_gptoss`` (gpt-oss, the harmony format; also ``gpt_oss``): the ``analysis`` channel is
  the reasoning, the ``final`` channel the answer; a ``commentary`` message to
  ``functions.NAME`` is a tool call, kept in the content in the form the ``openai`` tool-call
  parser reads. Harmony's markers are special tokens: its requests keep them in the text
  (``skip_special_tokens`` false) and this parser takes them out.

A prompt whose rendered text already closed the reasoning (Qwen3's template with
``enable_thinking`` false ends with ``<think>\\n\\n</think>\\n\\n``) makes the whole output the
answer. An output that continues the final message (``continue_final_message``) goes on from
where that message is: reasoning only inside a ``<think>`` it left open; an echoed message is
split from its own start. Streaming gives each delta's reasoning and content, holding back only
text that may be the start of a marker; the whole-text result is the streamed one joined (one
code path).

The think-tag parsers need a model whose tokenizer has ``<think>`` and ``</think>``: on any
other, ``deepseek_r1`` (which reasons until ``</think>``) returned every answer as reasoning
with ``content: null``, so ``check_reasoning_parser`` refuses such a model at start, as vLLM
does.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass
class ReasoningSplit:
    reasoning: str | None  # None: the output had no reasoning
    content: str | None  # None: no answer (yet)


@dataclass
class ReasoningMarkers:
    """Token ids that end (and may start) the reasoning, for structured outputs (None: the
    grammar holds from the first token): StructuredOutputsParams.reasoning_*."""

    end: tuple[int, ...]
    end_suffix: tuple[int, ...] | None = None
    start: tuple[int, ...] | None = None
    end_text: str | None = None  # the end marker as text, found however it is tokenized


class ReasoningParser:
    name = ""
    skip_special_tokens = True  # False: its markers are special tokens it must see

    def check_model(self, tokenizer) -> None:
        """ValueError when the model cannot write what this parser reads."""

    def stream(self, prompt_text: str = "") -> ReasoningStream:
        raise NotImplementedError

    def markers(self, tokenizer, prompt_text: str = "") -> ReasoningMarkers | None:
        raise NotImplementedError

    def split(self, text: str, prompt_text: str = "") -> ReasoningSplit:
        stream = self.stream(prompt_text)
        reasoning, content = stream.feed(text)
        more_reasoning, more_content = stream.finish()
        return ReasoningSplit(
            (reasoning + more_reasoning) if stream.had_reasoning else None,
            (content + more_content) or None,
        )

    def continued_tail(self, message_text: str) -> str:
        """The ``prompt_text`` for an output that continues the final message, whose text is
        ``message_text`` (continue_final_message): the output goes on where the message ends."""
        return message_text

    def split_message(self, message_text: str) -> ReasoningSplit:
        """A message's own text (an echo) split from its start: as a client wrote it."""
        return ReasoningSplit(None, message_text or None)


class ReasoningStream:
    """One output's deltas -> (reasoning, content) per delta; ``finish`` flushes the rest."""

    had_reasoning = False

    def feed(self, delta: str) -> tuple[str, str]:
        raise NotImplementedError

    def finish(self) -> tuple[str, str]:
        raise NotImplementedError


class ReasoningStreams:
    """One request's outputs through a parser, by output index: each delta's (reasoning,
    content) as it comes, and each output's whole split (what the deltas gave, joined)."""

    def __init__(self, parser: ReasoningParser, prompt_text: str = "") -> None:
        self.parser = parser
        self.prompt_text = prompt_text
        self._streams: dict[int, ReasoningStream] = {}
        self._reasoning: dict[int, list[str]] = {}
        self._content: dict[int, list[str]] = {}

    def feed(self, index: int, text: str, finished: bool) -> tuple[str, str]:
        """-> (reasoning, content) of output ``index``'s new text; ``finished`` flushes what
        was held back."""
        stream = self._streams.get(index)
        if stream is None:
            stream = self._streams[index] = self.parser.stream(self.prompt_text)
        reasoning, content = stream.feed(text)
        if finished:
            more_reasoning, more_content = stream.finish()
            reasoning, content = reasoning + more_reasoning, content + more_content
        self._reasoning.setdefault(index, []).append(reasoning)
        self._content.setdefault(index, []).append(content)
        return reasoning, content

    def split(self, index: int) -> ReasoningSplit:
        """Output ``index`` whole, held-back text included (an output cut short ends here)."""
        self.feed(index, "", finished=True)
        stream = self._streams[index]
        return ReasoningSplit(
            "".join(self._reasoning[index]) if stream.had_reasoning else None,
            "".join(self._content[index]) or None,
        )


def _held_back(text: str, markers: tuple[str, ...]) -> int:
    """The length of the longest suffix of ``text`` that is a proper prefix of a marker."""
    for n in range(min(max(len(m) for m in markers) - 1, len(text)), 0, -1):
        if any(m.startswith(text[-n:]) for m in markers):
            return n
    return 0


def _encode(tokenizer, text: str) -> tuple[int, ...]:
    return tuple(tokenizer.encode(text, add_bos=False))


class ThinkReasoningParser(ReasoningParser):
    """``<think>...</think>``: DeepSeek R1 (reasoning from the start) and Qwen3 (only if the
    output, or the prompt's end, opens it)."""

    start = "<think>"
    end = "</think>"

    def __init__(self, name: str, reasons_by_default: bool) -> None:
        self.name = name
        self.reasons_by_default = reasons_by_default

    def _opening(self, prompt_text: str) -> str:
        """How the output starts: "answer", "reasoning", or "either" (its first text says)."""
        tail = prompt_text.rstrip()
        if tail.endswith(self.end):
            return "answer"
        if tail.endswith(self.start) or self.reasons_by_default:
            return "reasoning"
        return "either"

    def stream(self, prompt_text: str = "") -> ReasoningStream:
        return _ThinkStream(self, self._opening(prompt_text))

    def check_model(self, tokenizer) -> None:
        missing = [m for m in (self.start, self.end) if not _is_one_token(tokenizer, m)]
        if tokenizer is not None and missing:
            raise ValueError(
                f"--reasoning-parser {self.name} reads reasoning between {self.start} and "
                f"{self.end}, and this model's tokenizer has no {' or '.join(missing)} token: "
                "the model does not mark its reasoning so (every answer would come back as "
                "reasoning); serve it without --reasoning-parser"
            )

    def continued_tail(self, message_text: str) -> str:
        """A continued message reasons on only if it opened ``<think>`` and did not close it;
        otherwise it is an answer, and so is what continues it (DeepSeek R1's parser, which
        reasons by default, took the continuation of an answer for reasoning)."""
        is_open = message_text.rfind(self.start) > message_text.rfind(self.end)
        return self.start if is_open else self.end

    def split_message(self, message_text: str) -> ReasoningSplit:
        """A message reasons only inside the ``<think>`` it opens with, whatever the parser
        assumes of a model's output."""
        stream = _ThinkStream(self, "either")
        reasoning, content = stream.feed(message_text)
        more_reasoning, more_content = stream.finish()
        return ReasoningSplit(
            (reasoning + more_reasoning) if stream.had_reasoning else None,
            (content + more_content) or None,
        )

    def markers(self, tokenizer, prompt_text: str = "") -> ReasoningMarkers | None:
        opening = self._opening(prompt_text)
        if opening == "answer":
            return None
        end = _encode(tokenizer, self.end)
        if opening == "reasoning":
            return ReasoningMarkers(end, end_text=self.end)
        return ReasoningMarkers(end, start=_encode(tokenizer, self.start), end_text=self.end)


class _ThinkStream(ReasoningStream):
    def __init__(self, parser: ThinkReasoningParser, opening: str) -> None:
        self.p = parser
        self.state = {"answer": "content", "reasoning": "start", "either": "start"}[opening]
        self.reasons_first = opening == "reasoning"
        self.buf = ""
        # Blank lines after an output's </think> are dropped; an answer the prompt opened is
        # kept as it comes (a continued message goes on mid-sentence: " 42").
        self.answer_started = opening == "answer"

    def feed(self, delta: str) -> tuple[str, str]:
        self.buf += delta
        reasoning, content = "", ""
        while True:
            if self.state == "start":  # an optional <think> after leading whitespace
                head = self.buf.lstrip()
                if head.startswith(self.p.start):
                    self.buf = head[len(self.p.start) :]
                    self.state, self.had_reasoning = "reasoning", True
                    continue
                if self.p.start.startswith(head):
                    return reasoning, content  # maybe the marker: wait
                self.state = "reasoning" if self.reasons_first else "content"
                self.had_reasoning = self.reasons_first
                continue
            if self.state == "reasoning":
                index = self.buf.find(self.p.end)
                if index >= 0:
                    reasoning += self.buf[:index]
                    self.buf = self.buf[index + len(self.p.end) :]
                    self.state = "content"
                    continue
                keep = _held_back(self.buf, (self.p.end,))
                reasoning += self.buf[: len(self.buf) - keep]
                self.buf = self.buf[len(self.buf) - keep :]
                return reasoning, content
            content += self._answer(self.buf)
            self.buf = ""
            return reasoning, content

    def _answer(self, text: str) -> str:
        """The answer, without the blank lines that follow ``</think>``."""
        if not self.answer_started:
            text = text.lstrip()
            self.answer_started = bool(text)
        return text

    def finish(self) -> tuple[str, str]:
        rest, self.buf = self.buf, ""
        if self.state == "start":
            self.had_reasoning = self.reasons_first
            self.state = "reasoning" if self.reasons_first else "content"
        if self.state == "reasoning":
            return rest, ""
        return "", self._answer(rest)


# Harmony's markers (special tokens of gpt-oss's vocabulary).
_START, _CHANNEL, _MESSAGE, _CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
_ENDS = ("<|end|>", "<|call|>", "<|return|>")
_MARKERS = (_START, _CHANNEL, _MESSAGE, _CONSTRAIN, *_ENDS, "<|endoftext|>")
TOOL_CALL_START = "<|channel|>commentary to=functions."  # what the openai tool parser reads


class HarmonyReasoningParser(ReasoningParser):
    name = "openai_gptoss"
    skip_special_tokens = False

    def stream(self, prompt_text: str = "") -> ReasoningStream:
        return _HarmonyStream()

    def markers(self, tokenizer, prompt_text: str = "") -> ReasoningMarkers | None:
        return ReasoningMarkers(
            _encode(tokenizer, _CHANNEL + "final"), end_suffix=_encode(tokenizer, _MESSAGE)
        )


class _HarmonyStream(ReasoningStream):
    """Messages are ``[<|start|>role]<|channel|>NAME[ to=RECIPIENT][<|constrain|>T]<|message|>
    BODY`` ended by <|end|>, <|call|> or <|return|> (the last two are stop tokens)."""

    def __init__(self) -> None:
        self.buf = ""
        self.in_body = False
        self.channel = ""
        self.recipient = ""

    def feed(self, delta: str) -> tuple[str, str]:
        self.buf += delta
        reasoning, content = "", ""
        while True:
            if not self.in_body:
                index = self.buf.find(_MESSAGE)
                if index < 0:
                    return reasoning, content
                self._header(self.buf[:index])
                self.buf = self.buf[index + len(_MESSAGE) :]
                self.in_body = True
                if self.recipient.startswith("functions."):
                    content += f"{TOOL_CALL_START}{self.recipient[10:]}{_MESSAGE}"
                continue
            index, marker = min(
                ((self.buf.find(m), m) for m in (*_ENDS, _START) if m in self.buf),
                default=(-1, ""),
            )
            body = self.buf if index < 0 else self.buf[:index]
            keep = _held_back(body, _MARKERS) if index < 0 else 0
            r, c = self._body(body[: len(body) - keep])
            reasoning, content = reasoning + r, content + c
            if index < 0:
                self.buf = body[len(body) - keep :]
                return reasoning, content
            self.buf = self.buf[index + (len(marker) if marker != _START else 0) :]
            if self.recipient.startswith("functions."):
                content += "<|call|>"
            self.in_body = False

    def _header(self, header: str) -> None:
        channel = header.split(_CHANNEL, 1)[1] if _CHANNEL in header else ""
        channel = channel.split(_CONSTRAIN, 1)[0]
        words = channel.split()
        self.channel = words[0] if words else ""
        for marker in _MARKERS:
            header = header.replace(marker, " ")
        to = [w for w in header.split() if w.startswith("to=")]
        self.recipient = to[0][3:] if to else ""

    def _body(self, text: str) -> tuple[str, str]:
        if self.channel == "analysis" and not self.recipient:
            self.had_reasoning = self.had_reasoning or bool(text)
            return text, ""
        return "", text  # final, a preamble, or a tool call's arguments

    def finish(self) -> tuple[str, str]:
        rest, self.buf = self.buf, ""
        if not self.in_body:
            return "", ""  # a header cut short
        for m in _MARKERS:
            rest = rest.replace(m, "")
        reasoning, content = self._body(rest)
        return reasoning, content


REASONING_PARSERS = {
    "deepseek_r1": lambda: ThinkReasoningParser("deepseek_r1", reasons_by_default=True),
    "qwen3": lambda: ThinkReasoningParser("qwen3", reasons_by_default=False),
    "openai_gptoss": HarmonyReasoningParser,
    "gpt_oss": HarmonyReasoningParser,
}


def _is_one_token(tokenizer, text: str) -> bool:
    """Whether ``text`` is one token of the vocabulary (SentencePiece may add a "▁" piece)."""
    ids = tokenizer.encode(text, add_bos=False)
    return any(tokenizer.decode([i], skip_special_tokens=False).strip() == text for i in ids)


def get_reasoning_parser(name: str) -> ReasoningParser:
    """ValueError naming the known parsers for an unknown name."""
    try:
        return REASONING_PARSERS[name]()
    except KeyError:
        raise ValueError(
            f"unknown reasoning parser {name!r} (known: {', '.join(sorted(REASONING_PARSERS))})"
        ) from None


def detect_reasoning_parser(chat_template: str | None) -> str | None:
    """A parser the chat template's format cannot do without: harmony (gpt-oss), whose raw
    output is channels and markers. Think-style models need --reasoning-parser, as in vLLM."""
    if chat_template and _CHANNEL in chat_template and "analysis" in chat_template:
        return "openai_gptoss"
    return None


def check_reasoning_parser(name: str | None, tokenizer) -> None:
    """At start: ValueError naming --reasoning-parser when the model cannot write what it reads
    (a think-tag parser on a model whose tokenizer has no ``<think>``/``</think>``)."""
    if name is not None:
        get_reasoning_parser(name).check_model(tokenizer)


def chat_reasoning_parser(name: str | None, tokenizer) -> ReasoningParser | None:
    """The daemon's --reasoning-parser, else the one a harmony chat template needs, else None."""
    if name is None and tokenizer is not None:
        name = detect_reasoning_parser(getattr(tokenizer, "chat_template", None))
    return None if name is None else get_reasoning_parser(name)


def prompt_tail(tokenizer, prompt_token_ids: list[int], num_tokens: int = 16) -> str:
    """The rendered prompt's last tokens as text, markers kept: whether the template opened
    (``<think>``) or closed (``</think>``) the reasoning."""
    if tokenizer is None or not prompt_token_ids:
        return ""
    return tokenizer.decode(list(prompt_token_ids[-num_tokens:]), skip_special_tokens=False)


def apply_reasoning(params, parser: ReasoningParser | None, tokenizer, tail: str):
    """A chat request's sampling parameters for a reasoning model: its markers kept in the
    text when they are special tokens, and its constraint (structured outputs, a forced tool
    call) started after the reasoning. ``params`` is changed and returned."""
    if parser is None:
        return params
    if not parser.skip_special_tokens:
        params.skip_special_tokens = False
    spec = params.structured_outputs
    if spec is not None and tokenizer is not None:
        markers = parser.markers(tokenizer, tail)
        if markers is not None:
            params.structured_outputs = replace(
                spec,
                reasoning_end=markers.end,
                reasoning_end_suffix=markers.end_suffix,
                reasoning_start=markers.start,
                reasoning_end_text=markers.end_text,
            )
    return params
