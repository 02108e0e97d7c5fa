"""POST /v1/completions: a prompt (text or token ids, or a list of either) -> choices."""

from __future__ import annotations

import time
import uuid

from aiohttp import web

from pydaemon.entrypoints.common.limits import EMPTY_PROMPT, out_of_vocabulary
from pydaemon.entrypoints.common.token_texts import TokenTexts
from pydaemon.entrypoints.openai.accumulator import Accumulator, ChoiceDelta, ChoiceState
from pydaemon.entrypoints.openai.chunk_template import IDS_MARKER, TEXT_MARKER, ChunkTemplate
from pydaemon.entrypoints.openai.engine_stream import EnginePrompt
from pydaemon.entrypoints.openai.errors import bad_request
from pydaemon.entrypoints.openai.logprobs import completion_logprobs
from pydaemon.entrypoints.openai.prompt_logprobs import echo_logprobs, vllm_prompt_logprobs
from pydaemon.entrypoints.openai.protocol import CompletionRequest
from pydaemon.entrypoints.openai.request_fields import check_logit_bias_size
from pydaemon.entrypoints.openai.responses import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    Usage,
    make_usage,
)
from pydaemon.entrypoints.openai.runner import respond
from pydaemon.entrypoints.openai.serving import OpenAIServing
from pydaemon.outputs import TokenLogprobs


async def create_completion(serving: OpenAIServing, request: web.Request) -> web.StreamResponse:
    raw = await serving.read_body(request)
    check_logit_bias_size(raw)  # before parsing: a huge one takes seconds to parse
    body = CompletionRequest.model_validate_json(raw)
    body.check(serving.model.vocab_size, serving.model.max_logprobs)
    lora_request = serving.admit(
        body.model, _num_prompts(body.prompt) * max(body.n, body.best_of or 1)
    )
    prompts = [
        _truncated(serving, body, p) for p in await _prompts(serving, body.prompt, body.echo)
    ]
    max_tokens = min(
        serving.resolve_max_tokens(
            len(p.token_ids), body.max_tokens, prompt_param="prompt", max_tokens_param="max_tokens"
        )
        for p in prompts
    )
    params = body.sampling_params(
        max_tokens, body.logprobs, body.best_of, serving.model.generation_defaults
    )
    if body.return_tokens_as_token_ids is None:
        body.return_tokens_as_token_ids = serving.options.return_tokens_as_token_ids
    formatter = CompletionFormatter(
        f"cmpl-{uuid.uuid4().hex}",
        serving.model_name(lora_request),
        serving.tokenizer,
        prompts,
        body,
    )
    return await respond(
        serving,
        request,
        prompts,
        params,
        formatter,
        stream=body.stream,
        include_usage=body.include_usage,
        cache_salt=body.cache_salt,
        lora_request=lora_request,
        constraint_source=body.constraint_source,
    )


def _truncated(serving: OpenAIServing, body: CompletionRequest, p: EnginePrompt) -> EnginePrompt:
    ids = body.truncated(p.token_ids, serving.model.max_model_len)
    if len(ids) == len(p.token_ids):
        return p
    return EnginePrompt(ids, serving.decode(ids) if p.text is not None else None)


def _num_prompts(prompt) -> int:
    """Counted before anything is tokenized: a list of strings or of token lists is a batch."""
    if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
        return 1
    return len(prompt)


async def _prompts(serving: OpenAIServing, prompt, echo: bool) -> list[EnginePrompt]:
    """str | list[str] | list[int] | list[list[int]] -> one EnginePrompt per prompt."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompt = [prompt]
    if not prompt:
        raise bad_request(f"{EMPTY_PROMPT} (prompt is an empty list)", "prompt")
    out = []
    for i, p in enumerate(prompt):
        param = "prompt" if len(prompt) == 1 else f"prompt.{i}"
        if isinstance(p, str):
            out.append(EnginePrompt(await serving.encode(p, add_bos=True, param=param), p))
            continue
        vocab_size = serving.model.vocab_size
        bad = [t for t in p if not 0 <= t < vocab_size]
        if not p:
            raise bad_request(f"{EMPTY_PROMPT} ({param} is an empty list)", param)
        if bad:
            raise bad_request(out_of_vocabulary(bad, vocab_size, param), param)
        # The echo spells every token, special ones too, as logprobs' text_offset counts them
        # (vLLM decodes the prompt's ids the same way)
        out.append(EnginePrompt(list(p), serving.decode(p, False) if echo else None))
    return out


class CompletionFormatter:
    def __init__(
        self,
        request_id: str,
        model: str,
        tokenizer,
        prompts: list[EnginePrompt],
        body: CompletionRequest,
    ) -> None:
        self.request_id = request_id
        self.model = model
        self.created = int(time.time())
        self.n = body.n
        self.has_logprobs = body.logprobs is not None
        self.echo = [p.text or "" for p in prompts] if body.echo else None
        # Fields not asked for are left out, not written as null.
        left_out = set() if body.return_token_ids else {"token_ids", "prompt_token_ids"}
        if body.prompt_logprobs is None:
            left_out.add("prompt_logprobs")
        self._exclude = {"choices": {"__all__": left_out}} if left_out else None
        # Chunks carry "usage" only with include_usage (null but on the usage chunk, as OpenAI)
        self._chunk_exclude = (
            self._exclude if body.include_usage else {**(self._exclude or {}), "usage": True}
        )
        self._num_logprobs = body.logprobs
        self._prompt_logprobs = body.prompt_logprobs
        self._return_token_ids = body.return_token_ids
        self._continuous_usage = body.continuous_usage
        self._templates: dict[int, ChunkTemplate] = {}  # choice index -> its text-chunk template
        self._tokenizer = tokenizer
        # Logprobs' token names: their text, or "token_id:<id>" (TokenTexts without tokenizer)
        self.logprob_tokenizer = None if body.return_tokens_as_token_ids else tokenizer
        self._prompts = prompts
        self._sent_prompt_ids: set[int] = set()  # choices whose chunk carried prompt_token_ids

    def _echo(self, index: int) -> str:
        return self.echo[index // self.n] if self.echo else ""

    def _prompt_ids(self, index: int) -> list[int] | None:
        """return_token_ids: the choice's prompt ids, once per stream (the first chunk)."""
        if not self._return_token_ids or index in self._sent_prompt_ids:
            return None
        self._sent_prompt_ids.add(index)
        return self._prompts[index // self.n].token_ids

    def _chunk(self, choices: list[CompletionChoice], usage: Usage | None = None) -> str:
        return CompletionResponse(
            id=self.request_id, created=self.created, model=self.model, choices=choices,
            usage=usage,
        ).model_dump_json(exclude=self._chunk_exclude)  # fmt: skip

    def _template(self, index: int) -> ChunkTemplate:
        template = self._templates.get(index)
        if template is None:
            ids = IDS_MARKER if self._return_token_ids else None
            choice = CompletionChoice(index=index, text=TEXT_MARKER, token_ids=ids)
            chunk = CompletionResponse(
                id=self.request_id, created=self.created, model=self.model, choices=[choice]
            )
            template = ChunkTemplate(chunk, self._chunk_exclude, has_ids=self._return_token_ids)
            self._templates[index] = template
        return template

    def _usage(self, acc: Accumulator, choice: ChoiceState) -> Usage | None:
        """stream_options.continuous_usage_stats: the usage so far on every chunk (vLLM's:
        the choice's prompt and the choice's own completion tokens)."""
        if not self._continuous_usage:
            return None
        num_prompt = acc.prompts[choice.index // self.n].num_prompt_tokens
        return make_usage(num_prompt, len(choice.token_ids), 0)

    def _echo_logprobs(self, acc: Accumulator, index: int) -> CompletionLogprobs | None:
        """echo with logprobs: the prompt's tokens, each with its top-``logprobs``."""
        if not self.echo or not self.has_logprobs:
            return None
        prompt_index = index // self.n
        positions = [
            None if p is None else _top_k(p, self._num_logprobs, target)
            for p, target in zip(
                acc.prompts[prompt_index].prompt_logprobs,
                self._prompts[prompt_index].token_ids,
                strict=False,
            )
        ]
        return echo_logprobs(
            self.logprob_tokenizer, self._prompts[prompt_index].token_ids, positions
        )

    def start_chunks(self, acc: Accumulator) -> list[str]:
        if not self.echo:
            return []
        return [
            self._chunk(
                [
                    CompletionChoice(
                        index=c.index,
                        text=self._echo(c.index),
                        logprobs=self._echo_logprobs(acc, c.index),
                        prompt_token_ids=self._prompt_ids(c.index),
                    )
                ],
                self._usage(acc, c),
            )
            for c in acc.choices
        ]

    def delta_chunks(self, deltas: list[ChoiceDelta], acc: Accumulator) -> list[str]:
        chunks = []
        for d in deltas:
            out = d.output
            index = d.choice.index
            if (
                out.finish_reason is None
                and not (self.has_logprobs and out.logprobs)
                and not self._continuous_usage
                and (not self._return_token_ids or index in self._sent_prompt_ids)
            ):
                chunks.append(self._template(index).render(out.text, out.token_ids))
                continue
            logprobs = None
            if self.has_logprobs and out.logprobs is not None:
                offset = len(self._echo(index)) + d.text_offset
                logprobs = completion_logprobs(d.choice.texts, out.token_ids, out.logprobs, offset)
            choice = CompletionChoice(
                index=index,
                text=out.text,
                logprobs=logprobs,
                finish_reason=out.finish_reason,
                stop_reason=out.stop_reason,
                token_ids=out.token_ids,
                prompt_token_ids=self._prompt_ids(index),
            )
            chunks.append(self._chunk([choice], self._usage(acc, d.choice)))
        return chunks

    def abort_chunks(self, choices: list[ChoiceState]) -> list[str]:
        return [
            self._chunk([CompletionChoice(index=c.index, text="", finish_reason="abort")])
            for c in choices
        ]

    def usage_chunk(self, usage: Usage) -> str:
        return CompletionResponse(
            id=self.request_id, created=self.created, model=self.model, choices=[], usage=usage
        ).model_dump_json()

    def response_json(self, acc: Accumulator) -> str:
        choices = []
        for c in acc.choices:
            logprobs = None
            prompt = self._prompts[c.index // self.n]
            if self.has_logprobs:
                texts = TokenTexts(self.logprob_tokenizer, prompt.token_ids)
                logprobs = completion_logprobs(
                    texts, c.token_ids, c.positions, len(self._echo(c.index))
                )
                echoed = self._echo_logprobs(acc, c.index)
                if echoed is not None:
                    logprobs = _joined(echoed, logprobs)
            prompt_logprobs = None
            if self._prompt_logprobs is not None:
                prompt_logprobs = vllm_prompt_logprobs(
                    self._tokenizer,
                    prompt.token_ids,
                    acc.prompts[c.index // self.n].prompt_logprobs,
                    self._prompt_logprobs,
                )
            choices.append(
                CompletionChoice(
                    index=c.index,
                    text=self._echo(c.index) + c.text,
                    logprobs=logprobs,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                    token_ids=c.token_ids,
                    prompt_token_ids=prompt.token_ids if self._return_token_ids else None,
                    prompt_logprobs=prompt_logprobs,
                )
            )
        response = CompletionResponse(
            id=self.request_id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=acc.usage(),
        )
        return response.model_dump_json(exclude=self._exclude)


def _top_k(position: TokenLogprobs, k: int, target: int) -> TokenLogprobs:
    """A prompt position's entry cut to its k most likely tokens and the prompt token."""
    ranked = sorted(position, key=lambda t: -position[t])[:k]
    return {t: position[t] for t in {*ranked, target} if t in position}


def _joined(first: CompletionLogprobs, second: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(
        text_offset=first.text_offset + second.text_offset,
        token_logprobs=first.token_logprobs + second.token_logprobs,
        tokens=first.tokens + second.tokens,
        top_logprobs=first.top_logprobs + second.top_logprobs,
    )
