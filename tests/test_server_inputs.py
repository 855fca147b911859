"""Hostile and careless input through the real server (issue 14): every case is a 4xx with
OpenAI's error body and no traceback in the log, and the server keeps serving.

Covered: bytes that are not UTF-8, absurd nesting, a body that is not what its Content-Encoding
says, malformed HTTP (garbage, a huge URL, a bad Content-Length), slow clients (headers and
bodies that trickle in), too many connections, max_tokens 0, unknown sampling_params keys,
unbounded stop strings, a batch larger than the server can ever hold, and the deep health
check under saturation (it must not queue behind admission, and concurrent calls share one
generation).
"""

from __future__ import annotations

import asyncio
import gzip
import json

import aiohttp
import pytest

from tests.server_helpers import (  # noqa: F401 (fixtures)
    TINY_ARGS,
    shared_server,
    tiny_model_dir,
    wait_clean,
)

pytestmark = pytest.mark.timeout(240)
TIMEOUT = aiohttp.ClientTimeout(total=60)
KEEP_ALIVE = 2  # seconds: --timeout-keep-alive and --body-read-timeout of this server
MAX_CONNECTIONS = 16
RUNNING, QUEUED = 2, 2


@pytest.fixture
def server(request, tiny_model_dir):
    return shared_server(
        request,
        "tiny-inputs",
        tiny_model_dir,
        *TINY_ARGS,
        "--max-running-requests",
        str(RUNNING),
        "--max-queued-requests",
        str(QUEUED),
        "--context-length",
        "1024",
        "--timeout-keep-alive",
        str(KEEP_ALIVE),
        "--body-read-timeout",
        str(KEEP_ALIVE),
        "--max-connections",
        str(MAX_CONNECTIONS),
    )


def _check_error_body(status: int, body: bytes, want_status: int, param: str | None = None) -> dict:
    assert status == want_status, (status, body[:300])
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    if param is not None:
        assert err["param"] == param, err
    return err


async def _post(s: aiohttp.ClientSession, url: str, data: bytes, headers: dict | None = None) -> tuple[int, bytes]:
    async with s.post(url, data=data, headers={"Content-Type": "application/json", **(headers or {})}) as r:
        return r.status, await r.read()


def _no_traceback(server) -> None:
    log = server.log_tail(200_000)
    assert "Traceback" not in log and "Unhandled exception" not in log, log[-3000:]


async def test_undecodable_bodies_are_400(server):
    deep = b'{"text": "x", "extra": ' + b"[" * 10_000 + b"]" * 10_000 + b"}"
    chat_deep = b'{"messages": [{"role": "user", "content": "hi"}], "response_format": ' + b'{"a":' * 10_000
    chat_deep += b"1" + b"}" * 10_000 + b"}"
    cases = [
        ("/v1/completions", b'{"prompt": "\xff", "max_tokens": 4}'),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a\xc3("}]}'),
        ("/generate", b'{"text": "\xff\xfe", "sampling_params": {"max_new_tokens": 2}}'),
        ("/abort_request", b'{"rid": "\xff"}'),
        ("/generate", deep),
        ("/v1/chat/completions", chat_deep),
        ("/v1/completions", b"[" * 100_000),
    ]
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        for path, body in cases:
            status, text = await _post(s, server.url + path, body)
            _check_error_body(status, text, 400)
        await wait_clean(s, server.url)
    _no_traceback(server)


async def test_content_encoding_must_match_the_body(server):
    good = gzip.compress(json.dumps({"text": "hello", "sampling_params": {"max_new_tokens": 2}}).encode())
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        status, body = await _post(s, server.url + "/generate", good, {"Content-Encoding": "gzip"})
        assert status == 200 and json.loads(body)["meta_info"]["completion_tokens"] == 2, body
        for path in ("/generate", "/v1/completions"):
            status, body = await _post(s, server.url + path, b"this is not gzip", {"Content-Encoding": "gzip"})
            _check_error_body(status, body, 400)
        status, body = await _post(s, server.url + "/generate", good[:-9], {"Content-Encoding": "gzip"})  # truncated
        assert status == 400, body
        status, body = await _post(s, server.url + "/generate", good, {"Content-Encoding": "br"})
        _check_error_body(status, body, 415)
        bomb = gzip.compress(b'{"text": "' + b"a" * (40 * 2**20) + b'"}')  # 40 MiB decoded, past --max-body-size
        status, body = await _post(s, server.url + "/generate", bomb, {"Content-Encoding": "gzip"})
        _check_error_body(status, body, 413)
        # A route that never reads its body: still answered, and the connection stays usable.
        status, _ = await _post(s, server.url + "/flush_cache", b"junk", {"Content-Encoding": "deflate"})
        assert status == 200
        async with s.get(server.url + "/v1/models") as r:
            assert r.status == 200
    # Headers and body in separate packets (as `requests` sends them): still an immediate 400.
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    body = b'{"rid": "a"}'
    writer.write(b"POST /abort_request HTTP/1.1\r\nHost: x\r\nContent-Encoding: deflate\r\n")
    writer.write(b"Content-Length: %d\r\n\r\n" % len(body))
    await writer.drain()
    await asyncio.sleep(0.2)
    writer.write(body)
    raw = await asyncio.wait_for(reader.read(), 30)
    writer.close()
    head, _, answer = raw.partition(b"\r\n\r\n")
    _check_error_body(int(head.split()[1]), answer, 400)
    _no_traceback(server)


async def _raw(server, data: bytes, read_timeout: float = 30) -> tuple[int, bytes]:
    """Send raw bytes on a fresh connection; the status and body of the answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    try:
        writer.write(data)
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(), read_timeout)  # the server closes after an error
    finally:
        writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


async def test_malformed_http_gets_a_json_error(server):
    url_path = "/health?" + "a" * 20_000
    cases = [
        b"GARBAGE\r\n\r\n",
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 40 + b"\r\n\r\n",  # TLS hello on plain HTTP
        f"GET {url_path} HTTP/1.1\r\nHost: x\r\n\r\n".encode(),
        b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n{}",
        b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"b" * 20_000 + b"\r\n\r\n",
    ]
    for data in cases:
        status, body = await _raw(server, data)
        _check_error_body(status, body, 400)
    _no_traceback(server)


async def test_slow_clients_are_timed_out(server):
    # Headers that never complete: the connection is closed after the keep-alive timeout.
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # no blank line: the headers never end
    await writer.drain()
    assert await asyncio.wait_for(reader.read(), KEEP_ALIVE + 30) == b""  # closed, nothing answered
    writer.close()
    # A body that trickles in: 408 with the error body, then the connection is closed.
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(
        b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{"
    )
    await writer.drain()
    raw = await asyncio.wait_for(reader.read(), KEEP_ALIVE + 30)
    writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    assert _check_error_body(int(head.split()[1]), body, 408)["code"] == "request_timeout"
    _no_traceback(server)


async def test_connections_beyond_the_limit_get_503(server):
    conns = []
    try:
        for _ in range(MAX_CONNECTIONS):
            conns.append(await asyncio.open_connection("127.0.0.1", server.port))
        await asyncio.sleep(0.3)  # all accepted and counted
        status, body = await _raw(server, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _check_error_body(status, body, 503)["code"] == "too_many_connections"
    finally:
        for _, w in conns:
            w.close()
    await asyncio.sleep(0.3)
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s, s.get(server.url + "/health") as r:
        assert r.status == 200  # room again once they closed


async def test_max_tokens_zero(server):
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        for path, body, param in [
            ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens"),
            (
                "/v1/chat/completions",
                {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0},
                "max_completion_tokens",
            ),
        ]:
            async with s.post(server.url + path, json=body) as r:
                _check_error_body(r.status, await r.read(), 400, param)
        # SGLang's native API: nothing is generated, finish "length".
        body = {"text": "hello there", "sampling_params": {"max_new_tokens": 0}}
        async with s.post(server.url + "/generate", json=body) as r:
            out = await r.json()
        assert out["text"] == "" and out["output_ids"] == [], out
        meta = out["meta_info"]
        assert meta["finish_reason"]["type"] == "length" and meta["completion_tokens"] == 0, meta
        assert meta["prompt_tokens"] > 0, meta
        async with s.post(server.url + "/generate", json={**body, "stream": True}) as r:
            events = [ln for ln in (await r.text()).split("\n") if ln.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and json.loads(events[0][6:])["output_ids"] == [], events
        await wait_clean(s, server.url)


async def test_unknown_sampling_params_key_is_400(server):
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        body = {"text": "hi", "sampling_params": {"max_new_tokens": 2, "tempreature": 0}}
        async with s.post(server.url + "/generate", json=body) as r:
            err = _check_error_body(r.status, await r.read(), 400, "sampling_params.tempreature")
        assert "tempreature" in err["message"]
        for _ in range(2):  # unknown top-level fields are tolerated and logged once
            body = {"text": "hi", "sampling_params": {"max_new_tokens": 1}, "future_field": 1}
            async with s.post(server.url + "/generate", json=body) as r:
                assert r.status == 200, await r.text()
    assert server.log_tail(200_000).count("'future_field'") == 1


async def test_stop_strings_are_bounded(server):
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        many = {"prompt": "hi", "max_tokens": 2, "stop": [f"stop{i}" for i in range(100_000)]}
        async with s.post(server.url + "/v1/completions", json=many) as r:
            _check_error_body(r.status, await r.read(), 400, "stop")
        long = {"text": "hi", "sampling_params": {"max_new_tokens": 2, "stop": ["x" * 10_000]}}
        async with s.post(server.url + "/generate", json=long) as r:
            _check_error_body(r.status, await r.read(), 400, "stop")
        ok = {"prompt": "hi", "max_tokens": 2, "stop": [f"stop{i}" for i in range(64)]}
        async with s.post(server.url + "/v1/completions", json=ok) as r:
            assert r.status == 200, await r.text()


async def test_a_batch_that_can_never_be_admitted_is_400(server):
    limit = RUNNING + QUEUED
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        for path, body, param in [
            ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 1, "n": limit + 1}}, "n"),
            ("/generate", {"text": ["hi"] * (limit + 1), "sampling_params": {"max_new_tokens": 1}}, "n"),
            ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "n": limit + 1}, "n"),
        ]:
            async with s.post(server.url + path, json=body) as r:
                err = _check_error_body(r.status, await r.read(), 400, param)
            assert err["code"] == "request_too_large" and "--max-queued-requests" in err["message"], err
        async with s.post(server.url + "/generate", json={"text": ["hi"] * limit}) as r:  # exactly the limit fits
            assert r.status == 200, await r.text()
        await wait_clean(s, server.url)


async def _generated_tokens(s: aiohttp.ClientSession, url: str) -> int:
    async with s.get(url + "/get_server_info") as r:
        return (await r.json())["internal_states"][0]["generated_tokens"]


async def test_health_generate_under_saturation_and_coalesced(server):
    long = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 900}
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        streams = []
        for i in range(RUNNING + QUEUED):  # admission is now full
            r = await s.post(
                server.url + "/generate", json={"text": f"fill {i}", "stream": True, "sampling_params": long}
            )
            assert r.status == 200, await r.text()
            streams.append(r)
        async with s.post(server.url + "/v1/completions", json={"prompt": "one more", "max_tokens": 1}) as r:
            assert _check_error_body(r.status, await r.read(), 503)["code"] == "queue_full"
        async with s.get(server.url + "/health_generate") as r:  # saturated is not unhealthy
            assert r.status == 200, await r.text()
        for r in streams:
            r.close()
        await wait_clean(s, server.url)
        before = await _generated_tokens(s, server.url)

        async def probe() -> int:
            async with s.get(server.url + "/health_generate") as r:
                return r.status

        assert await asyncio.gather(*(probe() for _ in range(8))) == [200] * 8
        await wait_clean(s, server.url)
        assert await _generated_tokens(s, server.url) - before <= 2  # 8 callers, one or two probes
    _no_traceback(server)
