"""Actor runtime: one asyncio task plus one typed mailbox per actor (the supervisor: supervisor.py).

Why actors: SGLang's scheduler, tokenizer and detokenizer talk over queues; making each of
them an actor with a mailbox that accepts only declared `msgspec.Struct` types keeps every
boundary explicit, so a boundary can later become a process boundary (the same Structs go
over msgpack, see `mailbox_codec`) without changing the code on either side.

Rules the runtime enforces, and why:

* Message types are tagged Structs, checked when the actor class is defined: a mailbox's union
  can only be decoded from msgpack if every member carries a distinct tag.
* `send` is synchronous and never blocks: the scheduler must not stall on a slow consumer;
  back-pressure belongs to admission control, not to the mailbox. It fails at the sender
  (TypeError for a type the actor does not accept, ActorStoppedError for a dead actor), so
  mistakes surface where they are made instead of as a message that is never handled.
* A crash is never silent: it is logged with the actor's name, kept in `error`, handed to
  `on_crash` (so the actor can fail the requests it owns) and reported to the `ActorSystem`.
* Nothing hangs: `stop` waits at most `timeout` before cancelling the task.

Mailboxes are single-reader and loop-bound: call `send` from the event loop's thread (from other
threads use `loop.call_soon_threadsafe(actor.send, msg)`), and receive only from the actor's task.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import enum
import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Union

import msgspec

from engine.errors import EngineError

if TYPE_CHECKING:
    from engine.actors.supervisor import ActorSystem

__all__ = [
    "Actor",
    "ActorState",
    "ActorStats",
    "ActorStoppedError",
    "RestartPolicy",
    "mailbox_codec",
]

logger = logging.getLogger(__name__)

RestartPolicy = Literal["never", "restart"]

# After a stop timeout the task is cancelled; this bounds how long we then wait for it to unwind,
# so even a task that swallows CancelledError cannot make `stop` hang.
_CANCEL_GRACE_S = 1.0


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


class ActorState(enum.Enum):
    """Lifecycle of an actor; `send` is accepted only in NEW, RUNNING and RESTARTING."""

    NEW = "new"  # constructed; sends queue up and are handled once started
    RUNNING = "running"
    RESTARTING = "restarting"  # crashed, the supervisor will start a fresh task
    STOPPING = "stopping"  # draining messages sent before stop()
    STOPPED = "stopped"
    CRASHED = "crashed"


_ACCEPTING = frozenset({ActorState.NEW, ActorState.RUNNING, ActorState.RESTARTING})


class ActorStats(msgspec.Struct, frozen=True):
    """Counters for the engine's internal-state endpoint (a Struct so it encodes as-is)."""

    name: str
    state: str
    received: int  # messages taken out of the mailbox (for a handle()-actor: handled)
    depth: int  # messages waiting in the mailbox now
    restarts: int
    error: str | None


class _StopSignal(BaseException):
    """Raised by the receive methods once stop() was requested and the mailbox is empty.

    A BaseException so that a broad `except Exception` in a subclass's run() loop cannot swallow
    it: it must unwind run() so that on_stop() runs.
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
        msgspec.msgpack.Decoder(Union[accepts])  # type: ignore[valid-type]
    return accepts


def mailbox_codec(
    accepts: Iterable[type[msgspec.Struct]],
) -> tuple[msgspec.msgpack.Encoder, msgspec.msgpack.Decoder[Any]]:
    """An (encoder, decoder) pair that moves any message of `accepts` through msgpack.

    The decoder targets the tagged union of all accepted types, so each payload comes back as
    the class it was sent as: this is all a mailbox needs to cross a process boundary.
    """
    types = _check_accepts("mailbox_codec", tuple(accepts))
    if not types:
        raise TypeError("mailbox_codec needs at least one message type")
    return msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(Union[types])  # type: ignore[valid-type]


class Actor:
    """One asyncio task draining one mailbox of declared, tagged `msgspec.Struct` messages.

    Write an actor either by overriding `handle` (the default `run` feeds it one message at a
    time) or by overriding `run` to own the loop, using `recv`, `recv_nowait`, `drain` and
    `recv_or` (a scheduler waking on a new request *or* a finished device step). Subclasses with
    an `__init__` must call `super().__init__(name)`.
    """

    accepts: ClassVar[tuple[type[msgspec.Struct], ...]] = ()
    _accept_set: ClassVar[frozenset[type]] = frozenset()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # Fail at class definition, not at the first send, when a message type is unusable.
        cls._accept_set = frozenset(_check_accepts(cls.__qualname__, cls.accepts))

    def __init__(self, name: str | None = None) -> None:
        self.name = name or type(self).__name__
        self._mailbox: collections.deque[msgspec.Struct] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None
        self._task: asyncio.Task[None] | None = None
        self._state = ActorState.NEW
        self._stop_requested = False
        self._error: BaseException | None = None
        self._received = 0
        self._restarts = 0
        self._supervisor: ActorSystem | None = None

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} {self._state.value} depth={len(self._mailbox)}>"

    # ---- sending -------------------------------------------------------------------------------

    def send(self, msg: msgspec.Struct) -> None:
        """Queue `msg` without blocking; fail here, at the sender, if it cannot be handled."""
        if type(msg) not in self._accept_set:
            # Exact type match: a Struct subclass has its own tag, so it would not decode as the
            # declared type on the far side of a process boundary.
            accepted = ", ".join(t.__qualname__ for t in self.accepts) or "nothing"
            raise TypeError(
                f"actor {self.name!r} accepts [{accepted}], not {type(msg).__qualname__}"
            )
        if self._state not in _ACCEPTING or self._stop_requested:
            raise ActorStoppedError(self.name, self._state, self._error)
        self._mailbox.append(msg)
        self._wake()

    # ---- receiving (from the actor's own task) -------------------------------------------------

    async def recv(self) -> msgspec.Struct:
        """Wait for the next message, in send order."""
        while not self._mailbox:
            if self._stop_requested:
                raise _StopSignal
            await self._wait()
        return self._pop()

    def recv_nowait(self) -> msgspec.Struct | None:
        """The next message, or None when the mailbox is empty."""
        if self._mailbox:
            return self._pop()
        if self._stop_requested:
            raise _StopSignal
        return None

    def drain(self) -> list[msgspec.Struct]:
        """Every queued message at once (a scheduler admits a whole burst per step)."""
        if not self._mailbox:
            if self._stop_requested:
                raise _StopSignal
            return []
        msgs = list(self._mailbox)
        self._mailbox.clear()
        self._received += len(msgs)
        return msgs

    async def recv_or(
        self, fut: asyncio.Future[Any] | concurrent.futures.Future[Any]
    ) -> tuple[msgspec.Struct | None, bool]:
        """Wait until a message arrives or `fut` completes; return `(msg or None, fut.done())`.

        Neither side is lost: a message is returned (never dropped when the future wins), and
        `fut` is neither consumed nor cancelled, so the caller reads its result when `done` is
        True and may pass it again otherwise. Queued messages win over a finished future, so a
        caller that loops drains its mailbox first. Waiting uses a done-callback, not polling.
        Only futures (and Tasks) are accepted: a bare coroutine would have to be wrapped in a
        task whose result the caller could never reach when a message wins.
        """
        if isinstance(fut, concurrent.futures.Future):
            fut = asyncio.wrap_future(fut)
        elif not asyncio.isfuture(fut):
            raise TypeError(
                f"recv_or needs a Future or Task, not {type(fut).__name__}; wrap a coroutine with"
                " asyncio.ensure_future() and keep the task to read its result"
            )
        if not self._mailbox and not fut.done() and not self._stop_requested:
            waiter = self._new_waiter()

            def wake(_: object) -> None:
                if not waiter.done():
                    waiter.set_result(None)

            fut.add_done_callback(wake)
            try:
                await waiter
            finally:
                fut.remove_done_callback(wake)
                self._clear_waiter(waiter)
        if self._mailbox:
            return self._pop(), fut.done()
        if fut.done():
            return None, True
        raise _StopSignal

    def _pop(self) -> msgspec.Struct:
        self._received += 1
        return self._mailbox.popleft()

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

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # ---- behaviour (override) ------------------------------------------------------------------

    async def run(self) -> None:
        """Default loop: hand each message to `handle`, in order, one at a time."""
        while True:
            msg = await self.recv()
            await self.handle(msg)

    async def handle(self, msg: msgspec.Struct) -> None:
        """Process one message (override this, or override `run`)."""
        raise NotImplementedError(f"{type(self).__qualname__} overrides neither handle() nor run()")

    async def on_start(self) -> None:
        """Runs in the actor's task before the first message (and again after each restart)."""

    async def on_stop(self) -> None:
        """Runs after a clean stop, once every message sent before stop() was received."""

    async def on_crash(self, exc: BaseException) -> None:
        """Runs after handle/run raised: fail the requests this actor owns here."""

    # ---- lifecycle -----------------------------------------------------------------------------

    @property
    def state(self) -> ActorState:
        return self._state

    @property
    def running(self) -> bool:
        """True while the actor's task is alive and not crashed (including while draining)."""
        return self._state in (ActorState.RUNNING, ActorState.STOPPING)

    @property
    def stopping(self) -> bool:
        """True once stop() was requested: a custom run() loop that never receives checks this."""
        return self._stop_requested

    @property
    def error(self) -> BaseException | None:
        """The exception of the last crash (kept after a restart, for diagnosis), or None."""
        return self._error

    @property
    def depth(self) -> int:
        """Messages waiting in the mailbox."""
        return len(self._mailbox)

    def stats(self) -> ActorStats:
        return ActorStats(
            name=self.name,
            state=self._state.value,
            received=self._received,
            depth=len(self._mailbox),
            restarts=self._restarts,
            error=None if self._error is None else f"{type(self._error).__name__}: {self._error}",
        )

    def start(self) -> None:
        """Create the actor's task on the running loop. An actor starts once (restarts are the
        supervisor's job), so a second call is a bug and raises RuntimeError."""
        if self._state is not ActorState.NEW:
            raise RuntimeError(f"actor {self.name!r} cannot start: it is {self._state.value}")
        asyncio.get_running_loop()  # raise here, not inside create_task, when no loop runs
        self._spawn()

    def _spawn(self) -> None:
        self._state = ActorState.RUNNING
        self._task = asyncio.get_running_loop().create_task(self._main(), name=f"actor:{self.name}")

    async def stop(self, timeout: float = 5.0) -> None:
        """Stop cleanly: messages already queued are received first, then on_stop() runs.

        New sends fail from now on. If the task has not finished after `timeout` seconds it is
        cancelled, so a wedged actor cannot hang shutdown. Called from the actor's own task, it
        only requests the stop (waiting for itself would deadlock).
        """
        if self._state is ActorState.NEW:
            self._state = ActorState.STOPPED
            return
        if self._state in (ActorState.RUNNING, ActorState.RESTARTING):
            self._state = ActorState.STOPPING
        self._stop_requested = True
        self._wake()
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
        me = asyncio.current_task()
        try:
            try:
                await self.on_start()
                await self.run()
            except _StopSignal:
                pass
            await self.on_stop()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            await self._crash(exc)
        finally:
            # Only the current task may settle the state: after a restart a new task owns it.
            if self._task is me and self._state in (
                ActorState.RUNNING, ActorState.STOPPING, ActorState.RESTARTING
            ):
                self._state = ActorState.STOPPED

    async def _crash(self, exc: Exception) -> None:
        sup = self._supervisor
        may_restart = self._state is ActorState.RUNNING and not self._stop_requested
        restart = sup is not None and sup._decide(self, exc, may_restart)
        # Set before on_crash runs, so sends made meanwhile fail at once (or queue for a restart).
        self._state = ActorState.RESTARTING if restart else ActorState.CRASHED
        self._error = exc
        logger.error(
            "actor %r crashed%s: %s: %s", self.name, " (restarting)" if restart else "",
            type(exc).__name__, exc, exc_info=exc,
        )
        try:
            await self.on_crash(exc)
        except Exception:
            logger.exception("actor %r: on_crash raised", self.name)
        if sup is not None:
            sup._notify(self, exc)
        if restart:
            if self._state is ActorState.RESTARTING:  # stop() may have come during on_crash
                self._restarts += 1
                self._spawn()  # fresh task; the mailbox and its pending messages are kept
            else:
                self._state = ActorState.STOPPED
