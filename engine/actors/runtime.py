"""Actor runtime: one asyncio task plus one typed mailbox per actor (the supervisor: supervisor.py).

Why actors: SGLang's scheduler, tokenizer and detokenizer talk over queues; making each stage an
actor with a mailbox that accepts only declared `msgspec.Struct` types keeps every boundary
explicit: who may send what to whom is written in the `accepts` of each actor class.

Rules the runtime enforces, and why:

* Message types are tagged Structs, checked when the actor class is defined (their union must
  build a msgpack decoder), so a mailbox's messages stay plain data that could cross a process.
* `send` is synchronous and never blocks: the scheduler must not stall on a slow consumer;
  back-pressure belongs to admission control, not to the mailbox. It fails at the sender
  (TypeError for a type the actor does not accept, ActorStoppedError for a dead actor), so
  mistakes surface where they are made instead of as a message that is never handled.
* One bad message never takes an actor down: an exception raised while handling a message is
  logged, counted (`stats().message_errors`) and handed to `on_message_error`, which fails just
  that request or control call; the actor goes on with the next message.
* A crash (an exception outside message handling, e.g. in a scheduler's step) is never silent:
  it is logged with the actor's name, kept in `error`, handed to `on_crash` (so the actor can fail
  the requests it owns) and to the crash listener (the `ActorSystem`, which turns the engine
  unhealthy).
* Nothing hangs: `stop` waits at most `timeout` before cancelling the task.

Mailboxes are single-reader and loop-bound: call `send` from the event loop's thread, and receive
only from the actor's own task.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import enum
import logging
from collections.abc import Callable
from typing import Any, ClassVar, Union

import msgspec

from engine.errors import EngineError

__all__ = ["Actor", "ActorState", "ActorStats", "ActorStoppedError", "CrashListener", "RecvListener"]

logger = logging.getLogger(__name__)

# After a stop timeout the task is cancelled; this bounds how long we then wait for it to unwind,
# so even a task that swallows CancelledError cannot make `stop` hang.
_CANCEL_GRACE_S = 1.0


class ActorState(enum.Enum):
    """Lifecycle of an actor; `send` is accepted only in NEW and RUNNING."""

    NEW = "new"  # constructed; sends queue up and are handled once started
    RUNNING = "running"
    STOPPING = "stopping"  # draining messages sent before stop()
    STOPPED = "stopped"
    CRASHED = "crashed"


def _traceback_for(exc: BaseException) -> BaseException | None:
    """The exception whose traceback a log line should carry: none for a send to a stopped actor,
    which is no bug where it is raised (the system is stopping, or the target crashed and logged
    its own traceback)."""
    return None if isinstance(exc, ActorStoppedError) else exc


class ActorStoppedError(EngineError, RuntimeError):
    """The target actor is stopping, stopped or crashed: the message was not queued.

    Raised at once so the sender can fail its request instead of queueing into a dead mailbox.
    """

    def __init__(self, actor: str, state: ActorState, cause: BaseException | None = None) -> None:
        detail = f": {type(cause).__name__}: {cause}" if cause is not None else ""
        super().__init__(f"actor {actor!r} is {state.value}{detail}")
        self.actor = actor
        self.state = state
        self.cause = cause


class ActorStats(msgspec.Struct, frozen=True):
    """Counters for the engine's internal-state endpoint (a Struct so it encodes as-is)."""

    name: str
    state: str
    received: int  # messages taken out of the mailbox
    depth: int  # messages waiting in the mailbox now
    error: str | None
    message_errors: int  # messages whose handling raised (contained: the actor went on)


CrashListener = Callable[["Actor", BaseException], None]
# Called with (actor name, message) for every message an actor takes out of its mailbox, before
# it is handled (the flight recorder: engine/recorder/ring.py).
RecvListener = Callable[[str, msgspec.Struct], None]


class _StopSignal(BaseException):
    """Raised by the receive methods once stop() was requested and nothing is left to receive.

    A BaseException so that a broad `except Exception` in a subclass's run() loop cannot swallow
    it: it must unwind run().
    """


def _check_accepts(owner: str, accepts: object) -> tuple[type[msgspec.Struct], ...]:
    """Validate a mailbox's message types; raise TypeError naming `owner` on the first problem."""
    if not isinstance(accepts, tuple):
        raise TypeError(f"{owner}.accepts must be a tuple of msgspec.Struct types, got {accepts!r}")
    for t in accepts:
        if not (isinstance(t, type) and issubclass(t, msgspec.Struct)):
            raise TypeError(f"{owner}.accepts: {t!r} is not a msgspec.Struct type")
        if t.__struct_config__.tag is None:
            raise TypeError(
                f"{owner}.accepts: {t.__qualname__} is not a tagged Struct; declare it with"
                " `tag=True` (or a tag string) so the mailbox union can be decoded from msgpack"
            )
    if len(set(accepts)) != len(accepts):
        raise TypeError(f"{owner}.accepts lists a type twice: {accepts!r}")
    if accepts:
        # Builds the union decoder now: distinct tags and one shared tag_field are checked here.
        msgspec.msgpack.Decoder(Union[accepts])  # type: ignore[valid-type]  # noqa: UP007
    return accepts


class Actor:
    """One asyncio task draining one mailbox of declared, tagged `msgspec.Struct` messages.

    Write an actor either by overriding `handle` (the default `run` feeds it one message at a
    time) or by overriding `run` to own the loop, using `recv`, `drain`, `recv_or` (a scheduler
    waking on a new request *or* a finished device step) and `recv_matching` (wait for one
    reply while leaving everything else queued). Subclasses must call `super().__init__(name)`.
    """

    accepts: ClassVar[tuple[type[msgspec.Struct], ...]] = ()
    _accept_set: ClassVar[frozenset[type]] = frozenset()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # Fail at class definition, not at the first send, when a message type is unusable.
        cls._accept_set = frozenset(_check_accepts(cls.__qualname__, cls.accepts))

    def __init__(self, name: str | None = None) -> None:
        self.name = name or type(self).__name__
        self.crash_listener: CrashListener | None = None  # set by the ActorSystem
        self.recv_listener: RecvListener | None = None  # set by the Engine (flight recorder)
        self._mailbox: collections.deque[msgspec.Struct] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None
        self._task: asyncio.Task[None] | None = None
        self._state = ActorState.NEW
        self._stop_requested = False
        self._error: BaseException | None = None
        self._received = 0
        self._message_errors = 0

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} {self._state.value} depth={len(self._mailbox)}>"

    # ---- sending -------------------------------------------------------------------------------

    def send(self, msg: msgspec.Struct) -> None:
        """Queue `msg` without blocking; fail here, at the sender, if it cannot be handled."""
        if type(msg) not in self._accept_set:
            # Exact type match: a Struct subclass has its own tag, so it would not decode as the
            # declared type on the far side of a process boundary.
            accepted = ", ".join(t.__qualname__ for t in self.accepts) or "nothing"
            raise TypeError(f"actor {self.name!r} accepts [{accepted}], not {type(msg).__qualname__}")
        if self._state not in (ActorState.NEW, ActorState.RUNNING) or self._stop_requested:
            raise ActorStoppedError(self.name, self._state, self._error)
        self._mailbox.append(msg)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # ---- receiving (from the actor's own task) -------------------------------------------------

    async def recv(self) -> msgspec.Struct:
        """Wait for the next message, in send order."""
        while not self._mailbox:
            if self._stop_requested:
                raise _StopSignal
            await self._wait()
        self._received += 1
        return self._taken(self._mailbox.popleft())

    def _taken(self, msg: msgspec.Struct) -> msgspec.Struct:
        if self.recv_listener is not None:
            self.recv_listener(self.name, msg)
        return msg

    def drain(self) -> list[msgspec.Struct]:
        """Every queued message at once (a scheduler admits a whole burst per step)."""
        if not self._mailbox:
            if self._stop_requested:
                raise _StopSignal
            return []
        msgs = list(self._mailbox)
        self._mailbox.clear()
        self._received += len(msgs)
        if self.recv_listener is not None:
            for msg in msgs:
                self.recv_listener(self.name, msg)
        return msgs

    async def recv_matching(self, match: Callable[[msgspec.Struct], bool]) -> msgspec.Struct:
        """Wait for the first message for which `match` is true; every other message stays queued,
        in order (Erlang's selective receive: a request/reply round trip inside a step)."""
        while True:
            for i, msg in enumerate(self._mailbox):
                if match(msg):
                    del self._mailbox[i]
                    self._received += 1
                    return self._taken(msg)
            if self._stop_requested:
                raise _StopSignal
            await self._wait()

    async def recv_or(
        self, fut: asyncio.Future[Any] | concurrent.futures.Future[Any], timeout: float | None = None
    ) -> tuple[msgspec.Struct | None, bool]:
        """Wait until a message arrives or `fut` completes; return `(msg or None, fut.done())`.

        Neither side is lost: a message is returned (never dropped when the future wins), and
        `fut` is neither consumed nor cancelled, so the caller reads its result when `done` is
        True and may pass it again otherwise. Queued messages win over a finished future, so a
        caller that loops drains its mailbox first. Waiting uses a done-callback, not polling.
        With `timeout` (seconds), TimeoutError when neither came in that time (`fut` untouched).
        """
        if isinstance(fut, concurrent.futures.Future):
            fut = asyncio.wrap_future(fut)
        elif not asyncio.isfuture(fut):
            raise TypeError(f"recv_or needs a Future or Task, not {type(fut).__name__}")
        if not self._mailbox and not fut.done() and not self._stop_requested:
            waiter = self._new_waiter()

            def wake(_: object) -> None:
                if not waiter.done():
                    waiter.set_result(None)

            fut.add_done_callback(wake)
            timer = None if timeout is None else asyncio.get_running_loop().call_later(timeout, wake, None)
            try:
                await waiter
            finally:
                fut.remove_done_callback(wake)
                if timer is not None:
                    timer.cancel()
                self._clear_waiter(waiter)
        if self._mailbox:
            self._received += 1
            return self._taken(self._mailbox.popleft()), fut.done()
        if fut.done():
            return None, True
        if self._stop_requested:
            raise _StopSignal
        raise TimeoutError(f"actor {self.name!r}: nothing within {timeout} s")

    def _new_waiter(self) -> asyncio.Future[None]:
        if self._waiter is not None and not self._waiter.done():
            raise RuntimeError(f"actor {self.name!r}: mailbox already has a reader waiting")
        self._waiter = asyncio.get_running_loop().create_future()
        return self._waiter

    def _clear_waiter(self, waiter: asyncio.Future[None]) -> None:
        if self._waiter is waiter:
            self._waiter = None

    async def _wait(self) -> None:
        waiter = self._new_waiter()
        try:
            await waiter
        finally:
            self._clear_waiter(waiter)

    # ---- behaviour (override) ------------------------------------------------------------------

    async def run(self) -> None:
        """Default loop: hand each message to `handle`, in order, one at a time (contained)."""
        while True:
            msg = await self.recv()
            try:
                await self.handle(msg)
            except Exception as exc:
                self.message_failed(msg, exc)

    async def handle(self, msg: msgspec.Struct) -> None:
        """Process one message (override this, or override `run`)."""
        raise NotImplementedError(f"{type(self).__qualname__} overrides neither handle() nor run()")

    def contain(self, handler: Callable[[msgspec.Struct], None], msg: msgspec.Struct) -> None:
        """`handler(msg)`; if it raises, the failure stays with that message (for `run` loops of
        their own: `self.contain(self._handle, msg)`)."""
        try:
            handler(msg)
        except Exception as exc:
            self.message_failed(msg, exc)

    def message_failed(self, msg: msgspec.Struct, exc: Exception) -> None:
        """Log and count a message whose handling raised, then let `on_message_error` answer it."""
        self._message_errors += 1
        logger.error(
            "actor %r failed to handle %s: %s: %s",
            self.name,
            type(msg).__name__,
            type(exc).__name__,
            exc,
            exc_info=_traceback_for(exc),
        )
        try:
            self.on_message_error(msg, exc)
        except Exception:
            logger.exception("actor %r: on_message_error raised", self.name)

    def on_message_error(self, msg: msgspec.Struct, exc: Exception) -> None:
        """Handling `msg` raised `exc`: fail what it was about (a request, a control call)."""

    async def on_crash(self, exc: BaseException) -> None:
        """Runs after run() raised outside message handling: fail the requests this actor owns."""

    # ---- lifecycle -----------------------------------------------------------------------------

    @property
    def state(self) -> ActorState:
        return self._state

    @property
    def running(self) -> bool:
        """True while the actor's task is alive and not crashed (including while draining)."""
        return self._state in (ActorState.RUNNING, ActorState.STOPPING)

    @property
    def error(self) -> BaseException | None:
        """The exception the actor crashed with, or None."""
        return self._error

    def stats(self) -> ActorStats:
        error = None if self._error is None else f"{type(self._error).__name__}: {self._error}"
        return ActorStats(self.name, self._state.value, self._received, len(self._mailbox), error, self._message_errors)

    def start(self) -> None:
        """Create the actor's task on the running loop; an actor starts once."""
        if self._state is not ActorState.NEW:
            raise RuntimeError(f"actor {self.name!r} cannot start: it is {self._state.value}")
        loop = asyncio.get_running_loop()  # raise here, not inside create_task, when no loop runs
        self._state = ActorState.RUNNING
        self._task = loop.create_task(self._main(), name=f"actor:{self.name}")

    async def stop(self, timeout: float = 5.0) -> None:
        """Stop cleanly: messages already queued are received first, then the task ends.

        New sends fail from now on. If the task has not finished after `timeout` seconds it is
        cancelled, so a wedged actor cannot hang shutdown. Called from the actor's own task, it
        only requests the stop (waiting for itself would deadlock).
        """
        if self._state is ActorState.NEW:
            self._state = ActorState.STOPPED
            return
        if self._state is ActorState.RUNNING:
            self._state = ActorState.STOPPING
        self._stop_requested = True
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        task = self._task
        if task is None or task.done() or task is asyncio.current_task():
            return
        done, _ = await asyncio.wait({task}, timeout=timeout)
        if done:
            return
        logger.warning("actor %r did not stop within %.3gs; cancelling it", self.name, timeout)
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=_CANCEL_GRACE_S)
        if not done:
            logger.error("actor %r ignored cancellation; abandoning its task", self.name)
            self._state = ActorState.STOPPED

    async def _main(self) -> None:
        try:
            await self.run()
        except _StopSignal:
            pass
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            await self._crash(exc)
        finally:
            if self._state in (ActorState.RUNNING, ActorState.STOPPING):
                self._state = ActorState.STOPPED

    async def _crash(self, exc: Exception) -> None:
        # Set before on_crash runs, so sends made meanwhile fail at once.
        self._state = ActorState.CRASHED
        self._error = exc
        logger.error("actor %r crashed: %s: %s", self.name, type(exc).__name__, exc, exc_info=_traceback_for(exc))
        try:
            await self.on_crash(exc)
        except Exception:
            logger.exception("actor %r: on_crash raised", self.name)
        if self.crash_listener is not None:
            try:
                self.crash_listener(self, exc)
            except Exception:
                logger.exception("actor %r: crash listener raised", self.name)
