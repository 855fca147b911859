"""The aiohttp application: routes, and the middlewares every request passes through.

Middlewares, outermost first:
  errors    - any failure becomes OpenAI's error body with the right status; a bug is a logged 500
  connection limit - a request on a connection past --max-connections gets 503 (server/http_protocol.py)
  api_key   - `Authorization: Bearer <key>` when --api-key is set (401 otherwise); /health*,
              /metrics and /openapi.json stay open for probes, scrapers and client generators;
              /dashboard and its socket also take `?api_key=<key>` (a browser sets no header there)
  body_size - 413 from the Content-Length header, before reading (aiohttp's client_max_size
              catches chunked bodies)
Run it with `http_protocol.ApiRunner(app, handler_cancellation=True)`: a client that disconnects
then cancels its handler, which aborts its generations (see server/generation.py).
"""

from __future__ import annotations

import hmac
import logging

from aiohttp import web

from engine import Engine
from server import (
    admin_api,
    dashboard,
    embeddings_api,
    lora_api,
    native_api,
    openai_api,
    openapi,
    rollout_api,
    tokenizer_api,
    ws,
)
from server.config import ServerConfig
from server.errors import ApiError, to_api_error
from server.http_protocol import connection_limit_middleware
from server.state import STATE, ServerState

log = logging.getLogger(__name__)

_OPEN_PATHS = ("/health", "/metrics", "/openapi.json")  # prefixes that need no API key


@web.middleware
async def errors_middleware(request: web.Request, handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ConnectionResetError:
        raise  # the client is gone: nobody to answer
    except Exception as e:
        err = to_api_error(e)
        if err is None:
            if isinstance(e, web.HTTPException):  # redirects and other non-errors pass through
                raise
            log.exception("unhandled error on %s %s", request.method, request.path)
            err = ApiError(500, f"internal server error: {type(e).__name__}: {e}", type="server_error")
        return err.response()


def _api_key_middleware(key: str):
    expected = f"Bearer {key}".encode()

    @web.middleware
    async def api_key_middleware(request: web.Request, handler) -> web.StreamResponse:
        if not request.path.startswith(_OPEN_PATHS):
            given = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(given, expected) and not dashboard.query_key_ok(request, key):
                raise ApiError(
                    401, "missing or invalid API key (send 'Authorization: Bearer <key>')", code="invalid_api_key"
                )
        return await handler(request)

    return api_key_middleware


def _body_size_middleware(limit: int):
    @web.middleware
    async def body_size_middleware(request: web.Request, handler) -> web.StreamResponse:
        if request.content_length is not None and request.content_length > limit:
            raise ApiError(
                413,
                f"the request body has {request.content_length} bytes; the limit is {limit}",
                code="request_entity_too_large",
                close=True,  # rather than read (and drop) the oversized body
            )
        return await handler(request)

    return body_size_middleware


async def _metrics_handler(request: web.Request) -> web.Response:
    state = request.app[STATE]
    state.metrics.refresh(await state.engine.get_internal_state(), state.inflight)
    return state.metrics.render()


async def _begin_drain(app: web.Application) -> None:
    app[STATE].draining = True


def build_app(engine: Engine, config: ServerConfig) -> web.Application:
    """The application for an already started `engine`."""
    middlewares = [errors_middleware, connection_limit_middleware]
    if config.api_key:
        middlewares.append(_api_key_middleware(config.api_key))
    middlewares.append(_body_size_middleware(config.max_body_size))
    app = web.Application(middlewares=middlewares, client_max_size=config.max_body_size)
    app[STATE] = ServerState(engine, config)
    app.on_shutdown.append(_begin_drain)  # before ws's hook: sockets drain with admission closed
    openai_api.add_routes(app)
    native_api.add_routes(app)
    tokenizer_api.add_routes(app)  # /tokenize, /detokenize (and /v1/...), /tokenizer_info
    embeddings_api.add_routes(app)  # /v1/embeddings, /encode
    ws.add_routes(app)
    admin_api.add_routes(app)
    rollout_api.add_routes(app)  # /update_weights_from_disk, /pause_generation, /continue_generation
    lora_api.add_routes(app)  # /load_lora_adapter, /unload_lora_adapter
    dashboard.add_routes(app)  # GET /dashboard and its live feed, GET /dashboard/ws
    openapi.add_routes(app, secured=bool(config.api_key))  # GET /openapi.json, built on startup from every route
    if config.enable_metrics:
        app.router.add_get("/metrics", _metrics_handler)
    return app


__all__ = ["build_app"]
