"""OpenAI tool calling (server/tool_parsers/, the Hermes and generic formats): the whole-text parsers against
cases, and the streaming parser, whose events must add up to the one-shot parse however the text is chunked.
(Validation, prompting and grammars: test_tool_calls.py; the tools: tests/tool_helpers.py.)"""

from __future__ import annotations

import json
import random
from typing import Any

import jsonschema
import pytest

from server.json_text import decode_string
from server.tool_parsers import ParsedOutput, StreamEvent, ToolPlan
from tests.tool_helpers import ARGS, GENERIC, HERMES_F, SCHEMAS, envelope, fmt_for, hermes_block, make_plan

# -- parsing -------------------------------------------------------------------------------------

W = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
SAME = "<the text itself>"  # expected content: the text, as it is
NATIVE_CASES: list[tuple[str, str | None, list[str]]] = [
    ("Hello world", SAME, []),
    ("", None, []),
    ("  \n ", None, []),
    (f"  Let me check.\n<tool_call>\n{W}\n</tool_call>\n", "Let me check.", ["get_weather"]),
    (f"<tool_call>{W}</tool_call> mid <tool_call> {W} </tool_call> end ", "mid  end", ["get_weather"] * 2),
    ('<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}</tool_call>', None, ["get_weather"]),
    ('<tool_call>{"name": "nope", "arguments": {}}</tool_call>', SAME, []),
    ("a <tool_call>{bad json</tool_call> b", SAME, []),
    (f"a <tool_call>\n{W}", SAME, []),
    ('<tool_call>{"name": "ping", "arguments": []}</tool_call>', SAME, []),
    ('<tool_call>{"name": "ping"}</tool_call>', SAME, []),
    (f"x <tool_call> <tool_call>{W}</tool_call> y", SAME, []),
    (f"<<tool_call>{W}</tool_call></tool_call>< <tool_", "<</tool_call>< <tool_", ["get_weather"]),
    (f"<tool_call>{W}</tool_call>\n<tool_call>{W}</tool_call>", None, ["get_weather"] * 2),
    ("é 😀 <tool_cal", SAME, []),
]
GENERIC_CASES: list[tuple[str, str | None, list[str]]] = [
    (envelope("get_weather", False), None, ["get_weather"]),
    (envelope("nested", True, 2), None, ["nested", "nested"]),
    (' { "response" : "Hi \\"there\\"\\n\\u00e9\\ud83d\\ude00\\/ end" }\n', 'Hi "there"\né😀/ end', []),
    ('{"response": "trunc\\u00', "trunc", []),
    ('{"response": "lone \\ud83d", "x": 1}', "lone \ufffd", []),
    ('{"response": "\\ud83d\\u0041\\udc00"}', "\ufffdA\ufffd", []),
    ('{"response": "bad \\x escape"}', "bad ", []),
    ('{"response": ""}', "", []),
    ('{"tool_call": {"name": "get_w', SAME, []),
    (envelope("nested", True, 2)[:-12], None, ["nested"]),  # cut by max_tokens: the complete call is kept
    ('{"tool_calls": [{"name": "get_w', SAME, []),
    ('{"tool_call": {"name": "unknown", "arguments": {}}}', SAME, []),
    ('{"tool_calls": []}', SAME, []),
    ('{"respond": 1}', SAME, []),
    ('{"response": 1}', SAME, []),
    ('{"tool_call": {"name": "ping", "arguments": {"x": NaN}}}', SAME, []),
    ("plain text", SAME, []),
    ("", None, []),
]


@pytest.mark.parametrize(("text", "content", "names"), NATIVE_CASES)
def test_parse_native(text: str, content: str | None, names: list[str]) -> None:
    parsed = make_plan().parse(text, HERMES_F)
    assert parsed.content == (text if content is SAME else content) and [c.name for c in parsed.tool_calls] == names
    for call in parsed.tool_calls:
        assert call.id.startswith("call_") and len(call.id) == 29 and int(call.id[5:], 16) >= 0
        assert call.arguments in ('{"city":"Paris"}', '{"city":"Rome"}')


@pytest.mark.parametrize(("text", "content", "names"), GENERIC_CASES)
def test_parse_generic(text: str, content: str | None, names: list[str]) -> None:
    parsed = make_plan().parse(text, GENERIC)
    assert parsed.content == (text if content is SAME else content) and [c.name for c in parsed.tool_calls] == names
    for call in parsed.tool_calls:
        assert call.arguments == json.dumps(ARGS[call.name], ensure_ascii=False, separators=(",", ":"))
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


def test_parse_respects_choice_and_parallel() -> None:
    two = hermes_block("get_weather", {"city": "A"}) + hermes_block("ping", {})
    single = make_plan(parallel=False).parse(two, HERMES_F)
    assert [c.name for c in single.tool_calls] == ["get_weather"] and single.content == hermes_block("ping", {})
    named = make_plan({"type": "function", "function": {"name": "ping"}}).parse(two, HERMES_F)
    assert [c.name for c in named.tool_calls] == ["ping"]
    assert make_plan("none").parse(two, HERMES_F) == ParsedOutput(two, [])


# -- streaming -----------------------------------------------------------------------------------


def _run(plan: ToolPlan, native: bool, chunks: list[str]) -> tuple[Any, list[StreamEvent]]:
    parser = plan.stream_parser(fmt_for(native))
    events = [e for chunk in chunks for e in parser.feed(chunk)]
    return parser, events + parser.finish()


def _check_stream(plan: ToolPlan, native: bool, text: str, chunks: list[str]) -> None:
    expected = plan.parse(text, fmt_for(native))
    parser, events = _run(plan, native, chunks)
    assert all((e.content is None) != (e.tool_call is None) and e.content != "" for e in events)
    assert "".join(e.content for e in events if e.content is not None) == (expected.content or "")
    deltas = [e.tool_call for e in events if e.tool_call is not None]
    assert len(parser.tool_calls) == len(expected.tool_calls)
    for i, (call, want) in enumerate(zip(parser.tool_calls, expected.tool_calls)):
        mine = [d for d in deltas if d.index == i]
        assert (mine[0].id, mine[0].name, call.name) == (call.id, want.name, want.name)
        assert all(d.id is None and d.name is None for d in mine[1:])
        assert "".join(d.arguments for d in mine) == call.arguments == want.arguments
    assert sorted({d.index for d in deltas}) == list(range(len(parser.tool_calls)))


def _chunkings(text: str, rng: random.Random) -> list[list[str]]:
    out = [[text], list(text)] + [[text[:i], text[i:]] for i in range(len(text) + 1)]
    for _ in range(20):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(1, 8))))
        out.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
    return out


@pytest.mark.parametrize(
    ("native", "text"),
    [(True, case[0]) for case in NATIVE_CASES] + [(False, case[0]) for case in GENERIC_CASES],
)
def test_stream_matches_parse_for_every_chunking(native: bool, text: str) -> None:
    rng = random.Random(text)
    for plan in (make_plan(), make_plan(parallel=False), make_plan("none")):
        for chunks in _chunkings(text, rng):
            _check_stream(plan, native, text, chunks)


def test_stream_sends_text_early() -> None:
    parser = make_plan().stream_parser(HERMES_F)
    assert parser.feed("  Hi there  ") == [StreamEvent(content="Hi there")]
    assert parser.feed("<tool") == []
    assert parser.feed("> now") == [StreamEvent(content="  <tool> now")]
    parser.feed(f" <tool_call>\n{W}\n</tool_call")
    events = parser.feed(">")
    assert len(events) == 1 and events[0].tool_call is not None and events[0].tool_call.name == "get_weather"
    assert parser.finish() == []
    generic = make_plan().stream_parser(GENERIC)
    assert generic.feed('{"resp') == [] and generic.feed('onse": "Hel') == [StreamEvent(content="Hel")]
    assert generic.feed("lo \\u00") == [StreamEvent(content="lo ")]
    assert generic.feed('e9"}') == [StreamEvent(content="é")] and generic.finish() == []


def test_decode_string_pieces_equal_the_whole() -> None:
    rng = random.Random(0)
    pieces = ["a", "\\n", '\\"', "\\\\", "\\u00e9", "\\ud83d\\ude00", "\\ud83d", "\\udc00", "é", "\\/", "\\t"]
    for _ in range(200):
        body = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 12)))
        whole = decode_string(body + '"tail', 0, final=True)
        assert whole[2] and whole[0] == json.loads(f'"{body}"').encode("utf-16", "surrogatepass").decode(
            "utf-16", "replace"
        )
        for cut in range(len(body) + 1):
            first, pos, closed = decode_string(body[:cut], 0, final=False)
            assert not closed
            assert first + decode_string(body + '"', pos, final=True)[0] == whole[0]
