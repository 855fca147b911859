"""`--ray-address`: the data-parallel replicas as Ray actors (server/dp/ray_placement.py).

A local Ray head on this machine (`ray start --head --block` in its own process group, so the
finaliser ends it and everything Ray started, replicas included, even after a failure), then a
controller with two replicas placed on it, round robin: each replica serves one of two requests.
Ray is kept small for a 2-core machine: 2 CPUs, a 100 MB object store, no dashboard, no usage
stats, no workers started ahead of the first job. Without Ray installed, `--ray-address` must
end at once with one line saying how to install it (simulated with a `ray` that fails to import).
"""

from __future__ import annotations

import asyncio
import shutil
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import pytest

from server.dp.ray_placement import INSTALL_HINT
from server.router.app import WORKER_HEADER
from tests.dp_helpers import CPU_ARGS, START_TIMEOUT, DPServer, GroupProcess, pid_alive, run_controller
from tests.server_helpers import free_port, server_env

pytestmark = pytest.mark.timeout(600)  # Ray and two replicas start beside the other worker's tests
try:
    import ray  # noqa: F401 - only whether it imports

    RAY_MISSING = ""
except ImportError as e:
    RAY_MISSING = f"ray does not import ({e}): pip install .[ray] (`make test` installs it)"
needs_ray = pytest.mark.skipif(bool(RAY_MISSING), reason=RAY_MISSING)
RAY_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_prestart_worker_first_driver": "0",  # no idle workers competing for the 2 cores
    "RAY_DISABLE_DOCKER_CPU_WARNING": "1",
    # Ray's memory monitor kills actors once the node's memory is 95% used, and under `make test`
    # the other worker's servers share this small machine's memory: it killed both replicas
    # mid-start. The kernel's OOM killer still guards the machine.
    "RAY_memory_monitor_refresh_ms": "0",
}


def test_without_ray_the_flag_fails_with_one_line(tmp_path):
    fake = tmp_path / "ray"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError(\"No module named 'ray' (simulated)\")\n")
    env = {**server_env(), "PYTHONPATH": str(tmp_path)}
    status, out, err = run_controller("--dp-size", "2", "--ray-address", "auto", "--port", str(free_port()), env=env)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert status == 1 and len(lines) == 1 and INSTALL_HINT in lines[0], err
    assert "Starting" not in out


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory):
    """A one-node Ray cluster on this machine; its GCS address. A short temp dir: Ray's socket
    paths live under it and must stay under the kernel's 107 characters."""
    temp = Path(tempfile.mkdtemp(prefix="ray-"))
    port = free_port()
    cli = Path(sys.executable).with_name("ray")
    cmd = [str(cli), "start", "--head", "--block", "--port", str(port), "--node-ip-address", "127.0.0.1"]
    cmd += ["--num-cpus", "2", "--object-store-memory", str(100 * 2**20), "--include-dashboard=false"]
    cmd += ["--disable-usage-stats", "--temp-dir", str(temp)]
    env = {**server_env(), **RAY_ENV, "TMPDIR": str(temp)}  # the replicas' logs go under it too
    head = GroupProcess(cmd, tmp_path_factory.mktemp("ray-log") / "head.log", env=env)
    head.launch()
    try:
        deadline = time.monotonic() + 180
        while "Ray runtime started" not in head.log_tail(100_000):
            assert head.alive(), f"ray start exited:\n{head.log_tail()}"
            assert time.monotonic() < deadline, f"ray start not ready in 180 s:\n{head.log_tail()}"
            time.sleep(0.2)
        yield f"127.0.0.1:{port}"
    finally:
        head.stop(timeout=30)  # `--block` stops what it started on SIGTERM; then the group is killed
        shutil.rmtree(temp, ignore_errors=True)


@needs_ray
async def test_replicas_on_ray_serve_through_the_router(ray_head, tmp_path):
    args = ("--dp-size", "2", "--ray-address", ray_head, "--load-balance-method", "round_robin", *CPU_ARGS)
    server = DPServer(tmp_path, *args)
    try:
        # Ray starts a worker process per actor before the replica loads: slower than local replicas
        # (on a 2-core machine beside a CPU hog and a browser test it took more than 180 s)
        await asyncio.to_thread(server.start, 2 * START_TIMEOUT)
        dp = server.dp()
        assert dp["placement"] == "ray" and all(r["node"] and r["healthy"] for r in dp["replicas"]), dp
        assert [r["torch_threads"] for r in dp["replicas"]] == [1, 1]  # bundles of 1 CPU each
        urls = {r["url"] for r in dp["replicas"]}
        served = set()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
            for i in range(2):
                body = {"model": "smollm2-135m", "prompt": f"Hello from Ray {i}", "max_tokens": 3}
                async with s.post(server.url + "/v1/completions", json=body) as r:
                    assert r.status == 200, await r.text()
                    assert (await r.json())["usage"]["completion_tokens"] == 3
                    served.add(r.headers[WORKER_HEADER])
        assert served == urls  # each replica served one
        pids = [r["pid"] for r in dp["replicas"]]
        assert await asyncio.to_thread(server.stop) == 0
        assert not any(pid_alive(p) for p in pids)  # stopped through their actors
    finally:
        server.stop()
