"""Reading a request's JSON body: bounded in time, strictly decoded, unknown fields noticed.

- Content-Encoding (gzip, deflate) is decoded here, not by aiohttp (`ApiRunner` turns its
  automatic decompression off): aiohttp's decoder raised its errors a second time, as unhandled
  exceptions, when the server never read a body, and waited for more data on some deflate bodies
  that were not deflate. Here a body that is not what its header says is a 400 at once, an
  unsupported coding a 415, and the decoded size is bounded by --max-body-size (a zip bomb is a 413).
- The body must arrive within `ServerConfig.body_read_timeout` seconds: a client trickling its
  body a byte at a time would otherwise hold a connection (and a handler) forever. Past it the
  answer is 408 and the connection is closed (the rest of the body is never read).
- Decoding is `errors.decode`: a wrong type, invalid JSON, invalid UTF-8 or absurd nesting is a
  400 naming the field.
- Unknown *top-level* fields are tolerated (clients send newer OpenAI fields and SGLang's many
  extensions) but each distinct one is logged once per endpoint, so an operator can see what
  clients send that we ignore. Unknown keys *inside* `sampling_params` are a 400 instead
  (`SamplingParams` forbids them): a typo there silently changes how tokens are chosen.
"""

from __future__ import annotations

import asyncio
import logging
import zlib
from functools import cache
from typing import TypeVar

import msgspec
from aiohttp import web

from server.errors import ApiError, decode
from server.state import STATE

log = logging.getLogger(__name__)

T = TypeVar("T")
_raw_fields = msgspec.json.Decoder(dict[str, msgspec.Raw])
_reported: set[tuple[str, str]] = set()  # (request type, field) already logged
MAX_REPORTED = 1024  # distinct unknown fields logged at most, so a fuzzer cannot flood the log


@cache
def _known_fields(type_: type) -> frozenset[str]:
    return frozenset(f.encode_name for f in msgspec.structs.fields(type_))


def note_unknown_fields(body: bytes, type_: type) -> list[str]:
    """The top-level keys of `body` that `type_` ignores; each is logged the first time it is seen."""
    try:
        keys = _raw_fields.decode(body).keys()
    except (msgspec.DecodeError, ValueError, RecursionError):
        return []  # not an object: decoding into type_ already said so
    unknown = sorted(k for k in keys if k not in _known_fields(type_))
    for key in unknown:
        tag = (type_.__name__, key)
        if tag not in _reported and len(_reported) < MAX_REPORTED:
            _reported.add(tag)
            log.warning("ignoring unknown field %r in %s bodies (logged once)", key, type_.__name__)
    return unknown


async def read_body(request: web.Request) -> bytes:
    """The whole body, or a 408 (connection closed) if it does not arrive in time."""
    timeout = request.app[STATE].config.body_read_timeout
    try:
        async with asyncio.timeout(timeout):
            return await request.read()
    except TimeoutError:
        _give_up_on_body(request)
        raise ApiError(
            408, f"the request body did not arrive within {timeout:g}s", code="request_timeout", close=True
        ) from None
    except web.RequestPayloadError:  # e.g. Content-Encoding: gzip on a body that is not
        _give_up_on_body(request)
        raise  # errors.to_api_error makes it a 400


def _give_up_on_body(request: web.Request) -> None:
    """Mark the body finished, so that aiohttp does not read the rest of it after our answer
    (its "lingering" read would wait on a slow client, or re-raise a decoding error as an
    unhandled exception); the answer closes the connection."""
    request.content.feed_eof()


_WBITS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


def decode_content(body: bytes, content_encoding: str, limit: int) -> bytes:
    """Undo the codings of a Content-Encoding header (applied in order, so undone in reverse)."""
    codings = [c.strip().lower() for c in content_encoding.split(",") if c.strip()]
    for coding in reversed(codings):
        if coding == "identity":
            continue
        if coding not in _WBITS:
            raise ApiError(
                415, f"unsupported Content-Encoding {coding!r}; send gzip, deflate or none", code="unsupported_encoding"
            )
        body = _inflate(body, coding, limit)
    return body


def _inflate(body: bytes, coding: str, limit: int) -> bytes:
    attempts = [_WBITS[coding]] + ([-zlib.MAX_WBITS] if coding == "deflate" else [])  # zlib-wrapped, or raw
    for wbits in attempts:
        inflater = zlib.decompressobj(wbits)
        try:
            out = inflater.decompress(body, limit + 1)
        except zlib.error:
            continue
        if len(out) > limit:
            raise ApiError(
                413, f"the decoded request body exceeds {limit} bytes", code="request_entity_too_large", close=True
            )
        if inflater.eof and not inflater.unused_data:
            return out
    raise ApiError(400, f"the request body is not valid {coding} data (Content-Encoding)", code="invalid_body")


async def read_json(request: web.Request, type_: type[T]) -> T:
    """Read and strictly decode the body into `type_` (see the module doc)."""
    body = await read_body(request)
    if request.headers.get("Content-Encoding"):
        limit = request.app[STATE].config.max_body_size
        body = decode_content(body, request.headers["Content-Encoding"], limit)
    value = decode(body, type_)
    note_unknown_fields(body, type_)
    return value


__all__ = ["note_unknown_fields", "read_body", "read_json"]
