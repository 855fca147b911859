"""CUDA device stream: launches on a dedicated CUDA stream, completions through CUDA host callbacks.

The `DeviceStream` contract (stream.py) on a GPU: `launch` enqueues the forward on its own
stream from a launcher thread and returns at once; the stream reaches a host callback (CuPy's
`launch_host_func` on the same stream) when the work is done, which hands the result to the event
loop. Without CuPy, a waiter thread synchronizes on a CUDA event per launch instead. Nothing here
touches CUDA or CuPy at import time.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import queue
import threading
import warnings
from collections.abc import Callable
from typing import Any, ParamSpec, Protocol, TypeVar

import torch

from engine.device.stream import Completion, DeviceHandle, DeviceStream, check_threads, running_loop

__all__ = ["CudaDeviceStream"]

log = logging.getLogger(__name__)

T = TypeVar("T")
P = ParamSpec("P")


class Synchronizable(Protocol):
    def synchronize(self) -> None: ...


class HostFuncStream(Protocol):
    def launch_host_func(self, callback: Callable[[Any], None], arg: Any) -> None: ...


class DeviceCallbackError(RuntimeError):
    """The completion path of a launch failed (not the launched work): its outcome is lost."""


def host_callback(completion: Completion) -> None:
    """Runs on a CUDA-internal thread when the stream reaches it.

    CUDA forbids CUDA API calls here, and an exception has nowhere to go, so it only hands the
    outcome to the event loop. If that fails, the handle fails at once (`fail_completion`)
    instead of staying pending until the scheduler's watchdog gives up on it.
    """
    try:
        completion.deliver()
    except BaseException as exc:
        log.exception("device stream host callback failed")
        fail_completion(completion, exc)


def fail_completion(completion: Completion, exc: BaseException) -> None:
    """From any thread: settle `completion` with a DeviceCallbackError on its loop.

    It goes through the owner's `on_settle` like any outcome, so the handles launched after it
    still resolve in launch order (one that never arrived would hold them all back).
    """
    error = DeviceCallbackError(f"the device stream's completion callback failed: {exc!r}")
    error.__cause__ = exc

    def settle() -> None:
        completion.ok, completion.value = False, error
        try:
            if completion.on_settle is not None:  # the owner resolves it, in launch order
                completion.on_settle(completion)
            else:
                completion.resolve()
        except Exception:  # the owner's hook broke too: at least this handle must not hang
            log.exception("device stream: settling a failed completion raised")
            if not completion.future.done():
                completion.future.set_exception(error)

    try:
        completion.loop.call_soon_threadsafe(settle)
    except RuntimeError:  # the loop is closed: nobody is left to await this handle
        pass
    except BaseException:
        log.exception("device stream: cannot fail a launch's handle on its event loop")


def cupy_host_stream(stream_ptr: int, device_index: int) -> HostFuncStream | None:
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
    except Exception as exc:
        log.info("CuPy host callbacks unavailable (%s); using an event-waiter thread", exc)
        return None


class EventWaiter:
    """Fallback completion path: one thread blocks on each event, in launch order, then delivers.

    A blocking-sync event puts the thread to sleep in the driver rather than spinning a core. A
    failed synchronize (a faulted context) is delivered as the handle's exception, so awaiting
    never hangs on this path.
    """

    def __init__(self, device_index: int | None, name: str = "device-stream-waiter") -> None:
        self._queue: queue.SimpleQueue[tuple[Synchronizable, Completion] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, args=(device_index,), name=name, daemon=True)
        self._thread.start()

    def submit(self, event: Synchronizable, completion: Completion) -> None:
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
            except Exception as exc:
                completion.ok, completion.value = False, exc
            try:  # this thread must survive: every later launch's handle comes through it
                completion.deliver()
            except BaseException as exc:
                log.exception("device stream waiter failed to deliver a completion")
                fail_completion(completion, exc)
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
        self._torch_threads = check_threads(torch_threads)
        self.stream = torch.cuda.Stream(device=dev)
        self._host_stream = cupy_host_stream(self.stream.cuda_stream, dev.index)
        self._waiter: EventWaiter | None = None
        # Launch-ordered completions not resolved yet. Two delivery paths can be live at once (host
        # callbacks up to a failure, the waiter after it), so resolution is ordered here, on the
        # loop, rather than trusted to whichever thread delivers first.
        self._inflight: collections.deque[Completion] = collections.deque()
        self._closed = False  # no new launches
        self._released = False  # threads joined

    @property
    def uses_host_callbacks(self) -> bool:
        """True while completions come from CuPy host callbacks, False on the waiter fallback."""
        return self._host_stream is not None

    def launch(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> DeviceHandle[T]:
        loop = running_loop()
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
        except Exception as exc:
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

    def _notify_when_reached(
        self, loop: asyncio.AbstractEventLoop, future: asyncio.Future[Any], ok: bool, value: Any, keepalive: object
    ) -> None:
        event = torch.cuda.Event(blocking=True)
        event.record(self.stream)
        completion = Completion(loop, future, ok, value, (keepalive, event), self._arrived)
        self._inflight.append(completion)
        if self._host_stream is not None:
            try:
                self._host_stream.launch_host_func(host_callback, completion)
                return
            except Exception as exc:
                log.warning("CuPy launch_host_func failed (%s); using an event-waiter thread", exc)
                self._host_stream = None
        if self._waiter is None:
            self._waiter = EventWaiter(self.device.index)
        self._waiter.submit(event, completion)

    def _arrived(self, completion: Completion) -> None:
        """A completion reached the loop: resolve it and every later one already here, in order."""
        completion.arrived = True
        inflight = self._inflight
        while inflight and inflight[0].arrived:
            inflight.popleft().resolve()
