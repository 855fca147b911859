"""/v1/embeddings and SGLang's /encode against the live server, through the clients people use
(`openai`, which asks for base64 by default; LangChain's OpenAIEmbeddings; LiteLLM): vectors equal
transformers' last hidden state of the last token, L2-normalised (fp32, cosine >= 0.99999), while
generations run beside them; bad input is a 400 naming the field."""

from __future__ import annotations

import asyncio
import os

import aiohttp
import openai
import pytest
import torch

from tests.server_helpers import shared_server

pytestmark = pytest.mark.timeout(300)
NAME = "smollm2"
CLIENTS_SERVER_ARGS = ("--served-model-name", NAME, "--max-total-tokens", "8192")
TEXTS = ["Embeddings map text to vectors.", "The lighthouse keeper lit the lamp.", "def f(x): return x * 2"]


@pytest.fixture(scope="module")
def server(request):
    return shared_server(request, "smollm2-clients", "smollm2-135m", *CLIENTS_SERVER_ARGS)


@pytest.fixture(scope="module")
def reference(hf_default_model, default_tokenizer) -> list[torch.Tensor]:
    model = hf_default_model
    out = []
    with torch.no_grad():
        for text in TEXTS:
            h = model.model(torch.tensor([default_tokenizer.encode(text)])).last_hidden_state[0, -1].float()
            out.append(torch.nn.functional.normalize(h, dim=0))
    return out


def _cos(a, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(torch.tensor(a, dtype=torch.float32), b, dim=0))


async def test_openai_client_embeddings_while_generating(server, reference, default_tokenizer):
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    gen = asyncio.ensure_future(
        client.completions.create(model=NAME, prompt="Once upon a time", max_tokens=48, temperature=0)
    )
    await asyncio.sleep(0)  # the generation is submitted first; the embeddings join its batches
    default = await client.embeddings.create(model=NAME, input=TEXTS)  # the client's default: base64
    floats = await client.embeddings.create(model=NAME, input=TEXTS, encoding_format="float")
    by_ids = await client.embeddings.create(model=NAME, input=default_tokenizer.encode(TEXTS[1]))
    done = await gen
    assert done.usage.completion_tokens == 48
    assert [d.index for d in default.data] == [0, 1, 2]
    for d, f, ref in zip(default.data, floats.data, reference):
        assert len(d.embedding) == ref.shape[0]
        assert _cos(d.embedding, ref) >= 0.99999 and _cos(f.embedding, ref) >= 0.99999
        assert d.embedding == pytest.approx(f.embedding, abs=1e-6)  # base64 carries the float32 values
    assert _cos(by_ids.data[0].embedding, reference[1]) >= 0.99999
    want = sum(len(default_tokenizer.encode(t)) for t in TEXTS)
    assert default.usage.prompt_tokens == default.usage.total_tokens == want
    width = len(floats.data[0].embedding)
    ok = await client.embeddings.create(model=NAME, input="x", dimensions=width)
    assert len(ok.data[0].embedding) == width
    with pytest.raises(openai.BadRequestError) as e:
        await client.embeddings.create(model=NAME, input="x", dimensions=8)
    assert e.value.body["param"] == "dimensions"
    with pytest.raises(openai.BadRequestError):
        await client.embeddings.create(model=NAME, input=[])
    with pytest.raises(openai.NotFoundError):
        await client.embeddings.create(model="another-model", input="x")


async def test_sglang_encode(server, reference):
    async with aiohttp.ClientSession() as s:
        async with s.post(server.url + "/encode", json={"text": TEXTS[0]}) as r:
            assert r.status == 200, await r.text()
            one = await r.json()
        async with s.post(server.url + "/encode", json={"text": TEXTS}) as r:
            many = await r.json()
        async with s.post(server.url + "/encode", json={"text": "a", "input_ids": [1]}) as r:
            assert r.status == 400 and (await r.json())["error"]["param"] == "text"
        async with s.post(server.url + "/get_model_info") as r:
            assert r.status in (200, 405)
    assert _cos(one["embedding"], reference[0]) >= 0.99999
    assert one["meta_info"]["prompt_tokens"] > 0
    assert [_cos(m["embedding"], ref) >= 0.99999 for m, ref in zip(many, reference)] == [True] * 3


def test_langchain_and_litellm_embeddings(server, reference):
    from langchain_openai import OpenAIEmbeddings

    # check_embedding_ctx_length would tokenize with tiktoken, whose files come from the internet
    lc = OpenAIEmbeddings(
        model=NAME, base_url=server.url + "/v1", api_key="unused", check_embedding_ctx_length=False, max_retries=0
    )
    vectors = lc.embed_documents(TEXTS)
    assert [_cos(v, ref) >= 0.99999 for v, ref in zip(vectors, reference)] == [True] * 3
    assert _cos(lc.embed_query(TEXTS[2]), reference[2]) >= 0.99999

    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm

    litellm.telemetry = False
    resp = litellm.embedding(model=f"openai/{NAME}", input=TEXTS[:2], api_base=server.url + "/v1", api_key="unused")
    got = [d["embedding"] for d in resp.data]
    assert [_cos(v, ref) >= 0.99999 for v, ref in zip(got, reference[:2])] == [True, True]
    assert resp.usage.prompt_tokens > 0
