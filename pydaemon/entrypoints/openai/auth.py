"""Optional bearer-token auth for ``/v1/*``, ``/tokenize``, ``/detokenize`` and, unless
``--no-metrics-auth``, ``/metrics`` (``/health`` and ``/version`` stay open for load balancers
and probes)."""

from __future__ import annotations

import hmac

from aiohttp import web

from pydaemon.entrypoints.common.api_key import check_api_key
from pydaemon.entrypoints.openai.errors import error_response

# Beyond /v1/*: vLLM's tokenizer routes (they spend the server's CPU on the caller's text).
GUARDED_PATHS = frozenset({"/tokenize", "/detokenize"})


def api_key_middleware(api_key: str, metrics_auth: bool = True):
    """Refuses ``/v1/*`` (and ``/metrics`` with ``metrics_auth``) requests without
    ``Authorization: Bearer <api_key>`` with 401."""
    expected = f"Bearer {check_api_key(api_key)}".encode()

    def is_guarded(path: str) -> bool:
        return (
            path == "/v1"
            or path.startswith("/v1/")
            or path in GUARDED_PATHS
            or (metrics_auth and path == "/metrics")
        )

    @web.middleware
    async def require_api_key(request: web.Request, handler) -> web.StreamResponse:
        if is_guarded(request.path):
            given = request.headers.get("Authorization", "")
            if not given:
                return error_response(
                    401, "missing 'Authorization: Bearer <api key>' header", code="invalid_api_key"
                )
            if not hmac.compare_digest(given.encode(), expected):
                return error_response(401, "invalid api key", code="invalid_api_key")
        return await handler(request)

    return require_api_key
