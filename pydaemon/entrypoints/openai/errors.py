"""Errors in OpenAI's JSON shape, ``{"error": {"message", "type", "param", "code"}}``.

Handlers raise ``ApiError``; the middleware turns it, a body that fails validation, an
aiohttp HTTP exception (unknown route, body too large) or an unexpected exception (500, with a
log line) into that shape with the right status.
"""

from __future__ import annotations

import logging

from aiohttp import web
from pydantic import ValidationError

from pydaemon.entrypoints.common.limits import LimitError
from pydaemon.entrypoints.openai.responses import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    408: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    503: "service_unavailable",
}


class ApiError(Exception):
    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


def error_response(
    status: int, message: str, *, param: str | None = None, code: str | None = None
) -> web.Response:
    body = ErrorResponse(
        error=ErrorInfo(
            message=message,
            type=_TYPES.get(status, "invalid_request_error"),
            param=param,
            code=code,
        )
    )
    return web.Response(status=status, text=body.model_dump_json(), content_type="application/json")


def error_event(error: ApiError) -> str:
    """An error that happens after a stream started: sent as one SSE ``data`` payload."""
    return ErrorResponse(
        error=ErrorInfo(
            message=error.message,
            type=_TYPES.get(error.status, "invalid_request_error"),
            param=error.param,
            code=error.code,
        )
    ).model_dump_json()


def _validation_message(e: ValidationError) -> tuple[str, str | None]:
    first = e.errors(include_url=False)[0]
    if first["type"] == "json_invalid":
        return f"the request body is not valid JSON: {first['msg']}", None
    loc = ".".join(str(part) for part in first["loc"])
    if first["type"] == "extra_forbidden":
        return f"unknown field {loc!r}", loc
    more = f" (and {e.error_count() - 1} more errors)" if e.error_count() > 1 else ""
    return f"{loc}: {first['msg']}{more}", loc or None


@web.middleware
async def error_middleware(request: web.Request, handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as e:
        return error_response(e.status, e.message, param=e.param, code=e.code)
    except LimitError as e:  # InvalidParam too
        return error_response(400, e.message, param=e.param)
    except ValidationError as e:
        message, param = _validation_message(e)
        return error_response(400, message, param=param)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return error_response(e.status, f"{request.method} {request.path}: {e.reason}")
    except Exception as e:
        logger.exception("unexpected error in %s %s", request.method, request.path)
        return error_response(500, f"internal error: {e!r}")
