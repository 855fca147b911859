"""The process: --help, bad flags and a bad model path exit non-zero with one line and no
traceback; SIGTERM lets an in-flight stream finish and exits 0."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys

import aiohttp
import pytest

from tests.server_helpers import REPO, TINY_ARGS, ServerProcess, server_env, tiny_model_dir  # noqa: F401

pytestmark = pytest.mark.timeout(180)


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "server", *args],
        cwd=REPO,
        env=server_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_help_names_every_flag():
    res = _run("--help", timeout=30)
    assert res.returncode == 0
    for flag in (
        "--model-path",
        "--host",
        "--port",
        "--served-model-name",
        "--context-length",
        "--dtype",
        "--watchdog-timeout",
        "--max-running-requests",
        "--max-total-tokens",
        "--mem-fraction-static",
        "--max-prefill-tokens",
        "--chunked-prefill-size",
        "--page-size",
        "--schedule-policy",
        "--disable-radix-cache",
        "--disable-overlap-schedule",
        "--api-key",
        "--enable-metrics",
        "--log-level",
        "--max-queued-requests",
        "--torch-threads",
    ):
        assert flag in res.stdout, flag


@pytest.mark.parametrize(
    "args",
    [
        ("--bogus",),
        ("--port", "http"),
        ("--dtype", "float8"),
        ("--page-size", "0"),
        ("--schedule-policy", "sjf"),
        ("--mem-fraction-static", "2"),
    ],
)
def test_bad_flag_exits_2_with_one_line(args):
    res = _run(*args, timeout=30)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "error" in lines[0] and "Traceback" not in res.stderr, res.stderr


def test_bad_model_path_exits_1_with_one_line(tmp_path):
    res = _run("--model-path", str(tmp_path / "no-such-model"), "--port", "1")
    assert res.returncode == 1
    err = res.stderr.strip().splitlines()
    assert len(err) == 1 and "no-such-model" in err[0] and "Traceback" not in res.stderr, res.stderr


def test_port_in_use_exits_1(tiny_model_dir):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        res = _run(
            "--model-path",
            tiny_model_dir,
            "--port",
            str(busy.getsockname()[1]),
            "--dtype",
            "float32",
            "--device",
            "cpu",
            "--max-total-tokens",
            "1024",
            "--log-level",
            "warning",
        )
    assert res.returncode == 1 and "cannot listen" in res.stderr and "Traceback" not in res.stderr, res.stderr


async def test_sigterm_finishes_in_flight_stream_and_exits_0(tiny_model_dir, tmp_path):
    srv = ServerProcess(tiny_model_dir, *TINY_ARGS, "--graceful-shutdown-timeout", "60", log_dir=tmp_path)
    srv.start()
    try:
        assert "Serving" in srv.log_tail() and tiny_model_dir in srv.log_tail()
        body = {
            "prompt": "Keep going",
            "max_tokens": 400,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        finish, usage = None, None
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
            async with s.post(srv.url + "/v1/completions", json=body) as r:
                assert r.status == 200
                first = await r.content.readline()
                assert first.startswith(b"data: ")
                srv.signal(signal.SIGTERM)
                lines = [first] + [line async for line in r.content]
        events = [ln.decode().strip()[6:] for ln in lines if ln.strip()]
        assert events[-1] == "[DONE]"
        for e in events[:-1]:
            chunk = json.loads(e)
            usage = chunk["usage"] or usage
            finish = (chunk["choices"] and chunk["choices"][0]["finish_reason"]) or finish
        assert finish == "length" and usage["completion_tokens"] == 400  # the whole answer came through
        assert srv.proc.wait(timeout=60) == 0
        assert "Shutting down" in srv.log_tail()
    finally:
        srv.stop()


async def test_engine_death_ends_streams_and_exits_3(tiny_model_dir, monkeypatch):
    """A hung forward trips the watchdog: the open stream ends with an error event and [DONE], and
    the server drains and exits 3 so its supervisor restarts it (an unhealthy engine's 503s are
    tested in process: test_server_errors.py)."""
    import asyncio
    import threading

    from engine.model_executor.model_runner import ModelRunner
    from server import ServerConfig
    from server.launch import EXIT_ENGINE_DIED, serve
    from tests.server_helpers import free_port

    real = ModelRunner.forward_batch_generation
    release, calls = threading.Event(), {"n": 0}

    def hang_on_fourth(runner, batch):
        calls["n"] += 1
        if calls["n"] == 4:
            release.wait(60)
        return real(runner, batch)

    monkeypatch.setattr(ModelRunner, "forward_batch_generation", hang_on_fourth)
    port = free_port()
    config = ServerConfig(model_path=tiny_model_dir, port=port, graceful_shutdown_timeout=5)
    options = {
        "dtype": "float32",
        "device": "cpu",
        "torch_threads": 1,
        "max_total_tokens": 4096,
        "watchdog_timeout": 1.5,
    }
    server = asyncio.create_task(serve(options, config))
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
            async with asyncio.timeout(120):
                while True:  # wait for the server to listen
                    try:
                        async with s.get(url + "/health") as r:
                            if r.status == 200:
                                break
                    except aiohttp.ClientConnectionError:
                        pass
                    await asyncio.sleep(0.1)
            body = {"prompt": "hello there", "max_tokens": 50, "stream": True, "ignore_eos": True}
            async with s.post(url + "/v1/completions", json=body) as r:
                assert r.status == 200
                events = [line async for line in r.content if line.strip()]
            assert b"[DONE]" in events[-1]
            error = json.loads(events[-2].decode().removeprefix("data: "))["error"]
            assert "did not complete within 1.5 s" in error["message"]
        assert await asyncio.wait_for(server, 60) == EXIT_ENGINE_DIED
    finally:
        release.set()
        if not server.done():
            server.cancel()
