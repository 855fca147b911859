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


class EngineUnhealthyError(EngineError):
    """The engine lost an actor (or was never started) and cannot serve requests."""


class WatchdogTimeoutError(EngineError):
    """A forward ran past `watchdog_timeout`: the device (or a kernel) hangs; the engine is dead."""
