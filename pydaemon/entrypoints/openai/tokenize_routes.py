"""vLLM's ``POST /tokenize``, ``POST /detokenize``, ``GET /version`` and, with
``--enable-tokenizer-info-endpoint``, ``GET /tokenizer_info`` (tokenizer_info.py).

``/tokenize`` takes a text (``{"prompt", "add_special_tokens": true}``) or a conversation
(``{"messages", "add_generation_prompt", "continue_final_message", "tools",
"chat_template_kwargs"}``, rendered by the chat template as a chat completion would be) and
answers ``{"count", "max_model_len", "tokens", "token_strs"}`` (``token_strs`` with
``"return_token_strs": true``: each token's vocabulary entry). ``/detokenize`` takes
``{"tokens"}`` and answers ``{"prompt"}``. Both name the model as chat completions do
(optional: the base model, an alias or an adapter, which shares the base model's tokenizer) and
sit behind the API key; ``/version`` answers ``{"version"}`` to anyone, as ``/health`` does.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web
from pydantic import Field

from pydaemon import __version__
from pydaemon.entrypoints.common.limits import check_text_size, out_of_vocabulary
from pydaemon.entrypoints.common.tool_choice import messages_for_template
from pydaemon.entrypoints.openai.errors import ApiError, bad_request
from pydaemon.entrypoints.openai.protocol import Body, ChatMessage
from pydaemon.entrypoints.openai.serving import OpenAIServing
from pydaemon.entrypoints.openai.tokenizer_info import tokenizer_info

MAX_DETOKENIZE_IDS = 1 << 20


def with_special_tokens(tokenizer, ids: list[int]) -> list[int]:
    """A rendered chat's ids with what the tokenizer itself adds (vLLM encodes the rendered
    chat with add_special_tokens): BOS only where its encoding adds one (SmolLM2's adds none:
    its BOS, <|im_start|>, was written twice)."""
    bos = tokenizer.bos_token_id
    if bos is not None and bos in tokenizer.encode("", True):
        return [bos, *ids]
    return ids


class TokenizeTextRequest(Body):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(Body):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # the template writes its own
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(Body):
    model: str | None = None
    tokens: list[int] = Field(max_length=MAX_DETOKENIZE_IDS)


def add_tokenize_routes(app: web.Application, serving: OpenAIServing) -> None:
    def tokenizer_for(model: str | None):
        if model is not None:
            serving.resolve_model(model)  # 404 for an unknown name
        if serving.tokenizer is None:
            raise bad_request("this model has no tokenizer")
        return serving.tokenizer

    async def tokenize(request: web.Request) -> web.Response:
        raw = await serving.read_body(request)
        try:
            parsed = json.loads(raw)
        except ValueError:
            parsed = None  # the model's validation says what is wrong
        is_chat = isinstance(parsed, dict) and "messages" in parsed
        if is_chat:
            body = TokenizeChatRequest.model_validate_json(raw)
            tokenizer = tokenizer_for(body.model)
            if body.continue_final_message and body.add_generation_prompt:
                raise bad_request(
                    "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                    "continue_final_message",
                )
            ids = await serving.encode_chat(
                messages_for_template([m.for_template() for m in body.messages]),
                body.tools,
                body.add_generation_prompt,
                body.chat_template_kwargs,
                body.continue_final_message,
            )
            if body.add_special_tokens:
                ids = with_special_tokens(tokenizer, ids)
        else:
            body = TokenizeTextRequest.model_validate_json(raw)
            tokenizer = tokenizer_for(body.model)
            check_text_size(body.prompt, serving.model.max_model_len, "prompt")
            loop = asyncio.get_running_loop()
            ids = await loop.run_in_executor(
                None, tokenizer.encode, body.prompt, body.add_special_tokens
            )
        answer = {
            "count": len(ids),
            "max_model_len": serving.model.max_model_len,
            "tokens": ids,
            "token_strs": [tokenizer.id_to_piece(t) for t in ids]
            if body.return_token_strs
            else None,
        }
        return web.json_response(answer)

    async def detokenize(request: web.Request) -> web.Response:
        body = DetokenizeRequest.model_validate_json(await serving.read_body(request))
        tokenizer = tokenizer_for(body.model)
        vocab_size = serving.model.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab_size]
        if bad:
            raise bad_request(out_of_vocabulary(bad, vocab_size, "tokens"), "tokens")
        loop = asyncio.get_running_loop()
        return web.json_response(
            {"prompt": await loop.run_in_executor(None, tokenizer.decode, body.tokens)}
        )

    async def version(request: web.Request) -> web.Response:
        return web.json_response({"version": __version__})

    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/version", version)
    if serving.options.enable_tokenizer_info_endpoint:

        async def get_tokenizer_info(request: web.Request) -> web.Response:
            if serving.tokenizer is None:
                raise ApiError(404, "this model has no tokenizer", code="no_tokenizer")
            info = tokenizer_info(serving.tokenizer, serving.model.max_model_len)
            return web.json_response(info)

        app.router.add_get("/tokenizer_info", get_tokenizer_info)
