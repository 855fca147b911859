"""The router's WebSocket relay against fake workers (server/router/ws_relay.py): a worker lost in
mid-generation ends that generation with an error and an abort delta; the others go on."""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web

from server.router import RouterConfig
from server.router.app import build_router_app
from tests.dp_helpers import serving


def _worker(die_on: str) -> web.Application:
    """Answers each generate with one delta then a final one, except `die_on`, after whose first
    delta the worker's socket breaks."""

    async def health(request):
        return web.json_response({})

    async def ws(request):
        sock = web.WebSocketResponse()
        await sock.prepare(request)
        async for msg in sock:
            frame = msg.json()
            gid = frame["id"]
            await sock.send_json({"type": "delta", "id": gid, "text": "x", "token_ids": [1]})
            if frame["text"] == die_on:
                request.transport.close()
                break
            final = {"type": "delta", "id": gid, "text": "", "token_ids": [], "finish_reason": {"type": "length"}}
            await sock.send_json(final)
        return sock

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/ws", ws)
    return app


async def test_worker_lost_mid_generation_ends_it_with_an_error_and_an_abort():
    async with serving(_worker(die_on="doomed")) as worker:
        config = RouterConfig(worker_urls=[worker], policy="round_robin", health_check_interval=0.2)
        async with serving(build_router_app(config)) as router, aiohttp.ClientSession() as s:
            async with s.ws_connect(router + "/ws") as ws:
                await ws.send_json({"type": "generate", "id": "ok", "text": "fine", "sampling_params": {}})
                got = [await ws.receive_json() for _ in range(2)]
                assert [m.get("finish_reason") for m in got] == [None, {"type": "length"}]
                await ws.send_json({"type": "generate", "id": 7, "text": "doomed", "sampling_params": {}})
                async with asyncio.timeout(60):  # a hang guard, generous for a busy machine
                    got = [await ws.receive_json() for _ in range(3)]
                assert [m["type"] for m in got] == ["delta", "error", "delta"]
                assert got[1]["id"] == 7 and got[1]["error"]["code"] == "worker_failed"
                assert got[2]["id"] == 7 and got[2]["finish_reason"]["type"] == "abort"
                # the socket stays usable: the next generation opens a new upstream socket
                await ws.send_json({"type": "generate", "id": "again", "text": "fine", "sampling_params": {}})
                async with asyncio.timeout(60):  # a hang guard, generous for a busy machine
                    got = [await ws.receive_json() for _ in range(2)]
                assert got[1]["id"] == "again" and got[1]["finish_reason"] == {"type": "length"}
