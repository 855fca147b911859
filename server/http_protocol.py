"""The HTTP connection layer below the application: protocol errors and connection limits.

aiohttp answers what it cannot parse (garbage bytes, a URL or header past its limits, a bad
Content-Length) itself, before any middleware runs, with a plain-text body and a logged
traceback per occurrence. Here such answers become OpenAI's JSON error body, logged as one
line, and a connection beyond `ServerConfig.max_connections` gets 503 for its first request and is
closed (`connection_limit_middleware`, which `app.py` installs first).

`ApiRunner` is `web.AppRunner` with this protocol: aiohttp builds one `RequestHandler` per
connection through its `Server` factory, which offers no hook for the handler class, so the
runner hands the server it built to a subclass (`ApiServer`) that makes ours.
"""

from __future__ import annotations

import logging
from typing import Any

from aiohttp import web
from aiohttp.abc import AbstractAccessLogger

from server.errors import ApiError

log = logging.getLogger(__name__)


class JsonErrorRequestHandler(web.RequestHandler):
    """One connection's protocol: aiohttp's, with JSON protocol errors and a connection cap."""

    def __init__(self, manager: ApiServer, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self.api_server = manager
        self.over_limit = False  # answered 503 and closed by `connection_limit_middleware`

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        limit = self.api_server.max_connections
        if limit is not None and len(self.api_server.connections) > limit:
            # Refused at its first request rather than here: closing a socket with the client's
            # request unread makes the kernel reset it, and the client would never see why.
            self.over_limit = True
            log.warning("connection over the limit: %d open, the limit is %d", len(self.api_server.connections), limit)

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """What aiohttp answers when a request fails below the app: a bad request line, headers
        past the limits, a bad Content-Length... (and, as a last resort, an error that escaped
        the app's own error middleware)."""
        if request.writer.output_size > 0:  # a response is already under way: nothing to add
            raise ConnectionError("response already started; cannot send an error")
        text = " ".join((message or (str(exc) if exc else "") or "bad request").split())
        if status >= 500:
            log.error("error below the application on %s: %s", request.path, text, exc_info=exc)
            err = ApiError(status, f"internal server error: {text}", type="server_error")
        else:
            log.info("rejected a malformed request from %s: %s", request.remote, text[:200])
            err = ApiError(status, f"malformed HTTP request: {text[:500]}", code="bad_http_request")
        resp = err.response()
        resp.force_close()
        return resp


@web.middleware
async def connection_limit_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    """A request on a connection beyond --max-connections: 503, and the connection is closed."""
    if getattr(request.protocol, "over_limit", False):
        limit = request.protocol.api_server.max_connections
        raise ApiError(
            503,
            f"too many open connections (the limit is {limit}); retry later",
            code="too_many_connections",
            close=True,
        )
    return await handler(request)


class ApiServer(web.Server):
    """aiohttp's connection factory, making `JsonErrorRequestHandler`s."""

    max_connections: int | None = None

    def __call__(self) -> web.RequestHandler:
        return JsonErrorRequestHandler(self, loop=self._loop, **self._kwargs)


class RedactingAccessLogger(AbstractAccessLogger):
    """One access-log line per request, with a query-string API key masked: the dashboard takes
    `?api_key=` (browsers cannot send headers on a page load or a WebSocket handshake), and a
    secret must not land in logs."""

    def log(self, request: web.BaseRequest, response: web.StreamResponse, time: float) -> None:
        url = request.rel_url
        if "api_key" in url.query:
            url = url.update_query(api_key="***")
        major, minor = request.version
        self.logger.info(
            '%s "%s %s HTTP/%d.%d" %d %d %.3fs',
            request.remote,
            request.method,
            url,
            major,
            minor,
            response.status,
            response.body_length,
            time,
        )


class ApiRunner(web.AppRunner):
    """`web.AppRunner` whose connections use `JsonErrorRequestHandler` (see the module doc)."""

    def __init__(self, app: web.Application, *, max_connections: int | None = None, **kwargs: Any) -> None:
        # Bodies are decoded by server/request_body.py, which answers a bad encoding with a 400.
        kwargs.setdefault("access_log_class", RedactingAccessLogger)
        super().__init__(app, auto_decompress=False, **kwargs)
        self.max_connections = max_connections

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = ApiServer  # same state, our factory (the class adds no fields)
        server.max_connections = self.max_connections
        return server


__all__ = ["ApiRunner", "ApiServer", "JsonErrorRequestHandler", "RedactingAccessLogger", "connection_limit_middleware"]
