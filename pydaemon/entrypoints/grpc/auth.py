"""Optional bearer-token auth: ``authorization: Bearer <key>`` on every call but health."""

from __future__ import annotations

import hmac

import grpc

from pydaemon.entrypoints.common.api_key import check_api_key

HEALTH_PREFIX = "/grpc.health.v1.Health/"
# The environment variable that holds the API key, for the daemon and its clients alike.
API_KEY_ENV = "PAGEDD_API_KEY"


def _refuse(handler: grpc.RpcMethodHandler | None, message: str) -> grpc.RpcMethodHandler:
    async def abort(request_or_iterator, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    if handler is not None and handler.request_streaming:
        if handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(abort)
        return grpc.stream_unary_rpc_method_handler(abort)
    if handler is not None and handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(abort)
    return grpc.unary_unary_rpc_method_handler(abort)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls without the right bearer token with UNAUTHENTICATED; health is exempt."""

    def __init__(self, api_key: str) -> None:
        self._expected = f"Bearer {check_api_key(api_key)}".encode()

    async def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method.startswith(HEALTH_PREFIX):
            return await continuation(handler_call_details)
        metadata = dict(handler_call_details.invocation_metadata or ())
        given = metadata.get("authorization", "")
        if isinstance(given, str):
            given = given.encode()
        handler = await continuation(handler_call_details)
        if not given:
            return _refuse(handler, "missing 'authorization: Bearer <api key>' metadata")
        if not hmac.compare_digest(given, self._expected):
            return _refuse(handler, "invalid api key")
        return handler
