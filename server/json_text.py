"""JSON text helpers for streaming parsers: a string body decoded piece by piece, the complete
items of an array cut off mid-way, and strict loading (no NaN / Infinity)."""

from __future__ import annotations

import json
import re
from typing import Any, NoReturn

_UNIT = re.compile(r'[^"\\]+|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4}')  # a JSON string's text, an escape at a time
_PARTIAL_ESCAPE = re.compile(r"\\(u[0-9a-fA-F]{0,3})?")
_HIGH_SURROGATE = re.compile(r"\\u[dD][89abAB][0-9a-fA-F]{2}")


def decode_string(text: str, pos: int, final: bool) -> tuple[str, int, bool]:
    """Decode a JSON string's body from `pos`: (text, where to go on from, string closed). Unless `final`, it stops
    before an escape that may be incomplete (a surrogate pair's second half too), so decoding a growing text piece by
    piece equals decoding it whole. Lone surrogates become U+FFFD (UTF-8 cannot carry them); a bad escape ends it."""
    i = held = pos
    while (m := _UNIT.match(text, i)) is not None:
        i, held = m.end(), m.start() if _HIGH_SURROGATE.fullmatch(m.group()) else m.end()
    rest = text[i:]
    closed = rest.startswith('"') or not (rest == "" or _PARTIAL_ESCAPE.fullmatch(rest))
    end = i if closed or final else held
    value = json.loads('"' + text[pos:end] + '"', strict=False)
    return value.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace"), end, closed


def complete_items(text: str, pos: int) -> list[Any]:
    """The complete JSON values of an array whose items start at `pos`, up to where it breaks off
    (a small model looping on calls until max_tokens still gets the calls it finished)."""
    decoder, items = json.JSONDecoder(parse_constant=reject_constant), []
    while True:
        try:
            item, pos = decoder.raw_decode(text, len(text) - len(text[pos:].lstrip()))
        except ValueError:
            return items
        items.append(item)
        rest = text[pos:].lstrip()
        if not rest.startswith(","):
            return items
        pos = len(text) - len(rest) + 1


def strict_loads(text: str) -> Any:
    """Strict JSON: NaN and Infinity raise ValueError (they would not re-serialize as JSON)."""
    return json.loads(text, parse_constant=reject_constant)


def reject_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not JSON")
