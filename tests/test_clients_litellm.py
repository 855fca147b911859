"""LiteLLM (`litellm.completion` / `text_completion` with the `openai/` provider and an
`api_base`) against the live server and the default model: chat completion, streaming
(chunks assembled by `stream_chunk_builder`), text completion (LiteLLM routes `openai/<name>`
to /v1/completions), and usage equal to what the server itself reports for the same request.
Greedy, so every answer is compared with the server's own answer to the same request.

LiteLLM runs offline here: the local model-cost map and offline mode are set before it is
imported, and every test runs with outbound connections other than loopback refused.
"""

from __future__ import annotations

import json
import os
import socket
import urllib.request

os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"  # never fetch the cost map from the internet
os.environ["LITELLM_OFFLINE_MODE"] = "true"  # nor any other catalog or tokenizer

import litellm
import pytest

from tests.server_helpers import shared_server

pytestmark = [
    pytest.mark.timeout(300),
    # LiteLLM's own TypedDicts, built by pydantic on first use: noise, not about the server
    pytest.mark.filterwarnings("ignore:Items? .*on TypedDict class.*ReadOnly:UserWarning"),
]
NAME = "smollm2"
# The same key and arguments in tests/test_clients_*.py: one server for all three modules.
CLIENTS_SERVER_ARGS = ("--served-model-name", NAME, "--max-total-tokens", "8192")
MESSAGES = [{"role": "user", "content": "Name three animals that live in the sea."}]
PROMPT = "The three primary colors are"
MAX_TOKENS = 20

litellm.telemetry = False
litellm.suppress_debug_info = True


@pytest.fixture
def server(request):
    return shared_server(request, "smollm2-clients", "smollm2-135m", *CLIENTS_SERVER_ARGS)


@pytest.fixture(autouse=True)
def loopback_only(monkeypatch):
    """Any connection LiteLLM tried to open elsewhere (telemetry, a cost map, a tokenizer
    download) fails the test instead of silently reaching out."""
    real_connect = socket.socket.connect
    attempts: list = []

    def connect(sock, address):
        host = address[0] if isinstance(address, tuple) else address
        if sock.family in (socket.AF_INET, socket.AF_INET6) and host not in ("127.0.0.1", "::1", "localhost"):
            attempts.append(address)
            raise OSError(f"test: outbound connection to {address} refused")
        return real_connect(sock, address)

    monkeypatch.setattr(socket.socket, "connect", connect)
    yield
    assert attempts == []


def _kw(server) -> dict:
    return {"api_base": server.url + "/v1", "api_key": "unused", "temperature": 0, "max_tokens": MAX_TOKENS}


def _server_answer(server, path: str, body: dict) -> dict:
    """The same request posted straight to the server: its own text and usage."""
    req = urllib.request.Request(
        server.url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def _chat_reference(server) -> dict:
    return _server_answer(
        server,
        "/v1/chat/completions",
        {"model": NAME, "messages": MESSAGES, "temperature": 0, "max_tokens": MAX_TOKENS},
    )


def _same_counts(usage, ref: dict) -> None:
    assert usage.prompt_tokens == ref["prompt_tokens"] > 0
    assert usage.completion_tokens == ref["completion_tokens"] > 0
    assert usage.total_tokens == ref["total_tokens"] == ref["prompt_tokens"] + ref["completion_tokens"]


def test_completion_text_and_usage_equal_the_servers(server):
    r = litellm.completion(model=f"openai/{NAME}", messages=MESSAGES, **_kw(server))
    ref = _chat_reference(server)
    assert r.choices[0].message.content == ref["choices"][0]["message"]["content"]
    assert r.choices[0].message.content
    assert r.choices[0].finish_reason == ref["choices"][0]["finish_reason"]
    assert r.model.endswith(NAME)
    _same_counts(r.usage, ref["usage"])
    assert r.usage.completion_tokens <= MAX_TOKENS


def test_streaming_chunks_assemble_to_the_completion(server):
    chunks = list(
        litellm.completion(
            model=f"openai/{NAME}",
            messages=MESSAGES,
            stream=True,
            stream_options={"include_usage": True},
            **_kw(server),
        )
    )
    ref = _chat_reference(server)
    want = ref["choices"][0]["message"]["content"]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want and sum(1 for c in chunks if c.choices and c.choices[0].delta.content) >= 2
    built = litellm.stream_chunk_builder(chunks, messages=MESSAGES)
    assert built.choices[0].message.content == want
    assert built.choices[0].finish_reason == ref["choices"][0]["finish_reason"]
    _same_counts(built.usage, ref["usage"])


async def test_async_completion_and_stream(server):
    r = await litellm.acompletion(model=f"openai/{NAME}", messages=MESSAGES, **_kw(server))
    stream = await litellm.acompletion(model=f"openai/{NAME}", messages=MESSAGES, stream=True, **_kw(server))
    parts = [c.choices[0].delta.content or "" async for c in stream if c.choices]
    assert "".join(parts) == r.choices[0].message.content


def test_text_completion_goes_to_v1_completions(server):
    r = litellm.text_completion(model=f"openai/{NAME}", prompt=PROMPT, **_kw(server))
    ref = _server_answer(
        server, "/v1/completions", {"model": NAME, "prompt": PROMPT, "temperature": 0, "max_tokens": MAX_TOKENS}
    )
    # the chat endpoint would wrap the prompt in the chat template: the text would differ
    assert r.choices[0].text == ref["choices"][0]["text"] and r.choices[0].text
    assert r.choices[0].finish_reason == ref["choices"][0]["finish_reason"]
    _same_counts(r.usage, ref["usage"])


def test_text_completion_stream(server):
    ref = _server_answer(
        server, "/v1/completions", {"model": NAME, "prompt": PROMPT, "temperature": 0, "max_tokens": MAX_TOKENS}
    )
    chunks = list(litellm.text_completion(model=f"openai/{NAME}", prompt=PROMPT, stream=True, **_kw(server)))
    text = "".join(c["choices"][0]["text"] or "" for c in chunks if c["choices"])
    assert text == ref["choices"][0]["text"]
    assert len(chunks) >= 2


def test_forced_tool_call(server):
    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 16},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city", "unit"],
            },
        },
    }
    r = litellm.completion(
        model=f"openai/{NAME}",
        messages=[{"role": "user", "content": "What is the weather like in Paris today?"}],
        tools=[tool],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        parallel_tool_calls=False,
        **{**_kw(server), "max_tokens": 96},
    )
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls"
    assert [c.function.name for c in calls] == ["get_weather"]
    args = json.loads(calls[0].function.arguments)
    assert set(args) == {"city", "unit"} and args["unit"] in ("celsius", "fahrenheit")
    assert isinstance(args["city"], str) and 0 < len(args["city"]) <= 16
