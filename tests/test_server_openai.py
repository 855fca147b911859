"""The official `openai` client (sync and async) against a real server subprocess serving the
default model: completions and chat, streaming and not, n > 1, stop sequences, logprobs, usage
consistent with the tokenizer, and greedy output equal to the in-process engine's."""

from __future__ import annotations

import openai
import pytest

from engine import Engine, SamplingParams
from tests.server_helpers import ServerProcess, shared_server

pytestmark = pytest.mark.timeout(300)
NAME = "smollm2"
PROMPT = "The three primary colors are"
MESSAGES = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def expected(default_source, default_tokenizer):
    """Greedy results of the in-process engine on the same weights and dtype."""
    # The GGUF tokenizer is built once per process (ModelSource.load_tokenizer caches it), so this
    # engine reuses the session's `default_tokenizer`.
    engine = Engine("smollm2-135m", dtype="float32", device="cpu", torch_threads=1, max_total_tokens=4096)
    params = SamplingParams(temperature=0.0, max_new_tokens=MAX_TOKENS)
    completion, chat = engine.generate_batch([PROMPT, MESSAGES], params)
    return {"completion": completion, "chat": chat}


@pytest.fixture(scope="module")
def server(request) -> ServerProcess:
    # the clients' shared server (tests/test_clients_*.py): the same model, name and flags
    return shared_server(
        request, "smollm2-clients", "smollm2-135m", "--served-model-name", NAME, "--max-total-tokens", "8192"
    )


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture
def aclient(server):
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _chat_prompt_len(tokenizer) -> int:
    return len(tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False))


def test_models_list(client):
    assert [m.id for m in client.models.list().data] == [NAME]


def test_completion_greedy_equals_engine(client, expected, default_tokenizer):
    exp = expected["completion"]
    r = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].text == exp.text and r.choices[0].finish_reason == exp.finish_reason
    assert r.usage.prompt_tokens == len(default_tokenizer.encode(PROMPT)) == exp.prompt_tokens
    assert r.usage.completion_tokens == exp.completion_tokens
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.model == NAME and r.object == "text_completion"


def test_chat_greedy_equals_engine_and_reports_cache(client, expected, default_tokenizer):
    exp = expected["chat"]
    r = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0)
    msg = r.choices[0].message
    assert msg.role == "assistant" and msg.content == exp.text
    assert r.usage.prompt_tokens == _chat_prompt_len(default_tokenizer) == exp.prompt_tokens
    assert r.usage.completion_tokens == exp.completion_tokens
    assert (r.metadata if "metadata" in type(r).model_fields else r.model_extra["metadata"]) == {
        "weight_version": "default"
    }  # SGLang's: the weights that produced it
    again = client.chat.completions.create(
        model=NAME, messages=MESSAGES, max_completion_tokens=MAX_TOKENS, temperature=0
    )
    assert again.choices[0].message.content == exp.text
    assert again.usage.prompt_tokens_details.cached_tokens > 0  # the radix cache served the prompt


def test_streaming_sync(client, expected):
    exp = expected["chat"]
    chunks = list(
        client.chat.completions.create(
            model=NAME,
            messages=MESSAGES,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == exp.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        exp.finish_reason
    ]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == exp.completion_tokens
    exp = expected["completion"]
    chunks = list(
        client.completions.create(model=NAME, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stream=True)
    )
    assert "".join(c.choices[0].text for c in chunks) == exp.text


def test_stop_sequences(client, expected):
    text = expected["completion"].text
    word = text.split()[len(text.split()) // 2]
    r = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stop=[word, "@@@"])
    assert r.choices[0].text == text[: text.index(word)] and r.choices[0].finish_reason == "stop"
    chat_text = expected["chat"].text
    word = chat_text.split()[len(chat_text.split()) // 2]
    chunks = list(
        client.chat.completions.create(
            model=NAME, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, stop=word, stream=True
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == chat_text[: chat_text.index(word)]
    assert chunks[-1].choices[0].finish_reason == "stop"


async def test_async_n_choices_and_usage(aclient, expected, default_tokenizer):
    r = await aclient.chat.completions.create(
        model=NAME, messages=MESSAGES, max_tokens=6, n=3, temperature=1.0, seed=11, extra_body={"ignore_eos": True}
    )
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert r.usage.prompt_tokens == _chat_prompt_len(default_tokenizer)  # the prompt counts once
    assert r.usage.completion_tokens == 18
    again = await aclient.chat.completions.create(
        model=NAME, messages=MESSAGES, max_tokens=6, n=3, temperature=1.0, seed=11, extra_body={"ignore_eos": True}
    )
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]
    # Two prompts x n=2 greedy: four choices in OpenAI's order, each equal to the engine's.
    exp = expected["completion"]
    r = await aclient.completions.create(model=NAME, prompt=[PROMPT, PROMPT], n=2, max_tokens=MAX_TOKENS, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2, 3] and all(c.text == exp.text for c in r.choices)
    assert r.usage.prompt_tokens == 2 * exp.prompt_tokens and r.usage.completion_tokens == 4 * exp.completion_tokens


async def test_async_streaming_n(aclient):
    stream = await aclient.completions.create(
        model=NAME,
        prompt=PROMPT,
        max_tokens=5,
        n=2,
        temperature=0.8,
        seed=3,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    texts, finish = {0: "", 1: ""}, {}
    async for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert finish == {0: "length", 1: "length"} and all(texts.values())


async def test_async_logprobs(aclient, expected):
    exp = expected["chat"]
    r = await aclient.chat.completions.create(
        model=NAME, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    assert len(content) == exp.completion_tokens
    assert "".join(t.token for t in content).startswith(r.choices[0].message.content)
    for t in content:
        assert len(t.top_logprobs) == 3 and t.top_logprobs[0].token == t.token
        assert t.logprob == pytest.approx(t.top_logprobs[0].logprob, abs=1e-4) and t.logprob <= 0
    r = await aclient.completions.create(model=NAME, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == r.choices[0].text and lp.text_offset[0] == 0


def test_start_logs_each_choice_and_no_traceback(server):
    """A start logs one line per choice it made at load, and never a traceback (one used to come
    from formatting the fused decode's row bound when it had none)."""
    log = server.log_path.read_text(errors="replace")
    assert "Traceback" not in log and "--- Logging error ---" not in log
    for line in ("torch threads:", "attention backend:", "KV pool:"):  # fp32: no int4 or fused-decode lines
        assert line in log, line
