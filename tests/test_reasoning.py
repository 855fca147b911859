"""Reasoning models (server/reasoning.py, `--reasoning-parser`) and `chat_template_kwargs` on
/v1/chat/completions.

The parser's streaming form must add up to its whole-text form at every chunking. End to end, a
tiny random Llama cannot think by itself, so its output is forced with the `regex` extension
field into `<think>...</think>...`; the tokenizer is the real one, so the tags arrive cut across
tokens as they would from a real model. `chat_template_kwargs` is shown to reach the template by
a Qwen3-style template whose `enable_thinking: false` adds an empty think block to the prompt:
the prompt's token count changes by exactly that block's tokens.
"""

from __future__ import annotations

import json
import random
import shutil
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import openai
import pytest

from server.cli import parse_args
from server.reasoning import FORMATS, Split, StreamingReasoningParser, reasoning_format, split
from tests.server_helpers import ServerProcess, get_json, shared_server, tiny_model_dir, tiny_server  # noqa: F401

pytestmark = pytest.mark.timeout(300)

R1, QWEN3, QWEN3_THINKING, KIMI = (FORMATS[n] for n in ("deepseek-r1", "qwen3", "qwen3-thinking", "kimi"))


def _stream(fmt, chunks: list[str]) -> Split:
    parser = StreamingReasoningParser(fmt)
    pieces = [parser.feed(c) for c in chunks] + [parser.finish()]
    return Split("".join(p.reasoning for p in pieces), "".join(p.content for p in pieces))


# -- the parser ----------------------------------------------------------------------------------

_WHOLE = [  # (format, output, reasoning, content)
    (R1, "<think>plan</think>answer", "plan", "answer"),
    (R1, "plan</think>answer", "plan", "answer"),  # R1's template opened the block
    (R1, "plan</think>", "plan", ""),
    (R1, "</think>answer", "", "answer"),
    (R1, "plan, cut at max_tokens", "plan, cut at max_tokens", ""),
    (R1, "", "", ""),
    (R1, "a</think>b</think>c", "a", "b</think>c"),  # only the first end tag closes
    (QWEN3, "<think>\nplan\n</think>\n\nanswer", "\nplan\n", "\n\nanswer"),
    (QWEN3, "answer without thinking", "", "answer without thinking"),
    (QWEN3, "plan</think>answer", "", "plan</think>answer"),  # qwen3 needs the explicit <think>
    (QWEN3, "say <think>x</think>", "", "say <think>x</think>"),  # a tag later is content
    (QWEN3, "<think>cut at max_tokens", "cut at max_tokens", ""),
    (QWEN3, "<thin", "", "<thin"),
    (QWEN3_THINKING, "plan</think>answer", "plan", "answer"),
    (KIMI, "◁think▷plan◁/think▷answer", "plan", "answer"),
    (KIMI, "<think>x</think>y", "", "<think>x</think>y"),
]


@pytest.mark.parametrize(("fmt", "text", "reasoning", "content"), _WHOLE)
def test_whole_text_split(fmt, text: str, reasoning: str, content: str) -> None:
    assert split(fmt, text) == (reasoning, content)


@pytest.mark.parametrize(("fmt", "text"), [(f, t) for f, t, _, _ in _WHOLE])
def test_streaming_equals_whole_text_at_every_split_point(fmt, text: str) -> None:
    want = split(fmt, text)
    assert _stream(fmt, [text]) == want
    assert _stream(fmt, list(text)) == want  # one character at a time
    for k in range(len(text) + 1):
        assert _stream(fmt, [text[:k], text[k:]]) == want, k
        for j in range(k, len(text) + 1):
            assert _stream(fmt, [text[:k], "", text[k:j], text[j:]]) == want, (k, j)


@pytest.mark.parametrize("fmt", list(FORMATS.values()), ids=list(FORMATS))
def test_streaming_equals_whole_text_on_random_tag_soup(fmt) -> None:
    """Texts made of whole and partial tags (the cases a holdback gets wrong), cut at random."""
    rng = random.Random(fmt.name)
    parts = [fmt.start, fmt.end, fmt.start[:3], fmt.start[3:], fmt.end[:2], fmt.end[2:], "<", ">", "/", "a", " ", "\n"]
    for _ in range(400):
        text = "".join(rng.choice(parts) for _ in range(rng.randint(0, 12)))
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 5))))
        chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        assert _stream(fmt, chunks) == split(fmt, text), chunks


def test_streaming_holds_back_only_what_could_be_a_tag() -> None:
    parser = StreamingReasoningParser(QWEN3)
    assert parser.feed("<th") == ("", "")  # maybe the start tag
    assert parser.feed("ink>I plan</th") == ("I plan", "")  # "</th" may be the end tag
    assert parser.feed("ing") == ("</thing", "")  # it was not
    assert parser.feed("</think>Hi") == ("", "Hi")
    assert parser.feed(" there") == ("", " there")
    assert parser.finish() == ("", "")
    plain = StreamingReasoningParser(QWEN3)
    assert plain.feed("Hello") == ("", "Hello")  # no tag at the start: content at once


def test_which_requests_split() -> None:
    assert reasoning_format(None, True, None) is None
    assert reasoning_format("deepseek-r1", True, None) is R1
    assert reasoning_format("deepseek-r1", False, None) is None  # separate_reasoning: false
    assert reasoning_format("qwen3", True, {"enable_thinking": False}) is None
    assert reasoning_format("qwen3", True, {"enable_thinking": True}) is QWEN3
    assert reasoning_format("qwen3", True, {"other": 1}) is QWEN3
    assert reasoning_format("qwen3", True, {"enable_thinking": "false"}) is QWEN3  # the template tests `is false`
    assert reasoning_format("deepseek-v3", True, None) is None  # V3 thinks only when asked to
    assert reasoning_format("deepseek-v3", True, {"thinking": True}) is FORMATS["deepseek-v3"]


def test_cli_flag() -> None:
    assert parse_args([])[1].reasoning_parser is None
    _, config = parse_args(["--reasoning-parser", "qwen3"])
    assert config.reasoning_parser == "qwen3" and config.public()["reasoning_parser"] == "qwen3"
    with pytest.raises(SystemExit) as e:
        parse_args(["--reasoning-parser", "nope"])
    assert e.value.code == 2


# -- end to end ----------------------------------------------------------------------------------

NAME = "tiny"
ASK = [{"role": "user", "content": "Think, then answer."}]
THINK_REGEX = "<think>[a-z ]{1,20}</think>[A-Za-z ]{1,20}"
# A Qwen3-style ChatML template: `enable_thinking: false` closes an empty think block in the
# prompt, as Qwen3's does; native tools in the <tool_call> format (server/tool_parsers/hermes.py).
TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}{% endfor %}. "
    'Call one as <tool_call>\n{"name": ..., "arguments": ...}\n</tool_call><|im_end|>\n{% endif %}'
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{%- endif %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


@pytest.fixture(scope="module")
def qwen3_model(tmp_path_factory, tiny_model_dir) -> str:
    """The tiny model with TEMPLATE as its chat template."""
    folder = tmp_path_factory.mktemp("qwen3-style") / "model"
    shutil.copytree(tiny_model_dir, folder)
    (folder / "chat_template.jinja").unlink(missing_ok=True)  # it would win over tokenizer_config.json
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = TEMPLATE
    config_path.write_text(json.dumps(config))
    return str(folder)


@pytest.fixture
def qwen3_server(request, qwen3_model) -> ServerProcess:
    return shared_server(
        request, "reasoning-qwen3", qwen3_model, "--served-model-name", NAME, "--reasoning-parser", "qwen3"
    )


@pytest.fixture
def r1_server(request, tiny_model_dir) -> ServerProcess:
    return shared_server(
        request, "reasoning-r1", tiny_model_dir, "--served-model-name", NAME, "--reasoning-parser", "deepseek-r1"
    )


def _client(srv: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _post(srv: ServerProcess, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(
        srv.url + "/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _extra(obj: Any, name: str) -> Any:
    """A field the openai client does not model (it keeps them as extras)."""
    return (obj.model_extra or {}).get(name)


def _streamed(client: openai.OpenAI, n: int = 1, **kw: Any) -> list[tuple[str | None, str | None, str | None]]:
    """Per choice: (reasoning, content, finish_reason), the deltas concatenated (None: no delta)."""
    got: list[dict[str, Any]] = [{"r": None, "c": None, "f": None} for _ in range(n)]
    for chunk in client.chat.completions.create(model=NAME, stream=True, n=n, **kw):
        for ch in chunk.choices:
            g = got[ch.index]
            reasoning = _extra(ch.delta, "reasoning_content")
            if reasoning:
                g["r"] = (g["r"] or "") + reasoning
            if ch.delta.content:
                g["c"] = (g["c"] or "") + ch.delta.content
            g["f"] = ch.finish_reason or g["f"]
    return [(g["r"], g["c"], g["f"]) for g in got]


def test_think_block_split_streaming_and_not(qwen3_server) -> None:
    client = _client(qwen3_server)
    kw: dict[str, Any] = dict(messages=ASK, max_tokens=60, temperature=0, extra_body={"regex": THINK_REGEX})
    r = client.chat.completions.create(model=NAME, **kw)
    msg = r.choices[0].message
    reasoning = _extra(msg, "reasoning_content")
    assert reasoning and msg.content and r.choices[0].finish_reason == "stop"
    assert "<think>" not in reasoning + msg.content and "</think>" not in reasoning + msg.content
    # the same output unsplit: exactly the tags around the two parts
    raw = client.chat.completions.create(
        model=NAME, **{**kw, "extra_body": {**kw["extra_body"], "separate_reasoning": False}}
    )
    assert raw.choices[0].message.content == f"<think>{reasoning}</think>{msg.content}"
    assert _extra(raw.choices[0].message, "reasoning_content") is None
    # streamed (two greedy choices, each with its own parser): the deltas add up to the same split
    assert _streamed(client, n=2, **kw) == [(reasoning, msg.content, "stop")] * 2


def test_enable_thinking_false_reaches_the_template_and_turns_splitting_off(qwen3_server) -> None:
    client = _client(qwen3_server)
    kw: dict[str, Any] = dict(messages=ASK, max_tokens=60, temperature=0)
    plain = client.chat.completions.create(model=NAME, max_tokens=1, messages=ASK)
    on = client.chat.completions.create(
        model=NAME, max_tokens=1, messages=ASK, extra_body={"chat_template_kwargs": {"enable_thinking": True}}
    )
    off = client.chat.completions.create(
        model=NAME, max_tokens=1, messages=ASK, extra_body={"chat_template_kwargs": {"enable_thinking": False}}
    )
    tokenizer_path = Path(qwen3_server.cmd[qwen3_server.cmd.index("--model-path") + 1])
    from transformers import AutoTokenizer

    block = len(AutoTokenizer.from_pretrained(tokenizer_path).encode("<think>\n\n</think>\n\n"))
    assert plain.usage.prompt_tokens == on.usage.prompt_tokens
    assert off.usage.prompt_tokens == plain.usage.prompt_tokens + block
    # thinking switched off: the output is all content, a forced think block included
    forced = {"regex": THINK_REGEX, "chat_template_kwargs": {"enable_thinking": False}}
    r = client.chat.completions.create(model=NAME, **kw, extra_body=forced)
    assert r.choices[0].message.content.startswith("<think>")
    assert _extra(r.choices[0].message, "reasoning_content") is None
    assert _streamed(client, **kw, extra_body=forced) == [(None, r.choices[0].message.content, "stop")]


def test_bad_chat_template_kwargs_are_400_naming_the_field(qwen3_server) -> None:
    for bad in ("enable_thinking", ["enable_thinking"], 5, {"add_generation_prompt": False}, {"messages": []}):
        status, body = _post(qwen3_server, {"model": NAME, "messages": ASK, "chat_template_kwargs": bad})
        assert status == 400, body
        assert body["error"]["param"] == "chat_template_kwargs" and body["error"]["type"] == "invalid_request_error"
    # the tools reach the template from `tools`; the same key in chat_template_kwargs is a clash
    clash = {"tools": [WEATHER], "chat_template_kwargs": {"tools": [WEATHER]}}
    status, body = _post(qwen3_server, {"model": NAME, "messages": ASK, **clash})
    assert (status, body["error"]["param"]) == (400, "chat_template_kwargs"), body
    with pytest.raises(openai.BadRequestError):
        _client(qwen3_server).chat.completions.create(
            model=NAME, messages=ASK, extra_body={"chat_template_kwargs": "x"}
        )
    # the server still serves
    assert _client(qwen3_server).chat.completions.create(model=NAME, messages=ASK, max_tokens=2).choices


def test_tool_calls_are_parsed_from_the_content_after_the_reasoning(qwen3_server) -> None:
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    regex = "<think>[a-z ]{1,20}</think>" + "".join("\\" + c if c in "{}[]().*+?|^$\\" else c for c in call)
    kw: dict[str, Any] = dict(messages=ASK, tools=[WEATHER], max_tokens=80, temperature=0, extra_body={"regex": regex})
    client = _client(qwen3_server)
    r = client.chat.completions.create(model=NAME, **kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and _extra(choice.message, "reasoning_content")
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    reasoning, content, finish = _streamed(client, **kw)[0]
    assert (reasoning, finish) == (_extra(choice.message, "reasoning_content"), "tool_calls")
    assert content == choice.message.content  # no call text leaks into the content


def test_deepseek_r1_output_starts_inside_the_reasoning(r1_server) -> None:
    client = _client(r1_server)
    kw: dict[str, Any] = dict(messages=ASK, max_tokens=60, temperature=0)
    for regex in ("[a-z ]{1,20}</think>[A-Za-z ]{1,20}", THINK_REGEX):  # R1 and R1-0528 style
        r = client.chat.completions.create(model=NAME, **kw, extra_body={"regex": regex})
        msg = r.choices[0].message
        reasoning = _extra(msg, "reasoning_content")
        assert reasoning and msg.content and "think>" not in reasoning + msg.content
        assert _streamed(client, **kw, extra_body={"regex": regex}) == [(reasoning, msg.content, "stop")]
    # cut by max_tokens inside the block: all of it is reasoning, the content null
    cut = {"regex": "<think>[a-z]{40}</think>[a-z]{3}"}
    r = client.chat.completions.create(model=NAME, **{**kw, "max_tokens": 12}, extra_body=cut)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "length" and msg.content is None and _extra(msg, "reasoning_content")
    assert _streamed(client, **{**kw, "max_tokens": 12}, extra_body=cut) == [
        (_extra(msg, "reasoning_content"), None, "length")
    ]
    info = get_json(r1_server.url + "/get_server_info")
    assert info["reasoning_parser"] == "deepseek-r1"


def test_without_a_parser_nothing_changes(tiny_server) -> None:
    status, body = _post(
        tiny_server,
        {"messages": ASK, "max_tokens": 30, "temperature": 0, "regex": THINK_REGEX, "chat_template_kwargs": {"x": 1}},
    )
    assert status == 200, body
    message = body["choices"][0]["message"]
    assert "reasoning_content" not in message and message["content"].startswith("<think>")
    assert get_json(tiny_server.url + "/get_server_info")["reasoning_parser"] is None
