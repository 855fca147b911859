"""GET /dashboard and GET /dashboard/ws on the --dp-size front end: a single server's page, fed
by one replica's own feed, relayed.

Why relay one replica rather than aggregate them: a snapshot is one engine's scheduler (its KV
pool, its radix tree, its requests' timelines, its steps); a sum over replicas would show a pool,
a cache and a batch that exist nowhere, and a second snapshot producer would copy
server/dashboard.py. So the page is the same bytes as a single server's (`dashboard.add_page`),
and its feed, GET /dashboard/ws?dp_rank=I (default 0), is replica I's /dashboard/ws passed on
frame by frame (replicas listen on loopback: a browser could not reach them itself). The hello
frame gets a `dp` key (this rank; every replica's index, health, restarts and device, as at the
moment the socket opened), which the page shows as links to each replica's dashboard,
/dashboard?dp_rank=J. A replica that is down gets the hello and an error frame, then a close; the
page reconnects with back-off, and so comes back to it once it is up again.

Auth as on a single server: the API key as the header or `?api_key=` (the router's middleware,
`RouterConfig.query_key_paths`); the front end opens the replica's feed with the key itself.
Back-pressure: a slow browser stalls only its own relay; the replica then finds that socket's
sender busy and drops its frames there (its one-frame mailbox), never queueing them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import WSCloseCode, WSMsgType, web

from server import dashboard
from server.router.errors import RouterError
from server.router.state import ROUTER

RANK_PARAM = "dp_rank"
_HELLO_KEYS = ("index", "healthy", "restarts", "device", "torch_threads", "kv_pool_tokens")


@dataclass
class Relays:
    """What the feed needs of the front end, and its open sockets (closed at shutdown)."""

    describe: Callable[[], dict[str, Any]]  # the `dp` section of /get_server_info
    model: str
    sockets: set[web.WebSocketResponse] = field(default_factory=set)


RELAYS: web.AppKey[Relays] = web.AppKey("dashboard_relays", Relays)


def replica_rank(request: web.Request, size: int) -> int:
    """`?dp_rank=` (default 0); a 400 naming it when it is not a replica's index."""
    raw = request.query.get(RANK_PARAM, "0")
    rank = int(raw) if raw.isdigit() else -1
    if not 0 <= rank < size:
        message = f"{RANK_PARAM} must be a replica index from 0 to {size - 1}, not {raw!r}"
        raise RouterError(400, message, code="invalid_dp_rank")
    return rank


async def page(request: web.Request) -> web.StreamResponse:
    replica_rank(request, request.app[RELAYS].describe()["size"])  # a bad rank: the 400, not a dead page
    return await dashboard.dashboard_page(request)


def hello_dp(dp: dict[str, Any], rank: int) -> dict[str, Any]:
    return {"rank": rank, "replicas": [{k: entry.get(k) for k in _HELLO_KEYS} for entry in dp["replicas"]]}


def with_dp(text: str, extra: dict[str, Any]) -> str:
    """The replica's hello frame with `dp` added (any other frame unchanged)."""
    try:
        frame = json.loads(text)
    except ValueError:
        return text
    if not isinstance(frame, dict) or frame.get("type") != "hello":
        return text
    return json.dumps({**frame, "dp": extra})


async def feed(request: web.Request) -> web.WebSocketResponse:
    relays, router = request.app[RELAYS], request.app[ROUTER]
    dp = relays.describe()
    rank = replica_rank(request, dp["size"])
    entry = dp["replicas"][rank]
    client = web.WebSocketResponse(max_msg_size=4096, heartbeat=dashboard.HEARTBEAT)
    await client.prepare(request)
    relays.sockets.add(client)
    try:
        await relay(client, router.session, entry, router.auth_headers(), hello_dp(dp, rank), relays.model)
    finally:
        relays.sockets.discard(client)
    return client


async def relay(
    client: web.WebSocketResponse,
    session: aiohttp.ClientSession | None,
    entry: dict[str, Any],
    headers: dict[str, str],
    extra: dict[str, Any],
    model: str,
) -> None:
    """Replica `entry`'s feed to `client` until either side closes."""
    try:
        if session is None or not entry.get("url") or not entry.get("healthy"):
            raise ConnectionError("it is down")
        upstream = await session.ws_connect(entry["url"] + dashboard.FEED_PATH, headers=headers)
    except (aiohttp.ClientError, OSError, TimeoutError) as e:
        hello = {"type": "hello", "model": model, "interval": dashboard.INTERVAL, "steps": [], "dp": extra}
        why = f"replica {entry['index']} is not reachable ({e}); retrying"
        with contextlib.suppress(ConnectionError):
            await client.send_str(json.dumps(hello))
            await client.send_str(json.dumps({"type": "error", "seq": 0, "t": time.time(), "message": why}))
        await client.close(code=WSCloseCode.TRY_AGAIN_LATER, message=b"replica down")
        return

    async def pump() -> None:
        first = True
        try:
            async for msg in upstream:
                if msg.type is not WSMsgType.TEXT:
                    break
                await client.send_str(with_dp(msg.data, extra) if first else msg.data)
                first = False
        except (aiohttp.ClientError, ConnectionError):
            pass  # either socket broke: the close below ends the other side
        finally:
            await client.close(code=WSCloseCode.GOING_AWAY, message=b"the replica's feed ended")

    sender = asyncio.create_task(pump())
    try:
        async for msg in client:  # read only to see the close (and answer pings)
            if msg.type is WSMsgType.ERROR:
                break
    except ConnectionResetError:
        pass
    finally:
        sender.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await sender
        await upstream.close()


async def close_all(app: web.Application) -> None:
    """Shutdown: every dashboard socket closes now (1001), so none holds the front end's drain."""
    for ws in list(app[RELAYS].sockets):
        with contextlib.suppress(Exception):
            await ws.close(code=WSCloseCode.GOING_AWAY, message=b"server shutting down")


def add_routes(app: web.Application, describe: Callable[[], dict[str, Any]], model: str) -> None:
    """GET /dashboard (the page) and GET /dashboard/ws (the relayed feed); `describe()` gives the
    `dp` section (size, replicas: index, url, healthy, ...)."""
    app[RELAYS] = Relays(describe, model)
    dashboard.add_page(app, page)
    app.router.add_get(dashboard.FEED_PATH, feed)
    app.on_shutdown.append(close_all)


__all__ = ["RANK_PARAM", "Relays", "add_routes", "relay", "replica_rank", "with_dp"]
