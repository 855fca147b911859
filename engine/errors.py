"""Typed exceptions: every way bad input or a broken model can fail, named.

The server maps these to HTTP statuses (InvalidRequestError -> 400, ...); in-process users catch
them. Nothing that a user can cause should surface as a bare traceback from deep inside torch.
"""

from __future__ import annotations


class EngineError(Exception):
    """Base class of every error this package raises on purpose."""


class ModelLoadError(EngineError):
    """The model could not be resolved or loaded (missing path, unsupported arch, bad weights)."""


class InvalidRequestError(EngineError, ValueError):
    """A request is malformed: a bad sampling value, an empty prompt, ...

    `param` names the offending field, as OpenAI's error body does.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class ContextLengthExceededError(InvalidRequestError):
    """Prompt (plus requested output) does not fit the model's context length."""


class RequestTooLargeError(InvalidRequestError):
    """A request can never fit the KV pool, however empty the engine is."""


class InvalidServerArgsError(InvalidRequestError):
    """An engine option cannot work: a non-positive size, a context longer than the model's, a KV
    pool too small for one request. Raised at start-up, before memory is allocated; the server
    exits with status 2 on it, as for a bad flag."""


class EngineUnhealthyError(EngineError):
    """The engine lost an actor (or was never started) and cannot serve requests."""


class WatchdogTimeoutError(EngineError):
    """A forward ran past `watchdog_timeout`: the device (or a kernel) hangs; the engine is dead."""


class GrammarCompileTimeoutError(InvalidRequestError):
    """A request's grammar (json_schema / regex / ebnf) did not compile within the compile timeout.

    A 4xx, not a 5xx: the spec is what is too expensive, and the same spec will time out again
    (the server should answer 400 with code "grammar_compile_timeout"). The compile itself cannot
    be interrupted: it finishes in the background and lands in the grammar cache, so a retry of
    the same spec may then succeed at once.
    """


class GrammarQueueFullError(EngineError):
    """Too many distinct grammars are compiling at once: a new spec must wait (the server answers
    503 with code "grammar_queue_full"). Cached specs, and specs already compiling, still work."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class DistributedError(EngineError):
    """A tensor-parallel rank died, or a collective or the rendezvous failed: the group cannot be
    repaired in place, so the engine turns unhealthy (its in-flight requests fail with this)."""
