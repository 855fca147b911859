"""Dispatcher: SGLang's TypeBasedDispatcher as an actor.

Every request-side message (generate, abort, stop-string finish, flush cache, get/set internal
state) enters here and is routed by its type to the actor that owns that concern. Today they all
land on the scheduler; adding a stage (a second scheduler, a cache manager) changes one table.
"""

from __future__ import annotations

from engine.actors.messages import SCHEDULER_INPUTS
from engine.actors.runtime import Actor


class TypeBasedDispatcher:
    def __init__(self, routes: dict[type, Actor]) -> None:
        self.routes = routes

    def __call__(self, msg) -> None:
        target = self.routes.get(type(msg))
        if target is None:
            raise TypeError(f"no route for {type(msg).__name__}")
        target.send(msg)


class Dispatcher(Actor):
    accepts = SCHEDULER_INPUTS

    def __init__(self, routes: dict[type, Actor]) -> None:
        super().__init__("dispatcher")
        self.dispatch = TypeBasedDispatcher(routes)

    async def handle(self, msg) -> None:
        self.dispatch(msg)
