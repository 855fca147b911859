"""Structured output and tool calling through the real server and the official `openai` client
(default model): response_format json_schema / json_object validated with `jsonschema`, regex and
EBNF through /generate and the WebSocket, tool calls (required, named, streamed, follow-up turn),
the grammar cache, aborts, and every bad input as a 400 naming its field."""

from __future__ import annotations

import asyncio
import json
import re

import aiohttp
import jsonschema
import openai
import pytest

from engine import GrammarCompileTimeoutError, GrammarQueueFullError
from server.errors import to_api_error
from tests.server_helpers import ServerProcess, shared_server, wait_clean

pytestmark = pytest.mark.timeout(600)
MODEL = "smollm2-135m"

SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 30},
            "address": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 30}, "zip": {"type": "integer"}},
                "required": ["city", "zip"],
            },
        },
        "required": ["name", "address"],
    },
    "array_bounds": {
        "type": "object",
        "properties": {
            "colors": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 2, "maxItems": 3}
        },
        "required": ["colors"],
    },
    "enum": {
        "type": "object",
        "properties": {"mood": {"enum": ["happy", "sad", "angry"]}, "level": {"enum": [1, 2, 3]}},
        "required": ["mood", "level"],
    },
    "integer_range": {
        "type": "object",
        "properties": {"age": {"type": "integer", "minimum": 18, "maximum": 65}},
        "required": ["age"],
    },
    "pattern": {
        "type": "object",
        "properties": {"phone": {"type": "string", "pattern": "^[0-9]{3}-[0-9]{4}$"}},
        "required": ["phone"],
    },
    "optional_fields": {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 30},
            "subtitle": {"type": "string", "maxLength": 30},
            "pages": {"type": "integer", "minimum": 1},
        },
        "required": ["title"],
        "additionalProperties": False,
    },
    "any_of": {
        "type": "object",
        "properties": {
            "pet": {
                "anyOf": [
                    {
                        "type": "object",
                        "properties": {"kind": {"const": "dog"}, "barks": {"type": "boolean"}},
                        "required": ["kind", "barks"],
                    },
                    {
                        "type": "object",
                        "properties": {"kind": {"const": "fish"}, "fins": {"type": "integer", "maximum": 10}},
                        "required": ["kind", "fins"],
                    },
                ]
            }
        },
        "required": ["pet"],
    },
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 40},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Get the local time in a time zone",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string", "maxLength": 40}},
            "required": ["timezone"],
        },
    },
}
ASK_WEATHER = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def server(request):
    # the same server as tests/test_tool_parsers_server.py's default-model one: started once
    return shared_server(request, "tools-default", MODEL, "--max-total-tokens", "16384")


@pytest.fixture
def aclient(server):
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


async def _state(server: ServerProcess) -> dict:
    async with aiohttp.ClientSession() as s, s.get(server.url + "/get_server_info") as r:
        return (await r.json())["internal_states"][0]


def _ask(name: str, schema: dict) -> list[dict[str, str]]:
    fields = ", ".join(schema["properties"])
    return [{"role": "user", "content": f"Make up an example record ({name}) with the fields {fields}, as JSON."}]


async def test_json_schema_outputs_validate_greedy_and_sampled(server, aclient):
    async def one(name: str, schema: dict, sampled: bool):
        r = await aclient.chat.completions.create(
            model=MODEL,
            messages=_ask(name, schema),
            response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}},
            max_tokens=250,
            temperature=0.8 if sampled else 0.0,
            seed=7 if sampled else None,
        )
        return name, schema, r.choices[0]

    cases = [(name, schema, sampled) for name, schema in SCHEMAS.items() for sampled in (False, True)]
    for name, schema, choice in await asyncio.gather(*(one(*c) for c in cases)):
        assert choice.finish_reason == "stop", (name, choice)
        jsonschema.validate(json.loads(choice.message.content), schema)


async def test_json_object_mode_on_chat_and_completions(server, aclient):
    chat = await aclient.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the capital of France? Reply in JSON."}],
        response_format={"type": "json_object"},
        max_tokens=120,
        temperature=0.0,
    )
    assert isinstance(json.loads(chat.choices[0].message.content), dict)
    schema = SCHEMAS["integer_range"]
    completion = await aclient.completions.create(
        model=MODEL,
        prompt="A person's age as JSON: ",
        max_tokens=40,
        temperature=0.0,
        extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": "age", "schema": schema}}},
    )
    assert completion.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(completion.choices[0].text), schema)


async def test_regex_and_ebnf_through_generate_and_the_websocket(server):
    regex = r"(red|green|blue), [0-9]{2}"
    ebnf = 'root ::= "The answer is " ("yes" | "no") "."'
    async with aiohttp.ClientSession() as s:
        async with s.post(
            server.url + "/generate",
            json={"text": "Pick a color and a number:", "sampling_params": {"regex": regex, "max_new_tokens": 20}},
        ) as r:
            body = await r.json()
        assert r.status == 200 and re.fullmatch(regex, body["text"]), body
        async with s.post(
            server.url + "/generate",
            json={"text": ["Is the sky blue?", "Is fire cold?"], "sampling_params": {"ebnf": ebnf, "temperature": 0}},
        ) as r:
            bodies = await r.json()
        assert r.status == 200 and all(re.fullmatch(r"The answer is (yes|no)\.", b["text"]) for b in bodies), bodies
        async with s.ws_connect(server.url + "/ws") as ws:
            await ws.send_json(
                {"type": "generate", "id": 1, "text": "Color:", "sampling_params": {"regex": regex, "temperature": 0}}
            )
            text = ""
            while True:
                msg = await ws.receive_json()
                assert msg["type"] == "delta", msg
                text += msg["text"]
                if msg.get("finish_reason"):
                    break
            assert re.fullmatch(regex, text) and msg["finish_reason"]["type"] == "stop", (text, msg)
            await ws.send_json({"type": "generate", "id": 2, "text": "x", "sampling_params": {"regex": "(bad"}})
            err = await ws.receive_json()
            assert err["type"] == "error" and err["error"]["param"] == "regex", err


async def test_unconstrained_neighbours_are_unchanged_and_the_cache_is_hit(server, aclient):
    async def plain(i: int) -> str:
        r = await aclient.completions.create(
            model=MODEL, prompt=f"Story {i}: Once upon a time", max_tokens=24, temperature=0
        )
        return r.choices[0].text

    alone = [await plain(i) for i in range(3)]
    before = (await _state(server))["grammar_cache"]
    schema = {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]}
    rf = {"type": "json_schema", "json_schema": {"name": "id", "schema": schema}}
    constrained = [
        aclient.chat.completions.create(model=MODEL, messages=_ask("id", schema), response_format=rf, max_tokens=30)
        for _ in range(3)
    ]
    results = await asyncio.gather(*(plain(i) for i in range(3)), *constrained)
    assert list(results[:3]) == alone
    after = (await _state(server))["grammar_cache"]
    assert after["misses"] == before["misses"] + 1  # one compile for the three, shared or then hit
    assert after["hits"] + after["shared"] >= before["hits"] + before["shared"] + 2


async def test_required_and_named_tool_calls_validate_and_stream_the_same(server, aclient):
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        kw = dict(model=MODEL, messages=ASK_WEATHER, tools=[WEATHER, TIME], tool_choice=choice, temperature=0.0)
        r = await aclient.chat.completions.create(**kw, max_tokens=120, parallel_tool_calls=False)
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls" and len(msg.tool_calls) == 1, r
        call = msg.tool_calls[0]
        assert call.type == "function" and call.id.startswith("call_")
        if isinstance(choice, dict):
            assert call.function.name == "get_weather"
        params = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]["function"]["parameters"]
        jsonschema.validate(json.loads(call.function.arguments), params)

        stream = await aclient.chat.completions.create(**kw, max_tokens=120, parallel_tool_calls=False, stream=True)
        calls: dict[int, dict] = {}
        reasons = []
        async for chunk in stream:
            for c in chunk.choices:
                reasons.append(c.finish_reason)
                for d in c.delta.tool_calls or []:
                    entry = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
                    entry["id"] = entry["id"] or d.id
                    entry["name"] = entry["name"] or (d.function.name if d.function else None)
                    entry["arguments"] += (d.function.arguments or "") if d.function else ""
        assert reasons[-1] == "tool_calls"
        assert [(c["name"], c["arguments"]) for c in calls.values()] == [(call.function.name, call.function.arguments)]
        assert calls[0]["id"].startswith("call_")


async def test_a_tool_result_follow_up_turn(server, aclient):
    first = await aclient.chat.completions.create(
        model=MODEL, messages=ASK_WEATHER, tools=[WEATHER], tool_choice="required", temperature=0.0, max_tokens=120
    )
    call = first.choices[0].message.tool_calls[0]
    history = [
        *ASK_WEATHER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": call.function.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "sunny"})},
    ]
    for choice in ("auto", "none"):
        r = await aclient.chat.completions.create(
            model=MODEL, messages=history, tools=[WEATHER], tool_choice=choice, temperature=0.0, max_tokens=150
        )
        out = r.choices[0]
        assert out.finish_reason in ("stop", "tool_calls", "length"), out
        if out.message.tool_calls:
            assert choice == "auto" and out.message.tool_calls[0].function.name == "get_weather"
        else:
            assert out.message.content, out


async def test_aborted_constrained_requests_free_their_memory(server, aclient):
    schema = {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "string"}}}}
    rf = {"type": "json_schema", "json_schema": {"name": "items", "schema": schema}}
    for _ in range(3):
        stream = await aclient.chat.completions.create(
            model=MODEL, messages=_ask("list", schema), response_format=rf, max_tokens=400, stream=True
        )
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                break
        await stream.close()  # disconnects mid-generation
    async with aiohttp.ClientSession() as s:
        await wait_clean(s, server.url)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "strin"}}}},
            "response_format.json_schema.schema",
        ),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"response_format": {"type": "json_object"}, "regex": "a+"}, "regex"),
        ({"regex": "(unclosed"}, "regex"),
        ({"ebnf": "root ::= nowhere"}, "ebnf"),
        ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function.name"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"logit_bias": {"99999999": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
    ],
)
async def test_bad_structured_inputs_are_400_naming_the_field(server, aclient, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        await aclient.chat.completions.create(model=MODEL, messages=ASK_WEATHER, max_tokens=5, extra_body=body)
    assert e.value.status_code == 400 and e.value.body["param"] == param, e.value.body


def test_compile_timeout_is_a_400_and_a_full_compile_queue_a_503():
    error = to_api_error(GrammarCompileTimeoutError("too slow", param="json_schema"))
    assert error.status == 400 and error.code == "grammar_compile_timeout" and error.param == "json_schema"
    error = to_api_error(GrammarQueueFullError("busy", param="regex"))
    assert error.status == 503 and error.code == "grammar_queue_full"
