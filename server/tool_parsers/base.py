"""What every tool-call format shares: the call and stream-event types, the `ToolFormat` interface, and the
streaming driver that turns a format's `step` into events.

A format reads the model's text as a sequence of steps over a buffer: "these n characters are content", "these n
characters are these calls", or "wait for more text". A step may only decide what no later text could change, so the
events of any chunking add up to those of the whole text; the whole-text parse is the stream run over the whole text.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import xgrammar as xgr

Obj = dict[str, Any]  # a JSON object


class ToolPlan(Protocol):
    """What this module needs of a request's plan (plan.py's `ToolPlan`, which imports this
    module: a protocol here keeps the two from importing each other)."""

    choice: str

    def render_native(self, messages: list[Obj]) -> tuple[list[Obj], Obj | None]: ...


@dataclass(frozen=True)
class FunctionTool:
    name: str
    description: str
    parameters: Obj  # JSON schema of the arguments object
    strict: bool


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # compact JSON text of the arguments object


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None  # None when there is no text besides the calls
    tool_calls: list[ToolCall]


@dataclass(frozen=True)
class ToolCallDelta:  # one entry of an OpenAI streaming chunk's `delta.tool_calls`
    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(frozen=True)
class StreamEvent:
    content: str | None = None
    tool_call: ToolCallDelta | None = None


@dataclass(frozen=True)
class Step:
    """What a format makes of the buffer's start: `n` characters of content (`calls` None) or of calls; `mode` is the
    format's state after them (None: unchanged). n == 0 with the mode unchanged means: wait for more text."""

    n: int
    calls: list[ToolCall] | None = None
    mode: str | None = None


WAIT = Step(0)


class ToolFormat:
    """One way a model writes tool calls. Native formats (all but the generic envelope) get the OpenAI tools through
    the chat template; `step` parses their text and `grammar` constrains it when a call is required."""

    name: ClassVar[str]
    native: ClassVar[bool] = True
    # The format's markers are special tokens (Mistral's [TOOL_CALLS]): keep them in the text, or the parser is blind.
    keep_special_tokens: ClassVar[bool] = False
    # Without parallel_tool_calls, a required or named call is one call (see the generic envelope for why).
    single_forced_call: ClassVar[bool] = False

    def render(self, plan: ToolPlan, messages: list[Obj]) -> tuple[list[Obj], Obj | None]:
        """The messages and extra kwargs for the chat template."""
        return plan.render_native(messages)

    def grammar(self, plan: ToolPlan) -> tuple[str, str] | None:
        """(kind, spec) constraining the output to one call (several if parallel), or None where not supported."""
        return None

    def step(self, parser: StreamingToolParser, buf: str, final: bool) -> Step:
        raise NotImplementedError

    def stream_parser(self, plan: ToolPlan) -> StreamingToolParser:
        return StreamingToolParser(plan, self)

    def parse(self, plan: ToolPlan, text: str) -> ParsedOutput:
        """The whole text, parsed as its stream is: content is the text outside calls, stripped."""
        parser = self.stream_parser(plan)
        events = parser.feed(text) + parser.finish()
        return ParsedOutput("".join(e.content for e in events if e.content) or None, parser.tool_calls)

    def __repr__(self) -> str:
        return f"<tool format {self.name}>"


@dataclass(eq=False)
class StreamingToolParser:
    """One choice's text deltas as OpenAI stream events. However the text is chunked, the content events add up to
    `parse(full).content` and each call's fragments to its arguments. Content streams as soon as the format knows it is
    not part of a call (edge whitespace is dropped, as `parse` strips it); a call is sent whole once complete."""

    plan: ToolPlan
    fmt: ToolFormat
    tool_calls: list[ToolCall] = field(default_factory=list)  # emitted so far, with the ids sent in the deltas
    mode: str = "text"  # the format's state
    _buf: str = ""
    _started: bool = False  # content was sent (so leading whitespace is not dropped)
    _pending_ws: str = ""  # trailing whitespace held until more text comes
    _finished: bool = False

    @property
    def at_start(self) -> bool:
        """Nothing but whitespace so far: formats whose calls may open the reply bare (Llama's JSON) look here."""
        return not self._started and not self.tool_calls

    def feed(self, text: str) -> list[StreamEvent]:
        if self._finished:
            raise RuntimeError("feed() after finish()")
        if self.plan.choice == "none":
            return content_events(text)
        self._buf += text
        return self._drain(final=False)

    def finish(self) -> list[StreamEvent]:
        done, self._finished = self._finished, True
        if done or self.plan.choice == "none":
            return []
        return self._drain(final=True)

    def _drain(self, final: bool) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        while self._buf:
            step = self.fmt.step(self, self._buf, final)
            if step.n == 0 and step.mode in (None, self.mode):
                if not final:
                    break
                step = Step(len(self._buf))  # nothing more will come: the rest is text
            text, self._buf, self.mode = self._buf[: step.n], self._buf[step.n :], step.mode or self.mode
            events += self._outside(text) if step.calls is None else [self._emit(c) for c in step.calls]
        return events

    def _outside(self, text: str) -> list[StreamEvent]:
        """Text outside calls, sent as `parse` strips the whole: no leading whitespace, and trailing whitespace only
        once more text follows."""
        if not self._started:
            text = text.lstrip()
        text = self._pending_ws + text
        body = text.rstrip()
        self._pending_ws = text[len(body) :]
        self._started = self._started or bool(body)
        return content_events(body)

    def _emit(self, call: ToolCall) -> StreamEvent:
        self.tool_calls.append(call)
        return StreamEvent(tool_call=ToolCallDelta(len(self.tool_calls) - 1, call.id, call.name, call.arguments))


def content_events(text: str) -> list[StreamEvent]:
    return [StreamEvent(content=text)] if text else []


# -- text helpers the formats share --------------------------------------------------------------------------------


def text_before(buf: str, markers: tuple[str, ...], final: bool) -> tuple[int, bool]:
    """(i, found): where the first marker starts in `buf`, or, if none does, how much of it is surely text: all but a
    suffix that may be a marker's start (all of it when `final`)."""
    hits = [i for i in (buf.find(m) for m in markers) if i >= 0]
    if hits:
        return min(hits), True
    if final:
        return len(buf), False
    keep = max((k for m in markers for k in range(len(m) - 1, 0, -1) if buf.endswith(m[:k])), default=0)
    return len(buf) - keep, False


@functools.cache
def _bracket_tokens(quotes: str) -> re.Pattern[str]:
    """Complete strings (skipped whole), brackets, and a quote that opens an unfinished string: the regex engine
    steps over everything else, so rescanning a growing call on every delta stays cheap."""
    strings = "|".join(f"{q}(?:[^{q}\\\\]|\\\\.)*{q}" for q in quotes)
    return re.compile(f"{strings}|[][(){{}}]|[{quotes}]", re.S)


def bracket_end(buf: str, start: int, quotes: str = '"') -> int | None:
    """Where the bracketed value opening at `buf[start]` ends (exclusive), or None while it is unfinished. Brackets
    inside strings (delimited by any of `quotes`, with backslash escapes) do not count; mismatched brackets are left
    for the real parser to reject."""
    depth = 0
    for m in _bracket_tokens(quotes).finditer(buf, start):
        tok = m.group()
        if tok in "([{":
            depth += 1
        elif tok in ")]}":
            depth -= 1
            if depth == 0:
                return m.end()
        elif len(tok) == 1:  # a quote whose string does not end (yet)
            return None
    return None


def skip_ws(buf: str, i: int) -> int:
    return len(buf) - len(buf[i:].lstrip()) if i < len(buf) else i


def closed_object(properties: Obj) -> Obj:
    """A schema of an object with exactly these properties."""
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


_RULE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*) ::= (.*)$")
_EBNF_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|[A-Za-z_][A-Za-z0-9_]*|\(=|\s+|.')


def ebnf_rules(ebnf: str, prefix: str, shared: dict[str, str]) -> tuple[str, list[str]]:
    """xgrammar's printed EBNF as rules to embed in a larger grammar: every rule renamed `prefix` + name but the
    `basic_*` ones (the JSON primitives, identical in every schema's grammar: kept once in `shared`), and lookaheads
    dropped (they assume a JSON context: `basic_string` may only be followed by `,` `}` `]` `:`, while a Python
    keyword argument is followed by `)`). Returns the renamed root rule's name and the other rules' lines."""
    rules = dict(m.groups() for line in ebnf.splitlines() if (m := _RULE.match(line)))

    def rename(name: str) -> str:
        return name if name.startswith("basic_") else prefix + name

    lines = []
    for name, body in rules.items():
        out, depth = [], 0  # depth > 0: inside a lookahead, which is dropped
        for tok in _EBNF_TOKEN.findall(body):
            if depth:
                depth += 1 if tok in ("(", "(=") else -1 if tok == ")" else 0
            elif tok == "(=":
                depth = 1
            else:
                out.append(rename(tok) if tok in rules else tok)
        line = f"{rename(name)} ::= {''.join(out).strip()}"
        if not name.startswith("basic_"):
            lines.append(line)
        elif shared.setdefault(name, line) != line:
            raise ValueError(f"xgrammar's {name} differs between schemas")
    return rename("root"), lines


def literal(text: str) -> str:
    """`text` as an EBNF string literal."""
    return json.dumps(text, ensure_ascii=False)


def repeated(ebnf: str, sep: str | None) -> str:
    """The grammar `ebnf` (one rule a line: string literals escape their newlines), or, given `sep`, one or more of
    its matches separated by `sep`: root ::= R (sep R)*, rewriting the root rule only."""
    if sep is None:
        return ebnf
    lines = ebnf.split("\n")
    k = next(i for i, line in enumerate(lines) if line.startswith("root ::= "))
    rule = lines[k][len("root ::= ") :]
    lines[k] = f"root ::= ({rule} ({literal(sep)} {rule})*)"
    return "\n".join(lines)


def wrapped_json(schema: Obj, before: str, after: str, sep: str | None) -> tuple[str, str]:
    """("ebnf", spec) of `before` JSON `after` with the JSON compact (no free whitespace: fewer tokens, and small
    models cannot loop on indentation), repeated with `sep` between when given."""
    json_grammar = xgr.Grammar.from_json_schema(json.dumps(schema, ensure_ascii=False), any_whitespace=False)
    parts = [xgr.Grammar.from_ebnf(f"root ::= {literal(t)}") if t else None for t in (before, after)]
    block = xgr.Grammar.concat(*(g for g in (parts[0], json_grammar, parts[1]) if g is not None))
    return "ebnf", repeated(str(block), sep)


def value_rules(schema: Any, root: Obj, prefix: str, shared: dict[str, str]) -> tuple[str, list[str]]:
    """EBNF rules (see `ebnf_rules`) of one compact JSON value of `schema`, a property of the tool schema `root`
    (whose `$defs` its refs may point into)."""
    sub = schema if isinstance(schema, dict) else {}
    if "$defs" in root and "$defs" not in sub:
        sub = {**sub, "$defs": root["$defs"]}
    ebnf = str(xgr.Grammar.from_json_schema(json.dumps(sub, ensure_ascii=False), any_whitespace=False))
    return ebnf_rules(ebnf, prefix, shared)
