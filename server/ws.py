"""WebSocket streaming at GET /ws: many generations per socket, each tagged with a client id.

Client -> server (JSON text frames):
    {"type": "generate", "id": "a", "text" | "input_ids": ..., "sampling_params": {...}, ...}
        (the fields of POST /generate; `stream` is implied)
    {"type": "cancel", "id": "a"}
Server -> client:
    {"type": "delta", "id": "a", "text": "...", "token_ids": [...]}            increments
    {"type": "delta", "id": "a", ..., "finish_reason": {...}, "meta_info": {...}}   the last one
    {"type": "error", "id": "a" | null, "error": {"message", "type", "param", "code"}}
Every accepted generation ends with exactly one delta carrying `finish_reason` (a cancelled one
with `{"type": "abort", "message": "cancelled by the client"}`); `index` tells choices apart
when n > 1 or a batch is sent. A rejected one gets an error and nothing else. Closing the socket
aborts everything still running on it. On shutdown a socket stops accepting generations and is
closed (1001) once its running ones finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field

from aiohttp import WSCloseCode, WSMsgType, web

from server.errors import ApiError, decode, to_api_error
from server.generation import GenerationGroup
from server.native_api import finish_reason_obj, meta_info, parse_generate
from server.protocol import WsCancel, WsClientMessage, WsDelta, WsError, encode
from server.state import STATE, ServerState

log = logging.getLogger(__name__)


@dataclass
class _Running:
    group: GenerationGroup
    many: bool  # tag deltas with `index`
    finished: set[int] = field(default_factory=set)  # indexes that sent their last delta
    task: asyncio.Task | None = None


class WsSession:
    def __init__(self, state: ServerState, ws: web.WebSocketResponse) -> None:
        self.state = state
        self.ws = ws
        self.running: dict[str | int, _Running] = {}
        self._send_lock = asyncio.Lock()
        self._drain_task: asyncio.Task | None = None

    async def send(self, obj: object) -> None:
        async with self._send_lock:  # frames of concurrent generations must not interleave
            await self.ws.send_str(encode(obj).decode())

    async def send_error(self, gen_id: str | int | None, err: ApiError) -> None:
        await self.send(WsError(gen_id, err.body().error))

    async def on_message(self, data: str | bytes) -> None:
        try:
            msg = decode(data if isinstance(data, bytes) else data.encode(), WsClientMessage)
        except ApiError as e:
            await self.send_error(None, e)
            return
        if isinstance(msg, WsCancel):
            await self.cancel(msg.id)
            return
        if msg.id in self.running:
            await self.send_error(msg.id, ApiError(400, f"generation {msg.id!r} is already running", param="id"))
            return
        try:
            specs, many = parse_generate(msg)
            group = GenerationGroup(self.state, specs)
            await group.__aenter__()  # admission and validation: errors answer this message only
        except Exception as e:
            err = to_api_error(e)
            if err is None:
                log.exception("websocket generate failed")
                err = ApiError(500, f"internal error: {e!r}", type="server_error")
            await self.send_error(msg.id, err)
            return
        run = _Running(group, many)
        run.task = asyncio.create_task(self._run(msg.id, run))
        self.running[msg.id] = run

    async def _run(self, gen_id: str | int, run: _Running) -> None:
        t0 = time.perf_counter()
        try:
            async for i, d in run.group:
                done = d.finish_reason is not None
                meta = meta_info(d.rid, d, t0) if done else None
                await self.send(
                    WsDelta(gen_id, d.text, d.token_ids, finish_reason_obj(d), meta, i if run.many else None)
                )
                if done:
                    run.finished.add(i)
        except ConnectionResetError:
            pass  # the socket is gone; the handler's cleanup aborts the rest
        except Exception as e:
            err = to_api_error(e) or ApiError(500, f"internal error: {e!r}", type="server_error")
            with contextlib.suppress(ConnectionResetError):
                await self.send_error(gen_id, err)
        finally:
            await run.group.aclose()
            if self.running.get(gen_id) is run:
                del self.running[gen_id]

    async def cancel(self, gen_id: str | int) -> None:
        run = self.running.pop(gen_id, None)
        if run is None:
            await self.send_error(gen_id, ApiError(404, f"no running generation {gen_id!r}", param="id"))
            return
        if run.task is not None:
            run.task.cancel()
            await asyncio.gather(run.task, return_exceptions=True)
        await run.group.aclose()  # aborted in the engine: memory freed before we answer
        for i in range(len(run.group.specs)):
            if i not in run.finished:
                await self.send(
                    WsDelta(
                        gen_id,
                        "",
                        [],
                        {"type": "abort", "message": "cancelled by the client"},
                        None,
                        i if run.many else None,
                    )
                )

    async def close_all(self) -> None:
        """The socket is gone: abort everything still running on it."""
        runs = list(self.running.values())
        self.running.clear()
        for run in runs:
            if run.task is not None:
                run.task.cancel()
        await asyncio.gather(*(r.task for r in runs if r.task), return_exceptions=True)
        for run in runs:
            await run.group.aclose()

    def drain(self) -> None:
        """Shutdown: let running generations finish (new ones get 503), then close the socket."""

        async def wait_and_close() -> None:
            while self.running:
                await asyncio.gather(*(r.task for r in list(self.running.values()) if r.task), return_exceptions=True)
            await self.ws.close(code=WSCloseCode.GOING_AWAY, message=b"server shutting down")

        if self._drain_task is None:
            self._drain_task = asyncio.create_task(wait_and_close())


SESSIONS: web.AppKey[set[WsSession]] = web.AppKey("ws_sessions", set)


async def websocket(request: web.Request) -> web.WebSocketResponse:
    state = request.app[STATE]
    ws = web.WebSocketResponse(max_msg_size=state.config.max_body_size)
    await ws.prepare(request)
    session = WsSession(state, ws)
    sessions = request.app[SESSIONS]
    sessions.add(session)
    if state.draining:
        session.drain()
    try:
        async for msg in ws:
            if msg.type in (WSMsgType.TEXT, WSMsgType.BINARY):
                await session.on_message(msg.data)
            elif msg.type == WSMsgType.ERROR:
                break
    except ConnectionResetError:
        pass
    finally:
        sessions.discard(session)
        await session.close_all()
    return ws


async def drain_sockets(app: web.Application) -> None:
    """on_shutdown hook: every open socket finishes its generations, then closes."""
    for session in list(app[SESSIONS]):
        session.drain()


def add_routes(app: web.Application) -> None:
    app[SESSIONS] = set()
    app.router.add_get("/ws", websocket)
    app.on_shutdown.append(drain_sockets)
