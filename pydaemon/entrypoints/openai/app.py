"""The aiohttp application and its server: routes, middlewares, start and stop.

Routes: ``GET /v1/models``, ``GET /v1/models/{model}``, ``POST /v1/completions``,
``POST /v1/chat/completions``, vLLM's ``POST /v1/chat/completions/batch`` (chat_batch.py),
``GET /health`` (200 serving, 503 otherwise) and
``GET /metrics`` (Prometheus, the same registry as the gRPC side's), vLLM's ``POST /tokenize``,
``POST /detokenize`` and ``GET /version`` (tokenize_routes.py); with LoRA, vLLM's
``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter`` (pydaemon/entrypoints/
openai/lora_routes.py). Adapters are listed as models whose ``parent`` is the base model.
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Callable
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from pydaemon.entrypoints.common.lora_adapters import AdapterNotFound, LoRAAdapters
from pydaemon.entrypoints.common.metrics import Metrics
from pydaemon.entrypoints.openai.auth import api_key_middleware
from pydaemon.entrypoints.openai.chat import create_chat_completion
from pydaemon.entrypoints.openai.chat_batch import create_batch_chat_completion
from pydaemon.entrypoints.openai.completions import create_completion
from pydaemon.entrypoints.openai.engine_stream import GenerateClient
from pydaemon.entrypoints.openai.errors import ApiError, error_middleware, error_response
from pydaemon.entrypoints.openai.lora_routes import add_lora_routes
from pydaemon.entrypoints.openai.responses import ModelCard, ModelList
from pydaemon.entrypoints.openai.serving import HttpOptions, OpenAIServing, ServedModel
from pydaemon.entrypoints.openai.tokenize_routes import add_tokenize_routes

logger = logging.getLogger(__name__)
# aiohttp's connection-level log: a malformed request would log an ERROR traceback each time.
_server_logger = logging.getLogger(__name__ + ".connections")


class _QuietMalformedRequests(logging.Filter):
    """A request that does not parse is the client's problem: one debug line, no traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, HttpProcessingError):
            _server_logger.debug("malformed HTTP request: %s", error)
            return False
        return True


_server_logger.addFilter(_QuietMalformedRequests())


def build_app(serving: OpenAIServing) -> web.Application:
    """The routes; with ``root_path`` (vLLM's --root-path: the prefix a proxy serves them
    under) each is also served under it, so both /v1/models and /llm/v1/models answer."""
    options = serving.options
    middlewares = [error_middleware]
    if options.api_key:
        middlewares.insert(
            0, api_key_middleware(options.api_key, options.metrics_auth, options.root_path)
        )
    app = web.Application(middlewares=middlewares, client_max_size=options.max_body_bytes)
    _add_routes(app, serving)
    if options.root_path:
        prefixed = web.Application(client_max_size=options.max_body_bytes)
        _add_routes(prefixed, serving)
        app.add_subapp(options.root_path, prefixed)
    return app


def _add_routes(app: web.Application, serving: OpenAIServing) -> None:

    def card(name: str | None = None) -> ModelCard:
        """The base model's card (under one of its names), or adapter ``name``'s (its parent
        the base model)."""
        m = serving.model
        if name is not None and not m.is_named(name):
            served = serving.adapters.get(name)  # AdapterNotFound -> 404
            return ModelCard(
                id=name,
                created=m.created,
                root=served.lora_path,
                parent=m.name,
                max_model_len=m.max_model_len,
                vocab_size=m.vocab_size,
            )
        return ModelCard(
            id=name or m.name,
            created=m.created,
            root=m.name,
            max_model_len=m.max_model_len,
            vocab_size=m.vocab_size,
        )

    def as_json(model) -> web.Response:
        return web.Response(text=model.model_dump_json(), content_type="application/json")

    async def list_models(request: web.Request) -> web.Response:
        aliases = [card(name) for name in serving.model.aliases]
        adapters = [card(a.lora_name) for a in serving.adapters.list()]
        return as_json(ModelList(data=[card(), *aliases, *adapters]))

    async def get_model(request: web.Request) -> web.Response:
        name = request.match_info["model"]
        try:
            return as_json(card(name))
        except AdapterNotFound:
            raise ApiError(
                404, f"model {name!r} does not exist", param="model", code="model_not_found"
            ) from None

    async def completions(request: web.Request) -> web.StreamResponse:
        return await create_completion(serving, request)

    async def chat_completions(request: web.Request) -> web.StreamResponse:
        return await create_chat_completion(serving, request)

    async def chat_completions_batch(request: web.Request) -> web.StreamResponse:
        return await create_batch_chat_completion(serving, request)

    async def health(request: web.Request) -> web.Response:
        if not serving.is_serving:
            return error_response(503, "not serving (draining or failed)", code="not_serving")
        if serving.is_stalled():
            return error_response(
                503, "the engine core has stopped making progress", code="engine_stalled"
            )
        return web.Response(text="")

    async def metrics(request: web.Request) -> web.Response:
        if serving.metrics is None:
            raise ApiError(404, "metrics are not collected by this server")
        return web.Response(
            text=serving.metrics.render(),
            content_type="text/plain",
            charset="utf-8",
            headers={"X-Content-Type-Options": "nosniff"},
        )

    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model}", get_model)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/chat/completions/batch", chat_completions_batch)
    add_lora_routes(app, serving)
    add_tokenize_routes(app, serving)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)


class HttpServer:
    """The OpenAI-compatible API on its own port, on the caller's event loop (the gRPC
    server's), over the same engine client."""

    def __init__(
        self,
        engine: GenerateClient,
        tokenizer: Any,
        model: ServedModel,
        options: HttpOptions,
        metrics: Metrics | None = None,
        num_queued: Callable[[], int] | None = None,
        is_stalled: Callable[[], bool] | None = None,
        adapters: LoRAAdapters | None = None,
    ) -> None:
        self.options = options
        self.serving = OpenAIServing(
            engine, tokenizer, model, options, metrics, num_queued, is_stalled, adapters
        )
        self.port: int | None = None
        self._runner: web.AppRunner | None = None

    @property
    def num_live_requests(self) -> int:
        return len(self.serving.live)

    def stop_admitting(self) -> None:
        self.serving.is_admitting = False

    def abort_all(self) -> None:
        self.serving.abort_all()

    def fail_waiting(self) -> int:
        return self.serving.fail_waiting()

    async def start(self) -> int:
        """Listens; returns the port (useful with port 0)."""
        # handler_cancellation: a client that disconnects cancels its handler, and so aborts
        # its engine request at once instead of at the next failed write.
        runner = web.AppRunner(
            build_app(self.serving),
            handler_cancellation=True,
            access_log=None,
            shutdown_timeout=1.0,
            # Closes a connection idle (or still sending its request head) this long.
            keepalive_timeout=self.options.idle_timeout_s,
            logger=_server_logger,
        )
        await runner.setup()
        site = web.TCPSite(
            runner,
            self.options.host,
            self.options.port,
            reuse_port=False,
            ssl_context=self._ssl_context(),
        )
        try:
            await site.start()
        except OSError:
            await runner.cleanup()
            raise
        self._runner = runner
        self.port = runner.addresses[0][1]
        return self.port

    def _ssl_context(self) -> ssl.SSLContext | None:
        if not self.options.tls_cert:
            return None
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self.options.tls_cert, self.options.tls_key)
        return context

    @property
    def scheme(self) -> str:
        return "https" if self.options.tls_cert else "http"

    async def stop(self) -> None:
        """Closes the listener and every connection (after the drain ended the requests)."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        self.serving.close()
