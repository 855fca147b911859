"""WebSocket streaming at GET /ws: many generations per socket, each tagged with a client id.

Client -> server (JSON text or binary frames, UTF-8):
    {"type": "generate", "id": "a", "text" | "input_ids": ..., "sampling_params": {...}, ...}
        (the fields of POST /generate; `stream` is implied)
    {"type": "cancel", "id": "a"}
Server -> client:
    {"type": "delta", "id": "a", "text": "...", "token_ids": [...]}            increments
    {"type": "delta", "id": "a", ..., "finish_reason": {...}, "meta_info": {...}}   the last one
    {"type": "error", "id": "a" | null, "error": {"message", "type", "param", "code"}}

Every accepted generation ends with exactly one delta carrying `finish_reason`, whatever ends it:
a cancel (`{"type": "abort", "message": "cancelled by the client"}`), shutdown past the grace
period (`"server shutting down"`), or a failure in mid-generation (an error message with its id
first, then the abort delta with the same message). `index` tells choices apart when n > 1 or a
batch is sent. A rejected generation gets an error and nothing else.

A frame that cannot be decoded (not UTF-8, not JSON, nested too deeply, not an object, an
unknown type, a wrong field type) gets an error with `id: null` and a 400 body; the socket stays
open and what runs on it goes on. Nothing a frame does escapes the handler: a bug while handling
one is logged and answered with a 500 error for that frame. Protocol-level failures are
aiohttp's and end the socket with a close code (a text frame that is not UTF-8: 1007, as RFC 6455
requires; a frame over --max-body-size: 1009).

Closing the socket aborts everything still running on it. On shutdown a socket stops accepting
generations and is closed (1001) once its running ones have sent their final delta.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from aiohttp import WSCloseCode, WSMsgType, web

from engine import ResultBuilder
from server.errors import ApiError, decode, to_api_error
from server.generation import GenerationGroup
from server.native_api import finish_reason_obj, parse_generate, result_meta
from server.protocol_native import WsCancel, WsClientMessage, WsDelta, WsError, encode
from server.state import STATE, ServerState

log = logging.getLogger(__name__)

CANCELLED = "cancelled by the client"
NO_FINISH = "the generation ended without a finish reason"  # a safety net: not expected to happen


@dataclass
class _Running:
    group: GenerationGroup
    many: bool  # tag deltas with `index`
    return_text_in_logprobs: bool = False
    finished: set[int] = field(default_factory=set)  # indexes that sent their last delta
    task: asyncio.Task | None = None


def _internal(e: BaseException) -> ApiError:
    return ApiError(500, f"internal error: {type(e).__name__}: {e}", type="server_error")


def decode_frame(data: str | bytes) -> WsClientMessage:
    """A client frame as a message, or an ApiError 400 for anything that is not one.

    Catches more than `errors.decode` promises: for msgspec, bytes that are not UTF-8 are a
    UnicodeDecodeError and deep nesting a RecursionError, and neither may reach the handler.
    """
    try:
        return decode(data if isinstance(data, bytes) else data.encode(), WsClientMessage)
    except ApiError:
        raise
    except UnicodeError as e:
        raise ApiError(400, f"the message is not valid UTF-8: {e}", code="invalid_json") from None
    except RecursionError:
        raise ApiError(400, "the message is nested too deeply", code="invalid_json") from None
    except Exception as e:  # whatever else the decoder raises on bytes it cannot take
        raise ApiError(400, f"cannot decode the message: {type(e).__name__}: {e}", code="invalid_json") from None


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

    async def on_frame(self, data: str | bytes) -> None:
        """One client frame; never raises but for a gone socket (ConnectionResetError)."""
        try:
            await self.on_message(data)
        except ConnectionResetError:
            raise
        except Exception as e:  # a bug: this frame gets a 500, the socket and its generations go on
            log.exception("websocket: handling a frame failed")
            await self.send_error(None, _internal(e))

    async def on_message(self, data: str | bytes) -> None:
        try:
            msg = decode_frame(data)
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
                err = _internal(e)
            await self.send_error(msg.id, err)
            return
        run = _Running(group, many, msg.return_text_in_logprobs)
        run.task = asyncio.create_task(self._run(msg.id, run))
        self.running[msg.id] = run

    async def _run(self, gen_id: str | int, run: _Running) -> None:
        """Stream one generation, then its final delta(s): the only writer of its frames."""
        try:
            ending = await self._stream(gen_id, run)
            await run.group.aclose()  # what still runs is aborted in the engine before we answer
            for i in range(len(run.group.specs)):
                if i not in run.finished:
                    finish = {"type": "abort", "message": ending}
                    await self.send(WsDelta(gen_id, "", [], finish, None, i if run.many else None))
                    run.finished.add(i)
        except ConnectionResetError:
            pass  # the socket is gone: nobody to tell; the handler's cleanup aborts the rest
        except Exception:
            log.exception("websocket: ending generation %r failed", gen_id)
        finally:
            await run.group.aclose()
            if self.running.get(gen_id) is run:
                del self.running[gen_id]

    async def _stream(self, gen_id: str | int, run: _Running) -> str:
        """Send the generation's deltas; returns the abort message for choices left unfinished."""
        t0 = time.perf_counter()
        outs = [ResultBuilder() for _ in run.group.specs]  # the final meta_info's log-probs
        text = self.state.token_text if run.return_text_in_logprobs else None
        try:
            async for i, d in run.group:
                done = d.finish_reason is not None
                outs[i].add(d)
                meta = result_meta(run.group.specs[i], outs[i], t0, text) if done else None
                await self.send(
                    WsDelta(gen_id, d.text, d.token_ids, finish_reason_obj(d), meta, i if run.many else None)
                )
                if done:
                    run.finished.add(i)
        except ConnectionResetError:
            raise
        except Exception as e:
            if e is run.group.aborted:  # cancel or shutdown: the final delta says why
                return run.group.aborted.message
            err = to_api_error(e)
            if err is None:
                log.exception("websocket generation %r failed", gen_id)
                err = _internal(e)
            await self.send_error(gen_id, err)
            return err.message
        return NO_FINISH

    async def cancel(self, gen_id: str | int) -> None:
        run = self.running.get(gen_id)
        if run is None:
            await self.send_error(gen_id, ApiError(404, f"no running generation {gen_id!r}", param="id"))
            return
        run.group.abort(ApiError(400, CANCELLED, param="id", code="cancelled"))  # a no-op if already ending
        if run.task is not None:  # its final delta goes out before the next frame is read
            await asyncio.wait({run.task})

    async def close_all(self) -> None:
        """The socket is gone: abort everything still running on it.

        The cleanup runs in its own task, shielded: aiohttp cancels this handler when the client
        goes away, possibly in the middle of it, and a generation task cancelled before it ever
        ran never reaches its own `finally`. Unshielded, such a generation kept running for
        nobody and its admission slot was never released (found by bench.soak).
        """
        runs = list(self.running.values())
        self.running.clear()
        for run in runs:
            if run.task is not None:
                run.task.cancel()
        cleanup = asyncio.ensure_future(_close_runs(runs))
        _CLEANUPS.add(cleanup)  # referenced until done, even if this handler is cancelled
        cleanup.add_done_callback(_CLEANUPS.discard)
        await asyncio.shield(cleanup)

    def drain(self) -> None:
        """Shutdown: let running generations end (new ones get 503), then close the socket (1001).

        They end by finishing or, past the grace period, by server/launch.py aborting them: then
        each sends its final `abort` delta before the close."""

        async def wait_and_close() -> None:
            try:
                while self.running:
                    tasks = [r.task for r in list(self.running.values()) if r.task]
                    await asyncio.gather(*tasks, return_exceptions=True)
                await self.ws.close(code=WSCloseCode.GOING_AWAY, message=b"server shutting down")
            except Exception:  # nobody awaits this task: say what went wrong here
                log.debug("websocket: closing on shutdown failed", exc_info=True)

        if self._drain_task is None:
            self._drain_task = asyncio.create_task(wait_and_close())


_CLEANUPS: set[asyncio.Task] = set()


async def _close_runs(runs: list[_Running]) -> None:
    await asyncio.gather(*(r.task for r in runs if r.task), return_exceptions=True)
    for run in runs:
        try:
            await run.group.aclose()  # aborts in the engine, releases the admission slots
        except Exception:
            log.exception("websocket: closing a generation failed")


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
                await session.on_frame(msg.data)
            elif msg.type == WSMsgType.ERROR:
                break
    except ConnectionResetError:
        pass
    except Exception:  # the socket is upgraded: the error middleware's HTTP answer cannot go here
        log.exception("websocket: the connection failed")
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
