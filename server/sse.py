"""Server-sent events, the way OpenAI and SGLang stream: `data: <json>\\n\\n` per event, then
`data: [DONE]`. A write to a client that went away raises ConnectionResetError (aiohttp's
ClientConnectionResetError subclasses it); callers let it end their `GenerationGroup`, which
aborts the generations.
"""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web

_encoder = msgspec.json.Encoder()
DONE = b"data: [DONE]\n\n"


async def open_sse(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                       "X-Accel-Buffering": "no"})  # fmt: skip
    await resp.prepare(request)
    return resp


async def send_event(resp: web.StreamResponse, obj: Any) -> None:
    await resp.write(b"data: " + _encoder.encode(obj) + b"\n\n")


async def send_done(resp: web.StreamResponse) -> None:
    await resp.write(DONE)
    await resp.write_eof()
