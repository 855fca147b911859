"""Data parallelism (`python -m server --dp-size N`, server/dp/), real processes: one controller
with two replicas of the default model on the CPU, shared by a cache-hit-rate comparison
(cache-aware routing vs one replica vs round robin), a replica SIGKILLed under load and brought
back (serving the weight update its sibling took before the kill), and a graceful SIGTERM of the
whole controller (last: it ends the module's controller).
Start-up failures (a bad model path, a busy port) end the controller at once with the replica's
error. Pure and in-process checks are in tests/test_dp_units.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import socket

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server.router import RouterConfig
from server.router.app import WORKER_HEADER, build_router_app
from tests.dp_helpers import CPU_ARGS, DPServer, pid_alive, poll, run_controller, serving
from tests.server_helpers import free_port, server_env

pytestmark = pytest.mark.timeout(300)
TIMEOUT = aiohttp.ClientTimeout(total=60)

# --- (c) start-up failures, real processes ----------------------------------------------------


def test_a_bad_model_path_ends_the_controller_with_the_replicas_error(tmp_path):
    args = ("--dp-size", "2", "--model-path", "/nonexistent", "--device", "cpu", "--port", str(free_port()))
    status, _, err = run_controller(*args, timeout=120, env={**server_env(), "TMPDIR": str(tmp_path)})
    assert status != 0, err
    first = err.strip().splitlines()[0]
    assert first.startswith("error: replica ") and "model path does not exist: /nonexistent" in first, err
    logs = sorted(p.name for p in tmp_path.glob("asyncllm-dp-*/*.log"))
    assert logs == ["replica-0.log", "replica-1.log"]  # kept after a failure


def test_a_busy_port_fails_before_any_replica_loads():
    with contextlib.closing(socket.create_server(("127.0.0.1", 0))) as busy:
        port = str(busy.getsockname()[1])
        status, out, err = run_controller("--dp-size", "2", "--port", port, timeout=60)
    assert status == 1 and err.startswith("error: cannot listen on 127.0.0.1:" + port), err
    assert "Starting" not in out


# --- (a), (b): one real controller, two replicas of the default model -------------------------


@pytest.fixture(scope="module")
def dp_server(tmp_path_factory):
    server = DPServer(tmp_path_factory.mktemp("dp"), "--dp-size", "2", *CPU_ARGS)
    try:
        yield server.start()
    finally:
        server.stop()


WORDS = [
    "river",
    "stone",
    "lamp",
    "orbit",
    "quartz",
    "meadow",
    "falcon",
    "copper",
    "velvet",
    "harbor",
    "signal",
    "timber",
    "canyon",
    "ember",
]
GROUPS, ROUNDS = 4, 8


def system_prompt(group: int) -> str:
    rng = random.Random(group)
    words = " ".join(rng.choice(WORDS) for _ in range(160))
    return f"You are assistant {group}. Your rules, which you must follow exactly: {words}."


def workload() -> list[tuple[int, str]]:
    """GROUPS x ROUNDS prompts, interleaved; each round starts one group later, so a group's
    requests alternate between even and odd positions (round robin splits every group)."""
    prompts = [system_prompt(g) for g in range(GROUPS)]
    order = []
    for r in range(ROUNDS):
        for k in range(GROUPS):
            g = (k + r) % GROUPS
            order.append((g, f"{prompts[g]}\nQuestion {r}: what is rule {r}?"))
    return order


async def run_workload(session: aiohttp.ClientSession, url: str) -> tuple[float, dict[int, set[str]]]:
    """Sequentially, in order; -> (cached prompt tokens / prompt tokens, the workers of each group)."""
    async with session.post(url + "/flush_cache") as r:
        assert r.status == 200, await r.text()
    cached = prompt = 0
    workers: dict[int, set[str]] = {g: set() for g in range(GROUPS)}
    for group, text in workload():
        body = {"model": "smollm2-135m", "prompt": text, "max_tokens": 2, "temperature": 0}
        async with session.post(url + "/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
            usage = (await r.json())["usage"]
            workers[group].add(r.headers.get(WORKER_HEADER, url))
        prompt += usage["prompt_tokens"]
        cached += usage["prompt_tokens_details"]["cached_tokens"]
    return cached / prompt, workers


async def test_cache_aware_routing_keeps_the_single_replica_hit_rate(dp_server):
    dp = dp_server.dp()
    assert [r["torch_threads"] for r in dp["replicas"]] == [1, 1]  # 2 cores / 2 replicas
    assert all(r["kv_pool_tokens"] == 4096 and r["device"] == "cpu" for r in dp["replicas"])
    urls = [r["url"] for r in dp["replicas"]]
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        single, _ = await run_workload(s, urls[0])  # one replica takes everything
        aware, groups = await run_workload(s, dp_server.url)
        async with serving(build_router_app(RouterConfig(urls, policy="round_robin"))) as rr_url:
            await poll(lambda: _healthy_router(s, rr_url))
            rr, rr_groups = await run_workload(s, rr_url)
    assert all(len(ws) == 1 for ws in groups.values()), groups  # each group stays on one replica
    assert set().union(*groups.values()) == set(urls)  # and the groups use both
    assert all(len(ws) == 2 for ws in rr_groups.values()), rr_groups
    assert aware >= 0.9 * single, (aware, single)
    assert rr < aware, (rr, aware, single)


async def test_the_front_end_serves_openapi_the_dashboard_and_every_replicas_metrics(dp_server):
    """What a single server serves besides the API: /openapi.json (a replica's own document: the
    same routes), /dashboard (the same page; its feed relayed from the replica `dp_rank` names)
    and /metrics (every replica's series, labelled by `dp_rank`)."""
    urls = [r["url"] for r in dp_server.dp()["replicas"]]
    front = dp_server.url
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        body = {"text": "One more for replica 1", "sampling_params": {"max_new_tokens": 3}}
        async with s.post(urls[1] + "/generate", json=body) as r:  # the two replicas' counts differ
            assert r.status == 200, await r.text()
        docs = []
        for url in (front, urls[0]):
            async with s.get(url + "/openapi.json") as r:
                assert r.status == 200
                docs.append(await r.json())
        assert sorted(docs[0]["paths"]) == sorted(docs[1]["paths"])
        assert docs[0] == docs[1]
        pages = []
        for url in (front, urls[0]):
            async with s.get(url + "/dashboard") as r:
                assert r.status == 200 and r.content_type == "text/html"
                assert r.headers["Content-Security-Policy"].startswith("default-src 'none'")
                pages.append(await r.text())
        assert pages[0] == pages[1]
        for rank, url in enumerate(urls):
            async with s.ws_connect(f"{front}/dashboard/ws?dp_rank={rank}") as ws:
                hello = await ws.receive_json(timeout=30)
                assert hello["type"] == "hello" and hello["dp"]["rank"] == rank
                assert [(e["index"], e["healthy"]) for e in hello["dp"]["replicas"]] == [(0, True), (1, True)]
                snapshot = await ws.receive_json(timeout=30)
            async with s.get(url + "/get_server_info") as r:
                own = (await r.json())["internal_states"][0]
            assert snapshot["type"] == "snapshot", snapshot
            assert snapshot["generated_tokens"] == own["generated_tokens"] and snapshot["total_tokens"] == 4096
        async with s.get(front + "/dashboard?dp_rank=2") as r:
            assert r.status == 400 and "dp_rank" in (await r.json())["error"]["message"]
        async with s.get(front + "/no_such_route") as r:
            assert r.status == 404 and "/no_such_route" in (await r.json())["error"]["message"]

        async with s.get(front + "/metrics") as r:
            merged = {f.name: f for f in text_string_to_metric_families(await r.text())}
        assert "sgl_router_requests" in merged  # the front end's own
        for rank, url in enumerate(urls):
            async with s.get(url + "/metrics") as r:
                own = {f.name: f for f in text_string_to_metric_families(await r.text())}
            for name in ("sglang:generation_tokens", "sglang:num_requests", "sglang:e2e_request_latency_seconds"):
                mine = [(x.name, x.labels, x.value) for x in own[name].samples if not x.name.endswith("_created")]
                theirs = [
                    (x.name, {k: v for k, v in x.labels.items() if k != "dp_rank"}, x.value)
                    for x in merged[name].samples
                    if x.labels.get("dp_rank") == str(rank) and not x.name.endswith("_created")
                ]
                assert mine and theirs == mine, (name, rank)


async def _healthy_router(s: aiohttp.ClientSession, url: str) -> bool:
    async with s.get(url + "/health") as r:
        return r.status == 200 and (await r.json())["healthy_workers"] == 2


async def read_stream(response: aiohttp.ClientResponse, first: asyncio.Event) -> list[str]:
    """The SSE data payloads, `first` set once a text chunk arrived."""
    events, buffer = [], b""
    async for chunk in response.content.iter_any():
        buffer += chunk
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            events.append(event.decode().removeprefix("data: "))
            first.set()
    return events


@pytest.mark.timeout(600)  # a kill, 2 streams to their end and a replica's restart, on 2 busy cores
async def test_a_killed_replica_fails_its_streams_and_comes_back(dp_server):
    dp = dp_server.dp()
    urls = [r["url"] for r in dp["replicas"]]
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        # A trainer's update before the kill: the restarted replica must serve it too, not its
        # command line's weights (the front end replays it before routing there).
        async with s.get(dp_server.url + "/get_model_info") as r:
            update = {"model_path": (await r.json())["model_path"], "weight_version": "policy-7"}
        async with s.post(dp_server.url + "/update_weights_from_disk", json=update) as r:
            assert r.status == 200 and (await r.json())["weight_version"] == "policy-7", await r.text()

        async def stream(i: int) -> tuple[str, list[str]]:
            # One per prefix group: cache-aware routing sends each where its group went (both
            # replicas, as the test above checks), or, on fresh trees, spreads them 2 and 2.
            body = {"model": "smollm2-135m", "prompt": f"{system_prompt(i)}\nTell story {i}.", "stream": True}
            body |= {"max_tokens": 160, "ignore_eos": True, "temperature": 0}
            # No bound on a stream's whole time (the session's 60 s total was hit beside a CPU
            # hog), only on a pause between its chunks.
            streaming = aiohttp.ClientTimeout(total=None, sock_read=60)
            async with s.post(dp_server.url + "/v1/completions", json=body, timeout=streaming) as r:
                assert r.status == 200
                started[i] = r.headers[WORKER_HEADER]
                return r.headers[WORKER_HEADER], await read_stream(r, firsts[i])

        firsts, started = [asyncio.Event() for _ in range(4)], {}
        tasks = [asyncio.create_task(stream(i)) for i in range(4)]
        async with asyncio.timeout(60):
            for e in firsts:
                await e.wait()  # every stream is producing tokens
        victim_url = next(u for u in reversed(urls) if u in started.values())
        victim = urls.index(victim_url)
        survivor_url = urls[1 - victim]
        old_pid = dp["replicas"][victim]["pid"]
        os.kill(old_pid, signal.SIGKILL)

        for i in range(3):  # requests that had not started: the survivor serves them
            body = {"model": "smollm2-135m", "prompt": f"After the kill {i}", "max_tokens": 2}
            async with s.post(dp_server.url + "/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
                assert r.headers[WORKER_HEADER] == survivor_url

        async def degraded() -> dict | None:
            async with s.get(dp_server.url + "/health") as r:
                body = await r.json()
                return body if r.status == 200 and body["status"] == "degraded" else None

        assert await poll(degraded, timeout=10) == {"status": "degraded", "healthy_workers": 1, "workers": 2}

        async with asyncio.timeout(240):  # the survivor's two streams finish: slow beside a CPU hog
            results = await asyncio.gather(*tasks)
        for worker, events in results:
            assert events[-1] == "[DONE]", events[-3:]
            if worker == victim_url:  # cut off: an error event, then [DONE]
                assert json.loads(events[-2])["error"]["code"] == "worker_failed", events[-3:]
            else:
                assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length", events[-3:]
        assert {w for w, _ in results} == set(urls)

        async def back() -> dict | None:
            async with s.get(dp_server.url + "/get_server_info") as r:
                entries = (await r.json())["dp"]["replicas"]
            return entries if all(e["healthy"] for e in entries) else None

        entries = await poll(back, timeout=150, every=0.5)
        assert entries[victim]["restarts"] == 1 and entries[victim]["pid"] != old_pid
        assert not pid_alive(old_pid)
        assert entries[victim]["url"] != victim_url  # restarted on a fresh port
        assert [e["behind"] for e in entries] == [False, False]
        for entry in entries:
            async with s.get(entry["url"] + "/get_model_info") as r:
                assert (await r.json())["weight_version"] == "policy-7", entry
        seen = set()
        for i in range(2):  # new prefixes go to the emptiest cache first: the restarted replica
            body = {"model": "smollm2-135m", "prompt": f"{system_prompt(20 + i)} Back?", "max_tokens": 1}
            async with s.post(dp_server.url + "/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
                seen.add(r.headers[WORKER_HEADER])
        assert entries[victim]["url"] in seen


async def test_sigterm_drains_the_front_end_then_stops_the_replicas(dp_server):
    """Last: it stops the module's controller. A stream in flight at SIGTERM completes."""
    pids = [r["pid"] for r in dp_server.dp()["replicas"]]
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        body = {"model": "smollm2-135m", "prompt": "Drain me", "stream": True, "max_tokens": 40, "ignore_eos": True}
        async with s.post(dp_server.url + "/v1/completions", json=body) as r:
            first = asyncio.Event()
            reading = asyncio.create_task(read_stream(r, first))
            async with asyncio.timeout(60):
                await first.wait()
            dp_server.proc.send_signal(signal.SIGTERM)
            async with asyncio.timeout(60):
                events = await reading
    assert events[-1] == "[DONE]" and json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
    assert await asyncio.to_thread(dp_server.proc.wait, 60) == 0
    assert not any(pid_alive(p) for p in pids)
    assert "Shutting down" in dp_server.log_tail()
