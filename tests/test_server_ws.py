"""WebSocket streaming at /ws: concurrent tagged generations on one socket, cancel, errors, and
closing the socket aborting what runs on it; frames that cannot be decoded (not UTF-8, 10,000
deep, not an object) answered on a socket that stays open, and failures in mid-generation ending
with the final delta (real server subprocess, tiny random model; failures injected in process)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import aiohttp
import pytest

from tests.server_helpers import free_port, tiny_model_dir, tiny_server, wait_clean  # noqa: F401 (fixtures)

pytestmark = pytest.mark.timeout(180)
TIMEOUT = aiohttp.ClientTimeout(total=90)
GREEDY = {"temperature": 0.0, "ignore_eos": True}


async def _generate(session: aiohttp.ClientSession, url: str, text: str, n: int) -> dict:
    body = {"text": text, "sampling_params": {**GREEDY, "max_new_tokens": n}}
    async with session.post(url + "/generate", json=body) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def test_three_concurrent_generations_cancel_one(tiny_server):
    url = tiny_server.url
    prompts = {"a": "The first story begins", "b": "A story that will be cancelled", "c": "Third: once upon"}
    lengths = {"a": 40, "b": 1500, "c": 33}
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        expected = {k: await _generate(s, url, prompts[k], lengths[k]) for k in ("a", "c")}
        texts = dict.fromkeys(prompts, "")
        ids = {k: [] for k in prompts}
        final: dict[str, dict] = {}
        async with s.ws_connect(url + "/ws") as ws:
            for k in prompts:
                await ws.send_json(
                    {
                        "type": "generate",
                        "id": k,
                        "text": prompts[k],
                        "sampling_params": {**GREEDY, "max_new_tokens": lengths[k]},
                    }
                )
            cancelled = False
            async with asyncio.timeout(80):
                while len(final) < 3:
                    msg = await ws.receive_json()
                    assert msg["type"] == "delta", msg
                    k = msg["id"]
                    assert k in prompts and k not in final, msg
                    texts[k] += msg["text"]
                    ids[k] += msg["token_ids"]
                    if msg.get("finish_reason") is not None:
                        final[k] = msg
                    if k == "b" and not cancelled:
                        await ws.send_json({"type": "cancel", "id": "b"})
                        cancelled = True
        for k in ("a", "c"):
            assert final[k]["finish_reason"] == {"type": "length", "length": lengths[k]}
            assert ids[k] == expected[k]["output_ids"] and texts[k] == expected[k]["text"]
            assert final[k]["meta_info"]["completion_tokens"] == lengths[k]
        assert final["b"]["finish_reason"]["type"] == "abort"
        assert len(ids["b"]) < lengths["b"]
        await wait_clean(s, url)


async def test_errors_keep_the_socket_usable(tiny_server):
    url = tiny_server.url
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s, s.ws_connect(url + "/ws") as ws:
        async with asyncio.timeout(60):
            await ws.send_str("{not json")
            err = await ws.receive_json()
            assert err["type"] == "error" and err["id"] is None and err["error"]["code"] == "invalid_json"
            await ws.send_json({"type": "generate", "id": 1, "text": "x", "sampling_params": {"temperature": -1}})
            err = await ws.receive_json()
            assert err["type"] == "error" and err["id"] == 1 and err["error"]["param"] == "temperature"
            await ws.send_json({"type": "generate", "id": 2, "text": "x", "sampling_params": {"top_k": "big"}})
            err = await ws.receive_json()
            assert err["id"] is None and err["error"]["param"] == "sampling_params.top_k"
            await ws.send_json({"type": "cancel", "id": "nothing"})
            err = await ws.receive_json()
            assert err["type"] == "error" and err["error"]["code"] == 404
            await ws.send_json(
                {
                    "type": "generate",
                    "id": "ok",
                    "text": "still works",
                    "sampling_params": {**GREEDY, "max_new_tokens": 3},
                }
            )
            got = []
            while not got or got[-1].get("finish_reason") is None:
                got.append(await ws.receive_json())
            assert all(m["id"] == "ok" for m in got) and sum(len(m["token_ids"]) for m in got) == 3


async def test_closing_the_socket_aborts_its_generations(tiny_server):
    url = tiny_server.url
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        ws = await s.ws_connect(url + "/ws")
        for i in range(3):
            await ws.send_json(
                {
                    "type": "generate",
                    "id": i,
                    "text": f"Long story {i}",
                    "sampling_params": {**GREEDY, "max_new_tokens": 1500},
                }
            )
        seen = set()
        async with asyncio.timeout(60):
            while len(seen) < 3:
                seen.add((await ws.receive_json())["id"])
        await ws.close()
        st = await wait_clean(s, url)
        assert st["running_requests"] == 0


async def test_closing_right_after_generate_releases_everything(tiny_server):
    """A socket closed before its generation sent anything: aiohttp cancels the handler inside its
    cleanup, and the generation task may never have started. Its admission slot must still be
    released and its engine request aborted (bench.soak found both leaking)."""
    url = tiny_server.url
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        for i in range(10):
            ws = await s.ws_connect(url + "/ws")
            body = {
                "type": "generate",
                "id": "a",
                "text": f"Hello {i}",
                "sampling_params": {**GREEDY, "max_new_tokens": 800},
            }
            await ws.send_json(body)
            await ws.close()
        async with asyncio.timeout(60):
            while True:
                async with s.get(url + "/get_server_info") as r:
                    info = await r.json()
                st = info["internal_states"][0]
                if info["inflight_generations"] == 0 and st["running_requests"] == 0 and st["waiting_requests"] == 0:
                    break
                await asyncio.sleep(0.05)
        await wait_clean(s, url)


# ---- frames that cannot be decoded; failures in mid-generation --------------------------------

DEEP = 10_000
BAD_FRAMES = [
    ("binary, not UTF-8", b"\xff\xfe\xfd\x80"),
    ("binary JSON with a non-UTF-8 string", b'{"type": "generate", "id": "u", "text": "caf\xe9 \xff"}'),
    ("10,000-deep array", "[" * DEEP + "]" * DEEP),
    ("10,000-deep value in an unknown field", '{"type": "cancel", "id": 1, "x": ' + "[" * DEEP + "]" * DEEP + "}"),
    ("10,000-deep object", '{"a": ' * DEEP + "1" + "}" * DEEP),
    ("an array", "[1, 2]"),
    ("a number", "42"),
    ("null", "null"),
    ("a string", '"generate"'),
    ("an unknown type", '{"type": "bogus", "id": 1}'),
    ("no type", '{"id": 1, "text": "x"}'),
    ("a wrong id type", '{"type": "cancel", "id": [1]}'),
    ("empty binary", b""),
]


async def _send_raw(ws: aiohttp.ClientWebSocketResponse, frame: str | bytes) -> None:
    if isinstance(frame, bytes):
        await ws.send_bytes(frame)
    else:
        await ws.send_str(frame)


async def _until_final(ws: aiohttp.ClientWebSocketResponse, gen_id: str, others: list[dict]) -> list[dict]:
    """Messages of `gen_id` up to its final delta; every other message goes to `others`."""
    got: list[dict] = []
    while not got or got[-1].get("finish_reason") is None:
        msg = await ws.receive_json()
        if msg.get("id") == gen_id:
            assert msg["type"] == "delta", msg
            got.append(msg)
        else:
            others.append(msg)
    return got


async def test_undecodable_frames_get_an_error_and_the_socket_keeps_serving(tiny_server):
    """Each bad frame gets one `error` (id null, a 400 body) while a generation runs on the same
    socket; that generation still ends with exactly one final delta, and the socket then serves
    a new generation."""
    url = tiny_server.url
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s, s.ws_connect(url + "/ws") as ws:
        async with asyncio.timeout(120):
            params = {**GREEDY, "max_new_tokens": 300}
            await ws.send_json({"type": "generate", "id": "bg", "text": "A long story", "sampling_params": params})
            first = await ws.receive_json()
            assert first["type"] == "delta" and first["id"] == "bg", first
            background = [first]
            errors: list[dict] = []
            for name, frame in BAD_FRAMES:
                await _send_raw(ws, frame)
                while True:  # the answer to this frame; deltas of "bg" interleave
                    msg = await ws.receive_json()
                    if msg["type"] == "error":
                        break
                    assert msg["id"] == "bg", (name, msg)
                    background.append(msg)
                err = msg["error"]
                assert msg["id"] is None, (name, msg)
                assert set(err) == {"message", "type", "param", "code"} and err["message"], (name, err)
                assert err["type"] == "invalid_request_error", (name, err)
                errors.append(err)
            for _ in range(500):  # many at once, not waiting for the answers: one error each, in order
                await ws.send_str("{not json")
            for _ in range(500):
                msg = await ws.receive_json()
                while msg["type"] == "delta":
                    background.append(msg)
                    msg = await ws.receive_json()
                assert msg["id"] is None and msg["error"]["code"] == "invalid_json", msg
            if background[-1].get("finish_reason") is None:
                background += await _until_final(ws, "bg", errors)
            assert len(errors) == len(BAD_FRAMES), errors
            finals = [m for m in background if m.get("finish_reason") is not None]
            assert len(finals) == 1 and finals[0] is background[-1], background
            assert finals[0]["finish_reason"] == {"type": "length", "length": 300}
            assert sum(len(m["token_ids"]) for m in background) == 300
            params = {**GREEDY, "max_new_tokens": 4}
            await ws.send_json({"type": "generate", "id": "after", "text": "still here", "sampling_params": params})
            stray: list[dict] = []
            after = await _until_final(ws, "after", stray)
            assert stray == [] and sum(len(m["token_ids"]) for m in after) == 4
            assert after[-1]["finish_reason"] == {"type": "length", "length": 4}
        assert not ws.closed
        await wait_clean(s, url)


async def test_oversized_and_invalid_text_frames_close_the_socket_with_a_code(tiny_server):
    """Protocol-level failures are aiohttp's: a frame over --max-body-size closes with 1009, a
    text frame that is not UTF-8 with 1007 (RFC 6455 says such a connection must fail), never
    with an HTTP answer written into the socket."""
    url = tiny_server.url
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        async with s.get(url + "/get_server_info") as r:
            limit = (await r.json())["max_body_size"]
        for close_code, send in (
            (1009, lambda ws: ws.send_str('{"type": "cancel", "id": "' + "x" * (limit + 10) + '"}')),
            (1007, lambda ws: ws._writer.send_frame(b'{"type": "cancel", "id": "\xff"}', aiohttp.WSMsgType.TEXT)),
        ):
            async with s.ws_connect(url + "/ws") as ws:
                with contextlib.suppress(ConnectionError):  # the server may close before all is sent
                    await send(ws)
                async with asyncio.timeout(30):
                    msg = await ws.receive()
                assert msg.type == aiohttp.WSMsgType.CLOSE and msg.data == close_code, msg  # the server's code
        async with s.ws_connect(url + "/ws") as ws:  # and the server is fine
            await ws.send_json({"type": "cancel", "id": "none"})
            assert (await ws.receive_json())["error"]["code"] == 404


@contextlib.asynccontextmanager
async def _server_in_this_process(model_dir: str) -> AsyncIterator[str]:
    """The base url of a server running in this event loop (so that a test can patch it)."""
    from aiohttp import web

    from engine import Engine
    from server import ServerConfig, build_app

    engine = await Engine(model_dir, dtype="float32", device="cpu", torch_threads=1, max_total_tokens=4096).start()
    port = free_port()
    runner = web.AppRunner(build_app(engine, ServerConfig(model_path=model_dir, port=port)), handler_cancellation=True)
    try:
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()
        await engine.stop()


async def test_failures_in_mid_generation_and_in_a_frame_keep_the_socket(tiny_model_dir, monkeypatch):
    """In process, with failures injected: one in the engine's stream after its first delta gets
    an error for that id, then the generation's final delta (`abort`); a bug while handling a
    frame gets a 500 error for that frame; the socket serves on."""
    from engine import RequestStream
    from server.ws import WsSession

    original = RequestStream.__anext__

    async def failing_after_first(self):
        calls = getattr(self, "_test_calls", 0)
        self._test_calls = calls + 1
        if calls == 1 and self.rid.startswith("boom"):
            raise RuntimeError("injected bug")
        return await original(self)

    async def broken_cancel(self, gen_id):
        raise RuntimeError("injected cancel bug")

    monkeypatch.setattr(RequestStream, "__anext__", failing_after_first)
    monkeypatch.setattr(WsSession, "cancel", broken_cancel)
    async with _server_in_this_process(tiny_model_dir) as url, aiohttp.ClientSession(timeout=TIMEOUT) as s:
        async with s.ws_connect(url + "/ws") as ws, asyncio.timeout(60):
            params = {**GREEDY, "max_new_tokens": 20}
            boom = {"type": "generate", "id": "g", "text": "hi", "rid": "boom-1", "sampling_params": params}
            await ws.send_json(boom)
            msgs = []
            while not msgs or msgs[-1].get("finish_reason") is None:
                msgs.append(await ws.receive_json())
            assert [m["type"] for m in msgs] == ["delta", "error", "delta"], msgs
            assert all(m["id"] == "g" for m in msgs)
            err = msgs[1]["error"]
            assert err["type"] == "server_error" and "injected bug" in err["message"], err
            assert msgs[2]["finish_reason"] == {"type": "abort", "message": err["message"]}
            await ws.send_json({"type": "cancel", "id": "g"})  # a bug in handling a frame: a 500 for it
            err = await ws.receive_json()
            assert err["type"] == "error" and err["id"] is None, err
            assert err["error"]["type"] == "server_error" and "injected cancel bug" in err["error"]["message"], err
            await ws.send_json({"type": "generate", "id": "ok", "text": "hi", "sampling_params": params})
            ok = []
            while not ok or ok[-1].get("finish_reason") is None:
                ok.append(await ws.receive_json())
            assert ok[-1]["finish_reason"] == {"type": "length", "length": 20}


async def test_final_meta_info_carries_the_logprobs_asked_for(tiny_server):
    """As /generate's: output and prompt log-probs in the final delta's meta_info, never dropped."""
    url = tiny_server.url
    body = {
        "text": "Log-probs over the socket",
        "sampling_params": {**GREEDY, "max_new_tokens": 5},
        "return_logprob": True,
        "top_logprobs_num": 2,
        "logprob_start_len": 0,
        "return_text_in_logprobs": True,
    }
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        async with s.post(url + "/generate", json=body) as r:
            assert r.status == 200, await r.text()
            want = (await r.json())["meta_info"]
        async with s.ws_connect(url + "/ws") as ws:
            await ws.send_json({"type": "generate", "id": "lp", **body})
            async with asyncio.timeout(60):
                while (msg := await ws.receive_json()).get("finish_reason") is None:
                    assert msg["type"] == "delta", msg
    meta = msg["meta_info"]
    assert len(meta["output_token_logprobs"]) == len(meta["output_top_logprobs"]) == 5
    assert len(meta["input_token_logprobs"]) == meta["prompt_tokens"]
    for key in ("input_token_logprobs", "input_top_logprobs", "output_token_logprobs", "output_top_logprobs"):
        assert meta[key] == want[key], key  # greedy: the same request over HTTP scores the same
