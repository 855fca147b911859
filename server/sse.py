"""Server-sent events, the way OpenAI and SGLang stream: `data: <json>\\n\\n` per event, then
`data: [DONE]`. A write to a client that went away raises ConnectionResetError (aiohttp's
ClientConnectionResetError subclasses it); callers let it end their `GenerationGroup`, which
aborts the generations.

Once the first byte is out the status line is spent, so an error in mid-stream (the engine went
down, a bug) can no longer be a 4xx/5xx answer: `sse_stream` turns it into one last
`data: {"error": {...}}` event (OpenAI's error body) followed by `[DONE]`, instead of a stream
that just stops. Shutdown past the grace period ends a stream the same way: its generations are
aborted with a 503 `shutting_down` error (server/launch.py, `GenerationGroup.abort`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from aiohttp import web

from server.errors import ApiError, error_json, to_api_error

log = logging.getLogger(__name__)

_encoder = msgspec.json.Encoder()
DONE = b"data: [DONE]\n\n"


async def open_sse(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )
    await resp.prepare(request)
    return resp


async def send_event(resp: web.StreamResponse, obj: Any) -> None:
    await resp.write(b"data: " + _encoder.encode(obj) + b"\n\n")


async def send_done(resp: web.StreamResponse) -> None:
    await resp.write(DONE)
    await resp.write_eof()


@contextlib.asynccontextmanager
async def sse_stream(request: web.Request) -> AsyncIterator[web.StreamResponse]:
    """An open SSE response whose errors end the stream with an error event (see the module doc).

    A client that went away ends it quietly (nobody to tell); cancellation propagates.
    """
    resp = await open_sse(request)
    try:
        yield resp
    except ConnectionResetError:
        return
    except Exception as e:
        err = to_api_error(e)
        if err is None:
            log.exception("error in mid-stream on %s %s", request.method, request.path)
            err = ApiError(500, f"internal server error: {type(e).__name__}: {e}", type="server_error")
        with contextlib.suppress(ConnectionResetError):
            await send_event(resp, error_json(err))
            await send_done(resp)
