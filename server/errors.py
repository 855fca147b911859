"""Every failure the HTTP layer reports, as OpenAI's error body:
`{"error": {"message", "type", "param", "code"}}` with a status that tells the client whether
retrying can help (4xx: fix the request; 503: try later).

`ApiError` is raised anywhere in a handler; the error middleware (server/app.py) turns it, the
engine's typed errors and aiohttp's HTTP exceptions into responses through `to_api_error`.
"""

from __future__ import annotations

import re
from typing import Any, TypeVar

import msgspec
from aiohttp import web

from engine import (
    ContextLengthExceededError,
    EngineUnhealthyError,
    GrammarCompileTimeoutError,
    GrammarQueueFullError,
    InvalidRequestError,
    RequestTooLargeError,
)

T = TypeVar("T")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    503: "service_unavailable",
}


class ErrorInfo(msgspec.Struct):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(msgspec.Struct):
    error: ErrorInfo


class ApiError(Exception):
    """An error with its HTTP status, as the client will see it."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | int | None = None,
        type: str | None = None,
        close: bool = False,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.close = close  # close the connection after answering (e.g. a body left half read)
        self.code = code if code is not None else status
        self.type = type or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")

    def body(self) -> ErrorResponse:
        return ErrorResponse(ErrorInfo(self.message, self.type, self.param, self.code))

    def response(self) -> web.Response:
        resp = web.Response(status=self.status, body=msgspec.json.encode(self.body()), content_type="application/json")
        if self.close:
            resp.force_close()
        return resp


def unavailable(message: str, code: str = "service_unavailable") -> ApiError:
    return ApiError(503, message, code=code)


_AT_PATH = re.compile(r" - at `(?:key` in `)?\$(.*)`$")  # "at `key` in `$.x`": a bad dict key
_MISSING = re.compile(r"(?:missing required|unknown) field `([^`]+)`")


def _param_of(error: msgspec.ValidationError) -> str | None:
    """msgspec says '... - at `$.messages[0].role`': the param is 'messages[0].role' (plus the
    field itself when it is missing or unknown)."""
    text = str(error)
    m = _AT_PATH.search(text)
    # "[...]" is msgspec's "some value of this map": the param is the map (`logit_bias`).
    path = m.group(1).lstrip(".").replace("[...]", "") if m else ""
    missing = _MISSING.search(text)
    if missing:
        path = f"{path}.{missing.group(1)}" if path else missing.group(1)
    return path or None


def decode(body: bytes, type_: type[T]) -> T:
    """Decode a JSON body strictly into `type_`: invalid JSON or a wrong type is a 400 naming the field."""
    try:
        return msgspec.json.decode(body, type=type_)
    except msgspec.ValidationError as e:
        raise ApiError(400, f"invalid request: {e}", param=_param_of(e)) from None
    except msgspec.DecodeError as e:
        raise ApiError(400, f"invalid JSON in the request body: {e}", code="invalid_json") from None
    except UnicodeDecodeError as e:  # a string holding bytes that are not UTF-8
        raise ApiError(
            400, f"the request body is not valid UTF-8: {e.reason} at byte {e.start}", code="invalid_json"
        ) from None
    except RecursionError:  # msgspec's own depth guard: nesting past the interpreter's limit
        raise ApiError(400, "the request body nests too deeply", code="invalid_json") from None


def to_api_error(exc: BaseException) -> ApiError | None:
    """The ApiError for an exception the server expects, or None for a bug (a 500)."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, ContextLengthExceededError):
        return ApiError(400, str(exc), param=exc.param, code="context_length_exceeded")
    if isinstance(exc, RequestTooLargeError):
        return ApiError(400, str(exc), param=exc.param, code="request_too_large")
    if isinstance(exc, GrammarQueueFullError):
        return unavailable(exc.message, code="grammar_queue_full")
    if isinstance(exc, GrammarCompileTimeoutError):
        return ApiError(400, exc.message, param=exc.param, code="grammar_compile_timeout")
    if isinstance(exc, InvalidRequestError):
        return ApiError(400, exc.message, param=exc.param)
    if isinstance(exc, EngineUnhealthyError):
        return unavailable(str(exc), code="engine_unhealthy")
    if isinstance(exc, web.RequestPayloadError):  # e.g. Content-Encoding: gzip on a body that is not
        message = f"cannot read the request body: {' '.join(str(exc).split())}"
        return ApiError(400, message, code="invalid_body", close=True)  # the rest of it is unreadable too
    if isinstance(exc, web.HTTPException) and exc.status >= 400:
        return ApiError(exc.status, exc.text or exc.reason)
    return None


def abort_error(message: str | None, healthy: bool) -> ApiError:
    """The error for a generation the engine ended early (the OpenAI API has no 'abort' finish)."""
    text = message or "the request was aborted"
    if not healthy:
        return unavailable(text, code="engine_unhealthy")
    if "does not fit" in text or "never fit" in text:  # the scheduler's "can never fit alone" abort
        return ApiError(400, text, code="request_too_large")
    return ApiError(500, text, code="aborted", type="server_error")


def error_json(err: ApiError) -> dict[str, Any]:
    """The error body as a plain object, for SSE events and WebSocket messages."""
    return msgspec.to_builtins(err.body())
