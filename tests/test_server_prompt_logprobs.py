"""Prompt log-probs over HTTP: OpenAI's legacy `echo` + `logprobs` on /v1/completions (scoring
only with `max_tokens: 0`, streaming too) and SGLang's `logprob_start_len` /
`input_token_logprobs` on /generate, equal to transformers' log_softmax (fp32) and to
themselves when the prompt is served again from the radix cache."""

from __future__ import annotations

import json
import math

import aiohttp
import openai
import pytest
import torch

from tests.server_helpers import shared_server

pytestmark = pytest.mark.timeout(300)
NAME = "smollm2"
CLIENTS_SERVER_ARGS = ("--served-model-name", NAME, "--max-total-tokens", "8192")
PROMPT = "The lighthouse keeper climbed the spiral staircase and lit the lamp"


@pytest.fixture(scope="module")
def server(request):
    return shared_server(request, "smollm2-clients", "smollm2-135m", *CLIENTS_SERVER_ARGS)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def prompt_ids(default_tokenizer) -> list[int]:
    return default_tokenizer.encode(PROMPT)


@pytest.fixture(scope="module")
def hf_lps(hf_default_model, prompt_ids) -> torch.Tensor:
    model = hf_default_model
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([prompt_ids])).logits[0].float(), -1)


def _want(prompt_ids: list[int], hf_lps: torch.Tensor, start: int = 0) -> list[float]:
    return [float(hf_lps[q - 1, prompt_ids[q]]) for q in range(max(start, 1), len(prompt_ids))]


def test_echo_logprobs_cover_the_prompt(client, default_tokenizer, prompt_ids, hf_lps):
    r = client.completions.create(model=NAME, prompt=prompt_ids, max_tokens=2, temperature=0, logprobs=2, echo=True)
    choice = r.choices[0]
    lp = choice.logprobs
    n = len(prompt_ids)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n + 2
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # the first token has no context
    assert lp.token_logprobs[1:n] == pytest.approx(_want(prompt_ids, hf_lps), abs=1e-3)
    assert lp.tokens[:n] == [default_tokenizer.decode([t]) for t in prompt_ids]
    assert choice.text.startswith(default_tokenizer.decode(prompt_ids))
    for tok, val, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert tok in top and top[tok] == pytest.approx(val)  # OpenAI: the chosen token is always listed
        assert 2 <= len(top) <= 3 and max(top.values()) >= val
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    assert r.usage.prompt_tokens == n and r.usage.completion_tokens == 2


def test_echo_with_max_tokens_zero_only_scores(client, prompt_ids, hf_lps):
    r = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=0, temperature=0, logprobs=1, echo=True)
    choice = r.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert choice.logprobs.token_logprobs[0] is None
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(_want(prompt_ids, hf_lps), abs=1e-3)
    assert r.usage.completion_tokens == 0
    with pytest.raises(openai.BadRequestError):  # without echo there is nothing to return
        client.completions.create(model=NAME, prompt=PROMPT, max_tokens=0)


def test_streamed_echo_carries_the_prompt_logprobs(client, prompt_ids, hf_lps):
    stream = client.completions.create(
        model=NAME, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=1, echo=True, stream=True
    )
    chunks = list(stream)
    first = chunks[0].choices[0]
    assert first.text == PROMPT
    assert first.logprobs.token_logprobs[1:] == pytest.approx(_want(prompt_ids, hf_lps), abs=1e-3)
    generated = [c.choices[0] for c in chunks[1:] if c.choices and c.choices[0].logprobs]
    assert sum(len(c.logprobs.tokens) for c in generated) == 3


async def test_generate_input_token_logprobs_and_radix_hit(server, default_tokenizer, prompt_ids, hf_lps):
    body = {
        "input_ids": prompt_ids,
        "sampling_params": {"max_new_tokens": 2, "temperature": 0},
        "return_logprob": True,
        "logprob_start_len": 3,
        "top_logprobs_num": 2,
        "return_text_in_logprobs": True,
    }
    async with aiohttp.ClientSession() as s:
        metas = []
        for _ in range(2):  # the second is a radix hit up to logprob_start_len
            async with s.post(server.url + "/generate", json=body) as r:
                assert r.status == 200, await r.text()
                metas.append((await r.json())["meta_info"])
        async with s.post(server.url + "/generate", json={**body, "logprob_start_len": -1}) as r:
            default = (await r.json())["meta_info"]
        async with s.post(server.url + "/generate", json={**body, "logprob_start_len": len(prompt_ids)}) as r:
            assert r.status == 400
            assert json.loads(await r.text())["error"]["param"] == "logprob_start_len"
    meta = metas[0]
    entries = meta["input_token_logprobs"]
    assert [e[1] for e in entries] == prompt_ids[3:]
    assert [e[2] for e in entries] == [default_tokenizer.decode([t]) for t in prompt_ids[3:]]
    assert entries[0][0] is None
    assert [e[0] for e in entries[1:]] == pytest.approx(_want(prompt_ids, hf_lps, 4), abs=1e-3)
    tops = meta["input_top_logprobs"]
    assert tops[0] is None and all(len(row) == 2 for row in tops[1:])
    assert all(
        math.isclose(row[0][0], float(hf_lps[q - 1].max()), abs_tol=1e-3) for q, row in zip(range(4, 99), tops[1:])
    )
    assert len(meta["output_token_logprobs"]) == 2
    assert metas[1]["cached_tokens"] <= 3
    assert [e[0] for e in metas[1]["input_token_logprobs"][1:]] == pytest.approx([e[0] for e in entries[1:]], abs=1e-5)
    # SGLang's default: only the last prompt position, which is not scored
    assert default["input_token_logprobs"] == [[None, prompt_ids[-1], default_tokenizer.decode([prompt_ids[-1]])]]
