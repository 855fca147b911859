"""Grammar compilation for structured output: one xgrammar compiler per model, a cache, a pool.

A request's grammar (a JSON schema, "any JSON object", a regex or an EBNF grammar) compiles
against the model's vocabulary into a `CompiledGrammar`: per-token mask tables that make each
decode step's mask cheap. Compiling is the expensive part (milliseconds for a small schema,
seconds for a big one, superlinear in nesting depth), so:

* compiled grammars are cached by (kind, spec) in an LRU of our own, bounded by entries and by
  xgrammar's estimate of their memory. Ours rather than xgrammar's built-in cache because we
  need to see hits and misses (`cache_info()`), to share one compile between concurrent
  requests for the same spec (xgrammar's cache only helps once a compile has finished), and
  to key JSON schemas by their canonical text. xgrammar's own cache is turned off so no
  grammar is held twice.
* `compile_async` runs the compile in the backend's small thread pool (xgrammar releases the
  GIL while it compiles, so the event loop keeps running) and gives up waiting after a
  timeout with `GrammarCompileTimeoutError`. A compile cannot be interrupted: a timed-out one
  finishes in its worker thread and still lands in the cache, so its thread is never leaked
  and a retry of the same spec is then a hit.
* a JSON schema nested deeper than `max_spec_depth` is refused before compiling, because
  compile time grows much faster than linearly with depth (a 1,000-level schema runs for
  minutes in a thread nobody can stop).

Bad specs raise `InvalidRequestError` whose `param` names the request field (json_schema /
regex / ebnf) and whose message is xgrammar's (without its C++ source location).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

import xgrammar as xgr

from engine.constrained.json_bounds import JsonBounds, TokenClasses, schema_bounds
from engine.errors import EngineError, GrammarCompileTimeoutError, GrammarQueueFullError, InvalidRequestError

GrammarKind = Literal["json_schema", "json_object", "regex", "ebnf"]
GRAMMAR_KINDS: tuple[str, ...] = ("json_schema", "json_object", "regex", "ebnf")

# The request field an error about each kind names (OpenAI's json_object mode is a
# response_format; the others are SGLang's sampling-parameter names).
_PARAM = {"json_schema": "json_schema", "json_object": "response_format", "regex": "regex", "ebnf": "ebnf"}
# xgrammar's errors start with "[hh:mm:ss] /project/cpp/file.cc:123: " and sometimes a failed
# check's condition; neither means anything to a client.
_XGR_PREFIX = re.compile(r"^\[[0-9:]+\]\s+\S+:\d+:\s*(Check failed: .*? is false:\s*)?")
_MAX_MESSAGE_CHARS = 1000
_ANY_JSON_OBJECT = '{"type": "object"}'
DEFAULT_JSON_BOUNDS = JsonBounds()


@dataclass(frozen=True, eq=False)
class CompiledGrammar:
    """One compiled grammar, shared read-only by every request that uses the same spec.

    `handle` is xgrammar's object; callers outside this package never need to touch it.
    `stop_token_ids` are the ids that end a completed grammar (the model's EOS ids).
    `json_bounds` (json kinds, unless the backend turned them off): the caps each request's
    `GrammarState` applies at run time, already raised to the bounds the schema states;
    `token_classes`: the backend's vocabulary classes they use.
    """

    kind: str
    spec: str
    handle: xgr.CompiledGrammar
    stop_token_ids: tuple[int, ...]
    vocab_size: int
    memory_bytes: int
    json_bounds: JsonBounds | None = None
    token_classes: TokenClasses | None = None


@dataclass(frozen=True)
class GrammarCacheInfo:
    """Counters of the grammar cache. `hits`: served from the cache; `shared`: joined a compile
    of the same spec already under way; `misses`: compiles started; `timeouts`: callers that
    stopped waiting (their compile went on)."""

    hits: int
    misses: int
    shared: int
    timeouts: int
    entries: int
    memory_bytes: int
    in_flight: int


def _default_threads() -> int:
    return max(1, min(4, os.cpu_count() or 1))


class GrammarBackend:
    """Compiles request grammars for one model's vocabulary; thread-safe.

    `vocab_size` is the model's (its logits' width, from the config), which may exceed the
    tokenizer's: the masks then cover every logit and the ids past the tokenizer are never
    allowed. `eos_token_ids` (ModelConfig.eos_token_ids) become the grammar's stop tokens, so a
    completed grammar allows exactly the model's EOS ids and accepting one terminates it; when
    empty, the tokenizer's eos token is used.

    JSON whitespace: `any_whitespace=True` (xgrammar's and SGLang's default) lets the model
    indent its JSON; small models can then loop on whitespace, which the JSON bounds' run-time
    `max_whitespace` cap ends; xgrammar's own `max_whitespace_cnt` (a bound per gap, compiled
    into the grammar) or `any_whitespace=False` (compact JSON) also prevent it.

    JSON bounds (`json_bounds`, engine/constrained/json_bounds.py): where a JSON schema or
    json_object mode leaves a string, a number, an array, whitespace or nesting open, each
    request's mask is narrowed at run time once a cap is reached, so constrained JSON always
    ends; bounds the schema states are never cut. `json_bounds=None`: xgrammar's unbounded JSON.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: frozenset[int] | tuple[int, ...] = (),
        *,
        max_threads: int | None = None,
        cache_max_entries: int = 256,
        cache_max_bytes: int = 512 << 20,
        any_whitespace: bool = True,
        max_whitespace_cnt: int | None = None,
        max_spec_depth: int = 128,
        max_pending: int = 64,
        json_bounds: JsonBounds | None = DEFAULT_JSON_BOUNDS,
    ) -> None:
        threads = max_threads if max_threads is not None else _default_threads()
        if threads < 1 or vocab_size < 1 or cache_max_entries < 1:
            raise ValueError("max_threads, vocab_size and cache_max_entries must be positive")
        stop = sorted(i for i in eos_token_ids if 0 <= i < vocab_size) or None
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop)
        self.vocab_size = vocab_size
        self.stop_token_ids: tuple[int, ...] = tuple(self.tokenizer_info.stop_token_ids)
        # One compile may use `threads` threads, and up to `threads` compiles run at once.
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=threads, cache_enabled=False)
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="grammar-compile")
        self._any_whitespace = any_whitespace
        self._max_whitespace_cnt = max_whitespace_cnt
        self.json_bounds = json_bounds
        self._token_classes = (
            TokenClasses(self.tokenizer_info.decoded_vocab, vocab_size) if json_bounds is not None else None
        )
        self._max_spec_depth = max_spec_depth
        # Distinct specs compiling or queued at once (`compile_async`). A compile cannot be
        # interrupted, so without a bound a client sending many slow schemas would queue work
        # for everyone's threads; past it a new spec is refused (GrammarQueueFullError, a 503),
        # while cached specs and ones already compiling are still served.
        self._max_pending = max_pending
        self._cache_max_entries = cache_max_entries
        self._cache_max_bytes = cache_max_bytes
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], CompiledGrammar] = OrderedDict()
        self._cache_bytes = 0
        self._inflight: dict[tuple[str, str], Future[CompiledGrammar]] = {}
        self._hits = self._misses = self._shared = self._timeouts = 0
        self._closed = False

    # ------------------------------------------------------------------ public API

    def compile(self, kind: str, spec: str = "") -> CompiledGrammar:
        """Compile (or fetch from the cache) in the calling thread. Blocks; use `compile_async`
        on an event loop. Joins a compile of the same spec already running elsewhere."""
        key = self._key(kind, spec)
        hit, future, owner = self._claim(key, submit=False)
        if hit is not None:
            return hit
        assert future is not None
        if owner:
            try:
                future.set_result(self._compile_and_store(key))
            except BaseException as e:
                future.set_exception(e)
                raise
        return future.result()

    async def compile_async(self, kind: str, spec: str = "", timeout: float | None = None) -> CompiledGrammar:
        """Compile in the backend's thread pool without blocking the event loop.

        Concurrent calls for the same (kind, spec) share one compile. Past `timeout` seconds
        (counted from this call, queueing included) raises GrammarCompileTimeoutError; the
        compile goes on and its result is cached. The spec is parsed and checked (JSON, depth)
        in the caller before anything is queued, so a malformed schema fails at once.
        """
        if self._closed:
            raise EngineError("the grammar backend is closed")
        key = self._key(kind, spec)
        hit, future, _ = self._claim(key, submit=True)
        if hit is not None:
            return hit
        assert future is not None
        waiter = asyncio.wrap_future(future)
        # Nobody may be left to read the outcome of a compile we stopped waiting for: read it
        # here so asyncio never logs "exception was never retrieved".
        waiter.add_done_callback(_consume)
        done, _ = await asyncio.wait({waiter}, timeout=timeout)
        if not done:
            with self._lock:
                self._timeouts += 1
            raise GrammarCompileTimeoutError(
                f"the {kind} grammar did not compile within {timeout:g} s; simplify it", param=_PARAM[kind]
            )
        if waiter.cancelled():  # close() dropped a compile that had not started
            raise EngineError("the grammar backend was closed before the grammar compiled")
        return waiter.result()

    def cache_info(self) -> GrammarCacheInfo:
        with self._lock:
            return GrammarCacheInfo(
                self._hits,
                self._misses,
                self._shared,
                self._timeouts,
                len(self._cache),
                self._cache_bytes,
                len(self._inflight),
            )

    def clear_cache(self) -> None:
        """Drop every cached grammar (requests holding one keep theirs) and zero the counters."""
        with self._lock:
            self._cache.clear()
            self._cache_bytes = 0
            self._hits = self._misses = self._shared = self._timeouts = 0

    def close(self, wait: bool = False) -> None:
        """Stop the thread pool: compiles not yet started are dropped (their waiters get an
        EngineError), running ones finish in the background unless `wait`. `compile` (in the
        caller's thread) keeps working."""
        self._closed = True
        self._executor.shutdown(wait=wait, cancel_futures=True)
        with self._lock:
            for key in [k for k, f in self._inflight.items() if f.cancelled()]:
                del self._inflight[key]

    # ------------------------------------------------------------------ internals

    def _key(self, kind: str, spec: str) -> tuple[str, str]:
        """The cache key: the kind and the spec, JSON schemas in canonical text (so formatting
        differences share one entry). Raises InvalidRequestError for a spec that cannot be a
        grammar of that kind before any compile is queued."""
        if kind not in GRAMMAR_KINDS:
            raise ValueError(f"unknown grammar kind {kind!r}; expected one of {', '.join(GRAMMAR_KINDS)}")
        param = _PARAM[kind]
        if kind == "json_object":
            return kind, ""
        if not isinstance(spec, str):
            raise InvalidRequestError(f"{param} must be a string, got {type(spec).__name__}", param=param)
        if kind != "json_schema":
            return kind, spec
        try:
            schema = json.loads(spec)
        except RecursionError:
            raise InvalidRequestError("json_schema nests too deeply", param=param) from None
        except ValueError as e:
            raise InvalidRequestError(f"json_schema is not valid JSON: {e}", param=param) from None
        if not isinstance(schema, (dict, bool)):
            raise InvalidRequestError(
                f"json_schema must be a JSON object (or a boolean), got {type(schema).__name__}", param=param
            )
        depth = _depth(schema)
        if depth > self._max_spec_depth:
            raise InvalidRequestError(
                f"json_schema nests {depth} levels deep; at most {self._max_spec_depth} are allowed", param=param
            )
        return kind, json.dumps(schema, separators=(",", ":"))

    def _claim(
        self, key: tuple[str, str], submit: bool
    ) -> tuple[CompiledGrammar | None, Future[CompiledGrammar] | None, bool]:
        """(cached grammar, None, False) on a hit; (None, the running compile's future, False)
        when one is under way; else registers a new compile: (None, future, True). With
        `submit` the compile is queued on the pool here, under the lock, so it is registered
        before its worker can finish and unregister it."""
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self._hits += 1
                return hit, None, False
            running = self._inflight.get(key)
            if running is not None:
                self._shared += 1
                return None, running, False
            if submit and len(self._inflight) >= self._max_pending:
                raise GrammarQueueFullError(
                    f"{len(self._inflight)} grammars are already compiling (at most {self._max_pending}); "
                    "retry later or reuse a schema",
                    param=_PARAM[key[0]],
                )
            if submit:
                try:
                    future = self._executor.submit(self._compile_and_store, key)
                except RuntimeError:  # close() ran after compile_async checked
                    raise EngineError("the grammar backend is closed") from None
            else:
                future = Future()
                future.set_running_or_notify_cancel()
            self._misses += 1
            self._inflight[key] = future
            return None, future, True

    def _compile_and_store(self, key: tuple[str, str]) -> CompiledGrammar:
        """Compile, then (in one locked step) cache the result and unregister the compile, so a
        caller always finds it in one place or the other."""
        try:
            compiled = self._compile_now(*key)
        except BaseException:
            with self._lock:
                self._inflight.pop(key, None)
            raise
        with self._lock:
            self._inflight.pop(key, None)
            self._cache[key] = compiled
            self._cache_bytes += compiled.memory_bytes
            while len(self._cache) > 1 and (
                len(self._cache) > self._cache_max_entries or self._cache_bytes > self._cache_max_bytes
            ):
                _, old = self._cache.popitem(last=False)
                self._cache_bytes -= old.memory_bytes
        return compiled

    def _compile_now(self, kind: str, spec: str) -> CompiledGrammar:
        compiler = self._compiler
        try:
            if kind in ("json_schema", "json_object"):
                # json_object is OpenAI's JSON mode: any object (not any JSON value), under the
                # same whitespace policy and bounds as a schema.
                handle = compiler.compile_json_schema(
                    spec if kind == "json_schema" else _ANY_JSON_OBJECT,
                    any_whitespace=self._any_whitespace,
                    max_whitespace_cnt=self._max_whitespace_cnt,
                    strict_mode=kind == "json_schema",
                )
            elif kind == "regex":
                handle = compiler.compile_regex(spec)
            else:
                handle = compiler.compile_grammar(spec)
        except (RuntimeError, ValueError, TypeError, UnicodeError) as e:
            raise InvalidRequestError(f"invalid {kind}: {_clean_message(e)}", param=_PARAM[kind]) from None
        bounds = None
        if self.json_bounds is not None and kind in ("json_schema", "json_object"):
            bounds = schema_bounds(self.json_bounds, kind, spec)
        return CompiledGrammar(
            kind,
            spec,
            handle,
            self.stop_token_ids,
            self.vocab_size,
            handle.memory_size_bytes,
            bounds,
            self._token_classes if bounds is not None else None,
        )


def _consume(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


def _clean_message(error: BaseException) -> str:
    text = _XGR_PREFIX.sub("", str(error).strip()).strip()
    return text[:_MAX_MESSAGE_CHARS] + ("..." if len(text) > _MAX_MESSAGE_CHARS else "")


def _depth(value: Any) -> int:
    """Nesting depth of a parsed JSON value (containers only), without recursion."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        node, level = stack.pop()
        if isinstance(node, dict):
            children = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        deepest = max(deepest, level)
        stack.extend((child, level + 1) for child in children)
    return deepest
