"""WebSocket streaming at /ws: concurrent tagged generations on one socket, cancel, errors, and
closing the socket aborting what runs on it (real server subprocess, tiny random model)."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from tests.server_helpers import tiny_model_dir, tiny_server, wait_clean  # noqa: F401 (fixtures)

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
