"""ActorSystem: starts, stops and supervises a set of actors (restart policies, sticky health).

Split from runtime.py, which holds the Actor itself; an actor calls back into its system when it
crashes (`_decide` before its on_crash hook: restart or give up; `_notify` after: record, tell
the owner).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

from engine.actors.runtime import Actor, ActorState, ActorStats, RestartPolicy

__all__ = ["ActorSystem"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _Entry:
    actor: Actor
    restart_policy: RestartPolicy
    max_restarts: int
    restarts: int = 0


class ActorSystem:
    """Starts, stops and supervises a set of actors.

    Health is sticky: once an actor crashes for good (policy "never", or its restarts are used
    up) the system is unhealthy, so a health check reports a broken engine instead of one that
    silently lost a stage. Crashes that were restarted are still listed in `crashed`.
    """

    def __init__(
        self,
        on_crash: Callable[[str, BaseException], None] | None = None,
        stop_timeout: float = 5.0,
    ) -> None:
        self._entries: dict[str, _Entry] = {}
        self._on_crash = on_crash
        self.stop_timeout = stop_timeout
        self.crashed: list[tuple[str, BaseException]] = []
        self._healthy = True
        self._started = False
        self._stopping = False

    def add(
        self,
        actor: Actor,
        *,
        restart_policy: RestartPolicy = "never",
        max_restarts: int = 3,
    ) -> Actor:
        """Register `actor` (names must be unique); it starts now if the system already runs."""
        if restart_policy not in ("never", "restart"):
            raise ValueError(f"restart_policy must be 'never' or 'restart', not {restart_policy!r}")
        if max_restarts < 0:
            raise ValueError("max_restarts must be >= 0")
        if actor.name in self._entries:
            raise ValueError(f"an actor named {actor.name!r} is already in the system")
        if actor._supervisor is not None:
            raise ValueError(f"actor {actor.name!r} already belongs to a system")
        actor._supervisor = self
        self._entries[actor.name] = _Entry(actor, restart_policy, max_restarts)
        if self._started and not self._stopping and actor.state is ActorState.NEW:
            actor.start()
        return actor

    def __getitem__(self, name: str) -> Actor:
        return self._entries[name].actor

    @property
    def actors(self) -> list[Actor]:
        return [e.actor for e in self._entries.values()]

    @property
    def healthy(self) -> bool:
        return self._healthy

    def stats(self) -> list[ActorStats]:
        return [e.actor.stats() for e in self._entries.values()]

    def start_all(self) -> None:
        """Start every actor not started yet, in the order they were added."""
        self._started = True
        for entry in self._entries.values():
            if entry.actor.state is ActorState.NEW:
                entry.actor.start()

    async def stop_all(self, timeout: float | None = None) -> None:
        """Stop every actor in reverse order of addition; each gets `timeout` before cancel.

        Bounded: at most about n * (timeout + 1 s) even when every actor is wedged.
        """
        self._stopping = True
        t = self.stop_timeout if timeout is None else timeout
        for entry in reversed(list(self._entries.values())):
            await entry.actor.stop(t)

    def _decide(self, actor: Actor, exc: BaseException, may_restart: bool) -> bool:
        """Called by a crashing actor before on_crash: restart it, or mark the system unhealthy."""
        entry = self._entries.get(actor.name)
        if (
            entry is not None
            and may_restart
            and not self._stopping
            and entry.restart_policy == "restart"
            and entry.restarts < entry.max_restarts
        ):
            entry.restarts += 1
            return True
        if entry is not None and entry.restart_policy == "restart" and may_restart:
            logger.error("actor %r exhausted %d restarts", actor.name, entry.max_restarts)
        self._healthy = False
        return False

    def _notify(self, actor: Actor, exc: BaseException) -> None:
        """Called by a crashing actor after its on_crash: record it and tell the owner."""
        self.crashed.append((actor.name, exc))
        if self._on_crash is not None:
            try:
                self._on_crash(actor.name, exc)
            except Exception:
                logger.exception("ActorSystem on_crash callback raised for %r", actor.name)
