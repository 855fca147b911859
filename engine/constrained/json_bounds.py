"""Default bounds for constrained JSON, so that it always ends.

A JSON schema that leaves a string, a number or an array open (or OpenAI's json_object mode,
which leaves everything open) lets a model, a small one or any model sampled hot, fill it until
max_tokens: digits after digits, a sentence that never closes its quote, the same item over and
over, runs of newlines, ever deeper nesting. The client then gets truncated JSON it cannot parse.

The bounds (soft caps, `JsonBounds`):

* strings: once one holds `max_string_length` characters, the next token must close it;
* numbers: once a run of digits (integer part, fraction or exponent) holds `max_number_digits`,
  the next token must not add a digit. 15, because every 15-digit integer is exact in an IEEE
  double (the number of JavaScript and most JSON parsers; 2**53 has 16 digits, not all exact), and
  a double holds 15-17 significant digits, so more digits are noise;
* arrays and objects: once one holds `max_items` items / members, the next must close it;
* whitespace: once a gap holds `max_whitespace` characters, the next token must not add any
  (32: indented JSON 7 levels deep at 4 spaces; the run of newlines a small model falls into);
* nesting: at `max_depth` open containers a value must not open another one.

How (and why not in the grammar): tightening xgrammar's grammar was measured first. A counted
repetition of a string character (`{0, 512}`) either compiles for seconds per schema (a char
class: one precomputed mask per count; maxLength 512 took 4 s, 64 took 1.4 s) or fills each
step's mask in ~0.5 s (a rule), and xgrammar 0.2.8's own maxLength strings allow no escapes. So the
grammar stays as xgrammar builds it and the caps are applied at run time: a small lexer follows the
JSON text the request has produced, and when a cap is reached the step's grammar mask is
intersected with a token class (tokens that close the string, tokens that do not start with a
digit, ...; computed once per backend and class, ~0.1 s). Costs: nothing at compile time, a few
bytes of lexing per token, and an AND of the mask row (~10 us) when a cap applies or inside a
string: there it also drops raw control characters, which xgrammar 0.2.8's maxLength strings allow
and no JSON parser accepts.

Why the output stays valid: only tokens the grammar allows are ever left, so whatever is produced
is valid against the schema. When the intersection is empty (the schema needs more here: a
pattern, a minLength, a required nested object) the grammar's own mask is used unchanged.

Never overriding the schema: the caps of a json_schema are raised to the largest bound the schema
states (maxLength / minLength, maxItems / minItems, the digits of minimum / maximum, its nesting),
so a field the schema allows to be longer is never cut short; the grammar enforces the schema's
own bounds. The caps are soft: a token that reaches the cap may overshoot it by its own length.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch


@dataclass(frozen=True)
class JsonBounds:
    """Default caps on what a JSON grammar leaves open; 0 turns a cap off."""

    max_string_length: int = 256
    max_number_digits: int = 15
    max_items: int = 100
    max_whitespace: int = 32
    max_depth: int = 6

    def __post_init__(self) -> None:
        for name, value in self.__dict__.items():
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"JsonBounds.{name} must be an integer >= 0 (0: no cap), got {value!r}")

    def for_schema(self, schema: Any) -> JsonBounds:
        """These caps raised to every bound `schema` states, so none of its bounds is cut."""
        lengths, items, digits, depth = [0], [0], [0], _depth(schema)
        stack = [schema]
        while stack:
            node = stack.pop()
            if isinstance(node, list):
                stack.extend(node)
                continue
            if not isinstance(node, dict):
                continue
            for key, value in node.items():
                if isinstance(value, (dict, list)):
                    stack.append(value)
                elif isinstance(value, bool) or not isinstance(value, (int, float)):
                    continue
                elif key in ("maxLength", "minLength"):
                    lengths.append(int(value))
                elif key in ("maxItems", "minItems", "maxProperties", "minProperties"):
                    items.append(int(value))
                elif key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
                    digits.append(len(str(abs(int(value)))) if abs(value) < 1e300 else 300)

        def raise_to(cap: int, need: int) -> int:
            return cap and max(cap, need)

        return replace(
            self,
            max_string_length=raise_to(self.max_string_length, max(lengths)),
            max_items=raise_to(self.max_items, max(items)),
            max_number_digits=raise_to(self.max_number_digits, max(digits)),
            max_depth=raise_to(self.max_depth, depth),
        )


def _depth(value: Any) -> int:
    """Nesting depth of a parsed JSON value: a bound on the nesting of the JSON it describes."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, level = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is not None:
            deepest = max(deepest, level)
            stack.extend((child, level + 1) for child in children)
    return deepest


_WS = b" \t\n\r"
_DIGITS = b"0123456789"


class TokenClasses:
    """The tokens allowed once caps are reached, as bitmask rows (int32 words, like xgrammar's),
    for one vocabulary (xgrammar's decoded vocabulary). A row depends only on a small key (inside
    a string or not, after a backslash or not, which caps are reached), so each is computed the
    first time it is needed (~0.1 s: every token run through the lexer) and cached. Shared by
    the requests of one grammar backend; a race fills the same row twice, harmlessly."""

    def __init__(self, decoded_vocab: list[bytes], vocab_size: int) -> None:
        self.vocab = list(decoded_vocab[:vocab_size])
        self.vocab_size = vocab_size
        self._rows: dict[tuple[bool, ...], np.ndarray] = {}

    def row(self, key: tuple[bool, ...]) -> np.ndarray:
        cached = self._rows.get(key)
        if cached is None:
            allowed = np.zeros(self.vocab_size, dtype=np.bool_)
            allowed[: len(self.vocab)] = [_keeps_caps(text, *key) for text in self.vocab]
            cached = self._rows[key] = _pack(allowed)
        return cached


def _keeps_caps(
    text: bytes,
    in_string: bool,
    escape: bool,
    string_cap: bool,
    digit_cap: bool,
    ws_cap: bool,
    item_cap: bool,
    depth_cap: bool,
) -> bool:
    """Whether `text`, produced from a state described by the flags, adds nothing to a quantity
    whose cap is reached: a character to the current string, a digit to the current digit run,
    whitespace to the current gap, a member to the current container, a level of nesting; and
    puts no raw control character in a string."""
    capped_string = in_string  # still in the string the state was in
    leading_ws = leading_digits = True
    level = 0  # containers opened (+) or closed (-) by the token so far
    for byte in text:
        if in_string:
            if byte < 0x20:  # JSON forbids raw control characters in strings
                return False
            if escape:
                escape = False
            elif byte == 0x22:
                in_string = capped_string = False
            else:
                if string_cap and capped_string:
                    return False
                escape = byte == 0x5C
            continue
        if byte in _WS:
            if ws_cap and leading_ws:
                return False
            leading_digits = False
            continue
        leading_ws = False
        if byte in _DIGITS:
            if digit_cap and leading_digits:
                return False
            continue
        leading_digits = False
        if byte == 0x22:
            in_string = True
        elif byte in b"[{":
            if depth_cap and level >= 0:
                return False
            level += 1
        elif byte in b"]}":
            level -= 1
        elif byte == 0x2C and item_cap and level == 0:
            return False
    return True


def _pack(allowed: np.ndarray) -> np.ndarray:
    words = (allowed.shape[0] + 31) // 32
    bits = np.zeros(words * 32, dtype=np.bool_)
    bits[: allowed.shape[0]] = allowed
    return np.packbits(bits, bitorder="little").view("<i4").astype(np.int32)


class JsonLexer:
    """Follows the JSON text a request produces, byte by byte, to know which cap applies next.

    The text is valid JSON so far (the grammar guarantees it), so the lexer only tracks: the open
    containers and their item counts, whether it is inside a string (and after a backslash),
    and the lengths of the current string, digit run and whitespace run. `snapshot`/`restore`
    undo tokens (a rollback).
    """

    __slots__ = ("bounds", "classes", "digits", "escape", "in_string", "stack", "string_len", "ws")

    def __init__(self, bounds: JsonBounds, classes: TokenClasses) -> None:
        self.bounds = bounds
        self.classes = classes
        self.stack: list[list[int]] = []  # [opening byte, items so far]
        self.in_string = self.escape = False
        self.string_len = self.digits = self.ws = 0

    def snapshot(self) -> tuple:
        return (tuple(tuple(c) for c in self.stack), self.in_string, self.escape, self.string_len, self.digits, self.ws)

    def restore(self, snap: tuple) -> None:
        stack, self.in_string, self.escape, self.string_len, self.digits, self.ws = snap
        self.stack = [list(c) for c in stack]

    def feed(self, text: bytes) -> None:
        for byte in text:
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif byte == 0x5C:  # an escape counts as one character (\uXXXX as five: soft)
                    self.escape = True
                    self.string_len += 1
                elif byte == 0x22:
                    self.in_string = False
                elif byte & 0xC0 != 0x80:  # count characters, not UTF-8 continuation bytes
                    self.string_len += 1
                continue
            if byte in _WS:
                self.ws += 1
                self.digits = 0
                continue
            self.ws = 0
            if byte in _DIGITS:
                self.digits += 1
                continue
            self.digits = 0
            if byte == 0x22:
                self.in_string, self.string_len = True, 0
            elif byte in b"[{":
                self.stack.append([byte, 0])
            elif byte in b"]}":
                if self.stack:
                    self.stack.pop()
            elif byte == 0x2C and self.stack:  # ',': one more item in the open container
                self.stack[-1][1] += 1

    def restrict(self, row: torch.Tensor) -> bool:
        """AND the grammar's mask `row` (int32 words) with the tokens that keep the reached caps;
        left unchanged where that would allow nothing (the grammar needs more here). Returns
        whether the row was narrowed."""
        b = self.bounds
        in_string = self.in_string
        key = (
            in_string,
            self.escape,
            in_string and bool(b.max_string_length) and self.string_len >= b.max_string_length,
            not in_string and bool(b.max_number_digits) and self.digits >= b.max_number_digits,
            not in_string and bool(b.max_whitespace) and self.ws >= b.max_whitespace,
            # commas so far + 1: the members the open container holds once the current one ends
            bool(b.max_items) and bool(self.stack) and self.stack[-1][1] + 1 >= b.max_items,
            bool(b.max_depth) and len(self.stack) >= b.max_depth,
        )
        # Inside a string the row is narrowed even with no cap reached: xgrammar 0.2.8's strings
        # with maxLength/minLength allow raw control characters (a tab, \x01), which make the
        # JSON unparseable; its plain strings never do, so for them this changes nothing.
        if not in_string and not any(key[2:]):
            return False
        # numpy on the CPU row (a view): a few microseconds, where torch's per-op dispatch cost
        # ~40 us a step, paid on every step inside a string.
        words = row.numpy()
        narrowed = words & self.classes.row(key)[: words.shape[0]]
        if not narrowed.any():
            return False
        words[:] = narrowed
        return True


def schema_bounds(bounds: JsonBounds, kind: str, spec: str) -> JsonBounds:
    """The caps for one grammar: json_object takes `bounds`; a json_schema raises them to the
    bounds it states."""
    if kind != "json_schema":
        return bounds
    return bounds.for_schema(json.loads(spec))
