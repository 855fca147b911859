"""Device streams: device work as asyncio awaitables, so CPU scheduling overlaps forward passes.

The overlap scheduler wants to plan batch N+1 on the CPU while the device is still running batch
N. A `DeviceStream` gives it exactly that, with the same code on CPU and GPU:

    handle = stream.launch(run_forward, batch)   # enqueues and returns at once
    ... plan the next batch, run other coroutines ...
    result = await handle                         # the loop sleeps; no polling, no blocked thread

Overlap contract:
  * `launch` never waits for device work. Launch N+1 may be issued before N's result is awaited.
  * Launches run in launch order (FIFO), one at a time, and their handles resolve in that order,
    so once handle N is done every earlier handle is done too.
  * `await handle` returns what the launched function returned, or raises what it raised. A failed
    launch does not poison the stream: later launches run normally.
  * `close()` / `await aclose()` let launched work finish, then release threads. Inside a running
    event loop prefer `aclose()`: `close()` blocks the calling thread until the device is idle.

Completion always reaches the event loop through `loop.call_soon_threadsafe`, from whichever thread
learns about it (a worker, a CUDA host callback, a waiter), so the loop is woken exactly once per
launch and never polls. `launch` must be called from inside a running event loop; the handle
belongs to that loop.

This module holds the interface and the completion path both streams share; `CpuDeviceStream`
lives in cpu_stream.py, `CudaDeviceStream` in cuda_stream.py, and `make_device_stream` (in this
package's `__init__`) picks one. Nothing touches CUDA or CuPy at import time: every module imports
on CPU-only machines, and every GPU use is guarded when a CUDA stream is built.
"""

from __future__ import annotations

import abc
import asyncio
import logging
from collections.abc import Callable, Generator
from typing import Any, Generic, ParamSpec, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")
P = ParamSpec("P")

__all__ = ["Completion", "DeviceHandle", "DeviceStream", "check_threads", "running_loop"]


class DeviceHandle(Generic[T]):
    """The pending result of one launch: awaitable, and `done()` once the device is past it.

    Awaiting goes through `asyncio.shield`, so cancelling a task that awaits the handle (e.g. an
    `asyncio.wait_for` timeout) leaves the handle itself pending: device work cannot be cancelled,
    and `done()` must keep meaning "the device finished", which the scheduler relies on.
    """

    __slots__ = ("_future",)

    def __init__(self, future: asyncio.Future[T]) -> None:
        self._future = future

    def done(self) -> bool:
        """True once the launched work finished (successfully or not); never blocks."""
        return self._future.done()

    @property
    def future(self) -> asyncio.Future[T]:
        """The underlying loop future, for done-callbacks and `asyncio.wait`-style multiplexing.

        Read it (`add_done_callback`, `result()` once done); never cancel or resolve it: that would
        make `done()` claim the device finished while it has not.
        """
        return self._future

    def __await__(self) -> Generator[Any, None, T]:
        return asyncio.shield(self._future).__await__()

    def __repr__(self) -> str:
        return f"<DeviceHandle {'done' if self.done() else 'pending'}>"


class DeviceStream(abc.ABC):
    """An in-order queue of device work whose completions are awaitable (see the module docstring).

    Usable as a (sync or async) context manager; leaving it closes the stream after launched work.
    """

    @abc.abstractmethod
    def launch(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> DeviceHandle[T]:
        """Enqueue `fn(*args, **kwargs)` behind earlier launches and return without waiting.

        Raises RuntimeError when the stream is closed or no event loop is running.
        """

    @abc.abstractmethod
    def close(self) -> None:
        """Refuse new launches, wait for launched work, release threads. Idempotent; blocking."""

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Like `close`, but the event loop keeps running while launched work drains.

        On return every handle launched before the call is done.
        """

    def __enter__(self) -> DeviceStream:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    async def __aenter__(self) -> DeviceStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


# ---- completion delivery (shared by both streams) ----------------------------------------------


class Completion:
    """One launch's outcome on its way to the event loop.

    `keepalive` holds whatever the device may still read or write (fn, its args, the event) so it
    cannot be freed before the stream is past it; it is dropped only once the outcome is settled
    on the loop. `deliver` is safe from any thread and does nothing but a thread-safe loop call,
    which is all a CUDA host callback is allowed to do.
    """

    __slots__ = ("arrived", "future", "keepalive", "loop", "ok", "on_settle", "value")

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        future: asyncio.Future[Any],
        ok: bool,
        value: Any,
        keepalive: object = None,
        on_settle: Callable[[Completion], None] | None = None,
    ) -> None:
        self.loop = loop
        self.future = future
        self.ok = ok
        self.value = value
        self.keepalive = keepalive
        self.on_settle = on_settle
        self.arrived = False

    def deliver(self) -> None:
        try:
            self.loop.call_soon_threadsafe(self._settle)
        except RuntimeError:  # the loop is closed: nobody is left to await this handle
            pass

    def _settle(self) -> None:
        if self.on_settle is not None:  # the owner resolves it, in launch order
            self.on_settle(self)
        else:
            self.resolve()

    def resolve(self) -> None:
        """Settle the future with the outcome (on the loop's thread); drop the keepalive."""
        future, ok, value = self.future, self.ok, self.value
        self.keepalive = self.value = None
        if future.done():
            return
        if ok:
            future.set_result(value)
        elif isinstance(value, StopIteration):  # asyncio refuses StopIteration as a future's error
            future.set_exception(RuntimeError(f"launched function raised {value!r}"))
        else:
            future.set_exception(value)


def check_threads(torch_threads: int | None) -> int | None:
    # Validated up front: a bad value would otherwise fail inside a worker, where no one sees it.
    if torch_threads is not None and (not isinstance(torch_threads, int) or torch_threads < 1):
        raise ValueError(f"torch_threads must be a positive int or None, got {torch_threads!r}")
    return torch_threads


def running_loop() -> asyncio.AbstractEventLoop:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        raise RuntimeError("DeviceStream.launch must be called from a running event loop") from None
