"""The router's journal of state-changing admin calls (server/router/journal.py): its net effect
for a fresh worker, pure; and in process, a router over stand-in workers (tiny aiohttp apps that
record the calls they take and can fail /health or refuse a call) holding out a worker that
missed or refused calls until they are replayed on it, in order. A real --dp-size replica
restored after a kill is in tests/test_dp.py."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from aiohttp import web

from server.router.app import build_router_app
from server.router.journal import STATE_ROUTES, AdminJournal
from server.router.state import ROUTER, RouterConfig
from tests.dp_helpers import poll, serving

pytestmark = pytest.mark.timeout(60)
TIMEOUT = aiohttp.ClientTimeout(total=20)


def test_the_net_effect_restores_weights_adapters_memory_and_pause_in_order():
    j = AdminJournal()
    j.record("/load_lora_adapter", {"lora_name": "a", "lora_path": "/a"}, {})
    j.record("/load_lora_adapter", {"lora_name": "b", "lora_path": "/b"}, {})
    j.record("/unload_lora_adapter", {"lora_name": "a"}, {})  # loaded and unloaded since start-up: nothing
    j.record("/unload_lora_adapter", {"lora_name": "s"}, {})  # a start-up adapter
    j.record("/load_lora_adapter", {"lora_name": "s", "lora_path": "/s2"}, {})  # the name again, new weights
    j.record("/update_weights_from_disk", {"model_path": "/w1"}, {"weight_version": "1"})
    j.record("/update_weights_from_disk", {"model_path": "/w2", "weight_version": "v2"}, {"weight_version": "v2"})
    j.record("/release_memory_occupation", {"tags": ["kv_cache"]}, {})
    j.record("/release_memory_occupation", {}, {})  # both
    j.record("/resume_memory_occupation", {"tags": ["weights"]}, {})
    j.record("/pause_generation", {"mode": "retract"}, {})
    j.record("/continue_generation", {}, {})
    j.record("/pause_generation", {"mode": "in_place"}, {})
    assert j.seq == 13
    assert j.restore() == [
        ("/update_weights_from_disk", {"model_path": "/w2", "weight_version": "v2"}),
        ("/unload_lora_adapter", {"lora_name": "s"}),
        ("/load_lora_adapter", {"lora_name": "b", "lora_path": "/b"}),
        ("/load_lora_adapter", {"lora_name": "s", "lora_path": "/s2"}),
        ("/release_memory_occupation", {"tags": ["kv_cache"]}),
        ("/pause_generation", {"mode": "in_place"}),
    ]
    # the missed calls keep the version the workers reported, so a replay gives the same one
    assert j.missed(5)[0] == (6, ("/update_weights_from_disk", {"model_path": "/w1", "weight_version": "1"}))
    assert [seq for seq, _ in j.missed(10)] == [11, 12, 13]
    j.trim([None, 11, 13])  # a fresh worker needs none of them; the slowest has 11
    assert [seq for seq, _ in j.missed(0)] == [12, 13]
    j.record("/resume_memory_occupation", {}, {})
    j.record("/continue_generation", {}, {})
    paths = [path for path, _ in j.restore()]  # back to weights and adapters only
    assert paths == ["/update_weights_from_disk", "/unload_lora_adapter", "/load_lora_adapter", "/load_lora_adapter"]
    j.record("/release_memory_occupation", {"tags": ["weights", "kv_cache"]}, {})
    j.record("/update_weights_from_disk", {"model_path": "/w3"}, {"weight_version": "4"})  # loads them again
    assert j.restore()[-1] == ("/release_memory_occupation", {"tags": ["kv_cache"]})


class StandIn:
    """A worker that answers /health (or 503 while `down`), takes every state route (recording
    it; a refused path answers 400), and counts weight updates as a server does."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict]] = []
        self.down = False
        self.refuse: set[str] = set()
        self.updates = 0
        self.delay = 0.0  # seconds each admin call takes
        self.app = web.Application()
        self.app.router.add_get("/health", self.health)
        for path in STATE_ROUTES:
            self.app.router.add_post(path, self.state_call)
        self.app.router.add_post("/start_profile", self.profile)
        self.app.router.add_post("/v1/completions", lambda r: web.json_response({"ok": True}))

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({}, status=503 if self.down else 200)

    async def profile(self, request: web.Request) -> web.Response:
        await asyncio.sleep(self.delay)
        return web.json_response({"success": True})

    async def state_call(self, request: web.Request) -> web.Response:
        body = await request.read()
        await asyncio.sleep(self.delay)
        if request.path in self.refuse:
            return web.json_response({"error": {"message": "in use"}}, status=400)
        parsed = json.loads(body) if body.strip() else {}
        self.calls.append((request.path, parsed))
        if request.path == "/update_weights_from_disk":
            self.updates += 1
            return web.json_response(
                {"success": True, "weight_version": parsed.get("weight_version") or str(self.updates)}
            )
        return web.json_response({"success": True})


async def test_a_worker_that_missed_or_refused_calls_is_held_out_until_they_are_replayed():
    workers = [StandIn() for _ in range(3)]
    async with serving(workers[0].app) as u0, serving(workers[1].app) as u1, serving(workers[2].app) as u2:
        config = RouterConfig(worker_urls=[u0, u1, u2], policy="round_robin", health_check_interval=0.05)
        app = build_router_app(config)
        async with serving(app) as url, aiohttp.ClientSession(timeout=TIMEOUT) as s:
            router = app[ROUTER]

            async def healthy(n: int):
                async with s.get(url + "/health") as r:
                    body = await r.json()
                return body if body.get("healthy_workers") == n else None

            workers[2].down = True
            await poll(lambda: healthy(2))
            load = {"lora_name": "x", "lora_path": "/adapters/x"}
            async with s.post(url + "/load_lora_adapter", json=load) as r:
                out = await r.json()
            assert r.status == 200 and out["success"], out
            assert out["workers"][2]["message"] == "unhealthy: skipped"
            async with s.post(url + "/update_weights_from_disk", json={"model_path": "/ckpt/1"}) as r:
                out = await r.json()
            assert r.status == 200 and out["weight_version"] == "1"
            workers[1].refuse.add("/unload_lora_adapter")  # its requests still use the adapter
            async with s.post(url + "/unload_lora_adapter", json={"lora_name": "x"}) as r:
                out = await r.json()
            assert r.status == 502 and not out["success"] and out["workers"][1]["status"] == 400
            assert await healthy(1)  # the one that refused is out of routing at once
            async with s.get(url + "/get_server_info") as r:
                entries = (await r.json())["workers"]
            assert "/unload_lora_adapter failed on it" in entries[1]["sync_error"] and "sync_error" not in entries[0]

            workers[2].down = False  # back: the three calls it missed, in order, then routed to
            await poll(lambda: healthy(2))
            update = ("/update_weights_from_disk", {"model_path": "/ckpt/1", "weight_version": "1"})
            unload = ("/unload_lora_adapter", {"lora_name": "x"})
            assert workers[2].calls == [("/load_lora_adapter", load), update, unload]
            assert router.workers[2].healthy and not router.workers[1].healthy
            assert "replaying /unload_lora_adapter answered 400" in router.workers[1].sync_error

            workers[1].refuse.clear()  # its requests ended: the unload goes through on a later round
            await poll(lambda: healthy(3))
            as_sent = ("/update_weights_from_disk", {"model_path": "/ckpt/1"})  # it took the broadcast itself
            assert workers[1].calls == [("/load_lora_adapter", load), as_sent, unload]
            assert [w.synced for w in router.workers] == [3, 3, 3] and router.workers[1].sync_error == ""
            seen = set()
            for _ in range(6):
                async with s.post(url + "/v1/completions", json={"prompt": "p"}) as r:
                    seen.add(r.headers["X-Router-Worker"])
            assert seen == {u0, u1, u2}
            # non-state admin routes are not journaled; a call no worker took changes nothing
            workers[0].refuse.add("/pause_generation")
            workers[1].refuse.add("/pause_generation")
            workers[2].refuse.add("/pause_generation")
            async with s.post(url + "/pause_generation", json={}) as r:
                assert r.status == 400
            assert router.journal.seq == 3 and await healthy(3)


async def test_a_slow_weight_update_is_not_cut_short(monkeypatch):
    """A weight update waits for the running requests, however long: the router waits for it (a
    call cut short would leave its outcome unknown), while other admin calls keep their timeout."""
    monkeypatch.setattr("server.router.app.ADMIN_TIMEOUT", aiohttp.ClientTimeout(total=0.2))
    worker = StandIn()
    worker.delay = 0.6  # every call it takes lasts longer than the admin timeout
    async with serving(worker.app) as u:
        app = build_router_app(RouterConfig(worker_urls=[u], health_check_interval=0.05))
        async with serving(app) as url, aiohttp.ClientSession(timeout=TIMEOUT) as s:
            async with s.post(url + "/update_weights_from_disk", json={"model_path": "/ckpt/2"}) as r:
                assert r.status == 200 and (await r.json())["weight_version"] == "1"
            async with s.post(url + "/start_profile") as r:
                out = await r.json()
            assert r.status == 502 and "TimeoutError" in out["workers"][0]["message"]
            assert app[ROUTER].workers[0].healthy  # a failed profile call changes no state
