"""Tool-call formats beyond the generic envelope (server/tool_parsers/): each format with a chat template written for
it (detection, rendering the conversation, the rendered calls read back), its whole-text parser against cases, and
its streaming parser at every split point. (Their grammars: test_tool_parsers_grammar.py; through the real server:
test_tool_parsers_server.py; the tools, calls and templates: tests/tool_format_helpers.py.)"""

from __future__ import annotations

import copy
import json
import random
from typing import Any

import pytest

from server.cli import TOOL_CALL_PARSERS, parse_args
from server.tool_parsers import (
    PARSER_NAMES,
    StreamEvent,
    ToolFormat,
    ToolPlan,
    detect_format,
    get_format,
    select_format,
)
from tests.tool_format_helpers import CALLS, FORMATS, TEMPLATES, format_of, got, make_plan, write_calls

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def tokenizers(default_tokenizer: Any) -> dict[str, Any]:
    out = {}
    for name, template in TEMPLATES.items():
        tok = copy.deepcopy(default_tokenizer)
        tok.chat_template = template
        out[name] = tok
    return out


def test_detection_from_the_chat_template(tokenizers: dict[str, Any], default_tokenizer: Any) -> None:
    for name, tok in tokenizers.items():
        assert detect_format(tok) == name.removesuffix("_args"), name
        fmt, why = select_format(None, tok)
        assert fmt.name == name.removesuffix("_args") and why == "detected from the chat template"
    assert format_of("mistral_args").args_style and not select_format(None, tokenizers["mistral"])[0].args_style
    assert select_format(None, tokenizers["mistral_args"])[0].args_style  # the variant follows the template
    assert detect_format(default_tokenizer) == "generic"  # SmolLM2's template does not render tools
    # the flag wins over detection; qwen25 is SGLang's name for the Hermes format
    fmt, why = select_format("pythonic", tokenizers["hermes"])
    assert (fmt.name, why) == ("pythonic", "--tool-call-parser")
    assert select_format("qwen25", default_tokenizer)[0].name == "hermes"
    assert select_format("generic", tokenizers["hermes"])[0].name == "generic"
    with pytest.raises(ValueError):
        get_format("nope")


def test_the_flag() -> None:
    assert TOOL_CALL_PARSERS == PARSER_NAMES  # cli.py mirrors them without importing xgrammar
    assert parse_args(["--tool-call-parser", "llama3"])[1].tool_call_parser == "llama3"
    assert parse_args([])[1].tool_call_parser is None
    with pytest.raises(SystemExit) as e:
        parse_args(["--tool-call-parser", "llama9"])
    assert e.value.code == 2


HISTORY: list[dict[str, Any]] = [
    {"role": "user", "content": "Weather in Paris, and note it."},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": f"c{k}", "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
            for k, (n, a) in enumerate(CALLS)
        ],
    },
    {"role": "tool", "tool_call_id": "c0", "content": "sunny"},
    {"role": "user", "content": "Thanks"},
]


@pytest.mark.parametrize("name", FORMATS)
def test_template_renders_calls_the_parser_reads_back(tokenizers: dict[str, Any], name: str) -> None:
    """The tools reach the template, and the earlier calls it shows the model are what the parser reads."""
    plan, fmt, tok = make_plan(), format_of(name), tokenizers[name]
    messages, kwargs = plan.render(copy.deepcopy(HISTORY), fmt)
    assert kwargs is not None and [t["function"]["name"] for t in kwargs["tools"]] == ["get_weather", "note", "ping"]
    prompt = tok.apply_chat_template(messages, tools=kwargs["tools"], tokenize=False, add_generation_prompt=True)
    assert '"name": "get_weather", "description": "Weather"' in prompt
    shown = prompt.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    parsed = plan.parse(shown, fmt)
    assert parsed.content is None and [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == CALLS


# -- parsing ---------------------------------------------------------------------------------------------------------

W = '{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}'
WP = '{"name": "get_weather", "parameters": {"city": "Rome", "days": 2}}'
ROME = ("get_weather", {"city": "Rome", "days": 2})
SAME = "<the text itself>"
CASES: dict[str, list[tuple[str, str | None, list[tuple[str, dict[str, Any]]]]]] = {
    "llama3": [
        (WP, None, [ROME]),
        (f"  {WP} ;\n {WP}", None, [ROME, ROME]),
        (f"{WP}\n{WP} and done", "and done", [ROME, ROME]),
        (f"Sure.<|python_tag|>{WP}", "Sure.", [ROME]),
        (f"<|python_tag|> {W}; ", None, [ROME]),
        ('{"name": "nope", "parameters": {}}', SAME, []),
        ('{"answer": 42}', SAME, []),
        (f"I think {WP}", SAME, []),  # a call must open the reply or follow the tag
        (f"{WP}; oops", "; oops", [ROME]),
        ("<|python_tag|>print(1)", SAME, []),
        ('<|python_tag|>{"name": "ping", "parameters": {}', SAME, []),
        (f"{WP[:-1]}", SAME, []),
        ("<|python_ta", SAME, []),
        ('{"name": "ping"}', SAME, []),
        ("", None, []),
    ],
    "mistral": [
        (f"[TOOL_CALLS] [{W}]", None, [ROME]),
        (f"Ok. [TOOL_CALLS][{W}, {W}] bye", "Ok.  bye", [ROME, ROME]),
        (f'[TOOL_CALLS] [{W}, {{"name": "x", "arguments": {{}}}}]', SAME, []),  # all calls, or text
        (
            '[TOOL_CALLS]get_weather[ARGS]{"city": "Rome", "days": 2}[TOOL_CALLS]ping[ARGS]{}',
            None,
            [ROME, ("ping", {})],
        ),
        ("[TOOL_CALLS]ping[ARGS]", SAME, []),
        ("[TOOL_CALLS]ping[ARG]{}", SAME, []),
        ("[TOOL_CALLS] hello", SAME, []),
        ("[TOOL_CALLS]nope[ARGS]{}", SAME, []),
        (f"[TOOL_CALLS] [{W}", SAME, []),
        ("[TOOL_CA", SAME, []),
        ("no calls [x]", SAME, []),
    ],
    "qwen3_coder": [
        (
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n<parameter=days>\n2\n"
            "</parameter>\n</function>\n</tool_call>",
            None,
            [ROME],
        ),
        (
            "Let me note.\n<tool_call>\n<function=note>\n<parameter=text>\n  two\nlines \n</parameter>\n"
            "<parameter=tags>\n['x', 'y']\n</parameter>\n<parameter=score>\n7\n</parameter>\n<parameter=meta>\n"
            '{"k": null}\n</parameter>\n<parameter=extra>\n[1, 2]\n</parameter>\n</function>\n</tool_call>',
            "Let me note.",
            [("note", {"text": "  two\nlines ", "tags": ["x", "y"], "score": 7, "meta": {"k": None}, "extra": [1, 2]})],
        ),
        (  # a value that is not its type stays a string; a missing </parameter> ends at the next one
            "<tool_call><function=get_weather><parameter=city>Rome<parameter=days>two</parameter>"
            "<parameter=metric>TRUE</parameter></function></tool_call>",
            None,
            [("get_weather", {"city": "Rome", "days": "two", "metric": True})],
        ),
        ("<tool_call>\n<function=nope>\n</function>\n</tool_call>", SAME, []),
        ("<tool_call>\n<function=ping>\nstray\n</function>\n</tool_call>", SAME, []),
        ("<tool_call>\n<function=ping>\n</function>\n</tool_call>", None, [("ping", {})]),
        ("<tool_call>\n<function=ping>", SAME, []),
    ],
    "pythonic": [
        ('[get_weather(city="Rome", days=2)]', None, [ROME]),
        ("Sure: [get_weather(city='Rome', days=+2), ping()] ok", "Sure:  ok", [ROME, ("ping", {})]),
        (
            '[note(text="\\ud83d\\ude00 é", tags=("a",), score=-1e2, meta={"k": null})]',
            None,
            [("note", {"text": "😀 é", "tags": ["a"], "score": -100.0, "meta": {"k": None}})],
        ),
        ("[get_weather('Rome', days=2)]", SAME, []),  # positional
        ("[get_weather(city=Rome, days=2)]", SAME, []),  # a name, not a literal
        ("[get_weather(city=__import__('os'), days=2)]", SAME, []),  # never evaluated
        ("[nope()]", SAME, []),
        ("[ping(), 3]", SAME, []),
        ("[ping(**{})]", SAME, []),
        ("[note(text={1, 2})]", SAME, []),  # a set is not JSON
        ("see [1] and [x] and [ping(]", SAME, []),
        ("[ping()", SAME, []),
        ("[ ping ( ) ]", None, [("ping", {})]),
    ],
    "hermes": [
        (f"Hi <tool_call>\n{W}\n</tool_call>", "Hi", [ROME]),
        (f"<tool_call>{WP}</tool_call>", SAME, []),  # "parameters" is Llama's key, not Hermes'
    ],
}


ALL_CASES = [(name, *case) for name, cases in CASES.items() for case in cases]


@pytest.mark.parametrize(("name", "text", "content", "calls"), ALL_CASES)
def test_parse(name: str, text: str, content: str | None, calls: list[tuple[str, Any]]) -> None:
    assert got(make_plan(), format_of(name), text) == (text if content is SAME else content, calls)


def test_parallel_and_named_choice_limit_the_calls() -> None:
    one = make_plan(parallel=False)
    assert got(one, format_of("llama3"), f"{WP}; {WP}") == ("; " + WP, [ROME])
    assert got(one, format_of("pythonic"), "[ping(), ping()]") == ("[ping(), ping()]", [])  # all of the list or none
    named = make_plan({"type": "function", "function": {"name": "ping"}})
    assert got(named, format_of("mistral"), f"[TOOL_CALLS] [{W}]") == (f"[TOOL_CALLS] [{W}]", [])
    assert got(make_plan("none"), format_of("pythonic"), "[ping()]") == ("[ping()]", [])


def _check_stream(plan: ToolPlan, fmt: ToolFormat, text: str, chunks: list[str]) -> None:
    expected = plan.parse(text, fmt)
    parser = plan.stream_parser(fmt)
    events: list[StreamEvent] = [e for chunk in chunks for e in parser.feed(chunk)] + parser.finish()
    assert all((e.content is None) != (e.tool_call is None) and e.content != "" for e in events)
    assert "".join(e.content or "" for e in events) == (expected.content or "")
    deltas = [e.tool_call for e in events if e.tool_call is not None]
    assert [(d.index, d.name, d.arguments) for d in deltas] == [
        (k, c.name, c.arguments) for k, c in enumerate(expected.tool_calls)
    ]
    assert [d.id for d in deltas] == [c.id for c in parser.tool_calls]


def _chunkings(text: str, rng: random.Random) -> list[list[str]]:
    out = [[text], list(text)] + [[text[:i], text[i:]] for i in range(len(text) + 1)]
    for _ in range(10):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(1, 6))))
        out.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
    return out


STREAM_CASES = ALL_CASES + [(name, write_calls(name, CALLS), None, CALLS) for name in FORMATS]


@pytest.mark.parametrize(("name", "text"), [(c[0], c[1]) for c in STREAM_CASES])
def test_stream_matches_parse_for_every_split(name: str, text: str) -> None:
    rng, fmt = random.Random(text), format_of(name)
    for plan in (make_plan(), make_plan(parallel=False)):
        for chunks in _chunkings(text, rng):
            _check_stream(plan, fmt, text, chunks)


def test_stream_sends_text_before_a_call_early() -> None:
    fmt = format_of("llama3")
    parser = make_plan().stream_parser(fmt)
    assert parser.feed("  ") == [] and parser.feed("Let me check. <|python") == [StreamEvent(content="Let me check.")]
    assert parser.feed("_tag|>" + WP[:-1]) == []
    events = parser.feed("}")
    assert len(events) == 1 and events[0].tool_call is not None and events[0].tool_call.name == "get_weather"
    pythonic = make_plan().stream_parser(format_of("pythonic"))
    assert "".join(e.content or "" for e in pythonic.feed("See [1] ")) == "See [1]" and pythonic.feed("[pi") == []
