"""LangChain's OpenAI integration (`langchain-openai`) against the live server and the default
model: ChatOpenAI invoke / stream / usage metadata, the three `with_structured_output` methods
(json_schema through openai's `.parse`, function_calling, json_mode), `bind_tools` with a forced
tool, and the completions `OpenAI` LLM. Greedy throughout, so a streamed answer must equal the
invoked one, and each answer is checked against what the official `openai` client gets from the
same server for the same request."""

from __future__ import annotations

import os
from typing import Literal

os.environ.setdefault("LANGCHAIN_TRACING_V2", "false")  # no LangSmith tracing (it is off unless set)
os.environ.setdefault("LANGSMITH_TRACING", "false")

import openai
import pytest
from langchain_core.messages import AIMessage, AIMessageChunk, HumanMessage
from langchain_openai import ChatOpenAI, OpenAI
from pydantic import BaseModel, Field

from tests.server_helpers import shared_server

pytestmark = pytest.mark.timeout(300)
NAME = "smollm2"
# The same key and arguments in tests/test_clients_*.py: one server for all three modules.
CLIENTS_SERVER_ARGS = ("--served-model-name", NAME, "--max-total-tokens", "8192")
QUESTION = "What is the capital of France? Answer in one sentence."
PROMPT = "The three primary colors are"
MAX_TOKENS = 20
TOOL_MAX_TOKENS = 96  # a whole call, its JSON envelope included, fits (each field is bounded)


@pytest.fixture
def server(request):
    return shared_server(request, "smollm2-clients", "smollm2-135m", *CLIENTS_SERVER_ARGS)


def _chat(server, max_tokens: int) -> ChatOpenAI:
    return ChatOpenAI(
        model=NAME,
        base_url=server.url + "/v1",
        api_key="unused",
        temperature=0,
        max_tokens=max_tokens,
        max_retries=0,
        timeout=120,
        stream_usage=True,
    )


@pytest.fixture
def chat(server) -> ChatOpenAI:
    return _chat(server, MAX_TOKENS)


@pytest.fixture
def tool_chat(server) -> ChatOpenAI:
    return _chat(server, TOOL_MAX_TOKENS)


@pytest.fixture
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


class CityWeather(BaseModel):
    """A short weather report for one city."""

    city: str = Field(max_length=16, description="the city's name")
    sky: Literal["sunny", "cloudy", "rainy"]


class GetWeather(BaseModel):
    """Get the current weather in a city."""

    city: str = Field(max_length=16, description="the city, e.g. Paris")
    unit: Literal["celsius", "fahrenheit"]


ASK_WEATHER = "What is the weather like in Paris today?"


def test_invoke_matches_the_openai_client_and_reports_usage(chat, oai, default_tokenizer):
    msg = chat.invoke([HumanMessage(QUESTION)])
    assert isinstance(msg, AIMessage) and msg.content
    ref = oai.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": QUESTION}],
        temperature=0,
        max_completion_tokens=MAX_TOKENS,
    )
    assert msg.content == ref.choices[0].message.content
    assert msg.response_metadata["model_name"] == NAME
    assert msg.response_metadata["finish_reason"] == ref.choices[0].finish_reason
    prompt_len = len(
        default_tokenizer.apply_chat_template(
            [{"role": "user", "content": QUESTION}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
    )
    usage = msg.usage_metadata
    assert usage is not None
    assert usage["input_tokens"] == ref.usage.prompt_tokens == prompt_len
    assert usage["output_tokens"] == ref.usage.completion_tokens
    assert 0 < usage["output_tokens"] <= MAX_TOKENS
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]


def test_stream_concatenates_to_the_invoke_answer(chat):
    want = chat.invoke([HumanMessage(QUESTION)])
    chunks = list(chat.stream([HumanMessage(QUESTION)]))
    assert all(isinstance(c, AIMessageChunk) for c in chunks)
    assert sum(1 for c in chunks if c.content) >= 2  # really streamed, not one blob
    whole = chunks[0]
    for c in chunks[1:]:
        whole += c
    assert whole.content == "".join(c.content for c in chunks) == want.content
    # include_usage: the final usage chunk becomes the aggregate's usage metadata
    assert whole.usage_metadata is not None
    assert whole.usage_metadata["input_tokens"] == want.usage_metadata["input_tokens"]
    assert whole.usage_metadata["output_tokens"] == want.usage_metadata["output_tokens"]
    assert whole.response_metadata["finish_reason"] == want.response_metadata["finish_reason"]


async def test_async_invoke_and_stream_agree(chat):
    want = await chat.ainvoke(QUESTION)
    parts = [c.content async for c in chat.astream(QUESTION)]
    assert "".join(parts) == want.content


def _weather_question() -> list[HumanMessage]:
    return [HumanMessage("Give a weather report for Paris as JSON with the fields city and sky.")]


def test_structured_output_json_schema(tool_chat):
    structured = tool_chat.with_structured_output(CityWeather, method="json_schema", include_raw=True)
    out = structured.invoke(_weather_question())
    assert out["parsing_error"] is None
    parsed = out["parsed"]
    assert isinstance(parsed, CityWeather)
    assert 0 < len(parsed.city) <= 16 and parsed.sky in ("sunny", "cloudy", "rainy")
    # the raw message is the JSON text the parsed object came from
    assert CityWeather.model_validate_json(out["raw"].content) == parsed


def test_structured_output_function_calling(tool_chat):
    structured = tool_chat.with_structured_output(CityWeather, method="function_calling", include_raw=True)
    out = structured.invoke(_weather_question())
    assert out["parsing_error"] is None
    assert isinstance(out["parsed"], CityWeather)
    raw = out["raw"]
    assert [c["name"] for c in raw.tool_calls] == ["CityWeather"]
    assert CityWeather.model_validate(raw.tool_calls[0]["args"]) == out["parsed"]
    assert raw.response_metadata["finish_reason"] == "tool_calls"


def test_structured_output_json_mode(tool_chat):
    """JSON mode constrains to *some* JSON object; the prompt spells out the one wanted, which the
    model copies, and LangChain's Pydantic parser checks its fields."""
    structured = tool_chat.with_structured_output(CityWeather, method="json_mode", include_raw=True)
    prompt = 'Reply with exactly this JSON object and nothing else: {"city": "Paris", "sky": "sunny"}'
    out = structured.invoke([HumanMessage(prompt)])
    assert out["parsing_error"] is None, out["raw"].content
    assert isinstance(out["parsed"], CityWeather)
    assert out["parsed"].sky in ("sunny", "cloudy", "rainy")
    assert out["raw"].content.lstrip().startswith("{")


def test_bind_tools_with_a_forced_tool(tool_chat):
    llm = tool_chat.bind_tools([GetWeather], tool_choice="GetWeather", parallel_tool_calls=False)
    msg = llm.invoke([HumanMessage(ASK_WEATHER)])
    assert isinstance(msg, AIMessage)
    assert [c["name"] for c in msg.tool_calls] == ["GetWeather"]
    call = msg.tool_calls[0]
    assert isinstance(call["args"], dict) and set(call["args"]) == {"city", "unit"}
    args = GetWeather.model_validate(call["args"])
    assert 0 < len(args.city) <= 16
    assert call["id"] and msg.invalid_tool_calls == []
    assert msg.response_metadata["finish_reason"] == "tool_calls"

    # streamed, the tool-call chunks aggregate to the same call
    chunks = list(llm.stream([HumanMessage(ASK_WEATHER)]))
    whole = chunks[0]
    for c in chunks[1:]:
        whole += c
    assert [(c["name"], c["args"]) for c in whole.tool_calls] == [("GetWeather", call["args"])]


def test_bind_tools_required_picks_one_of_the_tools(tool_chat):
    class GetTime(BaseModel):
        """Get the local time in a time zone."""

        timezone: str = Field(max_length=24)

    llm = tool_chat.bind_tools([GetWeather, GetTime], tool_choice="any")  # OpenAI's "required"
    msg = llm.invoke([HumanMessage(ASK_WEATHER)])
    assert len(msg.tool_calls) >= 1
    for call in msg.tool_calls:
        assert call["name"] in ("GetWeather", "GetTime")
        model = GetWeather if call["name"] == "GetWeather" else GetTime
        model.model_validate(call["args"])


def test_completions_llm_invoke_and_stream(server, oai):
    llm = OpenAI(
        model=NAME,
        base_url=server.url + "/v1",
        api_key="unused",
        temperature=0,
        max_tokens=MAX_TOKENS,
        max_retries=0,
        timeout=120,
    )
    text = llm.invoke(PROMPT)
    ref = oai.completions.create(model=NAME, prompt=PROMPT, temperature=0, max_tokens=MAX_TOKENS)
    assert isinstance(text, str) and text == ref.choices[0].text and text
    parts = list(llm.stream(PROMPT))
    assert len(parts) >= 2 and "".join(parts) == text
    # a batch goes as one request with a list of prompts; usage sums both
    result = llm.generate([PROMPT, QUESTION])
    ref2 = oai.completions.create(model=NAME, prompt=QUESTION, temperature=0, max_tokens=MAX_TOKENS)
    assert [g[0].text for g in result.generations] == [text, ref2.choices[0].text]
    usage = result.llm_output["token_usage"]
    assert usage["prompt_tokens"] == ref.usage.prompt_tokens + ref2.usage.prompt_tokens
    assert usage["completion_tokens"] == ref.usage.completion_tokens + ref2.usage.completion_tokens
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
