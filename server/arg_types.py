"""argparse `type=` validators shared by the server's CLI and bench.serving: a bad value is a
one-line "must be ..." error (exit 2), not a traceback. Imports nothing heavy (`--help` stays fast)."""

from __future__ import annotations

import argparse


def _checked(value, ok: bool, rule: str):
    if not ok:
        raise argparse.ArgumentTypeError(f"must be {rule}, got {value}")
    return value


def positive_int(text: str) -> int:
    value = int(text)
    return _checked(value, value >= 1, ">= 1")


def non_negative_int(text: str) -> int:
    value = int(text)
    return _checked(value, value >= 0, ">= 0")


def positive_float(text: str) -> float:
    value = float(text)
    return _checked(value, value > 0, "> 0")


def non_negative_float(text: str) -> float:
    value = float(text)
    return _checked(value, value >= 0 and value != float("inf"), ">= 0 and finite")


def request_rate(text: str) -> float:
    """Requests per second, > 0; `inf` sends everything at once."""
    value = float(text)
    return _checked(value, value > 0, "> 0 (or inf)")


def fraction(text: str) -> float:
    """A share in (0, 1]."""
    value = float(text)
    return _checked(value, 0.0 < value <= 1.0, "in (0, 1]")


def unit_interval(text: str) -> float:
    """A ratio in [0, 1]."""
    value = float(text)
    return _checked(value, 0.0 <= value <= 1.0, "in [0, 1]")


def port(text: str) -> int:
    value = int(text)
    return _checked(value, 0 <= value <= 65535, "in [0, 65535]")


def chunk_size(text: str) -> int:
    """--chunked-prefill-size: -1 disables chunking (SGLang's spelling), else a size >= 1."""
    value = int(text)
    return _checked(value, value == -1 or value >= 1, "-1 (no chunking) or >= 1")


def device(text: str) -> str:
    """--device: auto, cpu, cuda, or cuda:N (one GPU by index; the data-parallel controller gives
    each replica its own)."""
    kind, sep, index = text.partition(":")
    ok = text in ("auto", "cpu", "cuda") or (kind == "cuda" and sep == ":" and index.isdigit())
    return _checked(text, ok, "auto, cpu, cuda or cuda:N")
