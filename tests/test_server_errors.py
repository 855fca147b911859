"""Failure behaviour: every error case answers its status with OpenAI's error body; client
disconnects (HTTP streaming, non-streaming, WebSocket) abort their generations; afterwards the
memory invariant holds and the server still serves. Plus 503 from an unhealthy engine (in process).
"""

from __future__ import annotations

import asyncio
import contextlib
import json

import aiohttp
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from engine.errors import EngineUnhealthyError
from tests.server_helpers import (  # noqa: F401 (fixtures)
    TINY_ARGS,
    free_port,
    shared_server,
    tiny_model_dir,
    wait_clean,
)

pytestmark = pytest.mark.timeout(180)
TIMEOUT = aiohttp.ClientTimeout(total=60)
KEY = "sekrit-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
CONTEXT = 1024
BODY_LIMIT = 65536


@pytest.fixture
def server(request, tiny_model_dir):
    return shared_server(
        request,
        "tiny-errors",
        tiny_model_dir,
        *TINY_ARGS,
        "--api-key",
        KEY,
        "--max-running-requests",
        "2",
        "--max-queued-requests",
        "1",
        "--context-length",
        str(CONTEXT),
        "--max-body-size",
        str(BODY_LIMIT),
        "--enable-metrics",
    )


async def _aborted(s: aiohttp.ClientSession, url: str) -> float:
    """Generations the server ended early (client gone, cancelled): they were aborted in the engine."""
    async with s.get(url + "/metrics") as r:
        for fam in text_string_to_metric_families(await r.text()):
            for smp in fam.samples:
                if smp.name == "sglang:num_aborted_requests_total":
                    return smp.value
    raise AssertionError("no abort counter")


async def _expect_error(resp: aiohttp.ClientResponse, status: int, param: str | None = None, code=None) -> dict:
    body = await resp.json(content_type=None)
    assert resp.status == status, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


async def test_api_key(server):
    url = server.url
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        async with s.get(url + "/v1/models") as r:
            err = await _expect_error(r, 401, code="invalid_api_key")
            assert err["type"] == "authentication_error"
        async with s.post(url + "/v1/completions", json={"prompt": "x"}, headers={"Authorization": "Bearer no"}) as r:
            await _expect_error(r, 401)
        async with s.get(url + "/health") as r:  # probes need no key
            assert r.status == 200
        async with s.get(url + "/v1/models", headers=AUTH) as r:
            assert r.status == 200
        with pytest.raises(aiohttp.WSServerHandshakeError) as e:
            await s.ws_connect(url + "/ws")
        assert e.value.status == 401


LONG_IDS = list(range(1000, 1000 + CONTEXT + 10))
CASES = [
    # (path, body, status, param, code)
    ("/v1/completions", b'{"prompt": "hi", ', 400, None, "invalid_json"),
    ("/v1/completions", b"[1, 2]", 400, None, None),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt", None),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "5"}, 400, "max_tokens", None),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, 400, "stream", None),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature", None),
    ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, 400, "top_p", None),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens", None),
    ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "n", None),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": 3}, 400, "presence_penalty", None),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404, "model", "model_not_found"),  # as OpenAI and vLLM
    ("/v1/completions", {"prompt": LONG_IDS}, 400, "prompt", "context_length_exceeded"),
    ("/v1/completions", {"prompt": "", "max_tokens": 2}, 400, "prompt", None),
    ("/v1/chat/completions", {"messages": [{"role": 5, "content": "x"}]}, 400, "messages[0].role", None),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role", None),
    ("/v1/chat/completions", {"messages": "hello"}, 400, "messages", None),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x " * 1200}]},
        400,
        None,
        "context_length_exceeded",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
        400,
        "top_logprobs",
        None,
    ),
    ("/generate", {"text": "hi", "sampling_params": {"temperature": "hot"}}, 400, "sampling_params.temperature", None),
    ("/generate", {"text": "hi", "sampling_params": {"top_p": 0}}, 400, "top_p", None),
    ("/generate", {"sampling_params": {}}, 400, "text", None),
    ("/generate", {"input_ids": [1, [2]]}, 400, "input_ids", None),
    ("/generate", {"input_ids": [10**9]}, 400, "input_ids", None),
    ("/abort_request", {"rid": 5}, 400, "rid", None),
    ("/no/such/route", {}, 404, None, None),
]


async def test_bad_requests_get_their_status_and_error_body(server):
    url = server.url
    async with aiohttp.ClientSession(timeout=TIMEOUT, headers=AUTH) as s:
        for path, body, status, param, code in CASES:
            kw = (
                {"data": body, "headers": {"Content-Type": "application/json"}}
                if isinstance(body, bytes)
                else {"json": body}
            )
            async with s.post(url + path, **kw) as r:
                await _expect_error(r, status, param, code)
        async with s.post(url + "/v1/chat/completions", json={"model": "gpt-4", "messages": []}) as r:
            assert (await _expect_error(r, 404, "model", "model_not_found"))["type"] == "invalid_request_error"
        async with s.get(url + "/v1/completions") as r:
            await _expect_error(r, 405)
        big = {"prompt": "x" * (BODY_LIMIT + 10)}
        async with s.post(url + "/v1/completions", json=big) as r:
            await _expect_error(r, 413)

        async def chunked():  # no Content-Length: aiohttp's own limit must answer 413 too
            for _ in range(20):
                yield b"x" * 8192

        async with s.post(url + "/v1/completions", data=chunked()) as r:
            await _expect_error(r, 413)
        await wait_clean(s, url, AUTH)


async def _open_stream(s: aiohttp.ClientSession, url: str, i: int, running: bool) -> aiohttp.ClientResponse:
    body = {
        "text": f"Queue filler {i}",
        "stream": True,
        "sampling_params": {"temperature": 0, "ignore_eos": True, "max_new_tokens": CONTEXT - 20},
    }
    r = await s.post(url + "/generate", json=body)
    assert r.status == 200, await r.text()  # headers come once admitted and submitted
    if running:
        assert (await r.content.readline()).startswith(b"data: ")  # producing tokens
    return r


async def test_queue_limit_then_disconnects_free_memory(server):
    """2 running + 1 queued are admitted; a 4th gets 503; dropping the streams frees everything."""
    url = server.url
    async with aiohttp.ClientSession(timeout=TIMEOUT, headers=AUTH) as s:
        aborted = await _aborted(s, url)
        streams = [await _open_stream(s, url, i, running=i < 2) for i in range(3)]  # the 3rd queues
        async with s.post(url + "/v1/completions", json={"prompt": "one more", "max_tokens": 2}) as r:
            await _expect_error(r, 503, code="queue_full")
        async with s.get(url + "/health_generate") as r:  # saturated, not ill: the probe bypasses admission
            assert r.status == 200, await r.text()
        for r in streams:  # disconnect mid-stream
            r.close()
        await wait_clean(s, url, AUTH)
        assert await _aborted(s, url) == aborted + 3
        async with s.post(url + "/v1/completions", json={"prompt": "served again", "max_tokens": 2}) as r:
            assert r.status == 200, await r.text()


async def test_mid_request_disconnects_then_invariant_holds(server):
    url = server.url
    long = {"temperature": 0, "ignore_eos": True}
    async with aiohttp.ClientSession(timeout=TIMEOUT, headers=AUTH) as s:
        aborted = await _aborted(s, url)
        # Streaming OpenAI chat, dropped after the first chunk.
        body = {"messages": [{"role": "user", "content": "Go on"}], "stream": True, "max_tokens": 900, **long}
        r = await s.post(url + "/v1/chat/completions", json=body)
        assert (await r.content.readline()).startswith(b"data: ")
        r.close()
        # Non-streaming requests whose clients give up before the answer.
        short = aiohttp.ClientTimeout(total=0.3)
        for path, body in (
            ("/v1/completions", {"prompt": "Wait for me", "max_tokens": 900, **long}),
            ("/generate", {"text": "Wait", "sampling_params": {**long, "max_new_tokens": 900}}),
        ):
            with pytest.raises(asyncio.TimeoutError):
                async with s.post(url + path, json=body, timeout=short) as r:
                    await r.read()
        # A WebSocket closed with generations running.
        ws = await s.ws_connect(url + "/ws")
        await ws.send_json(
            {"type": "generate", "id": "w", "text": "socket", "sampling_params": {**long, "max_new_tokens": 900}}
        )
        assert (await ws.receive_json())["id"] == "w"
        await ws.close()
        st = await wait_clean(s, url, AUTH)
        assert st["healthy"]
        assert await _aborted(s, url) == aborted + 4  # each one aborted, none ran to its end
        async with s.post(
            url + "/v1/chat/completions",
            headers=AUTH,
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
        ) as r:
            assert r.status == 200 and (await r.json())["usage"]["completion_tokens"] <= 3
        async with s.get(url + "/health_generate") as r:
            assert r.status == 200


@contextlib.asynccontextmanager
async def _in_process_server(model_dir: str):
    """(engine, base url) of a server running in this process's event loop on a loopback port."""
    from engine import Engine
    from server import ServerConfig, build_app

    engine = Engine(model_dir, dtype="float32", device="cpu", torch_threads=1, max_total_tokens=4096)
    await engine.start()
    port = free_port()
    runner = web.AppRunner(build_app(engine, ServerConfig(model_path=model_dir, port=port)), handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield engine, f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()
        await engine.stop()


async def test_unhealthy_engine_gets_503(tiny_model_dir):
    """In process: once the engine is down, generation endpoints and health checks answer 503."""
    async with _in_process_server(tiny_model_dir) as (engine, url), aiohttp.ClientSession(timeout=TIMEOUT) as s:
        async with s.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}) as r:
            assert r.status == 200
        await engine.stop()
        assert not engine.healthy
        async with s.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}) as r:
            await _expect_error(r, 503, code="engine_unhealthy")
        async with s.post(url + "/generate", json={"text": "hi"}) as r:
            await _expect_error(r, 503)
        for path in ("/health", "/health_generate"):
            async with s.get(url + path) as r:
                await _expect_error(r, 503)


def _sse_events(raw: str) -> list[str]:
    return [line[len("data: ") :] for line in raw.split("\n") if line.startswith("data: ")]


@pytest.mark.parametrize(
    "failure,status_code",
    [
        (EngineUnhealthyError("the engine went down (injected)"), "engine_unhealthy"),
        (RuntimeError("injected bug"), None),
    ],
    ids=["engine-error", "bug"],
)
async def test_error_in_mid_stream_ends_with_an_error_event(tiny_model_dir, monkeypatch, failure, status_code):
    """After the first streamed bytes the status is spent: a failure must still reach the client
    as OpenAI's error body in a last event, then [DONE], not as a stream that just stops. The
    failure is injected into the engine's per-request stream after its first delta."""
    from engine import RequestStream

    original = RequestStream.__anext__

    async def failing_after_first(self):
        calls = getattr(self, "_test_calls", 0)
        self._test_calls = calls + 1
        if calls == 1:
            raise failure
        return await original(self)

    streams = [
        ("/v1/completions", {"prompt": "hi", "max_tokens": 8, "stream": True, "ignore_eos": True}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": True}),
        ("/generate", {"text": "hi", "stream": True, "sampling_params": {"max_new_tokens": 8}}),
    ]
    async with _in_process_server(tiny_model_dir) as (engine, url):
        async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
            monkeypatch.setattr(RequestStream, "__anext__", failing_after_first)
            for path, body in streams:
                async with s.post(url + path, json=body) as r:
                    assert r.status == 200
                    events = _sse_events(await r.text())
                assert events[-1] == "[DONE]", (path, events)
                err = json.loads(events[-2])["error"]
                assert set(err) == {"message", "type", "param", "code"}, err
                assert "injected" in err["message"], err
                if status_code is not None:
                    assert err["code"] == status_code, err
                else:
                    assert err["type"] == "server_error", err
            monkeypatch.undo()  # the server still serves, and nothing leaked
            async with s.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3}) as r:
                assert r.status == 200
        async with asyncio.timeout(30):
            while (st := await engine.get_internal_state())["running_requests"] or st["waiting_requests"]:
                await asyncio.sleep(0.05)
        assert st["available_tokens"] + st["evictable_tokens"] == st["total_tokens"], st
