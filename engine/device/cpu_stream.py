"""The CPU device stream: launched functions run in order on one dedicated worker thread."""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

import torch

from engine.device.stream import Completion, DeviceHandle, DeviceStream, check_threads, running_loop
from engine.kernels import cpu_extension

__all__ = ["CpuDeviceStream"]

T = TypeVar("T")
P = ParamSpec("P")


class _Job:
    __slots__ = ("args", "fn", "future", "kwargs", "loop")

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        future: asyncio.Future[Any],
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> None:
        self.loop, self.future, self.fn, self.args, self.kwargs = loop, future, fn, args, kwargs


class _Stop:
    """Queue sentinel; `aclose` passes a future to learn, without blocking, that the queue drained."""

    __slots__ = ("future", "loop")

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
        self._torch_threads = check_threads(torch_threads)
        self._queue: queue.SimpleQueue[_Job | _Stop] = queue.SimpleQueue()
        self._lock = threading.Lock()  # orders launch vs close: nothing may queue behind _Stop
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def launch(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> DeviceHandle[T]:
        loop = running_loop()
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
            # torch applies its process-wide thread setting to a thread lazily, at the thread's
            # first query or parallel op: trigger that first, or another thread's later
            # set_num_threads (the engine sets the event loop's) would become this thread's.
            torch.get_num_threads()
            torch.set_num_threads(self._torch_threads)
            # Our C++ kernels' library has its own copy of that lazy init: settle it too where the
            # library is already loaded (a second engine in this process); otherwise it loads with
            # the model, on this thread, and `cpu_extension.load` settles it then.
            cpu_extension.adopt_thread_count()
        while True:
            job = self._queue.get()
            if isinstance(job, _Stop):
                if job.loop is not None and job.future is not None:
                    Completion(job.loop, job.future, True, None).deliver()
                return
            try:
                value, ok = job.fn(*job.args, **job.kwargs), True
            except BaseException as exc:
                value, ok = exc, False
            Completion(job.loop, job.future, ok, value).deliver()
            del job, value  # drop the job's tensors now, not when the next job arrives
