"""OpenAI-style error bodies for the router's own failures (no healthy worker, bad API key,
a worker lost in mid-stream). The same shape as server/errors.py, written again here because
that module imports the engine (and torch): the router is a light process that never loads a
model and must start in a fraction of a second."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error"}


class RouterError(Exception):
    """An error with its HTTP status, answered as `{"error": {message, type, param, code}}`."""

    def __init__(self, status: int, message: str, code: str | int | None = None) -> None:
        super().__init__(message)
        self.status, self.message = status, message
        self.code = code if code is not None else status
        self.type = _TYPES.get(status, "service_unavailable" if status == 503 else "server_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": None, "code": self.code}}

    def response(self) -> web.Response:
        return web.json_response(self.body(), status=self.status)

    def sse_event(self) -> bytes:
        return b"data: " + json.dumps(self.body()).encode() + b"\n\n"


def no_healthy_worker() -> RouterError:
    return RouterError(503, "no healthy worker is available", code="no_healthy_worker")


__all__ = ["RouterError", "no_healthy_worker"]
