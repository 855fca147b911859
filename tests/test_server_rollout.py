"""The RL rollout endpoints through a live server: /update_weights_from_disk (greedy outputs equal
transformers on the new checkpoint, a bad one is a 400 and the old weights serve on, the version
in /get_model_info and meta_info), /pause_generation + /continue_generation with requests
streaming (none lost, token counts exact), /abort_request with abort_all."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import aiohttp
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.sched_harness import build_tiny_folder
from tests.server_helpers import ServerProcess, free_port, server_env, wait_clean
from tests.weight_helpers import PROMPTS, hf_greedy, perturbed_copy
from tests.weight_trainer import GROUP

NEW = 10
TIMEOUT = aiohttp.ClientTimeout(total=120)


@pytest.fixture(scope="module")
def rollout_server(tmp_path_factory, default_tokenizer):
    root = tmp_path_factory.mktemp("rollout")
    a = build_tiny_folder(root / "a", default_tokenizer)
    b = perturbed_copy(a, root / "b", seed=3)
    srv = ServerProcess(a, "--max-total-tokens", "8192", "--weight-version", "v0", log_dir=root).start()
    try:
        yield srv, a, b
    finally:
        srv.stop()


async def generate(s: aiohttp.ClientSession, url: str, ids: list[int], new: int = NEW) -> dict:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": new, "temperature": 0, "ignore_eos": True}}
    async with s.post(url + "/generate", json=body) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def streamed(s: aiohttp.ClientSession, url: str, ids: list[int], started: asyncio.Event, new: int) -> list[dict]:
    """A streaming /generate: every chunk's meta_info and output ids."""
    body = {
        "input_ids": ids,
        "stream": True,
        "sampling_params": {"max_new_tokens": new, "temperature": 0, "ignore_eos": True},
    }
    chunks = []
    async with s.post(url + "/generate", json=body) as r:
        assert r.status == 200
        async for line in r.content:
            text = line.decode().strip()
            if not text.startswith("data:") or text == "data: [DONE]":
                continue
            chunks.append(json.loads(text[5:]))
            started.set()
    return chunks


async def test_update_weights_from_disk_through_the_server(rollout_server):
    srv, a, b = rollout_server
    url = srv.url
    want_a, want_b = hf_greedy(a), hf_greedy(b)
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        outs = [await generate(s, url, p) for p in PROMPTS]
        assert [o["output_ids"] for o in outs] == want_a
        assert outs[0]["meta_info"]["weight_version"] == "v0"  # --weight-version
        async with s.post(url + "/update_weights_from_disk", json={"model_path": b, "weight_version": "s1"}) as r:
            assert r.status == 200, await r.text()
            assert (await r.json()) == {
                "success": True,
                "message": "Succeeded to update model weights.",
                "weight_version": "s1",
            }
        outs = [await generate(s, url, p) for p in PROMPTS]
        assert [o["output_ids"] for o in outs] == want_b
        assert {o["meta_info"]["weight_version"] for o in outs} == {"s1"}
        # OpenAI responses (non-streaming) carry it in SGLang's `metadata`
        async with s.get(url + "/v1/models") as r:
            model = (await r.json())["data"][0]["id"]
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        completion = await client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=2, temperature=0)
        assert completion.model_extra["metadata"] == {"weight_version": "s1"}
        await client.close()
        async with s.get(url + "/get_model_info") as r:
            assert (await r.json())["weight_version"] == "s1"
        async with s.get(url + "/get_server_info") as r:
            assert (await r.json())["weight_version"] == "s1"
        # not the served model: a 400 naming why, and the old weights keep serving
        async with s.post(url + "/update_weights_from_disk", json={"model_path": str(srv.log_path)}) as r:
            assert r.status == 400
            err = (await r.json())["error"]
            assert err["param"] == "model_path" and err["code"] == "weights_not_updated"
        async with s.post(url + "/update_weights_from_disk", json={"weight_version": "x"}) as r:
            assert r.status == 400  # model_path is required
        assert (await generate(s, url, PROMPTS[0]))["output_ids"] == want_b[0]
        async with s.post(url + "/update_weights_from_disk", json={"model_path": a}) as r:
            assert (await r.json())["weight_version"] == "2"
        assert (await generate(s, url, PROMPTS[0]))["output_ids"] == want_a[0]
        await wait_clean(s, url)


@pytest.mark.parametrize("mode", ["retract", "in_place"])
async def test_pause_continue_with_streams_loses_nothing(rollout_server, mode):
    srv, _, _ = rollout_server
    url, new = srv.url, 30
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        want = [(await generate(s, url, p, new))["output_ids"] for p in PROMPTS]
        events = [asyncio.Event() for _ in PROMPTS]
        tasks = [asyncio.ensure_future(streamed(s, url, p, e, new)) for p, e in zip(PROMPTS, events)]
        for e in events:
            await e.wait()
        async with s.post(url + "/pause_generation", json={"mode": mode}) as r:
            assert r.status == 200, await r.text()
        async with s.get(url + "/get_server_info") as r:
            st = (await r.json())["internal_states"][0]
        assert st["running_requests"] == (len(PROMPTS) if mode == "in_place" else 0)
        async with s.post(url + "/continue_generation") as r:
            assert r.status == 200
        for chunks, ids in zip(await asyncio.gather(*tasks), want):
            assert chunks[-1]["output_ids"] == ids
            assert chunks[-1]["meta_info"]["completion_tokens"] == new
            assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
        async with s.post(url + "/pause_generation", json={"mode": "sideways"}) as r:
            assert r.status == 400
        await wait_clean(s, url)


async def test_abort_all_and_pause_abort(rollout_server):
    srv, _, _ = rollout_server
    url = srv.url
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        for how in ("abort_request", "pause_generation"):
            events = [asyncio.Event() for _ in PROMPTS]
            tasks = [asyncio.ensure_future(streamed(s, url, p, e, 400)) for p, e in zip(PROMPTS, events)]
            for e in events:
                await e.wait()
            if how == "abort_request":
                async with s.post(url + "/abort_request", json={"abort_all": True}) as r:
                    assert r.status == 200
            else:
                async with s.post(url + "/pause_generation") as r:  # no body: mode abort
                    assert r.status == 200
                async with s.post(url + "/continue_generation") as r:
                    assert r.status == 200
            for chunks in await asyncio.gather(*tasks):
                assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "abort"
                assert chunks[-1]["meta_info"]["completion_tokens"] < 400
            await wait_clean(s, url)
        async with s.post(url + "/abort_request", json={}) as r:
            assert r.status == 400


async def test_weights_from_a_trainer_group_through_the_server(rollout_server):
    """verl/slime's server mode: the trainer process hosts a gloo group, the server joins it over
    HTTP, and the weights arrive by broadcast."""
    srv, a, b = rollout_server
    url = srv.url
    sd = AutoModelForCausalLM.from_pretrained(b, dtype=torch.float32).state_dict()
    spec = {
        "names": list(sd),
        "dtypes": [str(t.dtype) for t in sd.values()],
        "shapes": [list(t.shape) for t in sd.values()],
    }
    port = free_port()
    trainer = subprocess.Popen([sys.executable, "-m", "tests.weight_trainer", str(port), "2", b], env=server_env())
    try:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
            init = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2}
            async with s.post(url + "/init_weights_update_group", json={**init, "group_name": GROUP}) as r:
                assert r.status == 200, await r.text()
            body = {**spec, "group_name": GROUP, "weight_version": "from-trainer"}
            async with s.post(url + "/update_weights_from_distributed", json=body) as r:
                assert r.status == 200, await r.text()
                assert (await r.json())["weight_version"] == "from-trainer"
            assert (await generate(s, url, PROMPTS[0]))["output_ids"] == hf_greedy(b)[0]
            async with s.post(url + "/destroy_weights_update_group", json={"group_name": GROUP}) as r:
                assert r.status == 200
            async with s.post(url + "/update_weights_from_distributed", json={**body, "group_name": "gone"}) as r:
                assert r.status == 400 and (await r.json())["error"]["type"] == "invalid_request_error"
            async with s.post(url + "/update_weights_from_disk", json={"model_path": a}) as r:
                assert r.status == 200
        assert trainer.wait(timeout=120) == 0
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
