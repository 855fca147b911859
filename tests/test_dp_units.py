"""Data parallelism without a model (server/dp/): the replica command line rewritten from argv,
the resource split, the start-up failure report, and the front end's supervision, health and
/metrics over fake in-process replicas (tiny aiohttp apps that crash and come back on new ports).
The real processes are in tests/test_dp.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess

import aiohttp
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from server.cli import parse_args
from server.config import ServerConfig
from server.dp.controller import check_listen, report_start_failure
from server.dp.frontend import build_frontend
from server.dp.process import MARKER, ReplicaStartError, ServerProcess
from server.dp.replica import Replica
from server.dp.replica_args import ReplicaArgsError, replica_argv, split_options
from server.dp.resources import Machine, ReplicaPlan, ResourceError, plan_replicas
from server.dp.supervisor import Supervisor, backoff
from server.router.journal import STATE_ROUTES
from tests.dp_helpers import poll, serving
from tests.server_helpers import free_port

pytestmark = pytest.mark.timeout(60)
TIMEOUT = aiohttp.ClientTimeout(total=20)

# --- (d) the replica command line and the resource split, pure ---------------------------------


def test_replica_argv_drops_the_controller_flags_in_every_spelling():
    argv = ["--dp", "2", "--model-path=/m", "--chunked-prefill-size", "-1", "--enable-metrics", "--host", "0.0.0.0"]
    argv += ["--port=8000", "--load-balance-method", "round_robin", "--ray-address", "auto", "--api-key", "k"]
    assert [dest for dest, _ in split_options(argv)] == [
        "dp_size",
        "model_path",
        "chunked_prefill_size",
        "enable_metrics",
        "host",
        "port",
        "load_balance_method",
        "ray_address",
        "api_key",
    ]
    out = replica_argv(argv, {}, "127.0.0.1", 1234)
    assert out == ["--model-path=/m", "--chunked-prefill-size", "-1", "--enable-metrics", "--api-key", "k"] + [
        "--host",
        "127.0.0.1",
        "--port",
        "1234",
    ]


def test_replica_argv_overrides_replace_the_users_values():
    argv = ["--torch-threads", "8", "--mem-fraction-static=0.4", "--device", "cuda", "--dp-size", "2"]
    out = replica_argv(argv, {"torch_threads": "2", "mem_fraction_static": "0.2", "device": "cuda:1"}, "h", 1)
    assert out == ["--host", "h", "--port", "1", "--torch-threads", "2", "--mem-fraction-static", "0.2"] + [
        "--device",
        "cuda:1",
    ]
    dropped = replica_argv(argv, {"device": None}, "h", 1)  # None: the user's value goes, none is set
    assert dropped == ["--torch-threads", "8", "--mem-fraction-static=0.4", "--host", "h", "--port", "1"]


def test_replica_argv_refuses_a_value_the_cli_would_refuse():
    with pytest.raises(ReplicaArgsError):
        replica_argv(["--dp-size", "2"], {"device": "gpu"}, "127.0.0.1", 1)


def test_cpu_split_threads_and_kv_fraction():
    machine = Machine(cpu_threads=8)
    plans = plan_replicas(2, {}, machine)
    assert [(p.torch_threads, p.mem_fraction_static, p.device) for p in plans] == [(4, 0.05, None)] * 2
    assert plans[1].overrides() == {"torch_threads": "4", "mem_fraction_static": "0.05"}
    assert plans[0].bundle == {"CPU": 4.0}
    assert plan_replicas(3, {}, Machine(cpu_threads=2))[0].torch_threads == 1  # never 0
    user = plan_replicas(4, {"torch_threads": 3, "mem_fraction_static": 0.4}, machine)[0]
    assert (user.torch_threads, user.mem_fraction_static) == (3, pytest.approx(0.1))
    tokens = plan_replicas(2, {"max_total_tokens": 4096}, machine)[0]
    assert tokens.mem_fraction_static is None and "mem_fraction_static" not in tokens.overrides()
    assert plan_replicas(2, {"device": "auto"}, machine)[0].torch_threads == 4  # auto without GPUs: the CPU
    tp = plan_replicas(2, {"tp_size": 2}, machine)[0]  # 2 replicas x 2 ranks share the 8 threads
    assert (tp.torch_threads, tp.bundle) == (2, {"CPU": 4.0})


def test_cuda_split_devices():
    machine = Machine(cpu_threads=8, gpus=("0", "1", "2", "3"))
    plans = plan_replicas(2, {"mem_fraction_static": 0.8}, machine)  # auto with GPUs
    assert [p.device for p in plans] == ["cuda:0", "cuda:1"]
    assert all(p.mem_fraction_static is None and p.torch_threads is None for p in plans)  # full fraction
    tp = plan_replicas(2, {"device": "cuda", "tp_size": 2}, Machine(8, ("4", "5", "6", "7")))
    assert [(p.device, dict(p.env)) for p in tp] == [
        ("cuda", {"CUDA_VISIBLE_DEVICES": "4,5"}),
        ("cuda", {"CUDA_VISIBLE_DEVICES": "6,7"}),
    ]
    with pytest.raises(ResourceError, match="needs 6 GPUs, 4 visible"):
        plan_replicas(3, {"tp_size": 2}, machine)
    shared = plan_replicas(2, {"device": "cuda:1"}, machine)  # one GPU named: shared like a CPU
    assert [(p.device, p.mem_fraction_static) for p in shared] == [(None, 0.4)] * 2  # the GPU default 0.8, halved
    ray = plan_replicas(2, {"tp_size": 2}, machine, ray=True)
    assert [(p.device, dict(p.bundle)) for p in ray] == [("cuda", {"CPU": 1.0, "GPU": 2.0})] * 2


def test_multi_node_tensor_parallel_replicas_are_refused():
    for options in ({"nnodes": 2}, {"dist_init_addr": "10.0.0.1:5000"}):
        with pytest.raises(ResourceError, match="not supported"):
            plan_replicas(2, {"tp_size": 2, **options}, Machine(cpu_threads=8))
    assert len(plan_replicas(2, {"tp_size": 2, "nnodes": 1}, Machine(cpu_threads=8))) == 2


def test_backoff_doubles_and_is_capped():
    assert [backoff(i) for i in range(7)] == [1, 2, 4, 8, 16, 30, 30]


def test_start_failure_report_and_busy_port(capsys):
    class Quiet(Replica):
        def log_tail(self) -> str:
            return f"tail of replica {self.index}"

    replicas = [Quiet(ReplicaPlan(0)), Quiet(ReplicaPlan(1))]
    err = ReplicaStartError(1, "exited with status 2 during start-up", "max_total_tokens must be ...", "its tail", 2)
    assert report_start_failure(err, replicas) == 2  # a usage error stays one
    text = capsys.readouterr().err
    assert text.startswith("error: replica 1 exited with status 2 during start-up: max_total_tokens must be")
    assert "tail of replica 0" in text and "its tail" in text
    with contextlib.closing(socket.create_server(("127.0.0.1", 0))) as busy:
        assert "cannot listen" in (check_listen("127.0.0.1", busy.getsockname()[1]) or "")


async def test_server_process_exit_stop_and_log(tmp_path):
    """A replica process's end is seen at once (pidfd), SIGTERM is escalated to SIGKILL after the
    timeout, and the start-up error line is read from this launch's part of the log only."""
    proc = ServerProcess(0, tmp_path / "r.log")
    proc.proc = subprocess.Popen(["sleep", "0.2"])
    assert await asyncio.wait_for(proc.wait_exit(), 5) == 0
    proc.proc = subprocess.Popen(["bash", "-c", "trap '' TERM; sleep 30"])
    await asyncio.sleep(0.2)  # the trap is set
    assert await proc.stop(0.3) == -9  # killed: waiting for the trap-ignoring sleep would give 0
    old = f"{MARKER} 1\nerror: old failure\n"
    proc.log_path.write_text(old + f"{MARKER} 2\nloading\nerror: model path does not exist: /x\n")
    proc.log_offset = len(old)
    assert proc.error_line() == "model path does not exist: /x"
    assert "old failure" not in proc.log_tail()


# --- the front end and the supervisor over fake replicas, in process -------------------------


class FakeReplica(Replica):
    """A tiny aiohttp server standing in for a replica: /health, /v1/completions (says which
    replica answered), /metrics, /get_load, /tokenize; a new port at every start; `crash()` ends it as a kill would."""

    def __init__(self, index: int, failing_starts: int = 0) -> None:
        super().__init__(ReplicaPlan(index, torch_threads=1))
        self.failing_starts = failing_starts
        self.address: str | None = None
        self.runner: web.AppRunner | None = None
        self.gone = asyncio.Event()
        self.state_calls: list[tuple[str, dict]] = []  # since this process started
        self.weight_version = "default"  # the start-up weights' (a server's --weight-version)

    @property
    def url(self) -> str | None:
        return self.address

    @property
    def pid(self) -> int | None:
        return os.getpid()

    async def start(self, timeout: float) -> None:
        if self.failing_starts:
            self.failing_starts -= 1
            raise ReplicaStartError(self.index, "exited with status 1 during start-up", "bad", "", 1)
        app = web.Application()
        app.router.add_get("/health", lambda r: web.json_response({}))
        app.router.add_post("/v1/completions", lambda r: web.json_response({"replica": self.index}))
        app.router.add_get("/metrics", lambda r: web.Response(text=f"# TYPE up gauge\nup {self.index + 1}\n"))
        # as a single server answers: one entry, rank 0 (it does not know its index)
        load = [{"dp_rank": 0, "num_reqs": self.index + 1, "num_waiting_reqs": 0, "num_tokens": 0}]
        app.router.add_get("/get_load", lambda r: web.json_response(load))
        app.router.add_post("/tokenize", lambda r: web.json_response({"tokens": [self.index]}))
        app.router.add_post("/start_profile", lambda r: web.json_response({"success": True, "trace": f"t{self.index}"}))
        app.router.add_get("/dashboard/ws", self.dashboard_feed)
        for path in STATE_ROUTES:
            app.router.add_post(path, self.state_call)
        app.router.add_get("/get_model_info", lambda r: web.json_response({"weight_version": self.weight_version}))
        self.state_calls, self.weight_version = [], "default"
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        port = free_port()
        await web.TCPSite(self.runner, "127.0.0.1", port).start()
        self.address, self.gone = f"http://127.0.0.1:{port}", asyncio.Event()

    async def dashboard_feed(self, request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        await ws.send_json({"type": "hello", "model": "fake", "interval": 0.1, "steps": []})
        await ws.send_json({"type": "snapshot", "replica": self.index})
        async for _ in ws:
            pass
        return ws

    async def state_call(self, request: web.Request) -> web.Response:
        body = await request.read()
        self.state_calls.append((request.path, json.loads(body) if body.strip() else {}))
        return web.json_response({"success": True, "weight_version": f"r{self.index}-{len(self.state_calls)}"})

    async def wait_exit(self) -> int:
        await self.gone.wait()
        return -9

    async def crash(self) -> None:
        assert self.runner is not None
        await self.runner.cleanup()
        self.gone.set()

    async def stop(self, timeout: float) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
        self.gone.set()


async def test_frontend_restarts_a_crashed_replica_at_its_new_address(monkeypatch):
    monkeypatch.setattr("server.dp.supervisor.BACKOFF_S", 0.05)
    replicas = [FakeReplica(0), FakeReplica(1)]
    supervisor = Supervisor(replicas, start_timeout=5, stop_timeout=5)
    await supervisor.start_all()
    config = ServerConfig(load_balance_method="round_robin", enable_metrics=True)
    app = build_frontend(config, supervisor, "local")
    try:
        async with serving(app) as url, aiohttp.ClientSession(timeout=TIMEOUT) as s:
            supervisor.watch()

            async def health() -> dict:
                async with s.get(url + "/health") as r:
                    return await r.json()

            async def dp() -> dict:
                async with s.get(url + "/get_server_info") as r:
                    return (await r.json())["dp"]

            assert (await health())["status"] == "ok"
            async with s.get(url + "/metrics") as r:
                families = {f.name: f for f in text_string_to_metric_families(await r.text())}
            assert {(x.labels["dp_rank"], x.value) for x in families["up"].samples} == {("0", 1.0), ("1", 2.0)}
            assert "sgl_router_worker_healthy" in families
            async with s.get(url + "/get_load") as r:
                loads = await r.json()
            assert [(e["dp_rank"], e["num_reqs"]) for e in loads] == [(0, 1), (1, 2)]  # renumbered by replica
            async with s.post(url + "/tokenize", json={"prompt": "x"}) as r:
                assert r.status == 200 and (await r.json())["tokens"] in ([0], [1])  # proxied to a replica

            old = replicas[1].url
            replicas[1].failing_starts = 1  # the first restart fails too: it is retried
            await replicas[1].crash()
            assert await poll(lambda: _degraded(health)) == {"status": "degraded", "healthy_workers": 1, "workers": 2}
            async with s.post(url + "/v1/completions", json={"prompt": "x"}) as r:
                assert (await r.json()) == {"replica": 0}  # routed around the dead one
            entry = await poll(lambda: _entry_when(dp, 1, lambda e: e["healthy"]))
            assert entry["restarts"] == 2 and entry["url"] != old and entry["last_exit_status"] == 1
            assert (await health())["status"] == "ok"
            seen = set()
            for _ in range(4):
                async with s.post(url + "/v1/completions", json={"prompt": "x"}) as r:
                    seen.add((await r.json())["replica"])
            assert seen == {0, 1}
    finally:
        await supervisor.stop_all()


async def test_a_restarted_replica_gets_the_weights_adapters_and_pause_its_sibling_has():
    """A replica restarts from its command line: before it is routed to, the front end replays on
    it the last weight update (with the version its sibling reported), the adapters loaded since
    and a pause still in force; a call replayed there is not sent twice to the survivor."""
    replicas = [FakeReplica(0), FakeReplica(1)]
    async with watched_front_end(replicas) as (url, s):
        calls = [
            ("/load_lora_adapter", {"lora_name": "a", "lora_path": "/adapters/a"}),
            ("/update_weights_from_disk", {"model_path": "/ckpt/7"}),
            ("/load_lora_adapter", {"lora_name": "b", "lora_path": "/adapters/b"}),
            ("/unload_lora_adapter", {"lora_name": "a"}),
            ("/pause_generation", {"mode": "retract"}),
        ]
        for path, body in calls:
            async with s.post(url + path, json=body) as r:
                assert r.status == 200 and (await r.json())["success"], await r.text()
        assert replicas[0].state_calls == replicas[1].state_calls == calls
        await replicas[1].crash()
        entry = await poll(lambda: _entry_when(dp_info(s, url), 1, lambda e: e["restarts"] == 1 and e["healthy"]))
        assert entry["behind"] is False and "sync_error" not in entry
        assert replicas[1].state_calls == [
            ("/update_weights_from_disk", {"model_path": "/ckpt/7", "weight_version": "r0-2"}),  # replica 0's
            ("/load_lora_adapter", {"lora_name": "b", "lora_path": "/adapters/b"}),
            ("/pause_generation", {"mode": "retract"}),
        ]
        assert replicas[0].state_calls == calls


async def test_a_restarted_replica_without_the_trainers_broadcast_weights_is_held_out_until_it_gets_them():
    """Weights a trainer sent to each replica's own URL (/update_weights_from_distributed) are
    not in the front end's journal: a restarted replica serving another weight_version than its
    sibling stays out of routing, saying why, until the trainer sends them to it too."""
    replicas = [FakeReplica(0), FakeReplica(1)]
    async with watched_front_end(replicas) as (url, s):
        for replica in replicas:
            replica.weight_version = "step-3"  # the trainer's broadcast, to each replica
        await replicas[1].crash()
        entry = await poll(lambda: _entry_when(dp_info(s, url), 1, lambda e: "sync_error" in e))
        assert entry["restarts"] == 1 and not entry["healthy"] and entry["behind"]
        assert "serves weight_version 'default'" in entry["sync_error"] and "'step-3'" in entry["sync_error"]
        for _ in range(3):
            async with s.post(url + "/v1/completions", json={"prompt": "x"}) as r:
                assert (await r.json()) == {"replica": 0}
        replicas[1].weight_version = "step-3"  # the trainer sent them to the restarted one
        entry = await poll(lambda: _entry_when(dp_info(s, url), 1, lambda e: e["healthy"]))
        assert entry["behind"] is False and "sync_error" not in entry


@contextlib.asynccontextmanager
async def watched_front_end(replicas: list[FakeReplica]):
    """The front end over `replicas` (started and supervised), round robin; (url, client session)."""
    supervisor = Supervisor(replicas, start_timeout=5, stop_timeout=5)
    await supervisor.start_all()
    app = build_frontend(ServerConfig(load_balance_method="round_robin"), supervisor, "local")
    try:
        async with serving(app) as url, aiohttp.ClientSession(timeout=TIMEOUT) as s:
            supervisor.watch()
            yield url, s
    finally:
        await supervisor.stop_all()


def dp_info(s: aiohttp.ClientSession, url: str):
    async def dp() -> dict:
        async with s.get(url + "/get_server_info") as r:
            return (await r.json())["dp"]

    return dp


async def _degraded(health) -> dict | None:
    body = await health()
    return body if body["status"] == "degraded" else None


async def _entry_when(dp, index: int, pred) -> dict | None:
    entry = (await dp())["replicas"][index]
    return entry if pred(entry) else None


async def test_start_all_raises_the_first_failure_and_metrics_are_on_unless_disabled():
    replicas = [FakeReplica(0), FakeReplica(1, failing_starts=1)]
    supervisor = Supervisor(replicas, start_timeout=5, stop_timeout=5)
    with pytest.raises(ReplicaStartError, match="replica 1 exited with status 1"):
        await supervisor.start_all()
    await supervisor.stop_all()
    assert replicas[0].gone.is_set()  # stopped even though it had started
    replicas = [FakeReplica(0)]
    supervisor = Supervisor(replicas, start_timeout=5, stop_timeout=5)
    await supervisor.start_all()
    try:
        for argv, status in (([], 200), (["--enable-metrics"], 200), (["--disable-metrics"], 404)):
            _, config = parse_args(argv)  # as a single server: on by default, SGLang's flag a no-op
            async with serving(build_frontend(config, supervisor, "local")) as url:
                async with aiohttp.ClientSession(timeout=TIMEOUT) as s, s.get(url + "/metrics") as r:
                    assert r.status == status, argv
    finally:
        await supervisor.stop_all()


async def test_frontend_dashboard_openapi_and_admin_routes_over_fake_replicas():
    """The page and its relayed feed behind the key (`?api_key=` too), one replica per `dp_rank`,
    a replica that is down said so; /openapi.json open; /start_profile sent to every replica."""
    replicas = [FakeReplica(0), FakeReplica(1)]
    supervisor = Supervisor(replicas, start_timeout=5, stop_timeout=5)
    await supervisor.start_all()
    auth = {"Authorization": "Bearer k"}
    try:
        async with serving(build_frontend(ServerConfig(api_key="k"), supervisor, "local")) as url:
            async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
                async with s.get(url + "/dashboard") as r:
                    assert r.status == 401
                async with s.get(url + "/dashboard?api_key=k") as r:
                    assert r.status == 200 and r.content_type == "text/html"
                async with s.get(url + "/dashboard?dp_rank=x", headers=auth) as r:
                    assert r.status == 400 and (await r.json())["error"]["code"] == "invalid_dp_rank"
                async with s.get(url + "/openapi.json") as r:
                    doc = await r.json()
                assert doc["security"] == [{"bearer": []}] and "/dashboard/ws" in doc["paths"]
                async with s.post(url + "/start_profile", headers=auth) as r:
                    out = await r.json()
                assert out["success"] and out["trace"] == "t0" and len(out["workers"]) == 2
                async with s.get(url + "/v1/completions", headers=auth) as r:
                    assert r.status == 405 and "GET is not allowed on /v1/completions" in await r.text()
                for rank in (0, 1):
                    async with s.ws_connect(f"{url}/dashboard/ws?dp_rank={rank}&api_key=k") as ws:
                        hello = await ws.receive_json(timeout=5)
                        assert hello["model"] == "fake" and hello["dp"]["rank"] == rank
                        assert [e["healthy"] for e in hello["dp"]["replicas"]] == [True, True]
                        assert await ws.receive_json(timeout=5) == {"type": "snapshot", "replica": rank}
                await replicas[1].crash()  # not watched: the router's health check notices
                await poll(lambda: _replica_down(s, url, auth))
                async with s.post(url + "/start_profile", headers=auth) as r:
                    out = await r.json()
                assert out["success"] and out["workers"][1]["message"] == "unhealthy: skipped"
                async with s.ws_connect(f"{url}/dashboard/ws?dp_rank=1", headers=auth) as ws:
                    hello, error = await ws.receive_json(timeout=5), await ws.receive_json(timeout=5)
                    assert hello["dp"]["replicas"][1]["healthy"] is False
                    assert error["type"] == "error" and "replica 1 is not reachable" in error["message"]
                    assert (await ws.receive(timeout=5)).type is aiohttp.WSMsgType.CLOSE
                    assert ws.close_code == 1013
    finally:
        await supervisor.stop_all()


async def _replica_down(s: aiohttp.ClientSession, url: str, auth: dict) -> bool:
    async with s.get(url + "/get_server_info", headers=auth) as r:
        return not (await r.json())["dp"]["replicas"][1]["healthy"]
