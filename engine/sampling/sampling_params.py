"""Per-request sampling parameters and their validation.

Field names and validation rules follow SGLang's `SamplingParams`, so that request bodies and
mental models carry over. The struct is a plain value: the server decodes it straight from JSON
with msgspec (which checks types there), and in-process callers build it by keyword. Either way
`verify()` must be called before a request is admitted: it is the single place that turns a bad
value into an `InvalidRequestError` naming the field, instead of a NaN or a crash deep in the
sampler several steps later.
"""

from __future__ import annotations

import json
import math
from typing import Any, NoReturn

import msgspec

from engine.errors import InvalidRequestError

# Temperatures below this are treated as greedy decoding (SGLang's `_SAMPLING_EPS`): dividing
# logits by something this small only overflows, and the user clearly asked for argmax.
SAMPLING_EPS = 1e-6

# `top_k` value meaning "no top-k filtering".
TOP_K_DISABLED = -1

_INT_FIELDS = ("max_new_tokens", "min_new_tokens", "top_k", "n")
_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
)
_BOOL_FIELDS = ("ignore_eos", "skip_special_tokens")

# Bounds on the per-request work stop conditions put on the event loop: the output processor
# scans every text delta against every stop string, so 100,000 of them would slow every other
# request. OpenAI itself allows 4 stop strings; these leave room for any real use.
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 8192  # their total length
MAX_STOP_TOKEN_IDS = 1024
# logit_bias: OpenAI's range for a bias. The entry bound is ours (OpenAI documents none, vLLM has
# none): each step packs every running request's entries, so the work is entries x batch, and a
# vocab-sized map (~150k entries for Qwen) would make a 3 MB request body and a per-step copy of
# batch x vocab entries. 1024 covers banning or forcing any real word list; a caller who wants to
# exclude most of the vocabulary wants constrained decoding, not a bias per token.
MAX_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_ENTRIES = 1024
# Structured output: the grammar fields, and a bound on a spec's text (a schema beyond this is
# not a response format but an attack on the compiler; the body limit already bounds it too).
GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf")
MAX_GRAMMAR_CHARS = 1 << 20


def _is_int(value: object) -> bool:
    # bool is an int subclass, but `top_k=True` is a client bug, not a 1.
    return isinstance(value, int) and not isinstance(value, bool)


class SamplingParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """How one request wants its tokens chosen and when it wants to stop.

    Unknown fields are an error when decoding (a typo such as `tempreature` would otherwise
    silently sample at the default temperature), as they are for keyword construction.

    `temperature == 0` (anything below `SAMPLING_EPS`) or `top_k == 1` means greedy decoding.
    `seed` is stored as given (any int); the sampler folds it to 63 bits.
    `logit_bias` does not depend on previous tokens, so unlike penalties it never forces the
    synchronous (non-overlapped) scheduler step.
    """

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = TOP_K_DISABLED
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    seed: int | None = None
    n: int = 1
    # token id -> bias added to its logit before penalties, temperature and top-k/top-p/min-p
    # (OpenAI's semantics). JSON object keys decode to int ("123" -> 123); others are a 400.
    logit_bias: dict[int, float] | None = None
    # Structured output (SGLang's names): at most one. The output is constrained to the grammar
    # (xgrammar) and ends with "stop" when the grammar completes. A JSON schema may be given as
    # its JSON text or, in process, as a dict.
    json_schema: str | dict[str, Any] | None = None
    regex: str | None = None
    ebnf: str | None = None

    @property
    def is_greedy(self) -> bool:
        """True when this request decodes by argmax (no randomness at all)."""
        return self.temperature < SAMPLING_EPS or self.top_k == 1

    def grammar_spec(self) -> tuple[str, str] | None:
        """(kind, spec) of the request's grammar ("json_schema" | "regex" | "ebnf"), or None.
        Call after `verify()`, which guarantees at most one is set."""
        if self.json_schema is not None:
            schema = self.json_schema
            return "json_schema", schema if isinstance(schema, str) else json.dumps(schema)
        if self.regex is not None:
            return "regex", self.regex
        if self.ebnf is not None:
            return "ebnf", self.ebnf
        return None

    def has_penalties(self) -> bool:
        """Whether sampling needs the request's previous tokens (frequency/presence/repetition)."""
        return self.frequency_penalty != 0.0 or self.presence_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def stop_strs(self) -> list[str]:
        """The stop strings as a list, whatever form `stop` was given in.

        Empty strings are dropped: they would match before any text and end every request at
        once, which no client means by them.
        """
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        return [s for s in stops if s]

    def verify(self, vocab_size: int | None = None) -> None:
        """Raise `InvalidRequestError(param=<field>)` for the first invalid field.

        Rules are SGLang's. Comparisons are written as `not (valid range)` so that NaN, which
        fails every comparison, is rejected too. `vocab_size`, when given, bounds stop_token_ids
        and the token ids of logit_bias.
        """
        self._verify_types()
        self._verify_ranges()
        self._verify_logit_bias(vocab_size)
        self._verify_grammar()
        if vocab_size is not None and self.stop_token_ids:
            for token_id in self.stop_token_ids:
                if not 0 <= token_id < vocab_size:
                    raise InvalidRequestError(
                        f"stop_token_ids must be in [0, {vocab_size}), got {token_id}",
                        param="stop_token_ids",
                    )

    def _verify_types(self) -> None:
        # msgspec validates types when decoding JSON, but not when a Python caller builds the
        # struct by hand; a wrong type would otherwise surface as a TypeError inside torch.
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if not _is_int(value):
                raise InvalidRequestError(f"{name} must be an integer, got {value!r}", param=name)
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if not (_is_int(value) or isinstance(value, float)) or not math.isfinite(value):
                raise InvalidRequestError(f"{name} must be a finite number, got {value!r}", param=name)
        for name in _BOOL_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise InvalidRequestError(f"{name} must be a boolean, got {value!r}", param=name)
        if self.seed is not None and not _is_int(self.seed):
            raise InvalidRequestError(f"seed must be an integer, got {self.seed!r}", param="seed")
        stop = self.stop
        if stop is not None and not isinstance(stop, str):
            if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
                raise InvalidRequestError(f"stop must be a string or a list of strings, got {stop!r}", param="stop")
        ids = self.stop_token_ids
        if ids is not None and (not isinstance(ids, list) or not all(_is_int(t) for t in ids)):
            raise InvalidRequestError(f"stop_token_ids must be a list of integers, got {ids!r}", param="stop_token_ids")

    def _verify_ranges(self) -> None:
        def fail(name: str, rule: str) -> None:
            raise InvalidRequestError(f"{name} must be {rule}, got {getattr(self, name)!r}", name)

        if not self.temperature >= 0.0:
            fail("temperature", ">= 0")
        if not 0.0 < self.top_p <= 1.0:
            fail("top_p", "in (0, 1]")
        if not (self.top_k == TOP_K_DISABLED or self.top_k >= 1):
            fail("top_k", "-1 (disabled) or >= 1")
        if not 0.0 <= self.min_p <= 1.0:
            fail("min_p", "in [0, 1]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            fail("frequency_penalty", "in [-2, 2]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            fail("presence_penalty", "in [-2, 2]")
        if not 0.0 < self.repetition_penalty <= 2.0:
            fail("repetition_penalty", "in (0, 2]")
        if not self.max_new_tokens >= 0:
            fail("max_new_tokens", ">= 0")
        if not self.min_new_tokens >= 0:
            fail("min_new_tokens", ">= 0")
        if self.min_new_tokens > self.max_new_tokens:
            fail("min_new_tokens", f"<= max_new_tokens ({self.max_new_tokens})")
        if not self.n >= 1:
            fail("n", ">= 1")
        stops = self.stop_strs
        if len(stops) > MAX_STOP_STRINGS or sum(map(len, stops)) > MAX_STOP_CHARS:
            raise InvalidRequestError(
                f"stop allows at most {MAX_STOP_STRINGS} strings of {MAX_STOP_CHARS} characters in all, "
                f"got {len(stops)} of {sum(map(len, stops))}",
                "stop",
            )
        if self.stop_token_ids is not None and len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequestError(
                f"stop_token_ids allows at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}",
                "stop_token_ids",
            )

    def _verify_grammar(self) -> None:
        given = [name for name in GRAMMAR_FIELDS if getattr(self, name) is not None]
        if len(given) > 1:
            raise InvalidRequestError(
                f"at most one of json_schema, regex and ebnf may be given, got {' and '.join(given)}", given[1]
            )
        for name in given:
            value = getattr(self, name)
            allowed = (str, dict) if name == "json_schema" else (str,)
            if not isinstance(value, allowed):
                kinds = "a string or an object" if name == "json_schema" else "a string"
                raise InvalidRequestError(f"{name} must be {kinds}, got {type(value).__name__}", name)
            if isinstance(value, str) and not value.strip():
                raise InvalidRequestError(f"{name} must not be empty", name)
            if isinstance(value, str) and len(value) > MAX_GRAMMAR_CHARS:
                raise InvalidRequestError(
                    f"{name} allows at most {MAX_GRAMMAR_CHARS} characters, got {len(value)}", name
                )

    def _verify_logit_bias(self, vocab_size: int | None) -> None:
        bias = self.logit_bias
        if bias is None:
            return

        def fail(message: str) -> NoReturn:
            raise InvalidRequestError(f"logit_bias {message}", "logit_bias")

        if not isinstance(bias, dict):
            fail(f"must be an object mapping token ids to biases, got {type(bias).__name__}")
        if len(bias) > MAX_LOGIT_BIAS_ENTRIES:  # before looking at any entry: bounded work
            fail(f"allows at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(bias)}")
        limit = MAX_LOGIT_BIAS
        for token_id, value in bias.items():
            if not _is_int(token_id):
                fail(f"keys must be integer token ids, got {token_id!r}")
            if token_id < 0 or (vocab_size is not None and token_id >= vocab_size):
                fail(f"token ids must be in [0, {vocab_size or 'vocab_size'}), got {token_id}")
            # `not (range)` also rejects NaN; the range check rejects infinities.
            if not (_is_int(value) or isinstance(value, float)) or not -limit <= value <= limit:
                fail(f"values must be numbers in [{-limit:g}, {limit:g}], got {value!r} for token {token_id}")
