"""The process: --help, bad flags and a bad model path exit non-zero with one line and no
traceback; SIGTERM lets an in-flight stream finish and exits 0; past the grace period every
stream still open ends with its proper last message (SSE error + [DONE], WebSocket abort + 1001)."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
import time

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


GRACE = 0.5  # --graceful-shutdown-timeout for the test below
LONG = 1900  # tokens: far more than the tiny model makes within the grace period (context 2048)


async def _sse_events(resp: aiohttp.ClientResponse, started: asyncio.Event) -> list[str]:
    """The `data:` payloads of an SSE response, read raw; `started` is set at the first one."""
    assert resp.status == 200, await resp.text()
    events = []
    async for line in resp.content:
        if line.startswith(b"data: "):
            events.append(line.decode().strip()[len("data: ") :])
            started.set()
    return events


async def _inflight(s: aiohttp.ClientSession, url: str) -> int:
    async with s.get(url + "/get_server_info") as r:
        return (await r.json())["inflight_generations"]


def _assert_ended_by_shutdown(events: list[str]) -> None:
    """An SSE stream cut by shutdown: a few chunks, then OpenAI's error body, then [DONE]."""
    assert events[-1] == "[DONE]", events[-3:]
    err = json.loads(events[-2])["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["code"] == "shutting_down" and err["type"] == "service_unavailable", err
    assert "server shutting down" in err["message"], err
    assert len(events) >= 3 and all("error" not in json.loads(e) for e in events[:-2]), events[:3]


async def test_sigterm_past_the_grace_period_ends_every_stream_properly(tiny_model_dir, tmp_path):
    """SIGTERM while long generations run on every kind of stream, with a short grace period: at the
    deadline each SSE stream gets an error event (503 shutting_down) then [DONE], a non-streaming
    request a 503 body, a WebSocket generation its final `abort` delta and then a 1001 close;
    the process exits 0 promptly, with no traceback in its log."""
    import openai

    srv = ServerProcess(tiny_model_dir, *TINY_ARGS, "--graceful-shutdown-timeout", str(GRACE), log_dir=tmp_path)
    srv.start()
    greedy = {"temperature": 0, "ignore_eos": True}
    openai_args = {"model": tiny_model_dir, "prompt": "Count:", "max_tokens": LONG, "temperature": 0}
    openai_args["extra_body"] = {"ignore_eos": True}
    client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    started = {k: asyncio.Event() for k in ("chat", "generate", "ws", "openai_stream")}

    async def chat_sse(s: aiohttp.ClientSession) -> list[str]:
        body = {"messages": [{"role": "user", "content": "Tell a story"}], "max_tokens": LONG, "stream": True, **greedy}
        async with s.post(srv.url + "/v1/chat/completions", json=body) as r:
            return await _sse_events(r, started["chat"])

    async def generate_sse(s: aiohttp.ClientSession) -> list[str]:
        body = {"text": "Once upon a time", "stream": True, "sampling_params": {**greedy, "max_new_tokens": LONG}}
        async with s.post(srv.url + "/generate", json=body) as r:
            return await _sse_events(r, started["generate"])

    async def ws_generation(s: aiohttp.ClientSession) -> tuple[list[dict], aiohttp.WSMessage]:
        async with s.ws_connect(srv.url + "/ws") as ws:
            params = {**greedy, "max_new_tokens": LONG}
            await ws.send_json({"type": "generate", "id": "w", "text": "A long tale", "sampling_params": params})
            msgs: list[dict] = []
            while True:
                msg = await ws.receive()
                if msg.type != aiohttp.WSMsgType.TEXT:
                    return msgs, msg
                msgs.append(json.loads(msg.data))
                started["ws"].set()

    async def idle_ws(s: aiohttp.ClientSession) -> aiohttp.WSMessage:
        async with s.ws_connect(srv.url + "/ws") as ws:
            return await ws.receive()

    async def openai_stream() -> Exception:
        stream = await client.completions.create(stream=True, **openai_args)
        try:
            async for _ in stream:
                started["openai_stream"].set()
        except openai.APIError as e:
            return e
        raise AssertionError("the stream ended without an error")

    async def openai_plain() -> Exception:
        try:
            await client.completions.create(**openai_args)
        except openai.APIStatusError as e:
            return e
        raise AssertionError("no error")

    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=150)) as s, asyncio.timeout(150):
            tasks = [
                asyncio.create_task(c)
                for c in (chat_sse(s), generate_sse(s), ws_generation(s), idle_ws(s), openai_stream(), openai_plain())
            ]
            while not all(e.is_set() for e in started.values()) or await _inflight(s, srv.url) < 5:
                for t in tasks:
                    if t.done():
                        t.result()  # a request that failed before the signal fails the test now
                await asyncio.sleep(0.05)
            signalled = time.monotonic()
            srv.signal(signal.SIGTERM)
            chat, generate, (ws_msgs, ws_end), idle_end, stream_err, plain_err = await asyncio.gather(*tasks)
            code = await asyncio.to_thread(srv.proc.wait, GRACE + 60)
            exited_after = time.monotonic() - signalled
        _assert_ended_by_shutdown(chat)
        _assert_ended_by_shutdown(generate)
        finals = [m for m in ws_msgs if m.get("finish_reason") is not None]
        assert all(m["type"] == "delta" and m["id"] == "w" for m in ws_msgs), ws_msgs[-3:]
        assert len(finals) == 1 and finals[0] is ws_msgs[-1], ws_msgs[-3:]
        assert finals[0]["finish_reason"] == {"type": "abort", "message": "server shutting down"}
        assert sum(len(m["token_ids"]) for m in ws_msgs) < LONG
        for end in (ws_end, idle_end):
            assert end.type == aiohttp.WSMsgType.CLOSE and end.data == 1001, end
        assert isinstance(stream_err, openai.APIError) and "server shutting down" in stream_err.message
        assert plain_err.status_code == 503 and plain_err.body["code"] == "shutting_down", plain_err.body
        assert code == 0, srv.log_tail()
        assert exited_after < GRACE + 30, exited_after
        log = srv.log_tail(10**6)
        assert "Grace period over" in log and "Traceback" not in log and "Error" not in log, log
    finally:
        await client.close()
        srv.stop()
