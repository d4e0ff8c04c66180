"""Errors in the OpenAI shape: `{"error": {"message", "type", "param", "code"}}`.

Handlers turn every failure on the API into that shape with the right status; nothing
the client sees ever carries a traceback (unexpected errors are logged server-side and
answered with a fixed 500 line).
"""

from __future__ import annotations

import logging
import re
from typing import Any

import msgspec
from litestar import Request, Response
from litestar.exceptions import HTTPException, ValidationException

log = logging.getLogger("pagedjax.api")

# OpenAI's `type` values by status.
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
          429: "rate_limit_error", 500: "server_error", 503: "service_unavailable"}
_FIELD_MSG = re.compile(r"^([A-Za-z_][\w.\[\]]*): (.+)$", re.DOTALL)


class APIError(Exception):
    """Raised anywhere in the API; rendered by `api_error_response`."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status_code = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
        self.headers = headers or {}

    @classmethod
    def from_value_error(cls, exc: ValueError, *, default_param: str | None = None,
                         code: str | None = None) -> APIError:
        """Engine and SamplingParams errors read "field: message"; the field becomes `param`."""
        text = str(exc) or "invalid request"
        m = _FIELD_MSG.match(text)
        param = m.group(1) if m else default_param
        return cls(400, text, param=param, code=code)


CLIENT_CLOSED = 499  # nginx's "client closed request": nobody reads it, the access log does


class ClientDisconnected(Exception):
    """The client hung up before the answer was ready; its engine requests are aborted."""

    status_code = CLIENT_CLOSED


class ErrorBody(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(msgspec.Struct):
    error: ErrorBody


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None,
               type: str | None = None) -> ErrorResponse:
    return ErrorResponse(ErrorBody(message, type or _TYPES.get(status, "server_error"), param, code))


def api_error_response(exc: APIError) -> Response:
    body = ErrorResponse(ErrorBody(exc.message, exc.type, exc.param, exc.code))
    return Response(msgspec.json.encode(body), status_code=exc.status_code, media_type="application/json",
                    headers=exc.headers)


def msgspec_error(exc: msgspec.ValidationError | msgspec.DecodeError) -> APIError:
    """msgspec says "Expected `int` >= 1 - at `$.max_tokens`"; name the field as `param`."""
    text = str(exc)
    if isinstance(exc, msgspec.DecodeError) and not isinstance(exc, msgspec.ValidationError):
        return APIError(400, f"request body is not valid JSON: {text}", code="invalid_json")
    param = None
    m = re.search(r" - at `\$\.?(.*)`$", text)
    if m:
        param = m.group(1) or None
        text = text[:m.start()]
    missing = re.match(r"Object missing required field `(\w+)`", text)
    if missing:
        param = ".".join(p for p in (param, missing.group(1)) if p)
    unknown = re.match(r"Object contains unknown field `([^`]+)`", text)
    if unknown:
        param = ".".join(p for p in (param, unknown.group(1)) if p)
        return APIError(400, f"{param}: this server does not support this field", param=param,
                        code="unsupported_field")
    return APIError(400, f"{param}: {text}" if param else text, param=param, code="invalid_value")


# --- exception handlers ------------------------------------------------------------------

def handle_api_error(_: Request, exc: APIError) -> Response:
    return api_error_response(exc)


def handle_client_disconnected(_: Request, __: ClientDisconnected) -> Response:
    return Response(b"", status_code=CLIENT_CLOSED)


def handle_http_exception(request: Request, exc: HTTPException) -> Response:
    """Litestar's own errors (404, 405, body parsing) in the OpenAI shape on /v1, and
    Litestar's default elsewhere (the console renders its own pages)."""
    status = exc.status_code
    if not request.url.path.startswith("/v1"):
        return Response({"status_code": status, "detail": exc.detail}, status_code=status,
                        headers=exc.headers)
    message = str(exc.detail or "request failed")
    param = None
    if isinstance(exc, ValidationException) and isinstance(exc.extra, list) and exc.extra:
        first: Any = exc.extra[0]
        if isinstance(first, dict):
            param = first.get("key")
            message = f"{param}: {first.get('message')}" if param else str(first.get("message"))
    return api_error_response(APIError(status, message, param=param, headers=dict(exc.headers or {})))


def handle_unexpected(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return api_error_response(APIError(500, "internal server error; see the server log", code="internal_error"))


EXCEPTION_HANDLERS: dict[type[Exception], Any] = {
    APIError: handle_api_error,
    ClientDisconnected: handle_client_disconnected,
    HTTPException: handle_http_exception,
    Exception: handle_unexpected,
}
