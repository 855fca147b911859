"""Multi-LoRA through the server on loopback: `--lora-paths`, /generate's `lora_path`, the OpenAI
routes' `model=<adapter>` (the official client), /v1/models, /load_lora_adapter and
/unload_lora_adapter (SGLang's bodies), unknown adapters as 400s."""

from __future__ import annotations

import aiohttp
import openai
import pytest
import torch
from transformers import LlamaForCausalLM

from tests.lora_fixtures import LLAMA_ADAPTERS, wrap
from tests.sched_harness import build_tiny_folder
from tests.server_helpers import ServerProcess, wait_clean
from tests.test_lora_engine import greedy

PROMPT = [1200, 3400, 560, 7800, 910, 11200, 1300]
NEW = 5
SP = {"temperature": 0.0, "max_new_tokens": NEW, "ignore_eos": True}


@pytest.fixture(scope="module")
def setup(tmp_path_factory, default_tokenizer):
    root = tmp_path_factory.mktemp("server-lora")
    folder = build_tiny_folder(root / "base", default_tokenizer)
    base = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    paths, refs = {}, {None: greedy(base, PROMPT, NEW)}
    for i, name in enumerate(("all", "rslora")):
        model = wrap(base, name, LLAMA_ADAPTERS[name], seed=300 + i)
        paths[name] = str(root / name)
        model.save_pretrained(paths[name])
        refs[name] = greedy(model, PROMPT, NEW)
    srv = ServerProcess(
        folder,
        "--lora-paths",
        f"a1={paths['all']}",
        "--max-lora-rank",
        "8",
        "--max-loras-per-batch",
        "2",
        "--lora-target-modules",
        "all",
        "--max-total-tokens",
        "4096",
        "--served-model-name",
        "tiny",
        log_dir=root,
    ).start()
    yield srv, paths, refs
    srv.stop()


def gen(lora: str | None) -> dict:
    return {"input_ids": PROMPT, "sampling_params": SP, "lora_path": lora}


async def post(session: aiohttp.ClientSession, url: str, body: dict) -> tuple[int, dict]:
    async with session.post(url, json=body) as r:
        return r.status, await r.json()


async def test_generate_with_lora_path_and_batches(setup):
    srv, _, refs = setup
    async with aiohttp.ClientSession() as s:
        status, out = await post(s, srv.url + "/generate", gen("a1"))
        assert status == 200, out
        assert out["output_ids"] == refs["all"] != refs[None]
        body = {"input_ids": [PROMPT, PROMPT], "sampling_params": SP, "lora_path": [None, "a1"]}
        status, outs = await post(s, srv.url + "/generate", body)
        assert status == 200, outs
        assert [o["output_ids"] for o in outs] == [refs[None], refs["all"]]
        for bad in ({"lora_path": "nope"}, {"lora_path": ["a1"], "input_ids": [PROMPT, PROMPT]}):
            status, err = await post(s, srv.url + "/generate", {"input_ids": PROMPT, "sampling_params": SP, **bad})
            assert status == 400 and err["error"]["param"] == "lora_path", err
        await wait_clean(s, srv.url)


async def test_openai_model_names_the_adapter(setup):
    srv, _, _ = setup
    client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    async with aiohttp.ClientSession() as s:
        _, native = await post(s, srv.url + "/generate", gen("a1"))
    done = await client.completions.create(model="a1", prompt=PROMPT, max_tokens=NEW, temperature=0.0)
    assert done.model == "a1" and done.choices[0].text == native["text"]
    base = await client.completions.create(model="tiny", prompt=PROMPT, max_tokens=NEW, temperature=0.0)
    assert base.model == "tiny"
    chat = await client.chat.completions.create(
        model="a1", messages=[{"role": "user", "content": "hi"}], max_tokens=3, temperature=0.0
    )
    assert chat.model == "a1"
    with pytest.raises(openai.NotFoundError):
        await client.completions.create(model="nope", prompt=PROMPT, max_tokens=2)
    models = {m.id: m for m in (await client.models.list()).data}
    assert set(models) == {"tiny", "a1"}
    assert models["a1"].model_extra["parent"] == "tiny"
    await client.close()


async def test_load_and_unload_endpoints(setup):
    srv, paths, refs = setup
    async with aiohttp.ClientSession() as s:
        status, out = await post(s, srv.url + "/load_lora_adapter", {"lora_name": "a2", "lora_path": paths["rslora"]})
        assert status == 200 and out["success"] and out["loaded_adapters"] == ["a1", "a2"], out
        async with s.get(srv.url + "/v1/models") as r:
            assert {m["id"] for m in (await r.json())["data"]} == {"tiny", "a1", "a2"}
        body = {"input_ids": [PROMPT] * 3, "sampling_params": SP, "lora_path": ["a2", "a1", None]}
        status, outs = await post(s, srv.url + "/generate", body)
        assert [o["output_ids"] for o in outs] == [refs["rslora"], refs["all"], refs[None]], outs[0]["meta_info"]
        status, err = await post(s, srv.url + "/load_lora_adapter", {"lora_name": "a2", "lora_path": paths["all"]})
        assert status == 400, err  # the name is taken
        status, err = await post(s, srv.url + "/load_lora_adapter", {"lora_name": "a3", "lora_path": "/nowhere"})
        assert status == 400, err
        status, out = await post(s, srv.url + "/unload_lora_adapter", {"lora_name": "a2"})
        assert status == 200 and out["loaded_adapters"] == ["a1"], out
        status, err = await post(s, srv.url + "/unload_lora_adapter", {"lora_name": "a2"})
        assert status == 400 and err["error"]["param"] == "lora_name", err
        status, err = await post(s, srv.url + "/generate", gen("a2"))
        assert status == 400, err
        await wait_clean(s, srv.url)
