"""The live operator dashboard: GET /dashboard (one static page) and GET /dashboard/ws (its feed).

The page is `server/static/dashboard.html` with `dashboard.css` and `dashboard.js` inlined into it
when the app is built: one response, nothing else to fetch (no CDN, no build step), and a
Content-Security-Policy that lets it run its own script and talk to its own socket only.

The feed is a WebSocket that pushes one JSON text frame every INTERVAL seconds (10/s):
    {"type": "hello", "model", "interval", "steps": [...]}      first, once: the recent steps
    {"type": "snapshot", "seq", "t", <the state numbers>, "speculative", "kv_in_use_tokens", "tokens_per_s",
     "forward_tokens_per_s", "steps": [{"mode", "batch_size", "num_tokens", "duration_ms", "t"}],
     "radix_top": [{"text", "tokens", "subtree_tokens", "hits", "locked"}],
     "timelines": [{"rid", "queued", "prompt_tokens", "phases": [[name, t, tokens]],
                    "output_tokens", "finish_reason"}], "live_timelines"}
    {"type": "error", "seq", "t", "message"}                    the engine could not answer
A snapshot's own `t` is the server's wall clock (Unix seconds, for the page's time axes); every
other time in it (`t` of steps, `queued`, phase times) is in seconds relative to the scheduler's
clock when the snapshot was taken (so <= 0). `steps` are the forwards that ended since the previous
snapshot. The client sends nothing (what it sends is ignored).

Why one producer: every open dashboard would otherwise ask the scheduler for its state (a walk of
the radix tree) 10 times a second. One task takes one `get_internal_state(detail=True)` per tick,
encodes it once and hands the text to every socket; it runs only while a dashboard is connected.
Each socket has a one-frame mailbox and its own sender: a slow client's frames are replaced by
newer ones (dropped), never queued, and never hold the others up.

Auth: behind the API key like everything else, but a browser can set no header on a page load or
a WebSocket handshake, so these two paths also take the key as `?api_key=` (`query_key_ok`, used by
the middleware in server/app.py); the page passes its own query key on to the socket (and `dp_rank`,
which picks the replica behind a --dp-size front end: server/dp/dashboard.py). A key in a
URL is masked in the access log (`RedactingAccessLogger`) but stays in the browser's history: a
client that can set the header should.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import contextlib
import hashlib
import hmac
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
from aiohttp import WSCloseCode, WSMsgType, web

from engine import Engine, StepRecord
from server.state import STATE

log = logging.getLogger(__name__)

DASHBOARD_PATH = "/dashboard"
FEED_PATH = "/dashboard/ws"
INTERVAL = 0.1  # seconds between snapshots: 10 updates/s
HISTORY_STEPS = 300  # steps sent to a new client, and the most one snapshot carries
MAX_TIMELINES = 40  # the newest request timelines per snapshot (the page shows about that many)
RATE_WINDOW = 1.0  # seconds tokens/s is measured over
HEARTBEAT = 15.0  # seconds between pings to a dashboard (a browser answers them by itself)
STATIC = Path(__file__).resolve().parent / "static"
_STATE_KEYS = (
    "running_requests",
    "waiting_requests",
    "total_tokens",
    "available_tokens",
    "evictable_tokens",
    "protected_tokens",
    "token_usage",
    "cache_hit_rate",
    "num_retractions",
    "generated_tokens",
    "gen_throughput",
    "new_token_ratio",
    "max_running_requests",
    "healthy",
    "speculative",  # None, or the n-gram speculation totals (accept_rate, accept_length, ...)
)


def query_key_ok(request: web.Request, key: str) -> bool:
    """Whether a dashboard request carries the API key as `?api_key=` (see the module doc)."""
    if request.path not in (DASHBOARD_PATH, FEED_PATH):
        return False
    given = request.query.get("api_key", "")
    return hmac.compare_digest(given.encode(), key.encode())


def build_page(static: Path = STATIC) -> tuple[bytes, str]:
    """The page with its CSS and JS inlined, and the Content-Security-Policy that fits it (the
    script allowed by its hash, so nothing injected into the page could run)."""
    html = (static / "dashboard.html").read_text()
    css = (static / "dashboard.css").read_text()
    js = (static / "dashboard.js").read_text()
    html = html.replace('<link rel="stylesheet" href="dashboard.css">', f"<style>\n{css}</style>")
    html = html.replace('<script src="dashboard.js"></script>', f"<script>\n{js}</script>")
    digest = base64.b64encode(hashlib.sha256(f"\n{js}".encode()).digest()).decode()
    csp = (
        f"default-src 'none'; script-src 'sha256-{digest}'; style-src 'unsafe-inline'; "
        "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'"
    )
    return html.encode(), csp


def step_dict(step: StepRecord, clock: float) -> dict[str, Any]:
    return {
        "mode": step.mode,
        "batch_size": step.batch_size,
        "num_tokens": step.num_tokens,
        "duration_ms": round((step.end - step.start) * 1000, 3),
        "t": round(step.end - clock, 4),
    }


def timeline_dict(tl: dict[str, Any], clock: float) -> dict[str, Any]:
    return {
        "rid": tl["rid"],
        "queued": round(tl["queued_at"] - clock, 4),
        "prompt_tokens": tl["prompt_tokens"],
        "phases": [[name, round(t - clock, 4), tokens] for name, t, tokens in tl["phases"]],
        "output_tokens": tl["output_tokens"],
        "finish_reason": tl["finish_reason"],
    }


class Feed:
    """The one producer and its subscribers' one-frame mailboxes (see the module doc)."""

    def __init__(self, engine: Engine, model: str) -> None:
        self.engine = engine
        self.model = model
        self.clients: dict[web.WebSocketResponse, asyncio.Queue[str]] = {}
        self.task: asyncio.Task | None = None
        self.seq = 0
        self.last_step_end = float("-inf")
        self.recent: collections.deque[StepRecord] = collections.deque(maxlen=HISTORY_STEPS)
        self.clock = 0.0  # the scheduler's clock at the latest snapshot
        self.generated: collections.deque[tuple[float, int]] = collections.deque()
        self.texts: dict[tuple[int, ...], str] = {}

    def subscribe(self, ws: web.WebSocketResponse) -> asyncio.Queue[str]:
        box: asyncio.Queue[str] = asyncio.Queue(maxsize=1)
        self.clients[ws] = box
        if self.task is None or self.task.done():
            self.task = asyncio.create_task(self.run())
        return box

    def unsubscribe(self, ws: web.WebSocketResponse) -> None:
        self.clients.pop(ws, None)
        if not self.clients and self.task is not None:
            self.task.cancel()  # nobody watches: the scheduler is asked for nothing
            self.task = None

    def hello(self) -> str:
        steps = [step_dict(s, self.clock) for s in self.recent]
        frame = {"type": "hello", "model": self.model, "interval": INTERVAL, "steps": steps}
        return msgspec.json.encode(frame).decode()

    def publish(self, text: str) -> None:
        for box in self.clients.values():
            if box.full():  # the client has not taken the last one: it gets the newest instead
                box.get_nowait()
            box.put_nowait(text)

    async def run(self) -> None:
        """Tick every INTERVAL on the loop's clock (late ticks are skipped, not bunched).

        The loop also ends when it is no longer `self.task`: a cancel can be lost (Python 3.11's
        `asyncio.wait_for`, inside the engine's control call, swallows one that arrives as the
        reply does), and a lost one must not leave a second producer ticking."""
        loop = asyncio.get_running_loop()
        next_tick = loop.time()
        self.generated.clear()  # samples from before an idle spell would skew the first rates
        while self.task is asyncio.current_task():
            frame = await self.frame()
            if self.task is not asyncio.current_task():
                return
            self.publish(frame)
            next_tick += INTERVAL
            now = loop.time()
            if next_tick < now:
                next_tick = now
            await asyncio.sleep(next_tick - now)

    async def frame(self) -> str:
        self.seq += 1
        try:
            frame = await self.snapshot()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # an unhealthy or stopped engine: say so, keep ticking
            log.debug("dashboard: no snapshot", exc_info=True)
            frame = {"type": "error", "seq": self.seq, "t": time.time(), "message": f"{type(e).__name__}: {e}"}
        return msgspec.json.encode(frame).decode()

    async def snapshot(self) -> dict[str, Any]:
        st = await self.engine.get_internal_state(detail=True)
        clock = self.clock = st["clock"]
        out: dict[str, Any] = {"type": "snapshot", "seq": self.seq, "t": time.time()}
        out.update({k: st[k] for k in _STATE_KEYS if k in st})
        out["kv_in_use_tokens"] = st["total_tokens"] - st["available_tokens"] - st["evictable_tokens"]
        out["tokens_per_s"] = self.tokens_per_s(clock, st["generated_tokens"])
        out["steps"], out["forward_tokens_per_s"] = self.new_steps(clock)
        out["radix_top"] = [self.prefix_dict(p) for p in st.get("radix_top", [])]
        timelines = sorted(st.get("timelines", []), key=lambda tl: tl["queued_at"])
        out["live_timelines"] = sum(1 for tl in timelines if tl["finish_reason"] is None)
        out["timelines"] = [timeline_dict(tl, clock) for tl in timelines[-MAX_TIMELINES:]]
        return out

    def tokens_per_s(self, clock: float, generated: int) -> float:
        """Generated tokens per second over the last RATE_WINDOW seconds of snapshots."""
        samples = self.generated
        samples.append((clock, generated))
        while len(samples) > 2 and samples[1][0] <= clock - RATE_WINDOW:
            samples.popleft()
        t0, g0 = samples[0]
        return round((generated - g0) / (clock - t0), 1) if clock > t0 else 0.0

    def new_steps(self, clock: float) -> tuple[list[dict[str, Any]], float]:
        """The forwards that ended since the previous snapshot (at most HISTORY_STEPS), and the
        tokens per second the forwards computed (prefill and decode) over RATE_WINDOW."""
        fresh: list[StepRecord] = []
        window_tokens = 0
        for rec in reversed(self.engine.recent_steps()):  # newest first
            in_window = rec.end > clock - RATE_WINDOW
            is_new = rec.end > self.last_step_end and len(fresh) < HISTORY_STEPS
            if not (in_window or is_new):
                break
            window_tokens += rec.num_tokens if in_window else 0
            if is_new:
                fresh.append(rec)
        if fresh:
            self.last_step_end = fresh[0].end
        fresh.reverse()
        self.recent.extend(fresh)
        return [step_dict(s, clock) for s in fresh], round(window_tokens / RATE_WINDOW, 1)

    def prefix_dict(self, p: dict[str, Any]) -> dict[str, Any]:
        head = tuple(p["head"])
        text = self.texts.get(head)
        if text is None:
            if len(self.texts) > 4096:
                self.texts.clear()
            text = self.texts[head] = self.engine.detokenize(head)
        keys = ("tokens", "subtree_tokens", "hits", "locked")
        return {"text": text, **{k: p[k] for k in keys}}

    async def close_all(self) -> None:
        """Shutdown: every dashboard socket closes now (1001), not at the end of the grace period."""
        for ws in list(self.clients):
            with contextlib.suppress(Exception):
                await ws.close(code=WSCloseCode.GOING_AWAY, message=b"server shutting down")
        self.clients.clear()
        if self.task is not None:
            self.task.cancel()
            self.task = None


class _Page(msgspec.Struct):
    """The assembled page, built once when the routes are added."""

    body: bytes
    csp: str


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
FEED: web.AppKey[Feed] = web.AppKey("dashboard_feed", Feed)
PAGE: web.AppKey[_Page] = web.AppKey("dashboard_page", _Page)


async def dashboard_page(request: web.Request) -> web.Response:
    page = request.app[PAGE]
    headers = {
        "Content-Security-Policy": page.csp,
        "Cache-Control": "no-store",
        "Referrer-Policy": "no-referrer",  # the URL may carry the API key
        "X-Content-Type-Options": "nosniff",
    }
    return web.Response(body=page.body, content_type="text/html", charset="utf-8", headers=headers)


async def _send_frames(ws: web.WebSocketResponse, box: asyncio.Queue[str]) -> None:
    """This client's sender: a slow socket stalls only here, while its mailbox keeps the newest."""
    while True:
        await ws.send_str(await box.get())


async def dashboard_feed(request: web.Request) -> web.WebSocketResponse:
    feed = request.app[FEED]
    # The client has nothing to say; pings find a peer that vanished without closing.
    ws = web.WebSocketResponse(max_msg_size=4096, heartbeat=HEARTBEAT)
    await ws.prepare(request)
    if request.app[STATE].draining:
        await ws.close(code=WSCloseCode.GOING_AWAY, message=b"server shutting down")
        return ws
    await ws.send_str(feed.hello())
    sender = asyncio.create_task(_send_frames(ws, feed.subscribe(ws)))
    try:
        async for msg in ws:  # read only to see the close (and answer pings)
            if msg.type == WSMsgType.ERROR:
                break
            if sender.done():
                break
    except ConnectionResetError:
        pass
    finally:
        feed.unsubscribe(ws)
        sender.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):  # its error is the gone socket's
            await sender
    return ws


async def _close_feeds(app: web.Application) -> None:
    await app[FEED].close_all()


def add_page(app: web.Application, handler: Handler = dashboard_page) -> None:
    """GET /dashboard, the page assembled once. The --dp-size front end serves the same page with
    its own feed (server/dp/dashboard.py); its `handler` checks the replica asked for first."""
    body, csp = build_page()
    app[PAGE] = _Page(body, csp)
    app.router.add_get(DASHBOARD_PATH, handler)


def add_routes(app: web.Application) -> None:
    """GET /dashboard and GET /dashboard/ws; needs `app[STATE]` (server/app.py sets it first)."""
    state = app[STATE]
    add_page(app)
    app[FEED] = Feed(state.engine, state.config.model_name)
    app.router.add_get(FEED_PATH, dashboard_feed)
    app.on_shutdown.append(_close_feeds)


__all__ = [
    "DASHBOARD_PATH",
    "FEED_PATH",
    "HEARTBEAT",
    "INTERVAL",
    "Feed",
    "add_page",
    "add_routes",
    "build_page",
    "dashboard_page",
    "query_key_ok",
]
