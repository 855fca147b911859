"""Actor runtime, receiving: `recv_or` (a message or a device future, neither lost), `drain`,
`recv_matching` (selective receive), and the msgpack property of a mailbox's union."""

from __future__ import annotations

import asyncio
from typing import Union

import msgspec

from engine.actors.runtime import Actor, ActorState
from tests.test_actor_runtime import Boom, Ping, Pong, wait_until

T = 5.0  # per-test ceiling, seconds


class Step(msgspec.Struct, tag=True):
    """Asks the scheduler to wait on a fresh 'device' future."""


class Scheduler(Actor):
    """Owns its loop: wakes on a new message or when the pending device step finishes."""

    accepts = (Ping, Step)

    def __init__(self) -> None:
        super().__init__("sched")
        self.device: asyncio.Future[str] | None = None
        self.log: list[tuple[object, bool]] = []
        self.wakes = 0
        self.changed = asyncio.Event()

    async def run(self) -> None:
        while True:
            if self.device is None:
                msg, done = await self.recv(), False
            else:
                msg, done = await self.recv_or(self.device)
            self.wakes += 1
            if isinstance(msg, Step):
                self.device = asyncio.get_running_loop().create_future()
            elif msg is not None:
                self.log.append((msg.n, done))
            if done:
                assert self.device is not None
                self.log.append((self.device.result(), True))
                self.device = None
            self.changed.set()


async def test_recv_or_wakes_on_future_and_on_message_without_loss() -> None:
    async with asyncio.timeout(T):
        s = Scheduler()
        s.start()

        async def settle() -> None:
            await s.changed.wait()
            s.changed.clear()

        s.send(Step())
        await settle()
        assert s.device is not None and not s.device.done()

        s.send(Ping(1))  # message wins; the device future is left pending, not cancelled
        await settle()
        assert s.log == [(1, False)] and s.device is not None and not s.device.cancelled()

        s.device.set_result("step-1")  # the future wins with an empty mailbox
        await settle()
        assert s.log == [(1, False), ("step-1", True)] and s.device is None

        # Both ready at once: the message is returned and done=True, so neither is lost.
        s.send(Step())
        await settle()
        wakes = s.wakes
        await asyncio.sleep(0.05)
        assert s.wakes == wakes  # idle while waiting: no polling wake-ups
        s.device.set_result("step-2")
        s.send(Ping(2))
        await settle()
        assert s.log[-2:] == [(2, True), ("step-2", True)]
        await s.stop(timeout=T)
        assert s.state is ActorState.STOPPED


async def test_recv_or_rejects_bare_coroutine() -> None:
    async with asyncio.timeout(T):
        errors: list[BaseException] = []

        class Bad(Actor):
            accepts = (Ping,)

            async def run(self) -> None:
                coro = asyncio.sleep(0)
                try:
                    await self.recv_or(coro)  # type: ignore[arg-type]
                except TypeError as e:
                    errors.append(e)
                finally:
                    coro.close()

        b = Bad()
        b.start()
        await b.stop(timeout=T)
        assert errors and "Future or Task" in str(errors[0])


async def test_drain() -> None:
    async with asyncio.timeout(T):
        got: list[list[int]] = []
        go = asyncio.Event()

        class Batcher(Actor):
            accepts = (Ping,)

            async def run(self) -> None:
                assert self.drain() == []
                await go.wait()
                got.append([m.n for m in self.drain()])
                await self.recv()  # stop() unwinds this once the mailbox is empty

        b = Batcher()
        b.start()
        await asyncio.sleep(0)
        for i in range(4):
            b.send(Ping(i))
        go.set()
        await wait_until(lambda: bool(got))
        assert got == [[0, 1, 2, 3]] and b.stats().received == 4
        await b.stop(timeout=T)
        assert b.state is ActorState.STOPPED


def test_msgpack_round_trip_of_a_three_type_union() -> None:
    """What the tagged-Struct rule buys: a mailbox's union decodes from msgpack to the sent types."""

    class Three(Actor):
        accepts = (Ping, Pong, Boom)

    dec = msgspec.msgpack.Decoder(Union[Three.accepts])  # noqa: UP007
    msgs = [Ping(1), Pong(2), Boom("x"), Ping(3)]
    out = [dec.decode(msgspec.msgpack.encode(m)) for m in msgs]
    assert out == msgs and [type(m) for m in out] == [Ping, Pong, Boom, Ping]


async def test_recv_matching_takes_one_reply_and_keeps_the_rest_in_order() -> None:
    async with asyncio.timeout(T):
        got: list[object] = []
        asked = asyncio.Event()

        class Asker(Actor):
            accepts = (Ping, Pong)

            async def run(self) -> None:
                await asked.wait()
                reply = await self.recv_matching(lambda m: isinstance(m, Pong) and m.n == 7)
                got.append(("reply", reply.n))
                got.extend(("later", m.n) for m in self.drain())
                await self.recv()

        a = Asker()
        a.start()
        a.send(Ping(1))
        a.send(Pong(3))  # a Pong, but not the awaited one
        asked.set()
        await asyncio.sleep(0.01)
        assert got == []  # still waiting: nothing else was consumed
        a.send(Ping(2))
        a.send(Pong(7))
        a.send(Ping(4))
        await wait_until(lambda: len(got) == 5)
        assert got == [("reply", 7), ("later", 1), ("later", 3), ("later", 2), ("later", 4)]
        await a.stop(timeout=T)
        assert a.state is ActorState.STOPPED
