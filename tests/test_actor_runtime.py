"""Actor runtime: typed mailboxes, lifecycle, crash supervision, recv_or, selective receive.

Every test body runs under `asyncio.timeout` so a runtime bug fails fast instead of hanging.
"""

from __future__ import annotations

import asyncio
import logging

import msgspec
import pytest

from engine.actors.runtime import Actor, ActorState, ActorStats, ActorStoppedError
from engine.actors.supervisor import ActorSystem

T = 5.0  # per-test ceiling, seconds


class Ping(msgspec.Struct, tag=True):
    n: int


class Pong(msgspec.Struct, tag=True):
    n: int


class Boom(msgspec.Struct, tag="boom"):
    why: str = "asked to"


class Untagged(msgspec.Struct):
    n: int


class Recorder(Actor):
    """Records what it handles; its handler raises on Boom (a contained message failure)."""

    accepts = (Ping, Boom)

    def __init__(self, name: str | None = None, delay: float = 0.0) -> None:
        super().__init__(name)
        self.seen: list[int] = []
        self.events: list[str] = []
        self.crashes: list[BaseException] = []
        self.delay = delay

    async def run(self) -> None:
        self.events.append("start")
        try:
            await super().run()
        finally:  # a clean stop and a crash both end the task
            self.events.append(f"end after {len(self.seen)}")

    async def handle(self, msg: msgspec.Struct) -> None:
        if isinstance(msg, Boom):
            raise RuntimeError(msg.why)
        assert isinstance(msg, Ping)
        if self.delay:
            await asyncio.sleep(self.delay)
        self.seen.append(msg.n)

    async def on_crash(self, exc: BaseException) -> None:
        assert self.error is exc
        self.crashes.append(exc)


class Crasher(Recorder):
    """Its own run loop raises on Boom outside message handling: an actor crash."""

    async def run(self) -> None:
        while True:
            msg = await self.recv()
            if isinstance(msg, Boom):
                raise RuntimeError(msg.why)
            self.contain(lambda m: self.seen.append(m.n), msg)


async def wait_until(cond, step: float = 0.001) -> None:
    while not cond():
        await asyncio.sleep(step)


async def test_wrong_type_fails_at_sender() -> None:
    a = Recorder("rec")
    with pytest.raises(TypeError, match=r"'rec' accepts \[Ping, Boom\], not Pong"):
        a.send(Pong(1))
    with pytest.raises(TypeError, match="not Untagged"):
        a.send(Untagged(1))  # type: ignore[arg-type]
    assert a.stats().depth == 0


def test_bad_accepts_rejected_at_class_definition() -> None:
    with pytest.raises(TypeError, match="not a tagged Struct"):

        class _A(Actor):
            accepts = (Ping, Untagged)

    with pytest.raises(TypeError, match=r"not a msgspec\.Struct"):

        class _B(Actor):
            accepts = (int,)  # type: ignore[assignment]

    class Other(msgspec.Struct, tag="Ping"):  # same tag as Ping: the union could not decode
        x: str

    with pytest.raises(TypeError, match="unique `tag`"):

        class _C(Actor):
            accepts = (Ping, Other)


async def test_delivery_order_and_stats() -> None:
    async with asyncio.timeout(T):
        a = Recorder("rec")
        for i in range(5):
            a.send(Ping(i))  # queued before start: handled once started
        a.start()
        for i in range(5, 500):
            a.send(Ping(i))
        await wait_until(lambda: len(a.seen) == 500)
        assert a.seen == list(range(500))
        st = a.stats()
        assert isinstance(st, ActorStats)
        assert (st.name, st.state, st.received, st.depth, st.error) == ("rec", "running", 500, 0, None)
        msgspec.json.encode(st)  # internal-state endpoint can serve it as-is
        await a.stop()


async def test_start_twice_is_an_error() -> None:
    async with asyncio.timeout(T):
        a = Recorder()
        a.start()
        with pytest.raises(RuntimeError, match="cannot start"):
            a.start()
        await a.stop()
        with pytest.raises(RuntimeError, match="cannot start"):
            a.start()


async def test_stop_processes_pending_then_stops() -> None:
    async with asyncio.timeout(T):
        a = Recorder(delay=0.001)
        a.start()
        for i in range(50):
            a.send(Ping(i))
        await a.stop(timeout=T)
        assert a.seen == list(range(50))
        assert a.events == ["start", "end after 50"]
        assert not a.running and a.state is ActorState.STOPPED and a.error is None
        with pytest.raises(ActorStoppedError, match="stopped"):
            a.send(Ping(99))


async def test_sends_fail_while_stopping() -> None:
    async with asyncio.timeout(T):
        a = Recorder(delay=0.01)
        a.start()
        a.send(Ping(0))
        stopping = asyncio.create_task(a.stop(timeout=T))
        await asyncio.sleep(0)
        assert a.state is ActorState.STOPPING
        with pytest.raises(ActorStoppedError, match="stopping"):
            a.send(Ping(1))
        await stopping
        assert a.seen == [0]


class Wedged(Actor):
    accepts = (Ping,)

    def __init__(self, name: str | None = None) -> None:
        super().__init__(name)
        self.entered = asyncio.Event()
        self.cancelled = False

    async def handle(self, msg: msgspec.Struct) -> None:
        self.entered.set()
        try:
            await asyncio.Event().wait()  # never set
        except asyncio.CancelledError:
            self.cancelled = True
            raise


async def test_stop_of_wedged_actor_cancels_within_timeout() -> None:
    async with asyncio.timeout(T):
        a = Wedged()
        a.start()
        a.send(Ping(1))
        await a.entered.wait()
        await a.stop(timeout=0.1)  # the event is never set: only the cancellation can end the actor
        assert a.cancelled and not a.running and a.state is ActorState.STOPPED


async def test_stop_all_reverse_order_finishes_with_wedged_actor() -> None:
    async with asyncio.timeout(T):
        order: list[str] = []

        class Tracked(Recorder):
            async def run(self) -> None:
                try:
                    await super().run()
                finally:
                    order.append(self.name)

        sysm = ActorSystem(stop_timeout=0.1)
        first, wedged, last = Tracked("first"), Wedged("wedged"), Tracked("last")
        for a in (first, wedged, last):
            sysm.add(a)
        sysm.start_all()
        wedged.send(Ping(0))
        await wedged.entered.wait()
        await sysm.stop_all()  # returns at all only because the wedged actor is cancelled
        assert wedged.cancelled
        assert order == ["last", "first"]
        assert not any(a.running for a in sysm.actors)
        assert sysm.healthy  # a stop timeout is not a crash


async def test_crash_marks_unhealthy_calls_on_crash_and_rejects_sends(caplog) -> None:
    async with asyncio.timeout(T):
        reported: list[tuple[str, BaseException]] = []
        crashed = asyncio.Event()

        def on_crash(name: str, exc: BaseException) -> None:
            reported.append((name, exc))
            crashed.set()

        sysm = ActorSystem(on_crash=on_crash)
        a = sysm.add(Crasher("victim"))
        assert isinstance(a, Crasher)
        sysm.start_all()
        assert sysm.healthy
        with caplog.at_level(logging.ERROR, logger="engine.actors.runtime"):
            a.send(Ping(1))
            a.send(Boom("bad input"))
            await crashed.wait()
        assert not sysm.healthy
        assert [type(e) for e in a.crashes] == [RuntimeError]
        exc = a.crashes[0]
        assert str(exc) == "bad input" and a.error is exc
        assert reported == [("victim", exc)] and sysm.crashed == [("victim", exc)]
        assert a.state is ActorState.CRASHED and not a.running
        assert "'victim' crashed" in caplog.text and "bad input" in caplog.text
        with pytest.raises(ActorStoppedError, match=r"victim.*crashed.*bad input") as ei:
            a.send(Ping(2))
        assert ei.value.cause is exc
        assert a.seen == [1]
        await sysm.stop_all()  # stopping a crashed actor is a no-op, not a hang


async def test_a_failing_message_is_contained_and_the_actor_lives_on(caplog) -> None:
    async with asyncio.timeout(T):
        failed: list[tuple[msgspec.Struct, Exception]] = []

        class Answering(Recorder):
            def on_message_error(self, msg: msgspec.Struct, exc: Exception) -> None:
                failed.append((msg, exc))

        sysm = ActorSystem(on_crash=lambda n, e: pytest.fail(f"{n} crashed: {e!r}"))
        a = sysm.add(Answering("steady"))
        assert isinstance(a, Answering)
        sysm.start_all()
        with caplog.at_level(logging.ERROR, logger="engine.actors.runtime"):
            for m in (Ping(1), Boom("bad input"), Ping(2), Boom("again"), Ping(3)):
                a.send(m)
            await wait_until(lambda: len(a.seen) == 3)
        assert a.seen == [1, 2, 3] and a.state is ActorState.RUNNING and sysm.healthy
        assert [(type(m), str(e)) for m, e in failed] == [(Boom, "bad input"), (Boom, "again")]
        assert a.stats().message_errors == 2 and a.error is None
        assert "'steady' failed to handle Boom" in caplog.text
        a.contain(lambda m: 1 / 0, Ping(4))  # the helper for run loops of their own does the same
        assert a.stats().message_errors == 3 and isinstance(failed[-1][1], ZeroDivisionError)
        await sysm.stop_all()


class Player(Actor):
    accepts = (Ping, Pong)

    def __init__(self, name: str, rounds: int) -> None:
        super().__init__(name)
        self.peer: Player | None = None
        self.rounds = rounds
        self.done = asyncio.Event()

    async def handle(self, msg: msgspec.Struct) -> None:
        assert self.peer is not None and isinstance(msg, (Ping, Pong))
        if msg.n >= self.rounds:
            self.done.set()
            return
        reply = Pong(msg.n + 1) if isinstance(msg, Ping) else Ping(msg.n + 1)
        self.peer.send(reply)


async def test_ping_pong_between_actors() -> None:
    async with asyncio.timeout(T):
        n = 2000
        sysm = ActorSystem()
        a, b = Player("a", n), Player("b", n)
        a.peer, b.peer = b, a
        sysm.add(a)
        sysm.add(b)
        sysm.start_all()
        a.send(Ping(0))
        await b.done.wait() if n % 2 else await a.done.wait()
        assert a.stats().received + b.stats().received == n + 1
        await sysm.stop_all()
        assert sysm.healthy and sysm.crashed == []


def test_system_rejects_duplicate_names() -> None:
    sysm = ActorSystem()
    sysm.add(Recorder("x"))
    with pytest.raises(ValueError, match="already"):
        sysm.add(Recorder("x"))
    y = Recorder("y")
    sysm.add(y)
    with pytest.raises(ValueError, match="already belongs"):
        ActorSystem().add(y)
