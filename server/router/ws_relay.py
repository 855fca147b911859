"""GET /ws through the router: the single server's WebSocket protocol (server/ws.py), each
generation routed on its own.

One client socket may carry many generations; each `generate` frame is routed by its prompt
exactly as POST /generate is (so the cache-aware policy sees every prompt), over one upstream
socket per worker, opened when first needed. `cancel` frames go to the worker that runs that id.
Every frame a worker sends is passed to the client unchanged.

If a worker's socket breaks, each generation still open on it ends the way the server ends a
generation that fails in mid-flight: an `error` frame with its id, then its final delta with an
`abort` finish reason. Closing the client socket closes the upstream ones, and the workers abort
what still runs there. A worker that cannot be reached when a generation is routed is marked
unhealthy and the generation goes to another one (nothing was sent yet).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import WSMsgType, web

from server.router.errors import RouterError, no_healthy_worker
from server.router.policy import Worker, routing_text
from server.router.state import ROUTER, Router

log = logging.getLogger(__name__)

MAX_FRAME = 64 * 2**20  # the workers enforce their own --max-body-size


@dataclass
class _Open:
    """A generation in flight: which worker runs it and how many final deltas are still due."""

    worker: Worker
    finals_due: int
    started: bool = False  # a delta came: an error now is a mid-flight failure, its final delta follows


def _finals(frame: dict[str, Any]) -> int:
    """Final deltas a generate frame leads to: one per prompt of a batch, times `n`."""
    prompts = frame.get("text", frame.get("input_ids"))
    batch = len(prompts) if isinstance(prompts, list) and prompts and isinstance(prompts[0], (str, list)) else 1
    params = frame.get("sampling_params")
    n = params.get("n", 1) if isinstance(params, dict) else 1
    return batch * (n if isinstance(n, int) and n > 0 else 1)


def _failure_frames(gen_id: Any, message: str) -> list[str]:
    error = RouterError(502, message, code="worker_failed").body()["error"]
    abort = {"type": "abort", "message": message}
    final = {"type": "delta", "id": gen_id, "text": "", "token_ids": [], "finish_reason": abort}
    return [json.dumps({"type": "error", "id": gen_id, "error": error}), json.dumps(final)]


class WsRelay:
    """One client socket's upstream sockets and the generations open on them."""

    def __init__(self, router: Router, client: web.WebSocketResponse, headers: dict[str, str]) -> None:
        self.router, self.client, self.headers = router, client, headers
        self.upstreams: dict[str, aiohttp.ClientWebSocketResponse] = {}
        self.pumps: list[asyncio.Task[None]] = []
        self.open: dict[Any, _Open] = {}

    async def _upstream(self, worker: Worker) -> aiohttp.ClientWebSocketResponse:
        ws = self.upstreams.get(worker.url)
        if ws is None or ws.closed:
            assert self.router.session is not None
            ws = await self.router.session.ws_connect(
                worker.url + "/ws", headers=self.headers, max_msg_size=MAX_FRAME, heartbeat=30.0
            )
            self.upstreams[worker.url] = ws
            self.pumps.append(asyncio.create_task(self._pump(worker, ws)))
        return ws

    async def handle(self, data: str) -> None:
        """Route one client frame."""
        try:
            frame = json.loads(data)
        except ValueError:
            frame = None
        kind = frame.get("type") if isinstance(frame, dict) else None
        if kind == "cancel" and frame["id"] in self.open:
            await self.upstreams[self.open[frame["id"]].worker.url].send_str(data)
            return
        text = routing_text("/generate", frame) if kind == "generate" else ""
        tried: set[str] = set()
        while (worker := self.router.pick(text, tried)) is not None:
            try:
                ws = await self._upstream(worker)
            except (aiohttp.ClientError, OSError, TimeoutError) as e:
                self.router.set_health(worker, False, f" (websocket: {e})")
                tried.add(worker.url)
                continue
            if kind == "generate" and "id" in frame and frame["id"] not in self.open:
                self.open[frame["id"]] = _Open(worker, _finals(frame))
                self.router.begin(worker)
                self.router.metrics.requests.labels(worker.url, "/ws").inc()
            await ws.send_str(data)  # anything else (a bad frame): the worker answers the error
            return
        gen_id = frame.get("id") if isinstance(frame, dict) else None
        await self.client.send_str(json.dumps({"type": "error", "id": gen_id, **no_healthy_worker().body()}))

    async def _pump(self, worker: Worker, ws: aiohttp.ClientWebSocketResponse) -> None:
        """The worker's frames to the client, until its socket closes; then end what it ran."""
        try:
            async for msg in ws:
                if msg.type is not WSMsgType.TEXT:
                    break
                self._note(msg.data)
                await self.client.send_str(msg.data)
        except (ConnectionResetError, aiohttp.ClientError):
            pass
        finally:
            self.upstreams.pop(worker.url, None)
            stranded = [gid for gid, o in self.open.items() if o.worker is worker]
            if stranded and not self.client.closed:
                log.warning("worker %s lost its websocket with %d generation(s) open", worker.url, len(stranded))
                self.router.metrics.errors.labels("worker_lost_mid_stream").inc()
            for gid in stranded:
                self._done(gid)
                with contextlib.suppress(ConnectionResetError):
                    for frame in _failure_frames(gid, f"the worker {worker.url} failed in mid-stream"):
                        await self.client.send_str(frame)

    def _note(self, data: str) -> None:
        """Count the final deltas (and rejections) of the generations routed here."""
        with contextlib.suppress(ValueError):
            frame = json.loads(data)
            gen = self.open.get(frame.get("id")) if isinstance(frame, dict) else None
            if gen is None:
                return
            if frame.get("type") == "error" and not gen.started:  # rejected: nothing else follows
                self._done(frame["id"])
            elif frame.get("type") == "delta":
                gen.started = True
                if frame.get("finish_reason") is not None:
                    gen.finals_due -= 1
                    if gen.finals_due <= 0:
                        self._done(frame["id"])

    def _done(self, gen_id: Any) -> None:
        gen = self.open.pop(gen_id, None)
        if gen is not None:
            self.router.end(gen.worker)

    async def close(self) -> None:
        for ws in list(self.upstreams.values()):
            await ws.close()
        for task in self.pumps:
            task.cancel()
        await asyncio.gather(*self.pumps, return_exceptions=True)
        for gid in list(self.open):
            self._done(gid)


async def ws_handler(request: web.Request) -> web.WebSocketResponse:
    router = request.app[ROUTER]
    client = web.WebSocketResponse(max_msg_size=MAX_FRAME, heartbeat=30.0)
    await client.prepare(request)
    headers = {k: request.headers[k] for k in ("Authorization",) if k in request.headers} or router.auth_headers()
    relay = WsRelay(router, client, headers)
    try:
        async for msg in client:
            if msg.type is WSMsgType.TEXT:
                await relay.handle(msg.data)
            elif msg.type is WSMsgType.BINARY:
                await relay.handle(msg.data.decode("utf-8", "replace"))
    finally:
        await relay.close()
    return client
