"""Turns unexpected exceptions of any handler into INTERNAL, with a log line."""

from __future__ import annotations

import asyncio
import inspect
import logging

import grpc

logger = logging.getLogger(__name__)


def _wrap_coroutine(behavior, method: str):
    async def wrapper(request_or_iterator, context):
        try:
            return await behavior(request_or_iterator, context)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as e:
            logger.exception("unexpected error in %s", method)
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {e!r}")

    return wrapper


def _wrap_generator(behavior, method: str):
    async def wrapper(request_or_iterator, context):
        try:
            async for response in behavior(request_or_iterator, context):
                yield response
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as e:
            logger.exception("unexpected error in %s", method)
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {e!r}")

    return wrapper


_KINDS = {
    "unary_unary": grpc.unary_unary_rpc_method_handler,
    "unary_stream": grpc.unary_stream_rpc_method_handler,
    "stream_unary": grpc.stream_unary_rpc_method_handler,
    "stream_stream": grpc.stream_stream_rpc_method_handler,
}


class ExceptionInterceptor(grpc.aio.ServerInterceptor):
    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        for kind, make in _KINDS.items():
            behavior = getattr(handler, kind)
            if behavior is None:
                continue
            wrap = _wrap_generator if inspect.isasyncgenfunction(behavior) else _wrap_coroutine
            return make(
                wrap(behavior, handler_call_details.method),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler
