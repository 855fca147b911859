"""Dispatcher: SGLang's TypeBasedDispatcher as an actor.

Every request-side message enters here and is routed by its type, through one table, to the
actor that owns that concern:

    TokenizedGenerateReq                         -> PrefillAdderActor (it owns the waiting queue)
    AbortReq, StopStrMatched                     -> OverlapScheduler (it holds every request that
                                                    is not waiting, and forwards the others)
    FlushCacheReq, Get/SetInternalStateReq       -> OverlapScheduler (it owns memory and state)
    UpdateWeightsReq, WeightGroupReq,
    Pause/ContinueGenerationReq,
    MemoryOccupationReq, LoRAAdapterReq,
    AbortAllReq                                  -> OverlapScheduler (it owns the runner and the
                                                    running batch; it forwards AbortAllReq)

Why aborts go to the scheduler and not straight to "the holder": a request moves from the queue
to the scheduler only inside a plan round trip the scheduler itself completes before reading its
next message, and moves back only by a message the scheduler sends. So when the scheduler reads
an abort, either it holds the request or the PrefillAdder will, once it has read what is already
in its mailbox; a forwarded abort lands behind that hand-off. Routing by a location table instead
would race with requests in transit.
"""

from __future__ import annotations

from collections.abc import Mapping

import msgspec

from engine.actors.messages import (
    AbortAllReq,
    AbortReq,
    ContinueGenerationReq,
    FlushCacheReq,
    GetInternalStateReq,
    LoRAAdapterReq,
    MemoryOccupationReq,
    PauseGenerationReq,
    SetInternalStateReq,
    StopStrMatched,
    TokenizedGenerateReq,
    UpdateWeightsReq,
    WeightGroupReq,
)
from engine.actors.runtime import Actor

REQUEST_INPUTS = (
    TokenizedGenerateReq,
    AbortReq,
    StopStrMatched,
    FlushCacheReq,
    GetInternalStateReq,
    SetInternalStateReq,
    UpdateWeightsReq,
    PauseGenerationReq,
    ContinueGenerationReq,
    MemoryOccupationReq,
    WeightGroupReq,
    LoRAAdapterReq,
    AbortAllReq,
)


def routing_table(prefill_adder: Actor, scheduler: Actor) -> dict[type, Actor]:
    """Where each request-side message type goes."""
    return {
        TokenizedGenerateReq: prefill_adder,
        AbortReq: scheduler,
        StopStrMatched: scheduler,
        FlushCacheReq: scheduler,
        GetInternalStateReq: scheduler,
        SetInternalStateReq: scheduler,
        UpdateWeightsReq: scheduler,
        PauseGenerationReq: scheduler,
        ContinueGenerationReq: scheduler,
        MemoryOccupationReq: scheduler,
        WeightGroupReq: scheduler,
        LoRAAdapterReq: scheduler,
        AbortAllReq: scheduler,
    }


class Dispatcher(Actor):
    accepts = REQUEST_INPUTS

    def __init__(self, routes: Mapping[type, Actor]) -> None:
        super().__init__("dispatcher")
        missing = [t.__name__ for t in self.accepts if t not in routes]
        if missing:
            raise ValueError(f"the dispatcher has no route for {missing}")
        self.routes = dict(routes)

    async def handle(self, msg: msgspec.Struct) -> None:
        self.routes[type(msg)].send(msg)
