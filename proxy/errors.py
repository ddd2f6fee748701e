"""The proxy's one error envelope and its one exception handler.

Every error a client sees is ``{"error": {"message", "type", "param", "code"}}`` with a 4xx/5xx
status, raised as :class:`ProxyError` anywhere in the proxy and rendered by one handler. Nothing
else reaches the client: unexpected exceptions become a 500 envelope and are logged here. The
Anthropic Messages route (``/v1/messages``) gets the same errors in Anthropic's envelope,
``{"type": "error", "error": {"type", "message"}}``, rendered by the same handler.
"""

from __future__ import annotations

import logging

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

log = logging.getLogger(__name__)


class ProxyError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, dict[str, str | None]]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> Response:
        return Response(
            orjson.dumps(self.body()),
            status_code=self.status,
            media_type="application/json",
            headers=self.headers,
        )


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> ProxyError:
    return ProxyError(400, message, param=param, code=code)


_STATUS_TYPES = {
    401: ("authentication_error", "invalid_api_key"),
    403: ("permission_error", "forbidden"),
    404: ("invalid_request_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    413: ("invalid_request_error", "request_too_large"),
}


def internal_error() -> ProxyError:
    return ProxyError(
        500, "internal error in the Ratchet proxy", type="server_error", code="internal_error"
    )


def _as_proxy_error(request: Request, exc: Exception) -> ProxyError:
    """What the client is told about any exception that ends a request."""
    if isinstance(exc, ProxyError):
        return exc
    if isinstance(exc, ClientDisconnect):
        # The client left mid-body, or the server cut a slow body off and answered 408 itself
        # (proxy/connection.py): nobody reads this answer, and it is no error of ours to log.
        return ProxyError(
            400,
            "the client closed the connection before the whole body arrived",
            code="client_disconnected",
        )
    if isinstance(exc, StarletteHTTPException):  # no such route or method, and the like
        kind, code = _STATUS_TYPES.get(exc.status_code, ("invalid_request_error", "error"))
        message = (
            f"{request.method} {request.url.path} is not a route of this API"
            if exc.status_code in (404, 405)
            else str(exc.detail)
        )
        # Keep Starlette's headers: a 405 must say which methods are allowed (Allow).
        headers = getattr(exc, "headers", None)
        return ProxyError(exc.status_code, message, type=kind, code=code, headers=headers)
    log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return internal_error()


# Anthropic's error types by status, for the Messages route (docs.anthropic.com: errors).
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    504: "timeout_error",
    529: "overloaded_error",
}
ANTHROPIC_ROUTES = frozenset({"/v1/messages"})


def anthropic_error_type(status: int, openai_type: str = "") -> str:
    if status in _ANTHROPIC_TYPES:
        return _ANTHROPIC_TYPES[status]
    if status == 503 or openai_type == "overloaded_error":
        return "overloaded_error"
    return "invalid_request_error" if 400 <= status < 500 else "api_error"


def anthropic_response(error: ProxyError) -> Response:
    """The same error in Anthropic's envelope, ``{"type": "error", "error": {"type",
    "message"}}``: what the Messages API's clients parse."""
    body = {
        "type": "error",
        "error": {"type": anthropic_error_type(error.status, error.type), "message": error.message},
    }
    return Response(
        orjson.dumps(body),
        status_code=error.status,
        media_type="application/json",
        headers=error.headers,
    )


def response_for(path: str, error: ProxyError) -> Response:
    """The error in the envelope of the API at ``path``: Anthropic's on the Messages route."""
    return anthropic_response(error) if path in ANTHROPIC_ROUTES else error.response()


async def _error_response(request: Request, exc: Exception) -> Response:
    return response_for(request.url.path, _as_proxy_error(request, exc))


def install_handler(app: FastAPI) -> None:
    """One handler for every exception; Starlette looks handlers up by class, hence one key per
    kind."""
    for kind in (ProxyError, StarletteHTTPException, ClientDisconnect, Exception):
        app.add_exception_handler(kind, _error_response)
