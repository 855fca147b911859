"""The live dashboard without a browser (issue 18, item 4): GET /dashboard is one self-contained
page (nothing fetched from elsewhere), GET /dashboard/ws pushes snapshots at 10/s whose numbers are
the scheduler's (/get_server_info's when idle), both behind the API key, which a browser may pass
as `?api_key=`. The feed's fan-out (one producer, a slow client's frames dropped) is checked in
process on a stand-in engine; tests/test_dashboard_browser.py loads the page in Chromium."""

from __future__ import annotations

import asyncio
import itertools
import re
import signal
import socket
import time

import aiohttp
import pytest

from engine import StepRecord
from server.dashboard import INTERVAL, Feed, build_page
from tests.server_helpers import TINY_ARGS, ServerProcess, shared_server, tiny_model_dir, wait_clean  # noqa: F401

pytestmark = pytest.mark.timeout(180)
KEY = "dash-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
DASHBOARD_ARGS = (*TINY_ARGS, "--api-key", KEY, "--chunked-prefill-size", "32")
SNAPSHOT_KEYS = {
    "type", "seq", "t", "running_requests", "waiting_requests", "total_tokens", "available_tokens",
    "evictable_tokens", "protected_tokens", "token_usage", "cache_hit_rate", "num_retractions",
    "generated_tokens", "gen_throughput", "new_token_ratio", "max_running_requests", "healthy",
    "kv_in_use_tokens", "tokens_per_s", "forward_tokens_per_s", "steps", "radix_top", "timelines",
    "live_timelines", "speculative",
}  # fmt: skip
SAME_AS_SERVER_INFO = (
    "running_requests", "waiting_requests", "total_tokens", "available_tokens", "evictable_tokens",
    "protected_tokens", "num_retractions", "generated_tokens", "max_running_requests", "cache_hit_rate",
)  # fmt: skip


def dashboard_server(request, tiny_model_dir: str):
    """The tiny model with an API key and small prefill chunks (several per prompt), shared with
    the browser test when both run in one process."""
    return shared_server(request, "dashboard", tiny_model_dir, *DASHBOARD_ARGS)


@pytest.fixture
def server(request, tiny_model_dir):
    return dashboard_server(request, tiny_model_dir)


async def snapshots(ws: aiohttp.ClientWebSocketResponse, seconds: float) -> list[dict]:
    """The snapshot frames received over `seconds` (the hello frame is checked and skipped)."""
    out: list[dict] = []
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        try:
            frame = await ws.receive_json(timeout=left)
        except TimeoutError:
            break
        if frame["type"] == "hello":
            assert frame["interval"] == INTERVAL and isinstance(frame["steps"], list)
            continue
        assert frame["type"] == "snapshot", frame
        out.append(frame)
    return out


def test_page_is_self_contained():
    page, csp = build_page()
    html = page.decode()
    assert "<script>" in html and "<style>" in html  # inlined, not linked
    assert not re.search(r"<script[^>]*\bsrc=|<link[^>]*\bhref=(?!\"data:)", html, re.I)
    assert "http://" not in html and "https://" not in html and "url(" not in html and "@import" not in html
    for element_id in ("running", "waiting", "generated-tokens", "total-tokens", "retractions", "cache-hit-rate"):
        assert f'id="{element_id}"' in html
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp


async def test_page_and_api_key(server):
    async with aiohttp.ClientSession() as s:
        async with s.get(server.url + "/dashboard", headers=AUTH) as r:
            assert r.status == 200 and r.content_type == "text/html"
            html = await r.text()
            assert r.headers["Content-Security-Policy"].startswith("default-src 'none'")
            assert r.headers["Referrer-Policy"] == "no-referrer"
        assert 'id="updates"' in html and "http://" not in html and "https://" not in html
        async with s.get(server.url + f"/dashboard?api_key={KEY}") as r:
            assert r.status == 200 and await r.text() == html
        for query in ("", "?api_key=wrong", "?api_key="):
            async with s.get(server.url + "/dashboard" + query) as r:
                assert r.status == 401
                assert (await r.json())["error"]["code"] == "invalid_api_key"
        async with s.get(server.url + f"/get_server_info?api_key={KEY}") as r:
            assert r.status == 401  # the query key opens the dashboard's routes only
        with pytest.raises(aiohttp.WSServerHandshakeError) as e:
            await s.ws_connect(server.url + "/dashboard/ws")
        assert e.value.status == 401
        for kwargs in ({"headers": AUTH}, {"params": {"api_key": KEY}}):
            async with s.ws_connect(server.url + "/dashboard/ws", **kwargs) as ws:
                assert (await ws.receive_json(timeout=10))["type"] == "hello"
        async with s.get(server.url + "/dashboard/ws", headers=AUTH) as r:
            assert r.status == 400  # no upgrade headers, as /openapi.json says
        async with s.get(server.url + "/openapi.json") as r:
            paths = (await r.json())["paths"]
        assert "x-undocumented" not in paths["/dashboard"]["get"]
        assert "x-websocket" in paths["/dashboard/ws"]["get"]
    log = server.log_path.read_text()
    assert "/dashboard?api_key=" in log and KEY not in log  # access lines mask a query-string key


async def test_feed_rate_and_idle_numbers(server):
    async with aiohttp.ClientSession(headers=AUTH) as s:
        idle = await wait_clean(s, server.url, headers=AUTH)
        async with s.ws_connect(server.url + "/dashboard/ws") as ws:
            frames = await snapshots(ws, 2.0)
            async with s.get(server.url + "/get_server_info") as r:
                info = (await r.json())["internal_states"][0]
            last = (await snapshots(ws, 0.25))[-1]
    assert 12 <= len(frames) <= 24, len(frames)  # 10/s (a busy test machine may skip a few ticks)
    assert all(f.keys() == SNAPSHOT_KEYS for f in frames), frames[0].keys() ^ SNAPSHOT_KEYS
    gaps = [b["t"] - a["t"] for a, b in itertools.pairwise(frames)]
    assert 0.08 < sum(gaps) / len(gaps) < 0.17, gaps
    assert [b["seq"] - a["seq"] for a, b in itertools.pairwise(frames)] == [1] * (len(frames) - 1)
    for key in SAME_AS_SERVER_INFO:
        assert last[key] == info[key] == idle[key], key
    assert last["kv_in_use_tokens"] == info["total_tokens"] - info["available_tokens"] - info["evictable_tokens"]
    assert last["tokens_per_s"] == 0 and last["live_timelines"] == 0 and last["steps"] == []
    assert last["speculative"] is None  # not a speculating server


async def test_feed_under_load(server):
    prefix = "The dashboard shows what the scheduler does, step by step, for every request. " * 3
    new = 160  # enough work to be seen running by several snapshots, even on a fast machine
    gen = {"sampling_params": {"max_new_tokens": new, "temperature": 0.0, "ignore_eos": True}}
    async with aiohttp.ClientSession(headers=AUTH) as s:
        before = await wait_clean(s, server.url, headers=AUTH)

        async def one(i: int) -> None:
            async with s.post(server.url + "/generate", json={**gen, "text": prefix + f"request {i}"}) as r:
                assert r.status == 200, await r.text()

        async with s.ws_connect(server.url + "/dashboard/ws") as ws:
            load = asyncio.gather(*(one(i) for i in range(8)))
            frames = await snapshots(ws, 0.5)
            await load
            frames += await snapshots(ws, 0.5)
    steps = [st for f in frames for st in f["steps"]]
    assert {"EXTEND", "DECODE"} <= {st["mode"] for st in steps} <= {"EXTEND", "DECODE", "MIXED"}
    assert all(st["batch_size"] >= 1 and st["duration_ms"] >= 0 and st["t"] <= 0 for st in steps)
    assert max(f["running_requests"] for f in frames) >= 1
    assert max(f["tokens_per_s"] for f in frames) > 0 and max(f["forward_tokens_per_s"] for f in frames) > 0
    assert frames[-1]["generated_tokens"] == before["generated_tokens"] + 8 * new
    finished = [tl for tl in frames[-1]["timelines"] if tl["finish_reason"] is not None]
    assert len(finished) >= 8
    for tl in finished[-8:]:
        names = [p[0] for p in tl["phases"]]
        assert names[0] == "prefill" and names[-2:] == ["decode", "finished"], names
        times = [tl["queued"]] + [p[1] for p in tl["phases"]]
        assert times == sorted(times) and times[-1] <= 0 and tl["output_tokens"] == new
    assert any(names.count("prefill") > 1 for names in ([p[0] for p in tl["phases"]] for tl in finished))  # chunks
    top = frames[-1]["radix_top"]
    assert top and any(p["text"].startswith("The dashboard shows") and p["hits"] >= 1 for p in top), top


class StandInEngine:
    """What the feed reads of the engine, counted (in process: no server needed)."""

    def __init__(self) -> None:
        self.calls = 0
        self.steps: list[StepRecord] = []
        self.generated = 0

    async def get_internal_state(self, detail: bool = False) -> dict:
        assert detail
        self.calls += 1
        now = time.perf_counter()
        self.generated += 5
        self.steps.append(StepRecord("DECODE", 5, 5, now - 0.01, now - 0.005))
        base = {"running_requests": 5, "waiting_requests": 0, "total_tokens": 100, "available_tokens": 60}
        base |= {"evictable_tokens": 30, "generated_tokens": self.generated, "num_retractions": 0, "clock": now}
        return base | {"radix_top": [{"head": [1, 2], "tokens": 2, "subtree_tokens": 2, "hits": 3, "locked": False}]}

    def recent_steps(self) -> list[StepRecord]:
        return list(self.steps)

    def detokenize(self, ids) -> str:
        return " ".join(map(str, ids))


async def test_feed_fans_out_and_drops_for_a_slow_client():
    engine = StandInEngine()
    feed = Feed(engine, "m")  # type: ignore[arg-type]  (duck-typed)
    fast, slow = object(), object()
    fast_box = feed.subscribe(fast)  # type: ignore[arg-type]
    slow_box = feed.subscribe(slow)  # type: ignore[arg-type]
    got: list[str] = []
    for _ in range(10):
        got.append(await asyncio.wait_for(fast_box.get(), 2))
    assert engine.calls <= 11  # one producer for both clients
    assert slow_box.qsize() == 1  # never read: holds only the newest frame
    assert '"seq":' in slow_box.get_nowait() and len(set(got)) == 10
    feed.unsubscribe(fast)  # type: ignore[arg-type]
    assert feed.task is not None
    feed.unsubscribe(slow)  # type: ignore[arg-type]
    assert feed.task is None  # nobody watches: nothing is asked of the engine
    calls = engine.calls
    await asyncio.sleep(3 * INTERVAL)
    assert engine.calls == calls


async def test_a_stalled_socket_does_not_hold_the_others(server):
    """A client that completes the handshake and then never reads, its receive buffer tiny."""
    host, port = server.url.removeprefix("http://").split(":")
    raw = socket.socket()
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    raw.connect((host, int(port)))
    raw.sendall(
        (
            f"GET /dashboard/ws?api_key={KEY} HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\n"
            "Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
        ).encode()
    )
    try:
        assert b"101" in raw.recv(12)
        async with aiohttp.ClientSession(headers=AUTH) as s, s.ws_connect(server.url + "/dashboard/ws") as ws:
            frames = await snapshots(ws, 1.5)
        assert len(frames) >= 11, len(frames)
    finally:
        raw.close()


async def test_shutdown_closes_open_dashboards(tiny_model_dir, tmp_path):
    """SIGTERM with a dashboard open: its socket is closed at once (1001) and the server exits 0,
    without waiting out the grace period for a socket that would never close by itself."""
    srv = ServerProcess(tiny_model_dir, *TINY_ARGS, "--graceful-shutdown-timeout", "120", log_dir=tmp_path).start()
    try:
        async with aiohttp.ClientSession() as s, s.ws_connect(srv.url + "/dashboard/ws") as ws:
            assert len(await snapshots(ws, 0.5)) >= 3
            srv.signal(signal.SIGTERM)
            async with asyncio.timeout(60):  # half the grace period: a server that waits it out fails here
                while (await ws.receive()).type not in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED):
                    pass
            assert ws.close_code == 1001
        assert await asyncio.to_thread(srv.proc.wait, 60) == 0, srv.log_tail()  # a hang guard, under the grace
    finally:
        srv.stop()
