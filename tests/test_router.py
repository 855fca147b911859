"""The standalone router (server/router/): its policies as pure functions, then the real thing,
a `python -m server.router` subprocess in front of two tiny-model `python -m server` workers,
driven by the official `openai` client: proxying (streaming and not, n > 1, errors passed
through), the aggregated admin endpoints, cache-aware routing keeping a prefix group on one
worker where round robin spreads it, and a worker killed mid-stream and restarted."""

from __future__ import annotations

import asyncio
import json
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import aiohttp
import openai
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from server.router import RouterConfig
from server.router.app import WORKER_HEADER, aggregate, build_router_app
from server.router.policy import CacheAware, RoundRobin, ShortestQueue, Worker, routing_text
from server.router.tree import ApproxRadixTree
from tests.dp_helpers import serving
from tests.server_helpers import (  # noqa: F401 (tiny_model_dir: a fixture)
    TINY_ARGS,
    LaunchedServer,
    ServerProcess,
    free_port,
    get_json,
    server_env,
    tiny_model_dir,
)

pytestmark = pytest.mark.timeout(180)


# --- policies, pure -------------------------------------------------------------------------


def test_tree_matches_prefixes_and_splits_edges():
    t = ApproxRadixTree()
    t.insert("hello world")
    t.insert("hello there")
    assert t.match("hello world!") == 11 and t.match("hello th") == 8 and t.match("help") == 3
    assert t.match("xyz") == 0 and t.size == len("hello world") + len("there")


def test_tree_size_stays_bounded_and_keeps_recent():
    t = ApproxRadixTree(max_size=200)
    for i in range(500):
        t.insert(f"prefix-{i:04d}-" + "x" * 20)
        assert t.size <= 200
    assert t.match("prefix-0499-" + "x" * 20) == 32  # the newest survives
    assert t.match("prefix-0000-") < 12  # the oldest went first
    t.insert("y" * 1000)  # longer than the budget: truncated, never over it
    assert t.size <= 200


def _workers(*loads: int) -> list[Worker]:
    return [Worker(f"http://w{i}", inflight=n) for i, n in enumerate(loads)]


def test_cache_aware_prefers_the_longest_prefix_above_the_threshold():
    ws = _workers(0, 0)
    p = CacheAware(cache_threshold=0.5)
    first = p.pick(ws, "shared system prompt: question one")
    other = p.pick(ws, "completely different text here")
    assert other is not first  # a new prefix goes to the emptier tree
    for _ in range(5):
        first.inflight += 1  # some load, but below the imbalance thresholds
        assert p.pick(ws, "shared system prompt: question two") is first
        assert p.pick(ws, "completely different text, again") is other


def test_cache_aware_below_threshold_goes_to_the_smallest_tree():
    ws = _workers(0, 0)
    p = CacheAware(cache_threshold=0.9)
    a = p.pick(ws, "a" * 100)
    b = p.pick(ws, "a" * 50 + "b" * 50)  # 50 % matched on `a` < 90 %: the empty tree
    assert a is not b
    p.tree(a).insert("z" * 500)  # a's tree is now much bigger
    assert p.pick(ws, "q" * 10) is b


def test_cache_aware_switches_to_shortest_queue_when_imbalanced():
    ws = _workers(0, 0)
    p = CacheAware(cache_threshold=0.1, balance_abs_threshold=4, balance_rel_threshold=1.5)
    hot = p.pick(ws, "hot prefix 1")
    hot.inflight = 10  # 10 - 0 > 4 and 10 > 1.5 * 0
    cold = next(w for w in ws if w is not hot)
    assert p.pick(ws, "hot prefix 2") is cold
    hot.inflight = 4  # 4 - 0 is not > 4: balanced enough, the cache wins again
    assert p.pick(ws, "hot prefix 1 again") is hot  # its tree holds the longer match


def test_round_robin_cycles_and_shortest_queue_takes_the_least_loaded():
    ws = _workers(0, 0, 0)
    rr = RoundRobin()
    assert [rr.pick(ws, "x").url for _ in range(6)] == [w.url for w in ws] * 2
    ws = _workers(3, 1, 2)
    assert ShortestQueue().pick(ws, "") is ws[1]


@pytest.mark.parametrize("policy", [CacheAware(), RoundRobin(), ShortestQueue()], ids=lambda p: p.name)
def test_unhealthy_workers_are_never_picked(policy):
    ws = _workers(5, 0, 0)
    ws[1].healthy = ws[2].healthy = False
    assert all(policy.pick(ws, f"text {i}") is ws[0] for i in range(10))
    ws[0].healthy = False
    assert policy.pick(ws, "text") is None


def test_routing_text():
    assert routing_text("/v1/completions", {"prompt": "abc"}) == "abc"
    assert routing_text("/v1/completions", {"prompt": ["first", "second"]}) == "first"
    chat = {
        "messages": [{"role": "system", "content": "S"}, {"role": "user", "content": [{"type": "text", "text": "U"}]}]
    }
    assert routing_text("/v1/chat/completions", chat) == "SU"
    assert routing_text("/generate", {"text": "t"}) == "t"
    assert routing_text("/generate", {"input_ids": [1, 2, 3]}) == "1 2 3 "
    assert routing_text("/generate", None) == ""


def test_aggregate_sums_and_weights():
    ws = _workers(1, 2)
    infos = [
        {
            "internal_states": [
                {"running_requests": 1, "waiting_requests": 2, "generated_tokens": 10, "cache_hit_rate": 0.5}
            ]
        },
        {
            "internal_states": [
                {"running_requests": 3, "waiting_requests": 0, "generated_tokens": 5, "cache_hit_rate": 0.1}
            ]
        },
    ]
    agg = aggregate(ws, infos)
    assert (agg["running_requests"], agg["waiting_requests"], agg["generated_tokens"]) == (4, 2, 15)
    assert agg["cache_hit_rate"] == pytest.approx(0.3)
    for info, w in zip(infos, (100, 300), strict=True):
        info["internal_states"][0]["prompt_tokens"] = w
    assert aggregate(ws, infos)["cache_hit_rate"] == pytest.approx((0.5 * 100 + 0.1 * 300) / 400)
    assert aggregate(ws, [None, None])["workers"][0]["server_info"] is None


# --- in process: fake workers ---------------------------------------------------------------


def _fake_worker(completions) -> web.Application:
    async def health(request):
        return web.json_response({})

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_post("/v1/completions", completions)
    return app


async def test_worker_lost_mid_stream_ends_with_an_error_event():
    async def completions(request):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices": []}\n\n')
        request.transport.close()  # the worker dies: no [DONE], a broken chunked body
        return resp

    async with serving(_fake_worker(completions)) as worker:
        async with serving(build_router_app(RouterConfig([worker], health_check_interval=60))) as url:
            async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json={"stream": True}) as r:
                assert r.status == 200
                text = (await r.read()).decode()
    events = [e.removeprefix("data: ") for e in text.strip().split("\n\n")]
    assert events[0] == '{"choices": []}' and events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "worker_failed"


async def test_api_key_checked_and_forwarded():
    async def completions(request):
        return web.json_response({"auth": request.headers.get("Authorization")})

    async with serving(_fake_worker(completions)) as worker:
        config = RouterConfig([worker], health_check_interval=60, api_key="sk-1")
        async with serving(build_router_app(config)) as url, aiohttp.ClientSession() as s:
            async with s.post(url + "/v1/completions", json={"prompt": "x"}) as r:
                assert r.status == 401 and (await r.json())["error"]["code"] == "invalid_api_key"
            async with s.post(url + "/v1/completions", json={}, headers={"Authorization": "Bearer sk-1"}) as r:
                assert r.status == 200 and await r.json() == {"auth": "Bearer sk-1"}
            async with s.get(url + "/health") as r:
                assert r.status == 200  # probes need no key


async def test_no_healthy_worker_is_a_503():
    dead = f"http://127.0.0.1:{free_port()}"
    async with serving(build_router_app(RouterConfig([dead], health_check_interval=60))) as url:
        async with aiohttp.ClientSession() as s:
            for method, path in (("GET", "/health"), ("POST", "/v1/completions"), ("POST", "/generate")):
                async with s.request(method, url + path, json={"text": "x"}) as r:
                    body = await r.json()
                    assert r.status == 503 and body["error"]["code"] == "no_healthy_worker", body


# --- real workers behind a real router -------------------------------------------------------


class RouterProcess(LaunchedServer):
    """`python -m server.router` on a free port: LaunchedServer's start/stop (ready once /health
    is 200; SIGTERM returns the exit status) with a router's command line."""

    def __init__(self, workers: list[str], *args: str, log_dir: Path) -> None:
        super().__init__("", [])
        self.log_path = log_dir / f"router-{self.port}.log"
        self.cmd = [sys.executable, "-m", "server.router", "--port", str(self.port), "--worker-urls", *workers, *args]
        self.env = server_env()


@pytest.fixture(scope="module")
def workers(tmp_path_factory, tiny_model_dir):
    log_dir = tmp_path_factory.mktemp("router-workers")
    procs = [ServerProcess(tiny_model_dir, *TINY_ARGS, log_dir=log_dir) for _ in range(2)]
    for p in procs:
        p.launch()  # both load at once
    try:
        for p in procs:
            p.wait_ready()
        yield procs
    finally:
        for p in procs:
            p.stop()


@pytest.fixture(scope="module")
def router(workers, tmp_path_factory):
    r = RouterProcess([w.url for w in workers], "--health-check-interval", "0.2", log_dir=tmp_path_factory.mktemp("r"))
    yield r.start()
    assert r.stop() == 0  # SIGTERM: a clean exit


@pytest.fixture
def client(router):
    return openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model(router) -> str:
    return get_json(router.url + "/v1/models")["data"][0]["id"]


def test_openai_completion_and_n(client, model):
    r = client.completions.create(model=model, prompt="Hello there", max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop") and r.usage.completion_tokens >= 1
    r = client.completions.create(model=model, prompt="Hello there", max_tokens=3, n=3, temperature=1.0)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]


def test_openai_streams(client, model):
    chunks = list(client.completions.create(model=model, prompt="Once upon", max_tokens=5, stream=True, temperature=0))
    assert chunks and chunks[-1].choices[0].finish_reason in ("length", "stop")
    messages = [{"role": "user", "content": "Say hi"}]
    chunks = list(client.chat.completions.create(model=model, messages=messages, max_tokens=5, stream=True))
    assert any(c.choices and c.choices[0].finish_reason for c in chunks)


def test_worker_errors_pass_through(client, model):
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=model, prompt="x", max_tokens=-1)
    assert exc.value.status_code == 400
    err = exc.value.body
    assert err["type"] == "invalid_request_error" and err["message"]


def test_health_info_and_metrics(router, workers):
    assert get_json(router.url + "/health")["healthy_workers"] == 2
    info = get_json(router.url + "/get_server_info")
    assert [w["url"] for w in info["workers"]] == [w.url for w in workers]
    assert all(w["healthy"] and w["server_info"]["internal_states"] for w in info["workers"])
    assert info["generated_tokens"] == sum(
        w["server_info"]["internal_states"][0]["generated_tokens"] for w in info["workers"]
    )
    assert 0.0 <= info["cache_hit_rate"] <= 1.0
    with urllib.request.urlopen(router.url + "/metrics", timeout=10) as r:
        families = {f.name: f for f in text_string_to_metric_families(r.read().decode())}
    assert {s.labels["worker"] for s in families["sgl_router_worker_healthy"].samples} == {w.url for w in workers}
    assert sum(s.value for s in families["sgl_router_requests"].samples if s.name.endswith("_total")) >= 1
    req = urllib.request.Request(router.url + "/flush_cache", b"", method="POST")
    with urllib.request.urlopen(req, timeout=30) as r:
        assert json.loads(r.read())["success"] is True


def test_probes_model_info_and_aborts_reach_the_workers(router, workers, model):
    """What a single server answers, the router answers too: /health_generate (one replica that
    generates is enough), /get_model_info, and /abort_request sent to every worker (only the one
    holding the rid has it)."""
    with urllib.request.urlopen(router.url + "/health_generate", timeout=60) as r:
        assert r.status == 200
    assert (
        get_json(router.url + "/get_model_info")["model_path"]
        == get_json(workers[0].url + "/get_model_info")["model_path"]
    )
    _, out = _post(router.url + "/abort_request", {"rid": "no-such-request"})
    assert out["success"] is True and len(out["workers"]) == 2
    with pytest.raises(urllib.error.HTTPError) as bad:
        _post(router.url + "/abort_request", {"rid": 7})
    assert bad.value.code == 400


def test_tokenizer_version_and_load_through_the_router(router, workers, default_tokenizer):
    """The tokenizer endpoints answer through the router as from one server; /get_load lists
    every worker, numbered by its index (each calls itself rank 0)."""
    ids = default_tokenizer.encode("Routed tokens")
    for path in ("/tokenize", "/v1/tokenize"):
        assert _post(router.url + path, {"prompt": "Routed tokens"})[1]["tokens"] == ids
    assert _post(router.url + "/detokenize", {"tokens": ids})[1]["prompt"] == "Routed tokens"
    with pytest.raises(urllib.error.HTTPError) as bad:
        _post(router.url + "/detokenize", {"tokens": [-1]})
    assert bad.value.code == 400  # the worker's answer, passed through
    assert get_json(router.url + "/tokenizer_info")["eos_token"] == default_tokenizer.eos_token
    assert get_json(router.url + "/version") == get_json(workers[0].url + "/version")
    loads = get_json(router.url + "/get_load")
    assert [e["dp_rank"] for e in loads] == [0, 1]
    assert all(e["max_total_num_tokens"] == 16384 for e in loads)


def _post(url: str, body: dict) -> tuple[str, dict]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return r.headers[WORKER_HEADER], json.loads(r.read())


def _run_groups(url: str, model: str, tag: str) -> tuple[dict[int, set[str]], int]:
    """3 prefix groups (odd, so round robin alternates within a group), 4 requests each,
    interleaved; -> the workers each group went to, and the total cached prompt tokens."""
    prefixes = [f"{tag} group {g}: " + " ".join(f"{tag}{g}word{i}" for i in range(30)) for g in range(3)]
    seen: dict[int, set[str]] = {g: set() for g in range(3)}
    cached = 0
    for i in range(4):
        for g, prefix in enumerate(prefixes):
            body = {"model": model, "prompt": f"{prefix} question {i}?", "max_tokens": 1, "temperature": 0}
            worker, resp = _post(url + "/v1/completions", body)
            seen[g].add(worker)
            cached += ((resp["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")) or 0
    return seen, cached


def test_cache_aware_keeps_groups_together_round_robin_spreads_them(router, workers, model, tmp_path):
    seen, cached_aware = _run_groups(router.url, model, "ca")
    assert all(len(ws) == 1 for ws in seen.values()), seen
    assert len(set().union(*seen.values())) == 2  # the groups themselves are spread over both
    rr = RouterProcess(
        [w.url for w in workers],
        "--load-balance-method",
        "round_robin",
        "--health-check-interval",
        "0.2",
        log_dir=tmp_path,
    ).start()
    try:
        seen, cached_rr = _run_groups(rr.url, model, "rr")
    finally:
        rr.stop()
    assert all(len(ws) == 2 for ws in seen.values()), seen
    assert cached_aware > cached_rr, (cached_aware, cached_rr)


def _wait_for(pred, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def _metric_total(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        families = {f.name: f for f in text_string_to_metric_families(r.read().decode())}
    return sum(s.value for s in families[name].samples if s.name.endswith("_total"))


def test_killed_worker_is_routed_around_and_rejoins(workers, model, tmp_path):
    """Last in the module: it kills a worker. A slow health check (5 s) so the router still
    thinks the dead worker healthy: the retry path, not the health checks, saves the requests."""
    r = RouterProcess(
        [w.url for w in workers],
        "--load-balance-method",
        "round_robin",
        "--health-check-interval",
        "5",
        log_dir=tmp_path,
    ).start()
    client = openai.OpenAI(base_url=r.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    try:
        victim = workers[1]
        victim.proc.kill()
        victim.proc.wait()
        for i in range(4):  # round robin: at least one lands on the dead worker first
            out = client.completions.create(model=model, prompt=f"after the kill {i}", max_tokens=2)
            assert out.choices[0].text is not None
        assert _metric_total(r.url, "sgl_router_retries") >= 1
        assert get_json(r.url + "/health")["healthy_workers"] == 1
        info = get_json(r.url + "/get_server_info")
        assert [w["healthy"] for w in info["workers"]] == [True, False]
        assert info["workers"][1]["server_info"] is None

        victim.launch().wait_ready()  # same command, same port
        _wait_for(lambda: get_json(r.url + "/health")["healthy_workers"] == 2, timeout=15)
        used = {
            _post(r.url + "/v1/completions", {"model": model, "prompt": "back", "max_tokens": 1})[0] for _ in range(2)
        }
        assert used == {w.url for w in workers}
    finally:
        r.stop()


async def test_websocket_generations_through_the_router(router):
    """The server's /ws protocol through the router: concurrent ids (one with n=2), a cancel that
    reaches the worker running that id, a bad frame answered by a worker, each id's finals."""
    finals: dict[str, list[dict]] = {}
    async with aiohttp.ClientSession() as s, s.ws_connect(router.url + "/ws") as ws:
        params = {"temperature": 0, "max_new_tokens": 4}
        await ws.send_json({"type": "generate", "id": "a", "text": "Hello", "sampling_params": params})
        await ws.send_json({"type": "generate", "id": "b", "text": "Bye", "sampling_params": {**params, "n": 2}})
        long = {"temperature": 0, "max_new_tokens": 4000, "ignore_eos": True}
        await ws.send_json({"type": "generate", "id": "c", "text": "Long", "sampling_params": long})
        await ws.send_str("{not json")
        errors, cancelled = [], False
        async with asyncio.timeout(120):
            while sum(map(len, finals.values())) < 4:
                msg = await ws.receive_json()
                if msg["type"] == "error":
                    errors.append(msg)
                elif msg["id"] == "c" and not cancelled:
                    await ws.send_json({"type": "cancel", "id": "c"})
                    cancelled = True
                if msg["type"] == "delta" and msg.get("finish_reason"):
                    finals.setdefault(msg["id"], []).append(msg)
    assert [e["id"] for e in errors] == [None] and errors[0]["error"]["code"] == "invalid_json"
    assert len(finals["a"]) == 1 and len(finals["b"]) == 2
    assert finals["c"][0]["finish_reason"]["type"] == "abort"
