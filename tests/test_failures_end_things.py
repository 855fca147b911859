"""Failures end things, never hang them (issue "From first start to a month of uptime").

- `Engine.stop()` ends every stream still open (mid-generation, never iterated, waiting in the
  grammar queue) with an `abort` delta, so a reader's `async for` ends.
- An idle memory-invariant violation marks the engine unhealthy (the scheduler crashes) instead of
  being logged while the engine serves on.
- An impossible scheduler state (`prepare_for_decode` failing after the room check) crashes the
  scheduler instead of spinning the event loop without yielding: the loop stays responsive.
- A failure inside the CUDA host callback fails that handle at once (not at the watchdog), and
  the handles after it still resolve in launch order.

Engine tests run the tiny random Llama with the real tokenizer (tests/sched_harness.py) on CPU.
Every await has a generous timeout and every test a pytest-timeout, so a regression fails instead
of hanging; nothing asserts a wall-clock bound. The frozen-loop case needs pytest-timeout's signal
(an asyncio timeout cannot fire while the loop is frozen).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading

import pytest
import torch

from engine import Engine, EngineUnhealthyError, SamplingParams
from engine.constrained import GrammarBackend
from engine.device import DeviceHandle, make_device_stream
from engine.device import cuda_stream as cs
from engine.device import stream as ds
from engine.device.cuda_stream import CudaDeviceStream, DeviceCallbackError
from engine.engine import ENGINE_STOPPED
from engine.scheduler.batch import ScheduleBatch
from tests.sched_harness import build_tiny_folder
from tests.test_device_stream import SimEvent, SimHostStream, SimStream

TIMEOUT = 120  # a hang guard only (a first run may wait for the CPU kernels to build)
PROMPT = list(range(300, 340))
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def tiny_tok_folder(tmp_path_factory, default_tokenizer):
    return build_tiny_folder(tmp_path_factory.mktemp("tiny-failures"), default_tokenizer)


def tiny_engine(folder: str, tmp_path, **kw) -> Engine:
    # The flight recorder dumps on a crash: into the test's own directory.
    opts = dict(
        dtype="float32",
        device="cpu",
        torch_threads=1,
        max_total_tokens=4096,
        max_running_requests=8,
        flight_recorder_dir=str(tmp_path),
    )
    return Engine(folder, **{**opts, **kw})


async def read_all(stream) -> list:
    async with asyncio.timeout(TIMEOUT):
        return [d async for d in stream]


# ---- 1. stop() ends open streams -----------------------------------------------------------


async def test_stop_ends_every_open_stream_with_an_abort_delta(tiny_tok_folder, tmp_path, monkeypatch):
    compile_started = asyncio.Event()

    async def never_compiles(self, *args, **kwargs):
        """A grammar that stays in the grammar queue until stop(): the race-free way to have one."""
        compile_started.set()
        await asyncio.Event().wait()

    monkeypatch.setattr(GrammarBackend, "compile_async", never_compiles)
    long = SamplingParams(temperature=0.0, max_new_tokens=900, ignore_eos=True)
    engine = tiny_engine(tiny_tok_folder, tmp_path)
    await engine.start()
    try:
        generating = engine.open_stream(PROMPT, long)
        never_read = engine.open_stream(PROMPT[:30], long)
        grammar = engine.open_stream(PROMPT[:20], SamplingParams(max_new_tokens=8, regex="[ab]+"))
        async with asyncio.timeout(TIMEOUT):
            first = await anext(generating)  # mid-generation: a token came, hundreds remain
            await compile_started.wait()
        assert first.finish_reason is None and first.token_ids
        reader = asyncio.create_task(read_all(generating))  # blocked in `async for` during stop()
    finally:
        await engine.stop()
    rest = await reader
    assert rest, "the reader must get the final delta"
    assert rest[-1].finish_reason == "abort" and rest[-1].error == ENGINE_STOPPED, rest[-1]
    assert all(d.finish_reason is None for d in rest[:-1])
    assert len(first.token_ids) + sum(len(d.token_ids) for d in rest) < 900  # stopped, not finished
    for stream in (never_read, grammar):
        deltas = await read_all(stream)
        assert deltas[-1].finish_reason == "abort" and deltas[-1].error == ENGINE_STOPPED, deltas
    await never_read.aclose()  # finished: aborts nothing, reaches no stopped actor
    with pytest.raises(EngineUnhealthyError):
        engine.open_stream(PROMPT, long)


# ---- 2. an idle memory-invariant violation marks the engine unhealthy ----------------------


async def test_idle_memory_leak_marks_the_engine_unhealthy(tiny_tok_folder, tmp_path):
    params = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)
    async with tiny_engine(tiny_tok_folder, tmp_path) as engine:
        async with asyncio.timeout(TIMEOUT):
            assert (await engine.generate(PROMPT, params)).finish_reason == "length"
            st = await engine.get_internal_state()
        assert engine.healthy and st["memory_errors"] == [] and st["running_requests"] == 0, st
        # A leak: one KV slot taken behind the scheduler's back while it is idle. The next
        # busy -> idle edge checks the invariant and finds it.
        leaked = engine._scheduler.sched.allocator.alloc(1)
        assert leaked is not None and leaked.numel() == 1
        stream = engine.open_stream(PROMPT[:20], params)
        async with asyncio.timeout(TIMEOUT):
            reason = await engine.wait_unhealthy()
        assert "MemoryLeakError" in reason and "memory leak" in reason, reason
        assert not engine.healthy
        assert engine._scheduler.memory_errors and "available=" in engine._scheduler.memory_errors[0]
        deltas = await read_all(stream)  # it ends either way (its result, or the engine's error)
        assert deltas[-1].finish_reason is not None
        with pytest.raises(EngineUnhealthyError):  # fail fast from now on
            engine.open_stream(PROMPT, params)
        with pytest.raises(EngineUnhealthyError):
            await engine.get_internal_state()


# ---- 3. an impossible scheduler state crashes instead of freezing the loop ------------------


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
async def test_impossible_decode_state_crashes_and_the_loop_stays_responsive(
    tiny_tok_folder, tmp_path, monkeypatch, overlap
):
    refused = {"n": 0}

    def refuse(self, inputs_on_device: bool = False) -> bool:
        """What "cannot happen" after the room check: no room for the decode step."""
        refused["n"] += 1
        return False

    monkeypatch.setattr(ScheduleBatch, "prepare_for_decode", refuse)
    params = SamplingParams(temperature=0.0, max_new_tokens=50, ignore_eos=True)
    ticks = {"n": 0}
    stop_ticking = asyncio.Event()

    async def ticker() -> None:
        """Another coroutine: it only counts if the scheduler's loop lets the event loop run."""
        while not stop_ticking.is_set():
            ticks["n"] += 1
            await asyncio.sleep(0.001)

    async with tiny_engine(tiny_tok_folder, tmp_path, enable_overlap=overlap) as engine:
        ticking = asyncio.create_task(ticker())
        streams = [engine.open_stream(PROMPT[: 20 + i], params) for i in range(2)]
        async with asyncio.timeout(TIMEOUT):
            reason = await engine.wait_unhealthy()
        assert "SchedulerStuckError" in reason and "running=" in reason, reason
        assert refused["n"] >= 2 and not engine.healthy
        for stream in streams:  # both were prefilled and held by the scheduler: they end, failed
            deltas = await read_all(stream)
            assert deltas[-1].finish_reason == "abort" and "SchedulerStuckError" in deltas[-1].error, deltas
        seen = ticks["n"]
        async with asyncio.timeout(TIMEOUT):
            while ticks["n"] < seen + 3:  # the loop keeps scheduling others after the crash
                await asyncio.sleep(0)
        assert seen > 0  # and it did before it, too (the prefill ran on the forward thread)
        stop_ticking.set()
        await ticking
        with pytest.raises(EngineUnhealthyError):
            engine.open_stream(PROMPT, params)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
async def test_retraction_is_progress_not_a_stuck_scheduler(tiny_tok_folder, tmp_path, overlap):
    """The guard against a spinning loop must not fire where a turn launches nothing but changes
    state: retracting requests under memory pressure (they go back to the waiting queue)."""
    params = SamplingParams(temperature=0.0, max_new_tokens=100, ignore_eos=True)
    # 4 requests of 140 tokens each in a 256-token pool: they cannot all decode to the end.
    async with tiny_engine(tiny_tok_folder, tmp_path, max_total_tokens=256, enable_overlap=overlap) as engine:
        async with asyncio.timeout(TIMEOUT):
            results = await asyncio.gather(*(engine.generate(PROMPT[i:], params) for i in range(4)))
            st = await engine.get_internal_state()
        assert engine.healthy and st["num_retractions"] > 0, st
        assert [(r.finish_reason, r.completion_tokens) for r in results] == [("length", 100)] * 4


# ---- 4. a failing CUDA host callback fails its handle at once -------------------------------


class _DeliverFails(ds.Completion):
    def deliver(self) -> None:
        raise ValueError("injected callback failure")


async def test_failing_host_callback_fails_the_handle_from_a_foreign_thread() -> None:
    loop = asyncio.get_running_loop()
    settled: list[ds.Completion] = []

    def settle(c: ds.Completion) -> None:  # the owner's ordered resolution, on the loop's thread
        assert threading.current_thread() is threading.main_thread()
        settled.append(c)
        c.resolve()

    completion = _DeliverFails(loop, loop.create_future(), True, "lost", keepalive=object(), on_settle=settle)
    thread = threading.Thread(target=cs.host_callback, args=(completion,))  # like CUDA's callback thread
    thread.start()
    async with asyncio.timeout(TIMEOUT):
        with pytest.raises(DeviceCallbackError, match="injected callback failure") as info:
            await DeviceHandle(completion.future)
    await asyncio.to_thread(thread.join)
    assert isinstance(info.value.__cause__, ValueError)
    assert settled == [completion] and completion.keepalive is None  # through the owner, references dropped

    orphan = _DeliverFails(loop, loop.create_future(), True, None)  # no owner: resolved directly
    cs.host_callback(orphan)
    async with asyncio.timeout(TIMEOUT):
        with pytest.raises(DeviceCallbackError):
            await DeviceHandle(orphan.future)

    dead = asyncio.new_event_loop()
    dead.close()
    cs.host_callback(_DeliverFails(dead, loop.create_future(), True, None))  # logs, never raises


@pytest.mark.parametrize("fail_after", [0, 100], ids=["waiter-thread", "host-func"])
async def test_failed_delivery_fails_one_handle_and_later_ones_resolve_in_order(
    monkeypatch: pytest.MonkeyPatch, fail_after: int
) -> None:
    """CudaDeviceStream on a simulated device (tests/test_device_stream.py's fakes): launch 1's
    delivery fails, on either completion path; it fails at once, the others keep their results."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: None)
    monkeypatch.setattr(torch.cuda, "Stream", SimStream)
    monkeypatch.setattr(torch.cuda, "Event", SimEvent)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: object())
    host = SimHostStream(fail_after)
    monkeypatch.setattr(cs, "cupy_host_stream", lambda ptr, index: host if fail_after else None)
    real_deliver = ds.Completion.deliver

    def deliver(self: ds.Completion) -> None:
        if self.ok and self.value == 1:
            raise ValueError("injected delivery failure")
        real_deliver(self)

    monkeypatch.setattr(ds.Completion, "deliver", deliver)
    stream = make_device_stream("cuda")
    assert isinstance(stream, CudaDeviceStream) and stream.uses_host_callbacks == bool(fail_after)
    handles = [stream.launch(lambda i: i, i) for i in range(4)]
    async with asyncio.timeout(TIMEOUT):
        assert await handles[0] == 0
        with pytest.raises(DeviceCallbackError, match="injected delivery failure"):
            await handles[1]
        assert [await h for h in handles[2:]] == [2, 3]  # the path survived; order kept
        await stream.aclose()
