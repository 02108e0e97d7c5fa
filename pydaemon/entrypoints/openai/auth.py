"""Optional bearer-token auth for every path but ``/health`` and ``/version`` (open for load
balancers and probes) and, with ``--no-metrics-auth``, ``/metrics``: an allow-list, so that a
path added later, or one under ``--root-path``, is guarded unless it is named here."""

from __future__ import annotations

import hmac

from aiohttp import web

from pydaemon.entrypoints.common.api_key import check_api_key
from pydaemon.entrypoints.openai.errors import error_response

OPEN_PATHS = frozenset({"/health", "/version"})


def api_key_middleware(api_key: str, metrics_auth: bool = True, root_path: str | None = None):
    """Refuses requests without ``Authorization: Bearer <api_key>`` with 401, but for the
    open paths (also under ``root_path``)."""
    expected = f"Bearer {check_api_key(api_key)}".encode()
    open_paths = OPEN_PATHS if metrics_auth else OPEN_PATHS | {"/metrics"}
    if root_path:
        open_paths = open_paths | {root_path + p for p in open_paths}

    def is_guarded(path: str) -> bool:
        return path not in open_paths

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
