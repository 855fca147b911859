"""Reasoning models: the `<think>…</think>` block of a chat completion split out into
`reasoning_content` (SGLang's `--reasoning-parser`), the rest left as `content`.

Pure text processing (no engine, no I/O), in two forms that must agree: `split` for a whole
output, and `StreamingReasoningParser`, whose `feed`/`finish` pieces concatenate to what `split`
gives for the whole text however the text was chunked (a tag cut between two deltas, "<th" then
"ink>", is held back until it can be told apart from ordinary text).

The formats, as SGLang names them:

* forced (`deepseek-r1`, `qwen3-thinking`, `deepseek-v3` with `thinking: true`): the chat template
  already opened the block, so the output starts inside it; a leading start tag, if the model
  writes one anyway, is dropped. Everything before the end tag is reasoning.
* not forced (`qwen3`, `glm45`, `kimi`): reasoning only when the output starts with the start tag
  (a tag later in the text is ordinary content, so both forms stay simple and equal).
* unterminated (the output hit max_tokens before the end tag): all of it is reasoning and the
  content is empty, as in SGLang.

A format may have a switch in `chat_template_kwargs` (Qwen3's `enable_thinking`, DeepSeek V3's
`thinking`): when it turns thinking off the template makes the model answer directly, so nothing
is split (`reasoning_format` returns None) and a stray tag stays visible in the content.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    start: str
    end: str
    forced: bool  # the template opened the block: the output starts as reasoning
    switch: str | None = None  # the chat_template_kwargs key that turns thinking on and off
    switch_default: bool = True  # thinking when the request does not send the switch


THINK, END_THINK = "<think>", "</think>"
FORMATS: dict[str, ReasoningFormat] = {
    f.name: f
    for f in (
        ReasoningFormat("deepseek-r1", THINK, END_THINK, forced=True),
        ReasoningFormat("deepseek-v3", THINK, END_THINK, forced=True, switch="thinking", switch_default=False),
        ReasoningFormat("qwen3", THINK, END_THINK, forced=False, switch="enable_thinking"),
        # Qwen3-Thinking-2507's template ends the prompt with "<think>\n" itself.
        ReasoningFormat("qwen3-thinking", THINK, END_THINK, forced=True, switch="enable_thinking"),
        ReasoningFormat("glm45", THINK, END_THINK, forced=False, switch="enable_thinking"),
        ReasoningFormat("kimi", "◁think▷", "◁/think▷", forced=False),
    )
}
REASONING_PARSERS = tuple(FORMATS)


class Split(NamedTuple):
    reasoning: str
    content: str


def reasoning_format(
    parser: str | None, separate_reasoning: bool, chat_template_kwargs: dict[str, Any] | None
) -> ReasoningFormat | None:
    """The format to split this request's output with; None leaves all of it as content (no
    parser configured, the request's `separate_reasoning: false`, or thinking switched off)."""
    if parser is None or not separate_reasoning:
        return None
    fmt = FORMATS[parser]
    if fmt.switch is not None:
        value = (chat_template_kwargs or {}).get(fmt.switch, fmt.switch_default)
        # As the templates test it: Qwen3's `enable_thinking is false` turns a default-on
        # switch off only for a real false; a default-off one is on only for a real true.
        if (value is False) if fmt.switch_default else (value is not True):
            return None
    return fmt


def split(fmt: ReasoningFormat, text: str) -> Split:
    """The reasoning and the content of a whole output."""
    if text.startswith(fmt.start):
        body = text[len(fmt.start) :]
    elif fmt.forced:
        body = text
    else:
        return Split("", text)
    reasoning, _, content = body.partition(fmt.end)
    return Split(reasoning, content)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that `tag` starts with (a tag still arriving)."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


_START, _REASONING, _CONTENT = "start", "reasoning", "content"


class StreamingReasoningParser:
    """`split` one delta at a time: `feed` returns what can be told apart so far, `finish` the
    rest; all the pieces concatenate to `split(fmt, whole_text)`."""

    def __init__(self, fmt: ReasoningFormat) -> None:
        self.fmt = fmt
        self._state = _START  # whether the output opens with the start tag is not known yet
        self._held = ""  # text that could still be (part of) a tag

    def feed(self, text: str) -> Split:
        fmt, held = self.fmt, self._held + text
        reasoning = ""
        if self._state == _START:
            if held.startswith(fmt.start):
                held, self._state = held[len(fmt.start) :], _REASONING
            elif fmt.start.startswith(held):  # "<th": could still become the start tag
                self._held = held
                return Split("", "")
            else:
                self._state = _REASONING if fmt.forced else _CONTENT
        if self._state == _REASONING:
            end = held.find(fmt.end)
            if end < 0:
                keep = _partial_suffix(held, fmt.end)
                self._held = held[len(held) - keep :]
                return Split(held[: len(held) - keep], "")
            reasoning, held, self._state = held[:end], held[end + len(fmt.end) :], _CONTENT
        self._held = ""
        return Split(reasoning, held)

    def finish(self) -> Split:
        """The output ended: what was held back is text after all (an unterminated block's tail
        is reasoning, like the rest of it)."""
        held, self._held = self._held, ""
        in_reasoning = self._state == _REASONING or (self._state == _START and self.fmt.forced)
        return Split(held, "") if in_reasoning else Split("", held)
