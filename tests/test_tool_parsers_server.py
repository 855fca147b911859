"""Tool-call formats end to end, through the real server and the `openai` client: a Llama-3 template detected and
pythonic by the flag, each forced with the grammar, and the default model's required call (one call, not the same call
twice). (The formats offline: test_tool_parsers.py, test_tool_parsers_grammar.py.)"""

from __future__ import annotations

import json
import shutil
from typing import Any

import jsonschema
import openai
import pytest

from tests.server_helpers import ServerProcess, shared_server, tiny_model_dir  # noqa: F401 (a fixture)
from tests.tool_format_helpers import SCHEMAS, TEMPLATES, TOOLS, WEATHER_PARAMS

pytestmark = pytest.mark.timeout(600)

NAME = "tiny"
ASK = [{"role": "user", "content": "What is the weather in Paris for 3 days?"}]


@pytest.fixture(scope="module")
def llama3_model(tmp_path_factory, tiny_model_dir) -> str:
    """The tiny model with the Llama-3 style template: the server detects the llama3 format from it."""
    folder = tmp_path_factory.mktemp("llama3-tools") / "model"
    shutil.copytree(tiny_model_dir, folder)
    (folder / "chat_template.jinja").unlink(missing_ok=True)  # it would win over tokenizer_config.json
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = TEMPLATES["llama3"]
    config_path.write_text(json.dumps(config))
    return str(folder)


def _client(srv: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def _streamed_calls(client: openai.OpenAI, **kw: Any) -> tuple[list[tuple[str, str]], str | None, str]:
    """(calls as (name, arguments), the last finish_reason, the content) of a streamed request."""
    calls: dict[int, dict[str, Any]] = {}
    finish, content = None, ""
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            finish = c.finish_reason or finish
            content += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"id": d.id, "name": None, "arguments": ""})
                assert d.id is None or entry["id"] == d.id
                if d.function is not None:
                    entry["name"] = entry["name"] or d.function.name
                    entry["arguments"] += d.function.arguments or ""
    assert all(e["id"] and e["id"].startswith("call_") for e in calls.values())
    return [(e["name"], e["arguments"]) for _, e in sorted(calls.items())], finish, content


@pytest.mark.parametrize("how", ["llama3 detected", "pythonic flag"])
def test_a_format_forced_by_the_grammar_end_to_end(request, how: str) -> None:
    """Llama 3 detected from its template; pythonic by the flag, over a template that does not render tools (the
    flag wins over detection; the grammar alone makes the random tiny model call)."""
    if how == "llama3 detected":
        model = request.getfixturevalue("llama3_model")
        srv = shared_server(request, "tools-llama3", model, "--served-model-name", NAME)
        assert "tool calls: llama3 format (detected from the chat template)" in srv.log_tail()
    else:
        model = request.getfixturevalue("tiny_model_dir")
        srv = shared_server(
            request, "tools-pythonic", model, "--served-model-name", NAME, "--tool-call-parser", "pythonic"
        )
        assert "tool calls: pythonic format (--tool-call-parser)" in srv.log_tail()
    client = _client(srv)
    tools = [TOOLS[0], TOOLS[2]]
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        kw: dict[str, Any] = dict(
            model=NAME, messages=ASK, tools=tools, tool_choice=choice, temperature=0, max_tokens=60
        )
        r = client.chat.completions.create(**kw, parallel_tool_calls=False)
        choice_out = r.choices[0]
        assert choice_out.finish_reason == "tool_calls" and choice_out.message.content is None, r
        [call] = choice_out.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        if isinstance(choice, dict):
            assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        streamed, finish, content = _streamed_calls(client, **kw, parallel_tool_calls=False)
        assert (streamed, finish, content) == ([(call.function.name, call.function.arguments)], "tool_calls", "")


def test_default_model_required_call_is_one_call(request) -> None:
    """The bug: the default model, told a call is required, wrote `{"tool_calls": [CALL, CALL, ...]}` with the same
    call repeated (parallel calls allowed by default). Without parallel_tool_calls it now gets one call."""
    srv = shared_server(request, "tools-default", "smollm2-135m", "--max-total-tokens", "16384")
    # the whole log: tests/test_server_structured.py shares this server, its requests may fill the tail
    assert "tool calls: generic format" in srv.log_path.read_text(errors="replace")
    client = _client(srv)
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_PARAMS}}
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        kw: dict[str, Any] = dict(
            model="smollm2-135m", messages=ASK, tools=[weather], tool_choice=choice, temperature=0, max_tokens=100
        )
        r = client.chat.completions.create(**kw)
        assert r.choices[0].finish_reason == "tool_calls", r
        calls = [(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls]
        assert len(calls) == 1 and calls[0][0] == "get_weather"
        jsonschema.validate(json.loads(calls[0][1]), WEATHER_PARAMS)
        assert _streamed_calls(client, **kw) == (calls, "tool_calls", "")
    # asked for parallel calls, the array envelope stays (and what the model writes in it is parsed as written)
    r = client.chat.completions.create(**{**kw, "parallel_tool_calls": True})
    assert r.choices[0].finish_reason in ("tool_calls", "length") and r.usage.completion_tokens > 0
