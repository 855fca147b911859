"""ActorSystem: starts and stops a set of actors and keeps the engine's health.

Health is sticky: once an actor crashes the system is unhealthy, so a health check reports a
broken engine instead of one that silently lost a stage. Nothing is restarted: an actor that
crashed may have lost requests' state, and the engine's owner (a supervisor process, an operator)
decides what happens next.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from engine.actors.runtime import Actor, ActorState, ActorStats

__all__ = ["ActorSystem"]

logger = logging.getLogger(__name__)


class ActorSystem:
    def __init__(self, on_crash: Callable[[str, BaseException], None] | None = None, stop_timeout: float = 5.0) -> None:
        self._actors: dict[str, Actor] = {}
        self._on_crash = on_crash
        self.stop_timeout = stop_timeout
        self.crashed: list[tuple[str, BaseException]] = []

    def add(self, actor: Actor) -> Actor:
        """Register `actor` (names must be unique); `start_all` starts it."""
        if actor.name in self._actors:
            raise ValueError(f"an actor named {actor.name!r} is already in the system")
        if actor.crash_listener is not None:
            raise ValueError(f"actor {actor.name!r} already belongs to a system")
        actor.crash_listener = self._crashed
        self._actors[actor.name] = actor
        return actor

    def __getitem__(self, name: str) -> Actor:
        return self._actors[name]

    @property
    def actors(self) -> list[Actor]:
        return list(self._actors.values())

    @property
    def healthy(self) -> bool:
        return not self.crashed

    def stats(self) -> list[ActorStats]:
        return [a.stats() for a in self._actors.values()]

    def start_all(self) -> None:
        """Start every actor not started yet, in the order they were added."""
        for actor in self._actors.values():
            if actor.state is ActorState.NEW:
                actor.start()

    async def stop_all(self, timeout: float | None = None) -> None:
        """Stop every actor in reverse order of addition; each gets `timeout` before cancel.

        Bounded: at most about n * (timeout + 1 s) even when every actor is wedged.
        """
        t = self.stop_timeout if timeout is None else timeout
        for actor in reversed(list(self._actors.values())):
            await actor.stop(t)

    def _crashed(self, actor: Actor, exc: BaseException) -> None:
        """An actor's crash listener: record it (health turns False) and tell the owner."""
        self.record_crash(actor.name, exc)

    def record_crash(self, name: str, exc: BaseException) -> None:
        """Something the actors depend on died (`name`: an actor, or e.g. a tensor-parallel rank):
        health turns False for good and the owner is told."""
        self.crashed.append((name, exc))
        if self._on_crash is not None:
            try:
                self._on_crash(name, exc)
            except Exception:
                logger.exception("ActorSystem on_crash callback raised for %r", name)
