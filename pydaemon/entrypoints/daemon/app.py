"""The daemon: a grpc.aio server around an EngineClient, with health, reflection, auth, TLS,
metrics, sd_notify, and a graceful drain.

Life cycle: ``start(client_factory)`` listens at once (health NOT_SERVING, Generate answers
UNAVAILABLE), builds the engine client off the loop (``pagedd serve``: starts the engine-core
process, which loads and warms the model), then serves (health SERVING,
``READY=1``). ``drain()`` stops admitting (health NOT_SERVING, ``STOPPING=1``), lets live
requests finish within the grace period, aborts the rest, and stops the server.
"""

from __future__ import annotations

import asyncio
import logging
import re
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from pydaemon import heap_freeze
from pydaemon.engine.engine_client import EngineClient
from pydaemon.entrypoints.common.lora_adapters import LoRAAdapters, LoRAOptions
from pydaemon.entrypoints.common.metrics import Metrics
from pydaemon.entrypoints.common.reasoning_parsers import (
    check_reasoning_parser,
    get_reasoning_parser,
)
from pydaemon.entrypoints.common.tool_parsers import get_tool_parser
from pydaemon.entrypoints.daemon.fd_limits import (
    connection_budget,
    quiet_accept_errors,
    raise_fd_limit,
)
from pydaemon.entrypoints.daemon.flag_names import with_flag_names
from pydaemon.entrypoints.daemon.heap_trim import HeapTrimmer
from pydaemon.entrypoints.daemon.liveness import Liveness
from pydaemon.entrypoints.daemon.metrics_http import MetricsServer
from pydaemon.entrypoints.daemon.model_overrides import apply_model_overrides
from pydaemon.entrypoints.daemon.sd_notify import SdNotifier, watchdog_interval_s
from pydaemon.entrypoints.grpc.auth import ApiKeyInterceptor
from pydaemon.entrypoints.grpc.errors import ExceptionInterceptor
from pydaemon.entrypoints.grpc.health import Health
from pydaemon.entrypoints.grpc.reflection import enable_server_reflection
from pydaemon.entrypoints.grpc.servicer import GenerationServicer, ServingOptions
from pydaemon.entrypoints.openai import HttpOptions, HttpServer, ServedModel
from pydaemon.proto.pagedd.v1 import generation_pb2 as pb
from pydaemon.proto.pagedd.v1 import generation_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)


@dataclass
class ServerOptions:
    host: str = "127.0.0.1"
    port: int = 50051  # 0: any free port (see PageddServer.port)
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None  # None: no metrics endpoint; 0: any free port
    http_host: str = "127.0.0.1"
    http_port: int | None = None  # None: no OpenAI HTTP API; 0: any free port
    api_key: str | None = None
    metrics_auth: bool = True  # with api_key: /metrics requires it too
    tls_cert: str | None = None  # PEM file paths; both or neither
    tls_key: str | None = None
    max_message_bytes: int = 16 * 1024 * 1024
    keepalive_time_s: float = 30.0
    keepalive_timeout_s: float = 10.0
    grace_period_s: float = 30.0
    idle_timeout_s: float = 15.0  # HTTP: idle or half-sent connections are closed after this
    # An engine core without a step or heartbeat this long is reported NOT_SERVING / 503.
    engine_stall_timeout_s: float = 30.0
    heap_trim_interval_s: float = 10.0  # freed heap given back to the OS this often
    # gRPC: a connection that has not finished its HTTP/2 handshake (the client preface and
    # settings) this long is closed; and at most this many connections are held at once
    # (None: half the process's file descriptors, at most 4096), so that idle sockets cannot
    # use up the descriptors every port needs.
    handshake_timeout_s: float = 5.0
    max_grpc_connections: int | None = None
    serving: ServingOptions = field(default_factory=ServingOptions)
    lora: LoRAOptions = field(default_factory=LoRAOptions)
    # --served-model-name: the names clients use (the first is the one answers carry)
    served_model_names: list[str] = field(default_factory=list)
    chat_template: str | None = None  # --chat-template, read and checked: instead of the model's
    root_path: str | None = None  # --root-path: the HTTP routes are also served under it
    enable_tokenizer_info_endpoint: bool = False  # vLLM's flag: serve GET /tokenizer_info

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key must be given together")
        if self.serving.tool_call_parser is not None:
            get_tool_parser(self.serving.tool_call_parser)  # ValueError naming the known ones
        if self.serving.reasoning_parser is not None:
            get_reasoning_parser(self.serving.reasoning_parser)
        if self.grace_period_s < 0:
            raise ValueError(f"grace_period_s must be >= 0 (got {self.grace_period_s})")
        if self.root_path is not None and (
            not re.fullmatch(r"(/[A-Za-z0-9._~-]+)+", self.root_path)
            or {".", ".."} & set(self.root_path.split("/"))
        ):
            raise ValueError(
                f"--root-path must be a path such as /llm (no trailing slash), not "
                f"{self.root_path!r}"
            )


class PageddServer:
    def __init__(self, options: ServerOptions, notifier: SdNotifier | None = None) -> None:
        self.options = options
        self.notifier = notifier or SdNotifier()
        self.health = Health()
        self.liveness = Liveness(
            self.health, options.engine_stall_timeout_s, on_stall=self._fail_waiting_requests
        )
        self.heap_trimmer = HeapTrimmer(options.heap_trim_interval_s)
        self.async_engine: EngineClient | None = None  # the engine client, once started
        self.metrics = Metrics(self._stats)
        self.servicer = GenerationServicer(options.serving, self.metrics)
        self.servicer.is_stalled = self.liveness.is_stalled
        self.metrics_server: MetricsServer | None = None
        self.http: HttpServer | None = None  # the OpenAI API, when http_port is set
        self.port: int | None = None
        self._server: grpc.aio.Server | None = None
        self._watchdog_task: asyncio.Task | None = None
        self._is_loading = False
        self.is_drained = asyncio.Event()

    def _stats(self) -> Any:
        return self.async_engine.latest_stats

    # ---- start-up ----------------------------------------------------------------------

    async def listen(self) -> int:
        o = self.options
        interceptors: list[grpc.aio.ServerInterceptor] = []
        if o.api_key:
            interceptors.append(ApiKeyInterceptor(o.api_key))
        interceptors.append(ExceptionInterceptor())
        server = grpc.aio.server(
            interceptors=interceptors,
            options=[
                ("grpc.max_send_message_length", o.max_message_bytes),
                ("grpc.max_receive_message_length", o.max_message_bytes),
                ("grpc.keepalive_time_ms", int(o.keepalive_time_s * 1e3)),
                ("grpc.keepalive_timeout_ms", int(o.keepalive_timeout_s * 1e3)),
                ("grpc.keepalive_permit_without_calls", 1),
                ("grpc.http2.min_ping_interval_without_data_ms", 5000),
                ("grpc.so_reuseport", 0),  # a second daemon on the same port must fail
                ("grpc.server_handshake_timeout_ms", int(o.handshake_timeout_s * 1e3)),
                (
                    "grpc.max_allowed_incoming_connections",
                    o.max_grpc_connections or connection_budget(),
                ),
            ],
        )
        pb_grpc.add_GenerationServicer_to_server(self.servicer, server)
        from grpc_health.v1 import health_pb2_grpc

        health_pb2_grpc.add_HealthServicer_to_server(self.health.servicer, server)
        await self.health.set_starting()
        enable_server_reflection(
            (pb.DESCRIPTOR.services_by_name["Generation"].full_name, "grpc.health.v1.Health"),
            server,
        )
        address = f"{o.host}:{o.port}"
        try:  # grpc raises RuntimeError("Failed to bind") where older versions returned 0
            if o.tls_cert:
                with open(o.tls_key, "rb") as f_key, open(o.tls_cert, "rb") as f_cert:
                    credentials = grpc.ssl_server_credentials([(f_key.read(), f_cert.read())])
                self.port = server.add_secure_port(address, credentials)
            else:
                self.port = server.add_insecure_port(address)
        except RuntimeError:
            self.port = 0
        if self.port == 0:
            raise OSError(
                f"cannot listen on {address}: the port is in use (another daemon?) or the "
                "address is not one of this machine's"
            )
        await server.start()
        self._server = server
        self._watchdog_task = asyncio.create_task(self._watchdog())
        return self.port

    async def start(self, client_factory: Callable[[], EngineClient]) -> None:
        """Listens, then builds the engine client off the loop (it loads and warms the model),
        then serves."""
        if self._server is None:
            await self.listen()
        loop = asyncio.get_running_loop()
        started = time.monotonic()
        self._is_loading = True
        self.notifier.status("loading the model")
        try:
            client = await loop.run_in_executor(None, client_factory)
        finally:
            self._is_loading = False
        client.start()
        o = self.options
        apply_model_overrides(client, o.served_model_names, o.chat_template)
        self.async_engine = client
        check_reasoning_parser(o.serving.reasoning_parser, client.tokenizer)
        self.metrics.set_baseline(client.latest_stats)  # the warm-up is not a served request
        self.metrics.model_name = client.model_info.model_name
        self.metrics.cache_config = client.model_info.cache_config
        self.servicer.engine = client
        self.servicer.adapters = await LoRAAdapters.start(
            client.model_info.model_name, client, o.lora
        )
        if o.metrics_port is not None:
            self.metrics_server = MetricsServer(
                self.metrics.render,
                o.metrics_host,
                o.metrics_port,
                api_key=o.api_key if o.metrics_auth else None,
                max_connections=connection_budget(share=0.125, most=1024),
                tls=(o.tls_cert, o.tls_key) if o.tls_cert else None,
            )
            await self.metrics_server.start()
        if o.http_port is not None:
            info = client.model_info
            model = ServedModel(
                info.model_name,
                info.max_model_len,
                info.vocab_size,
                info.generation_defaults,
                aliases=tuple(o.served_model_names[1:]),
                max_logprobs=info.max_logprobs,
            )
            await self._start_http(model, client.tokenizer)
        self.servicer.is_admitting = True
        await self.health.set_serving()
        self.liveness.start(client)
        self.heap_trimmer.start()
        stats = self.async_engine.latest_stats
        where = f"{o.host}:{self.port}" + (" (TLS)" if o.tls_cert else "")
        metrics_where = (
            f"; metrics on http://{o.metrics_host}:{self.metrics_server.port}/metrics"
            if self.metrics_server
            else ""
        )
        if self.http is not None:
            metrics_where += (
                f"; OpenAI API on {self.http.scheme}://{o.http_host}:{self.http.port}/v1"
            )
        logger.info(
            "ready in %.1f s: serving model %s (max_model_len %d, %d KV blocks of %d tokens, "
            "%d CPU swap blocks) on %s%s",
            time.monotonic() - started,
            client.model_info.model_name,
            client.model_info.max_model_len,
            stats.num_gpu_blocks,
            client.model_info.block_size,
            stats.num_cpu_blocks,
            where,
            metrics_where,
        )
        # The front process's heap (grpc, the tokenizer, the HTTP app) out of full garbage
        # collections while it streams tokens (pydaemon/heap_freeze.py); thawed by drain().
        heap_freeze.freeze_startup_heap()
        self.notifier.ready(f"serving {client.model_info.model_name} on {where}")

    async def _start_http(self, model: ServedModel, tokenizer: Any) -> None:
        o = self.options
        options = HttpOptions(
            host=o.http_host,
            port=o.http_port,
            api_key=o.api_key,
            metrics_auth=o.metrics_auth,
            tls_cert=o.tls_cert,
            tls_key=o.tls_key,
            max_queued_requests=o.serving.max_queued_requests,
            stall_timeout_s=o.serving.stall_timeout_s,
            idle_timeout_s=o.idle_timeout_s,
            parse_special_tokens_in_chat=o.serving.parse_special_tokens_in_chat,
            max_body_bytes=o.max_message_bytes,
            tool_call_parser=o.serving.tool_call_parser,
            reasoning_parser=o.serving.reasoning_parser,
            root_path=o.root_path,
            return_tokens_as_token_ids=o.serving.return_tokens_as_token_ids,
            enable_tokenizer_info_endpoint=o.enable_tokenizer_info_endpoint,
        )
        async_engine = self.async_engine
        self.http = HttpServer(
            async_engine,
            tokenizer,
            model,
            options,
            self.metrics,
            num_queued=lambda: async_engine.num_unscheduled,
            is_stalled=self.liveness.is_stalled,
            adapters=self.servicer.adapters,
        )
        await self.http.start()

    def _fail_waiting_requests(self) -> None:
        """The engine core stalled: requests still waiting for their first output fail now
        (UNAVAILABLE / 503; nothing was sent, so a client may retry on another replica) rather
        than at their clients' deadlines. Streams that have begun wait for the core."""
        num_failed = self.servicer.fail_waiting()
        if self.http is not None:
            num_failed += self.http.fail_waiting()
        if num_failed:
            logger.warning("failed %d requests waiting for the stalled engine core", num_failed)

    @property
    def num_live_requests(self) -> int:
        """Requests in flight through gRPC and HTTP."""
        num_http = self.http.num_live_requests if self.http is not None else 0
        return self.servicer.num_live_requests + num_http

    # ---- watchdog ----------------------------------------------------------------------

    async def _watchdog(self) -> None:
        interval = watchdog_interval_s()
        if interval is None or not self.notifier.enabled:
            return
        while True:
            if self.is_making_progress(2 * interval):
                self.notifier.watchdog()
            await asyncio.sleep(interval)

    def is_making_progress(self, within_s: float) -> bool:
        """Loading, or the engine alive and through a step/idle heartbeat recently."""
        if self.async_engine is None:
            return self._is_loading
        return self.async_engine.is_alive and self.async_engine.seconds_since_progress() < within_s

    # ---- drain -------------------------------------------------------------------------

    async def drain(self) -> None:
        """Stops admitting, lets live requests finish within the grace period, aborts the rest."""
        if self.is_drained.is_set():
            return
        grace = self.options.grace_period_s
        self.servicer.is_admitting = False
        if self.http is not None:
            self.http.stop_admitting()
        self.liveness.stop()
        self.heap_trimmer.stop()
        await self.health.set_not_serving()
        num_live = self.num_live_requests
        if self.async_engine is not None:  # (nothing to drain when start-up failed)
            logger.info("draining: %d live requests, grace period %.1f s", num_live, grace)
        self.notifier.stopping(f"draining {num_live} requests")
        deadline = time.monotonic() + grace
        while self.num_live_requests and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.num_live_requests:
            logger.warning("grace period over: aborting %d requests", self.num_live_requests)
            self.servicer.abort_all()
            if self.http is not None:
                self.http.abort_all()
            await asyncio.sleep(0.1)  # lets the writers send the Finished(ABORTED) frames
        if self._server is not None:
            await self._server.stop(grace=1.0)
        if self.http is not None:
            await self.http.stop()
        if self._watchdog_task is not None:
            self._watchdog_task.cancel()
        if self.async_engine is not None:
            await self.async_engine.shutdown()
        self.servicer.adapters.close()
        if self.metrics_server is not None:
            await self.metrics_server.stop()
        if self.async_engine is not None:
            logger.info("drained; exiting")
        heap_freeze.thaw()
        self.is_drained.set()


async def serve(client_factory: Callable[[], EngineClient], options: ServerOptions) -> int:
    """Runs the daemon until SIGTERM or SIGINT, then drains; returns the exit code."""
    server = PageddServer(options)
    loop = asyncio.get_running_loop()
    raise_fd_limit()
    quiet_accept_errors(loop)
    stop = asyncio.Event()
    # SIGHUP (the terminal closed, or a reload by habit) drains too rather than killing.
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        loop.add_signal_handler(sig, stop.set)
    start = asyncio.create_task(server.start(client_factory))
    stopped = asyncio.create_task(stop.wait())
    await asyncio.wait({start, stopped}, return_when=asyncio.FIRST_COMPLETED)
    if start.done() and start.exception() is not None:
        error = start.exception()
        # A bad setting (ValueError) or a port in use, a missing file (OSError) is the
        # operator's to fix: its message is enough. Otherwise the traceback of the error itself
        # (exc_info=True would log "NoneType: None" here).
        is_operators = isinstance(error, (ValueError, OSError))
        message = with_flag_names(str(error)) if is_operators else str(error)
        logger.error("start-up failed: %s", message, exc_info=None if is_operators else error)
        server.notifier.status(f"start-up failed: {message}")
        await server.drain()
        return 1
    died = asyncio.create_task(_engine_death(server))
    await asyncio.wait({stopped, died}, return_when=asyncio.FIRST_COMPLETED)
    if not start.done():
        start.cancel()
    if died.done():
        # A dead engine (e.g. a tensor-parallel worker gone) cannot serve again: exit non-zero
        # so that systemd's Restart=on-failure brings up a fresh daemon.
        logger.error("the engine failed: %r; draining and exiting", server.async_engine.error)
        server.notifier.status(f"engine failed: {server.async_engine.error!r}")
        await server.drain()
        return 1
    died.cancel()
    await server.drain()
    return 0


async def _engine_death(server: PageddServer, poll_s: float = 0.5) -> None:
    """Returns once the started engine's thread has died."""
    while server.async_engine is None or server.async_engine.is_alive:
        await asyncio.sleep(poll_s)
