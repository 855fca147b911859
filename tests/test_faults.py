"""Faults stay contained: a failed forward never poisons the prefix cache, and one bad message
never takes an actor down (issue 14's first steps).

A forward fault is injected into the real model runner of a real `Engine` (tiny random Llama with
the real tokenizer, fp32, greedy); the prompt that failed is then retried and must produce exactly
what a fault-free engine produces, with `cached_tokens` counting only KV that was computed.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from engine import Engine, InvalidRequestError, SamplingParams
from engine.model_executor.model_runner import ModelRunner
from tests.sched_harness import build_tiny_folder

TIMEOUT = 120
PROMPT = list(range(300, 450))  # 150 tokens: three chunks of 64 with chunked prefill
PARAMS = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_tok_folder(tmp_path_factory, default_tokenizer):
    return build_tiny_folder(tmp_path_factory.mktemp("tiny-faults"), default_tokenizer)


def tiny_engine(folder: str, **kw) -> Engine:
    opts = dict(dtype="float32", device="cpu", torch_threads=1, max_total_tokens=4096, max_running_requests=16)
    return Engine(folder, **{**opts, **kw})


@pytest.fixture(scope="module")
def reference(tiny_tok_folder) -> list[int]:
    async def run() -> list[int]:
        async with tiny_engine(tiny_tok_folder) as engine:
            return (await engine.generate(PROMPT, PARAMS)).token_ids

    with asyncio.Runner() as runner:
        return runner.run(run())


def fail_forward(monkeypatch: pytest.MonkeyPatch, *, at_call: int, extend_only: bool = True) -> dict[str, int]:
    """Make the `at_call`-th (extend, by default) forward raise, as a device error would."""
    real = ModelRunner.forward_batch_generation
    calls = {"n": 0}

    def flaky(runner, batch):
        if not extend_only or batch.forward_mode.is_extend():
            calls["n"] += 1
            if calls["n"] == at_call:
                raise RuntimeError("injected device failure")
        return real(runner, batch)

    monkeypatch.setattr(ModelRunner, "forward_batch_generation", flaky)
    return calls


async def assert_clean(engine: Engine) -> dict:
    async with asyncio.timeout(30):
        while (st := await engine.get_internal_state())["running_requests"] or st["waiting_requests"]:
            await asyncio.sleep(0.01)
    assert st["memory_errors"] == [] and st["protected_tokens"] == 0, st
    assert st["available_tokens"] + st["evictable_tokens"] == st["total_tokens"], st
    return st


@pytest.mark.parametrize(
    ("chunk", "fail_at", "cached_after"),
    [(None, 1, 0), (64, 1, 0), (64, 2, 64), (64, 3, 128)],
    ids=["whole-prompt", "first-chunk", "second-chunk", "last-chunk"],
)
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
async def test_failed_forward_never_poisons_the_prefix_cache(
    tiny_tok_folder, reference, monkeypatch, overlap, chunk, fail_at, cached_after
):
    async with tiny_engine(tiny_tok_folder, enable_overlap=overlap, chunked_prefill_size=chunk) as engine:
        fail_forward(monkeypatch, at_call=fail_at)
        async with asyncio.timeout(TIMEOUT):
            failed = await engine.generate(PROMPT, PARAMS)
        assert failed.finish_reason == "abort" and "injected device failure" in failed.error
        monkeypatch.undo()
        await assert_clean(engine)
        async with asyncio.timeout(TIMEOUT):
            retry = await engine.generate(PROMPT, PARAMS)
        # Only the chunks whose forward completed were cached; the rest was computed again.
        assert retry.cached_tokens == cached_after
        assert retry.token_ids == reference
        assert engine.healthy
        await assert_clean(engine)


async def test_abort_during_a_failing_extend_caches_nothing_uncomputed(tiny_tok_folder, reference, monkeypatch):
    """The request is aborted while its prefill runs, and that prefill then fails."""
    real = ModelRunner.forward_batch_generation
    entered, release = threading.Event(), threading.Event()

    def slow_then_fail(runner, batch):
        if batch.forward_mode.is_extend():
            entered.set()
            release.wait(10)
            raise RuntimeError("injected device failure")
        return real(runner, batch)

    async with tiny_engine(tiny_tok_folder) as engine:
        monkeypatch.setattr(ModelRunner, "forward_batch_generation", slow_then_fail)
        stream = engine.open_stream(PROMPT, PARAMS, rid="victim")
        async with asyncio.timeout(TIMEOUT):
            await asyncio.to_thread(entered.wait, 10)
            await engine.abort("victim")  # freed at once, while its forward is still running
            release.set()
            deltas = [d async for d in stream]
        assert deltas[-1].finish_reason == "abort"
        monkeypatch.undo()
        await assert_clean(engine)
        async with asyncio.timeout(TIMEOUT):
            retry = await engine.generate(PROMPT, PARAMS)
        assert retry.cached_tokens == 0 and retry.token_ids == reference
        await assert_clean(engine)


async def test_bad_control_values_are_typed_errors_and_the_engine_lives(tiny_tok_folder):
    async with tiny_engine(tiny_tok_folder) as engine:
        for bad in (
            {"max_running_requests": "lots"},
            {"max_running_requests": 0},
            {"new_token_ratio": -1.0},
            {"new_token_ratio": "x"},
            {"no_such_knob": 1},
        ):
            with pytest.raises(InvalidRequestError) as e:
                await engine.set_internal_state(**bad)
            assert e.value.param == next(iter(bad))
        assert engine.healthy
        st = await engine.set_internal_state(max_running_requests=4, new_token_ratio=0.5)
        assert st["max_running_requests"] == 4 and st["new_token_ratio"] == 0.5
        async with asyncio.timeout(TIMEOUT):
            res = await engine.generate(PROMPT, PARAMS)
        assert res.finish_reason == "length" and engine.healthy


async def test_a_message_that_raises_fails_only_its_request(tiny_tok_folder, monkeypatch):
    """Detokenizing one request raises inside the OutputProcessor; a control call raises inside
    the scheduler: each fails alone (typed reply, final delta with the error), the actors live on."""
    from engine.actors.output_processor import OutputProcessor
    from engine.scheduler.scheduler import Scheduler

    real_one = OutputProcessor._one

    def exploding(self, msg, i):
        if msg.rids[i] == "doomed":
            raise UnicodeError("injected detokenizer failure")
        return real_one(self, msg, i)

    async with tiny_engine(tiny_tok_folder) as engine:
        monkeypatch.setattr(OutputProcessor, "_one", exploding)
        monkeypatch.setattr(Scheduler, "flush_cache", lambda self: 1 / 0)
        async with asyncio.timeout(TIMEOUT):
            doomed, fine = await asyncio.gather(
                engine.generate(PROMPT, PARAMS, rid="doomed"), engine.generate(PROMPT[:40], PARAMS, rid="fine")
            )
            assert doomed.finish_reason == "abort" and "injected detokenizer failure" in doomed.error
            assert fine.finish_reason == "length" and len(fine.token_ids) == PARAMS.max_new_tokens
            assert await engine.flush_cache() is False  # the control call failed, and said so
        monkeypatch.undo()
        assert engine.healthy
        st = await assert_clean(engine)
        assert st["message_errors"] >= 2
        assert all(a.endswith(":running") for a in st["actors"])
        async with asyncio.timeout(TIMEOUT):
            again = await engine.generate(PROMPT, PARAMS, rid="doomed")
        assert again.finish_reason == "length"


@pytest.mark.parametrize("victim", ["receiver", "dispatcher", "prefill_adder", "scheduler", "output_processor"])
async def test_whichever_actor_dies_open_requests_end_at_once(tiny_tok_folder, monkeypatch, victim):
    """An actor dies outside message handling (a bug): every open request ends with an error at
    once (not run to its end, not by the watchdog), the engine reports unhealthy, and a new request
    is refused with a typed error."""
    from engine import EngineUnhealthyError
    from engine.actors.dispatcher import Dispatcher
    from engine.actors.output_processor import OutputProcessor
    from engine.actors.overlap_scheduler import OverlapScheduler
    from engine.actors.prefill_adder import PrefillAdderActor
    from engine.actors.receiver import Receiver

    classes = {
        "receiver": Receiver,
        "dispatcher": Dispatcher,
        "prefill_adder": PrefillAdderActor,
        "scheduler": OverlapScheduler,
        "output_processor": OutputProcessor,
    }
    cls = classes[victim]
    original = cls.run
    trigger = asyncio.Event()

    async def run_until_triggered(self) -> None:
        """The actor's own loop, until the trigger: then it raises, as a bug would."""
        body = asyncio.ensure_future(original(self))
        fired = asyncio.ensure_future(trigger.wait())
        await asyncio.wait({body, fired}, return_when=asyncio.FIRST_COMPLETED)
        if not fired.done():  # the actor ended on its own (a stop): nothing to inject
            fired.cancel()
            return await body
        body.cancel()
        raise RuntimeError(f"injected crash of {victim}")

    monkeypatch.setattr(cls, "run", run_until_triggered)
    params = SamplingParams(temperature=0.0, max_new_tokens=2000, ignore_eos=True)
    async with tiny_engine(tiny_tok_folder, max_running_requests=3) as engine:
        streams = [engine.open_stream(PROMPT[: 20 + i], params) for i in range(4)]  # the 4th waits
        async with asyncio.timeout(TIMEOUT):
            assert (await anext(streams[0])).token_ids  # generating
        trigger.set()
        # Every open request ends, with the error, long before it could have finished (2000 tokens)
        # and without the watchdog (300 s). No wall-clock bound: beside a CPU hog a one-second one
        # was missed while the streams drained what they had buffered.
        async with asyncio.timeout(TIMEOUT):
            for stream in streams:
                deltas = [d async for d in stream]
                assert deltas[-1].finish_reason == "abort" and victim in deltas[-1].error
                assert sum(len(d.token_ids) for d in deltas) < params.max_new_tokens
        assert not engine.healthy
        with pytest.raises(EngineUnhealthyError):
            engine.open_stream(PROMPT, PARAMS)
        with pytest.raises(EngineUnhealthyError):
            await engine.get_internal_state()


async def test_watchdog_fails_a_hung_forward_and_marks_the_engine_dead(tiny_tok_folder, monkeypatch, caplog):
    import logging
    import time

    from engine import EngineUnhealthyError

    real = ModelRunner.forward_batch_generation
    release = threading.Event()
    calls = {"n": 0}

    def hang_on_third(runner, batch):
        calls["n"] += 1
        if calls["n"] == 3:
            release.wait(60)  # a device that stopped answering
        return real(runner, batch)

    monkeypatch.setattr(ModelRunner, "forward_batch_generation", hang_on_third)
    params = SamplingParams(temperature=0.0, max_new_tokens=50, ignore_eos=True)
    try:
        async with tiny_engine(tiny_tok_folder, watchdog_timeout=2.0) as engine:
            with caplog.at_level(logging.ERROR):
                t0 = time.perf_counter()
                async with asyncio.timeout(30):
                    results = await asyncio.gather(*(engine.generate(PROMPT[: 30 + i], params) for i in range(3)))
                waited = time.perf_counter() - t0
            release.set()
            assert all(r.finish_reason == "abort" and "did not complete within 2.0 s" in r.error for r in results)
            assert 2.0 <= waited < 10.0
            assert not engine.healthy
            with pytest.raises(EngineUnhealthyError):
                engine.open_stream(PROMPT, PARAMS)
            log = caplog.text
            assert "watchdog: a DECODE forward of 3 request(s)" in log and "stacks of every thread" in log
            assert "device-stream" in log and "hang_on_third" in log  # the hung thread's own stack
    finally:
        release.set()
