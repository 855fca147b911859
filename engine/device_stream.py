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

Nothing here touches CUDA or CuPy at import time: the module imports on CPU-only machines, and
every GPU use is guarded when a CUDA stream is built.
"""

from __future__ import annotations

import abc
import asyncio
import collections
import logging
import queue
import threading
import warnings
from collections.abc import Callable, Generator
from typing import Any, Generic, ParamSpec, Protocol, TypeVar

import torch

log = logging.getLogger(__name__)

T = TypeVar("T")
P = ParamSpec("P")

__all__ = ["CpuDeviceStream", "CudaDeviceStream", "DeviceHandle", "DeviceStream", "make_device_stream"]


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


class _Completion:
    """One launch's outcome on its way to the event loop.

    `keepalive` holds whatever the device may still read or write (fn, its args, the event) so it
    cannot be freed before the stream is past it; it is dropped only once the outcome is settled
    on the loop. `deliver` is safe from any thread and does nothing but a thread-safe loop call,
    which is all a CUDA host callback is allowed to do.
    """

    __slots__ = ("loop", "future", "ok", "value", "keepalive", "on_settle", "arrived")

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        future: asyncio.Future[Any],
        ok: bool,
        value: Any,
        keepalive: object = None,
        on_settle: Callable[[_Completion], None] | None = None,
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


def _check_threads(torch_threads: int | None) -> int | None:
    # Validated up front: a bad value would otherwise fail inside a worker, where no one sees it.
    if torch_threads is not None and (not isinstance(torch_threads, int) or torch_threads < 1):
        raise ValueError(f"torch_threads must be a positive int or None, got {torch_threads!r}")
    return torch_threads


# ---- CPU ---------------------------------------------------------------------------------------


class _Job:
    __slots__ = ("loop", "future", "fn", "args", "kwargs")

    def __init__(self, loop: asyncio.AbstractEventLoop, future: asyncio.Future[Any], fn: Callable[..., Any],
                 args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.loop, self.future, self.fn, self.args, self.kwargs = loop, future, fn, args, kwargs


class _Stop:
    """Queue sentinel; `aclose` passes a future to learn, without blocking, that the queue drained."""

    __slots__ = ("loop", "future")

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None, future: asyncio.Future[None] | None = None):
        self.loop, self.future = loop, future


class CpuDeviceStream(DeviceStream):
    """Runs launched functions, in order, on one dedicated worker thread.

    Torch releases the GIL inside its ops, so while the worker computes a forward pass the event
    loop keeps scheduling. One thread (not a pool) gives FIFO order and one-at-a-time execution
    for free, like a device queue.

    `torch_threads`, when given, is applied with `torch.set_num_threads` inside the worker thread:
    the intra-op thread count is per calling thread, so setting it on the main thread would not
    bind the worker. With None the worker keeps torch's default for a new thread.
    """

    def __init__(self, torch_threads: int | None = None, *, name: str = "device-stream") -> None:
        self._torch_threads = _check_threads(torch_threads)
        self._queue: queue.SimpleQueue[_Job | _Stop] = queue.SimpleQueue()
        self._lock = threading.Lock()  # orders launch vs close: nothing may queue behind _Stop
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def launch(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> DeviceHandle[T]:
        loop = _running_loop()
        future: asyncio.Future[T] = loop.create_future()
        with self._lock:
            if self._closed:
                raise RuntimeError("launch on a closed DeviceStream")
            self._queue.put(_Job(loop, future, fn, args, kwargs))
        return DeviceHandle(future)

    def close(self) -> None:
        self._request_stop(_Stop())
        if threading.current_thread() is not self._thread:  # fn closing its own stream must not self-join
            self._thread.join()

    async def aclose(self) -> None:
        loop = asyncio.get_running_loop()
        drained: asyncio.Future[None] = loop.create_future()
        if self._request_stop(_Stop(loop, drained)):
            await drained  # resolved after every earlier completion was queued to the loop
            self._thread.join()  # the worker is already returning: this does not block the loop
        elif self._thread.is_alive():  # someone else is closing: wait without blocking the loop
            await asyncio.to_thread(self._thread.join)

    def _request_stop(self, stop: _Stop) -> bool:
        with self._lock:
            if self._closed:
                return False
            self._closed = True
            self._queue.put(stop)
            return True

    def _run(self) -> None:
        if self._torch_threads is not None:
            torch.set_num_threads(self._torch_threads)
        while True:
            job = self._queue.get()
            if isinstance(job, _Stop):
                if job.loop is not None and job.future is not None:
                    _Completion(job.loop, job.future, True, None).deliver()
                return
            try:
                value, ok = job.fn(*job.args, **job.kwargs), True
            except BaseException as exc:  # noqa: BLE001 - a worker has no caller to re-raise to
                value, ok = exc, False
            _Completion(job.loop, job.future, ok, value).deliver()
            del job, value  # drop the job's tensors now, not when the next job arrives


# ---- CUDA --------------------------------------------------------------------------------------


class _Synchronizable(Protocol):
    def synchronize(self) -> None: ...


class _HostFuncStream(Protocol):
    def launch_host_func(self, callback: Callable[[Any], None], arg: Any) -> None: ...


def _host_callback(completion: _Completion) -> None:
    """Runs on a CUDA-internal thread when the stream reaches it.

    CUDA forbids CUDA API calls here, and an exception has nowhere to go, so it only hands the
    outcome to the event loop.
    """
    try:
        completion.deliver()
    except BaseException:  # noqa: BLE001
        log.exception("device stream host callback failed")


def _cupy_host_stream(stream_ptr: int, device_index: int) -> _HostFuncStream | None:
    """A CuPy view of the torch stream for `launch_host_func`, or None when CuPy cannot serve.

    CuPy is optional at run time: a missing wheel, a CUDA runtime the driver does not support, or
    any other failure selects the waiter-thread fallback instead of failing the engine.
    """
    try:
        import cupy

        if not cupy.cuda.is_available():
            return None
        with warnings.catch_warnings():  # ExternalStream is deprecated in CuPy 14 but still works
            warnings.simplefilter("ignore", DeprecationWarning)
            return cupy.cuda.ExternalStream(stream_ptr, device_index)
    except Exception as exc:  # noqa: BLE001 - any failure means "use the fallback"
        log.info("CuPy host callbacks unavailable (%s); using an event-waiter thread", exc)
        return None


class _EventWaiter:
    """Fallback completion path: one thread blocks on each event, in launch order, then delivers.

    A blocking-sync event puts the thread to sleep in the driver rather than spinning a core. A
    failed synchronize (a faulted context) is delivered as the handle's exception, so awaiting
    never hangs on this path.
    """

    def __init__(self, device_index: int | None, name: str = "device-stream-waiter") -> None:
        self._queue: queue.SimpleQueue[tuple[_Synchronizable, _Completion] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, args=(device_index,), name=name, daemon=True)
        self._thread.start()

    def submit(self, event: _Synchronizable, completion: _Completion) -> None:
        self._queue.put((event, completion))

    def close(self) -> None:
        """Deliver everything submitted so far, then stop the thread."""
        self._queue.put(None)
        self._thread.join()

    def _run(self, device_index: int | None) -> None:
        if device_index is not None:  # a fresh thread's current device is 0; events are per device
            torch.cuda.set_device(device_index)
        while (item := self._queue.get()) is not None:
            event, completion = item
            try:
                event.synchronize()
            except Exception as exc:  # noqa: BLE001 - surfaced through the handle
                completion.ok, completion.value = False, exc
            completion.deliver()
            del item, event, completion


class CudaDeviceStream(DeviceStream):
    """Enqueues launched functions on a dedicated `torch.cuda.Stream`; completion via host callback.

    `fn` runs on the launching (event-loop) thread inside `torch.cuda.stream(self.stream)`, so it
    only enqueues kernels and returns quickly; CUDA runs them in stream order. After `fn` an event
    is recorded and a CuPy host function is queued behind the work; when the stream reaches it, it
    resolves the handle via `loop.call_soon_threadsafe`. Without usable CuPy, a waiter thread
    synchronizes on each event instead. An exception raised by `fn` while enqueueing travels the
    same path, so handles still resolve in launch order.

    Why references are kept: `fn`, its args, its result and the event stay referenced until the
    stream is past the launch, because a tensor freed early would hand its memory to new
    allocations while queued kernels still use it. Tensors `fn` allocates belong to this stream in
    the caching allocator; a consumer on another stream that keeps them while freeing must call
    `tensor.record_stream(...)` as usual.

    Caveats: a host callback needs the GIL, and stream work queued behind it waits until it gets
    it (at most about `sys.getswitchinterval()` while the loop thread holds the GIL). CUDA skips
    host functions once the context has faulted, so after a device fault handles on the CuPy path
    stay pending; await them under a timeout.

    `torch_threads`, when given, is applied on the launching thread (where `fn`'s host code runs).
    """

    def __init__(self, device: torch.device | str | int, torch_threads: int | None = None) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError(
                "CudaDeviceStream needs a CUDA device but torch.cuda.is_available() is False; "
                "use make_device_stream(), which picks CpuDeviceStream for CPU devices"
            )
        dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        if dev.type != "cuda":
            raise ValueError(f"CudaDeviceStream needs a cuda device, got {dev}")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        self.device = dev
        self._torch_threads = _check_threads(torch_threads)
        self.stream = torch.cuda.Stream(device=dev)
        self._host_stream = _cupy_host_stream(self.stream.cuda_stream, dev.index)
        self._waiter: _EventWaiter | None = None
        # Launch-ordered completions not resolved yet. Two delivery paths can be live at once (host
        # callbacks up to a failure, the waiter after it), so resolution is ordered here, on the
        # loop, rather than trusted to whichever thread delivers first.
        self._inflight: collections.deque[_Completion] = collections.deque()
        self._closed = False  # no new launches
        self._released = False  # threads joined

    @property
    def uses_host_callbacks(self) -> bool:
        """True while completions come from CuPy host callbacks, False on the waiter fallback."""
        return self._host_stream is not None

    def launch(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> DeviceHandle[T]:
        loop = _running_loop()
        if self._closed:
            raise RuntimeError("launch on a closed DeviceStream")
        if self._torch_threads is not None and torch.get_num_threads() != self._torch_threads:
            torch.set_num_threads(self._torch_threads)
        future: asyncio.Future[T] = loop.create_future()
        try:
            # The scheduler writes device tensors (request table entries, KV slot lists) on the
            # launching thread's current stream just before launching; torch's side streams do not
            # order after it implicitly, so this launch's work waits for what is queued there.
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
                value, ok = fn(*args, **kwargs), True
        except Exception as exc:  # noqa: BLE001 - delivered through the handle, in order
            value, ok = exc, False
        self._notify_when_reached(loop, future, ok, value, (fn, args, kwargs))
        return DeviceHandle(future)

    def close(self) -> None:
        self._closed = True
        if self._released:
            return
        self._released = True
        try:
            self.stream.synchronize()  # launched work (and its host callbacks) completes first
        finally:
            if self._waiter is not None:
                self._waiter.close()
            self._inflight.clear()

    async def aclose(self) -> None:
        if self._released:
            return
        self._closed = True
        loop = asyncio.get_running_loop()
        drained: asyncio.Future[None] = loop.create_future()
        self._notify_when_reached(loop, drained, True, None, None)
        await drained  # in-order delivery: every earlier handle is done now
        self.close()  # the stream is idle, so this does not block the loop

    def _notify_when_reached(self, loop: asyncio.AbstractEventLoop, future: asyncio.Future[Any],
                             ok: bool, value: Any, keepalive: object) -> None:
        event = torch.cuda.Event(blocking=True)
        event.record(self.stream)
        completion = _Completion(loop, future, ok, value, (keepalive, event), self._arrived)
        self._inflight.append(completion)
        if self._host_stream is not None:
            try:
                self._host_stream.launch_host_func(_host_callback, completion)
                return
            except Exception as exc:  # noqa: BLE001 - fall back for this and all later launches
                log.warning("CuPy launch_host_func failed (%s); using an event-waiter thread", exc)
                self._host_stream = None
        if self._waiter is None:
            self._waiter = _EventWaiter(self.device.index)
        self._waiter.submit(event, completion)

    def _arrived(self, completion: _Completion) -> None:
        """A completion reached the loop: resolve it and every later one already here, in order."""
        completion.arrived = True
        inflight = self._inflight
        while inflight and inflight[0].arrived:
            inflight.popleft().resolve()


# ---- selection ---------------------------------------------------------------------------------


def make_device_stream(device: torch.device | str, torch_threads: int | None = None) -> DeviceStream:
    """The stream for `device`: CUDA streams for cuda devices, the CPU worker for anything else.

    Raises RuntimeError for a cuda device when CUDA is not usable, rather than silently running
    on the CPU.
    """
    dev = torch.device(device)
    if dev.type == "cuda":
        return CudaDeviceStream(dev, torch_threads)
    return CpuDeviceStream(torch_threads)


def _running_loop() -> asyncio.AbstractEventLoop:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        raise RuntimeError("DeviceStream.launch must be called from a running event loop") from None
