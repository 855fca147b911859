"""SGLang-native endpoints and /metrics against a real server subprocess (tiny random model)."""

from __future__ import annotations

import asyncio
import itertools
import json

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server_helpers import tiny_model_dir, tiny_server, wait_clean  # noqa: F401 (fixtures)

pytestmark = pytest.mark.timeout(180)
TIMEOUT = aiohttp.ClientTimeout(total=60)
GREEDY = {"temperature": 0.0, "ignore_eos": True}


async def _sse_events(resp: aiohttp.ClientResponse) -> list:
    """The JSON events of an SSE response, then checks it ended with [DONE]."""
    events, done = [], False
    async for raw in resp.content:
        line = raw.decode().strip()
        if not line:
            continue
        assert line.startswith("data: "), line
        if line == "data: [DONE]":
            done = True
            continue
        events.append(json.loads(line[6:]))
    assert done
    return events


async def test_health_model_and_server_info(tiny_server):
    url = tiny_server.url
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        async with s.get(url + "/health") as r:
            assert r.status == 200
        async with s.get(url + "/health_generate") as r:
            assert r.status == 200
        async with s.get(url + "/get_model_info") as r:
            info = await r.json()
        assert info["is_generation"] is True and info["context_length"] == 2048 and info["vocab_size"] == 49152
        async with s.get(url + "/get_server_info") as r:
            info = await r.json()
        assert info["max_total_tokens"] == 16384 and info["enable_metrics"] is True
        assert info["internal_states"][0]["total_tokens"] == 16384
        async with s.get(url + "/v1/models") as r:
            models = await r.json()
        assert models["data"][0]["max_model_len"] == 2048


async def test_generate_text_ids_batch_and_n(tiny_server, default_tokenizer):
    url = tiny_server.url
    prompt = "The capital of France is"
    ids = default_tokenizer.encode(prompt)
    sp = {**GREEDY, "max_new_tokens": 8}
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        async with s.post(url + "/generate", json={"text": prompt, "sampling_params": sp}) as r:
            assert r.status == 200, await r.text()
            by_text = await r.json()
        meta = by_text["meta_info"]
        assert len(by_text["output_ids"]) == 8 and meta["completion_tokens"] == 8
        assert meta["prompt_tokens"] == len(ids) and meta["finish_reason"] == {"type": "length", "length": 8}
        assert by_text["text"] == default_tokenizer.decode(by_text["output_ids"])
        async with s.post(url + "/generate", json={"input_ids": ids, "sampling_params": sp}) as r:
            by_ids = await r.json()
        assert by_ids["output_ids"] == by_text["output_ids"]
        batch = {"text": [prompt, "Once upon a time"], "sampling_params": sp, "rid": ["b0", "b1"]}
        async with s.post(url + "/generate", json=batch) as r:
            out = await r.json()
        assert [o["index"] for o in out] == [0, 1] and [o["meta_info"]["id"] for o in out] == ["b0", "b1"]
        assert out[0]["output_ids"] == by_text["output_ids"]
        sampled = {"text": prompt, "sampling_params": {"max_new_tokens": 8, "n": 3, "seed": 7, "temperature": 1.0}}
        async with s.post(url + "/generate", json=sampled) as r:
            out = await r.json()
        assert len(out) == 3 and len({tuple(o["output_ids"]) for o in out}) > 1
        async with s.post(url + "/generate", json=sampled) as r:  # seeded: reproducible
            again = await r.json()
        assert [o["output_ids"] for o in again] == [o["output_ids"] for o in out]


async def test_generate_stream_is_cumulative_and_ends_with_done(tiny_server):
    url = tiny_server.url
    body = {"text": "Hello", "sampling_params": {**GREEDY, "max_new_tokens": 12}}
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        async with s.post(url + "/generate", json=body) as r:
            whole = await r.json()
        async with s.post(url + "/generate", json={**body, "stream": True}) as r:
            assert r.headers["Content-Type"].startswith("text/event-stream")
            events = await _sse_events(r)
    texts = [e["text"] for e in events]
    assert all(b.startswith(a) for a, b in itertools.pairwise(texts))
    assert events[-1]["text"] == whole["text"] and events[-1]["output_ids"] == whole["output_ids"]
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert all(e["meta_info"]["finish_reason"] is None for e in events[:-1])


async def test_logprobs(tiny_server):
    body = {
        "text": "Hello",
        "sampling_params": {**GREEDY, "max_new_tokens": 5},
        "return_logprob": True,
        "top_logprobs_num": 3,
    }
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s, s.post(tiny_server.url + "/generate", json=body) as r:
        out = await r.json()
    lps, tops = out["meta_info"]["output_token_logprobs"], out["meta_info"]["output_top_logprobs"]
    assert [t for _, t, _ in lps] == out["output_ids"]
    for (lp, tok, _), top in zip(lps, tops):
        assert len(top) == 3 and top[0][1] == tok  # greedy: the chosen token is the most likely
        assert lp == pytest.approx(top[0][0], abs=1e-4) and lp <= 0


async def test_abort_request_and_flush_cache(tiny_server):
    url = tiny_server.url
    body = {
        "text": "Tell me a long story",
        "rid": "abort-me",
        "stream": True,
        "sampling_params": {**GREEDY, "max_new_tokens": 1500},
    }
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        async with s.post(url + "/generate", json=body) as r:
            first = await r.content.readline()
            assert first.startswith(b"data: ")
            async with s.post(url + "/abort_request", json={"rid": "abort-me"}) as a:
                assert a.status == 200
            rest = await _sse_events(r)
        assert rest[-1]["meta_info"]["finish_reason"]["type"] == "abort"
        assert rest[-1]["meta_info"]["completion_tokens"] < 1500
        await wait_clean(s, url)
        async with s.post(url + "/flush_cache") as r:
            assert r.status == 200 and (await r.json())["success"] is True
        st = await wait_clean(s, url)
        assert st["evictable_tokens"] == 0


def _samples(text: str) -> dict[str, float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            out[smp.name] = out.get(smp.name, 0.0) + smp.value
    return out


async def test_metrics_parse_and_counters_move(tiny_server, default_tokenizer):
    url = tiny_server.url
    prompt = "Metrics are counted here"
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        async with s.get(url + "/metrics") as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
            before = _samples(await r.text())
        body = {"text": prompt, "sampling_params": {**GREEDY, "max_new_tokens": 6}}
        async with s.post(url + "/generate", json=body) as r:
            assert r.status == 200
        await wait_clean(s, url)
        async with s.get(url + "/metrics") as r:
            after = _samples(await r.text())
    for name in ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage", "sglang:cache_hit_rate"):
        assert name in after
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    assert delta["sglang:prompt_tokens_total"] >= len(default_tokenizer.encode(prompt))
    assert delta["sglang:generation_tokens_total"] >= 6
    assert delta["sglang:num_requests_total"] >= 1
    for h in ("time_to_first_token", "inter_token_latency", "e2e_request_latency", "queue_time"):
        assert delta[f"sglang:{h}_seconds_count"] >= 1, h
    assert 0 <= delta["sglang:queue_time_seconds_sum"] <= delta["sglang:e2e_request_latency_seconds_sum"]
    assert after["sglang:num_running_reqs"] == 0


async def test_concurrent_requests_all_complete(tiny_server):
    url = tiny_server.url
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:

        async def one(i: int) -> dict:
            body = {"text": f"Request number {i}", "sampling_params": {**GREEDY, "max_new_tokens": 4 + i % 5}}
            async with s.post(url + "/generate", json=body) as r:
                return await r.json()

        outs = await asyncio.gather(*(one(i) for i in range(24)))
        assert [o["meta_info"]["completion_tokens"] for o in outs] == [4 + i % 5 for i in range(24)]
        await wait_clean(s, url)
