"""Turns unexpected exceptions of any handler into INTERNAL, with a log line, and a unary
request message that does not decode into INVALID_ARGUMENT (grpc would answer UNKNOWN).

A call whose client left (cancelled, or past its deadline) before the handler answered is not
an error: grpc raises ``ExecuteBatchError`` when the answer (or an abort) is sent on a call
that is already over, which happens whenever the event loop was busy when the client gave up
(``GetServerStatus`` polled with a short deadline while the model loads). It is logged at
DEBUG and nothing more is sent.
"""

from __future__ import annotations

import asyncio
import inspect
import logging

import grpc
from google.protobuf.message import DecodeError
from grpc._cython.cygrpc import ExecuteBatchError  # grpc exports no public name for it

logger = logging.getLogger(__name__)


class _Undecodable:
    """Stands for a unary request whose bytes did not decode; the handler is not called."""

    def __init__(self, error: DecodeError) -> None:
        self.error = error


def _tolerant(deserializer):
    def deserialize(data: bytes):
        try:
            return deserializer(data)
        except DecodeError as e:
            return _Undecodable(e)

    return deserialize


async def _refuse_undecodable(request, context) -> None:
    if isinstance(request, _Undecodable):
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"the request message could not be decoded: {request.error}",
        )


def _client_gone(method: str) -> asyncio.CancelledError:
    """What a handler ends with when its call was over before it could answer: the RPC was
    cancelled (grpc logs that at DEBUG too), and nothing more is sent."""
    logger.debug("%s: the client left before the answer was sent", method)
    return asyncio.CancelledError()


def _wrap_coroutine(behavior, method: str):
    async def wrapper(request_or_iterator, context):
        await _refuse_undecodable(request_or_iterator, context)
        try:
            return await behavior(request_or_iterator, context)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except ExecuteBatchError:
            raise _client_gone(method) from None
        except Exception as e:
            logger.exception("unexpected error in %s", method)
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {e!r}")

    return wrapper


def _wrap_generator(behavior, method: str):
    async def wrapper(request_or_iterator, context):
        await _refuse_undecodable(request_or_iterator, context)
        try:
            async for response in behavior(request_or_iterator, context):
                yield response
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except ExecuteBatchError:
            raise _client_gone(method) from None
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
            deserializer = handler.request_deserializer
            if kind.startswith("unary_") and deserializer is not None:
                deserializer = _tolerant(deserializer)
            return make(
                wrap(behavior, handler_call_details.method),
                request_deserializer=deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler
