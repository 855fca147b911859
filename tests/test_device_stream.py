"""DeviceStream: launches return at once, run in order, and resolve awaitables on the event loop.

Timing-sensitive claims are checked as event-loop progress (ticks counted while a handle is
pending, or a gate only a coroutine can open), not as wall-clock thresholds. Every await runs
under a timeout so a lost completion fails the test instead of hanging it.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import AsyncIterator

import pytest
import torch

from engine.device import CpuDeviceStream, DeviceHandle, make_device_stream
from engine.device import cuda_stream as cs
from engine.device import stream as ds
from engine.device.cuda_stream import CudaDeviceStream

TIMEOUT = 5.0


@pytest.fixture
async def cpu_stream() -> AsyncIterator[CpuDeviceStream]:
    stream = CpuDeviceStream()
    yield stream
    async with asyncio.timeout(TIMEOUT):
        await stream.aclose()


async def _tick_while_pending(handle: DeviceHandle[object]) -> int:
    """Count event-loop turns this coroutine gets while `handle` is still pending."""
    ticks = 0
    while not handle.done():
        ticks += 1
        await asyncio.sleep(0.001)
    return ticks


# ---- CPU stream ------------------------------------------------------------------------------


async def test_results_fifo_and_resolve_in_order(cpu_stream: CpuDeviceStream) -> None:
    ran: list[int] = []

    def job(i: int) -> int:
        time.sleep(0.01 * (5 - i))  # earlier jobs are slower: order must not follow duration
        ran.append(i)
        return i * i

    handles = [cpu_stream.launch(job, i) for i in range(5)]

    async def waiter(i: int) -> int:
        result = await handles[i]
        assert all(h.done() for h in handles[:i]), "a later handle resolved before an earlier one"
        return result

    async with asyncio.timeout(TIMEOUT):
        results = await asyncio.gather(*(waiter(i) for i in reversed(range(5))))
    assert results == [i * i for i in reversed(range(5))]
    assert ran == list(range(5))
    assert [h.future.result() for h in handles] == [i * i for i in range(5)]


async def test_launch_returns_before_work_and_loop_keeps_running(cpu_stream: CpuDeviceStream) -> None:
    gate, finished = threading.Event(), threading.Event()

    def work() -> str:
        gate.wait(TIMEOUT)
        time.sleep(0.2)  # still running while the loop ticks below
        finished.set()
        return "slept"

    handle = cpu_stream.launch(work)
    assert not finished.is_set() and not handle.done()  # launch returned before the work ran
    gate.set()
    async with asyncio.timeout(TIMEOUT):
        ticks = await _tick_while_pending(handle)
        assert await handle == "slept"
    assert ticks > 0, "the event loop made no progress while the worker ran"


async def test_pending_handle_lets_other_coroutines_run(cpu_stream: CpuDeviceStream) -> None:
    """Deterministic overlap: the work can only finish after a coroutine runs and opens the gate."""
    gate = threading.Event()
    handle = cpu_stream.launch(lambda: gate.wait(TIMEOUT) and torch.ones(4).sum().item())

    async def opener() -> None:
        for _ in range(10):
            await asyncio.sleep(0)
        assert not handle.done()
        gate.set()

    async with asyncio.timeout(TIMEOUT):
        _, result = await asyncio.gather(opener(), handle)
    assert result == 4.0


async def test_cancelled_waiter_leaves_handle_pending(cpu_stream: CpuDeviceStream) -> None:
    gate = threading.Event()
    handle = cpu_stream.launch(lambda: gate.wait(TIMEOUT) and 7)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(handle, 0.01)
    assert not handle.done(), "a timed-out await must not mark device work finished"
    gate.set()
    async with asyncio.timeout(TIMEOUT):
        assert await handle == 7


async def test_exception_propagates_and_stream_keeps_working(cpu_stream: CpuDeviceStream) -> None:
    def boom() -> None:
        raise ValueError("bad batch")

    def stop() -> None:
        raise StopIteration

    failed = cpu_stream.launch(boom)
    stopped = cpu_stream.launch(stop)
    ok = cpu_stream.launch(torch.add, torch.ones(3), 1)
    async with asyncio.timeout(TIMEOUT):
        with pytest.raises(ValueError, match="bad batch"):
            await failed
        with pytest.raises(RuntimeError, match="StopIteration"):
            await stopped
        assert torch.equal(await ok, torch.full((3,), 2.0))
        assert await cpu_stream.launch(lambda: "after") == "after"


async def test_torch_threads_applied_in_worker_thread() -> None:
    main_threads = torch.get_num_threads()
    stream = CpuDeviceStream(torch_threads=main_threads + 1)
    try:
        async with asyncio.timeout(TIMEOUT):
            assert await stream.launch(torch.get_num_threads) == main_threads + 1
            assert torch.get_num_threads() == main_threads  # the event-loop thread is untouched
            await stream.launch(torch.set_num_threads, main_threads)  # leave new threads' default as found
    finally:
        async with asyncio.timeout(TIMEOUT):
            await stream.aclose()


def test_torch_threads_validated() -> None:
    with pytest.raises(ValueError, match="torch_threads"):
        CpuDeviceStream(torch_threads=0)


def _alive(name: str) -> bool:
    return any(t.name == name and t.is_alive() for t in threading.enumerate())


async def test_aclose_finishes_launched_work_and_joins_thread() -> None:
    stream = CpuDeviceStream(name="ds-test-aclose")
    assert _alive("ds-test-aclose")
    handle = stream.launch(lambda: time.sleep(0.05) or "finished")
    async with asyncio.timeout(TIMEOUT):
        await stream.aclose()
        assert handle.done()
        assert await handle == "finished"
        await stream.aclose()  # idempotent
    assert not _alive("ds-test-aclose")
    with pytest.raises(RuntimeError, match="closed"):
        stream.launch(lambda: None)


async def test_close_blocks_until_work_done_and_joins_thread() -> None:
    with CpuDeviceStream(name="ds-test-close") as stream:
        handle = stream.launch(lambda: time.sleep(0.05) or "finished")
    assert not _alive("ds-test-close")
    async with asyncio.timeout(TIMEOUT):
        assert await handle == "finished"  # delivered even though the loop was blocked in close()
    stream.close()  # idempotent


def test_launch_needs_a_running_loop() -> None:
    with CpuDeviceStream() as stream, pytest.raises(RuntimeError, match="running event loop"):
        stream.launch(lambda: None)


# ---- CUDA stream: selection and fallback logic (runs without a GPU) ----------------------------


def test_make_device_stream_picks_cpu_stream() -> None:
    with make_device_stream(torch.device("cpu")) as stream:
        assert isinstance(stream, CpuDeviceStream)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error path")
def test_cuda_stream_without_cuda_raises_clearly() -> None:
    with pytest.raises(RuntimeError, match=r"torch\.cuda\.is_available"):
        CudaDeviceStream(torch.device("cuda"))
    with pytest.raises(RuntimeError, match=r"torch\.cuda\.is_available"):
        make_device_stream(torch.device("cuda:0"))


def test_cupy_unavailable_selects_waiter_fallback() -> None:
    try:
        import cupy

        cupy_ok = cupy.cuda.is_available()
    except Exception:
        cupy_ok = False
    if cupy_ok:
        pytest.skip("CuPy has a device here; the fallback selection is checked without one")
    assert cs.cupy_host_stream(0, 0) is None


class _FakeEvent:
    """Stands in for a CUDA event: synchronize() blocks for a while, or fails like a faulted context."""

    def __init__(self, delay: float, error: Exception | None = None) -> None:
        self.delay, self.error = delay, error

    def synchronize(self) -> None:
        time.sleep(self.delay)
        if self.error is not None:
            raise self.error


async def test_event_waiter_fallback_delivers_in_order_and_surfaces_errors() -> None:
    loop = asyncio.get_running_loop()
    waiter = cs.EventWaiter(device_index=None)
    futures = [loop.create_future() for _ in range(3)]
    events = [_FakeEvent(0.03), _FakeEvent(0.0, RuntimeError("device fault")), _FakeEvent(0.0)]
    for i, (event, future) in enumerate(zip(events, futures, strict=True)):
        waiter.submit(event, ds.Completion(loop, future, True, f"r{i}", keepalive=event))
    handles = [DeviceHandle(f) for f in futures]
    assert not handles[0].done()
    async with asyncio.timeout(TIMEOUT):
        assert await handles[0] == "r0"
        with pytest.raises(RuntimeError, match="device fault"):
            await handles[1]
        assert await handles[2] == "r2"
    await asyncio.to_thread(waiter.close)


async def testhost_callback_resolves_from_foreign_thread_and_tolerates_closed_loop() -> None:
    loop = asyncio.get_running_loop()
    future: asyncio.Future[str] = loop.create_future()
    kept: set[ds.Completion] = set()

    def settle(c: ds.Completion) -> None:  # the owner's hook: it resolves, on the loop's thread
        assert threading.current_thread() is threading.main_thread()
        kept.discard(c)
        c.resolve()

    completion = ds.Completion(loop, future, True, "done", keepalive=object(), on_settle=settle)
    kept.add(completion)
    threading.Thread(target=cs.host_callback, args=(completion,)).start()  # like CUDA's callback thread
    async with asyncio.timeout(TIMEOUT):
        assert await DeviceHandle(future) == "done"
    assert not kept and completion.keepalive is None  # references dropped only once settled

    dead = asyncio.new_event_loop()
    dead.close()
    cs.host_callback(ds.Completion(dead, loop.create_future(), True, None))  # must not raise


class SimStream:
    """A fake torch.cuda.Stream: work is already done when enqueued (the fake device is instant)."""

    def __init__(self, device: object = None) -> None:
        self.cuda_stream = 0
        self.waited_on: list[object] = []

    def synchronize(self) -> None:
        pass

    def wait_stream(self, other: object) -> None:
        self.waited_on.append(other)


class SimEvent(_FakeEvent):
    def __init__(self, blocking: bool = False) -> None:
        super().__init__(0.0)

    def record(self, stream: object) -> None:
        pass


class SimHostStream:
    """Plays CUDA's host-function thread: one thread runs callbacks in order, a bit later; can fail."""

    def __init__(self, fail_after: int) -> None:
        self.fail_after, self.calls = fail_after, 0
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, daemon=True).start()

    def launch_host_func(self, callback, arg) -> None:
        self.calls += 1
        if self.calls > self.fail_after:
            raise RuntimeError("cudaLaunchHostFunc failed")
        self._queue.put((callback, arg))

    def _run(self) -> None:
        while True:
            callback, arg = self._queue.get()
            time.sleep(0.005)  # the handle is still pending when launch returns
            callback(arg)


@pytest.mark.parametrize("fail_after", [0, 2, 100], ids=["waiter-only", "host-func-then-waiter", "host-func"])
async def test_cuda_stream_logic_on_a_simulated_device(monkeypatch: pytest.MonkeyPatch, fail_after: int) -> None:
    """CudaDeviceStream's launch/ordering/fallback/close logic, with torch.cuda faked out."""
    import contextlib

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: None)
    monkeypatch.setattr(torch.cuda, "Stream", SimStream)
    monkeypatch.setattr(torch.cuda, "Event", SimEvent)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    launcher_stream = object()  # the launching thread's current stream
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: launcher_stream)
    host = SimHostStream(fail_after)
    monkeypatch.setattr(cs, "cupy_host_stream", lambda ptr, index: host if fail_after else None)

    stream = make_device_stream("cuda")
    assert isinstance(stream, CudaDeviceStream) and stream.device == torch.device("cuda", 0)
    on_loop_thread: list[bool] = []

    def enqueue(i: int) -> int:
        on_loop_thread.append(threading.current_thread() is threading.main_thread())
        if i == 1:
            raise ValueError("enqueue failed")
        return i

    handles = [stream.launch(enqueue, i) for i in range(4)]
    assert all(on_loop_thread), "CUDA launches must enqueue on the launching thread"
    assert stream.stream.waited_on == [launcher_stream] * 4, "each launch must order after the launcher's stream"
    assert stream.uses_host_callbacks == (fail_after > 4)

    async def waiter(i: int) -> None:
        try:
            assert await handles[i] == i
        except ValueError:
            assert i == 1  # the enqueue-time error is delivered in its place in the order
        assert all(h.done() for h in handles[:i]), "a later handle resolved before an earlier one"

    async with asyncio.timeout(TIMEOUT):
        await asyncio.gather(*(waiter(i) for i in reversed(range(4))))
        await stream.aclose()
    with pytest.raises(RuntimeError, match="closed"):
        stream.launch(enqueue, 0)
    stream.close()  # idempotent


# ---- CUDA stream on a real device ------------------------------------------------------------


def _matmul_chain(a: torch.Tensor, n: int) -> torch.Tensor:
    x = a
    for _ in range(n):
        x = torch.tanh(x @ a)
    return x


@pytest.mark.gpu
@pytest.mark.parametrize("host_callbacks", [True, False], ids=["cupy-host-func", "waiter-thread"])
async def test_cuda_stream_matmul_chain(monkeypatch: pytest.MonkeyPatch, host_callbacks: bool) -> None:
    if not host_callbacks:
        monkeypatch.setattr(cs, "cupy_host_stream", lambda ptr, index: None)
    stream = CudaDeviceStream(torch.device("cuda"))
    if host_callbacks and not stream.uses_host_callbacks:
        pytest.skip("CuPy cannot drive this GPU")
    a = torch.randn(1024, 1024, device="cuda") / 32
    torch.cuda.synchronize()

    def forward(x: torch.Tensor) -> torch.Tensor:
        torch.cuda._sleep(200_000_000)  # ~0.1 s of device time: the launch must not wait for it
        return _matmul_chain(x, 20)

    try:
        async with asyncio.timeout(TIMEOUT):
            handle = stream.launch(forward, a)
            assert not stream.stream.query(), "launch waited for the device"
            failed = stream.launch(lambda: 1 / 0)  # an enqueue-time error resolves after `handle`
            ticks = await _tick_while_pending(handle)
            result = await handle
            with pytest.raises(ZeroDivisionError):
                await failed
        assert ticks > 0
        torch.testing.assert_close(result, _matmul_chain(a, 20))
    finally:
        async with asyncio.timeout(TIMEOUT):
            await stream.aclose()
