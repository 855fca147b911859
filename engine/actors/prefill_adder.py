"""PrefillAdderActor: the actor that owns the waiting queue and decides what prefills next.

It wraps a `PrefillPlanner` (engine/scheduler/waiting_queue.py). New requests arrive here from the
Dispatcher; requests the scheduler gives back (retracted) arrive as `RequeueReqs`. Once per round
with something to prefill, the scheduler sends a `PlanPrefillReq` with its budgets and waits for
the `PrefillPlanReply`: the requests to prefill, taken out of the queue, each with its prefix
match. The scheduler stays the owner of memory and of the running batch.

Reading the radix tree: the planner matches prompts against the scheduler's tree only while
handling a `PlanPrefillReq`, and the scheduler sends that request and then waits for this reply
without touching the tree, so the two never interleave on it.

Aborts reach this actor only through the scheduler (which forwards those of requests it does not
hold): see the Dispatcher for why that order can never lose one.
"""

from __future__ import annotations

import msgspec

from engine.actors.messages import (
    AbortAllReq,
    AbortReq,
    BatchTokenOut,
    PlanPrefillReq,
    PrefillPlanReply,
    RequeueReqs,
    StopStrMatched,
    TokenizedGenerateReq,
    WaitingCount,
)
from engine.actors.runtime import Actor
from engine.recorder.events import describe_plan
from engine.recorder.ring import FlightRecorder
from engine.scheduler.req import Finished, FinishReason, Req
from engine.scheduler.waiting_queue import PrefillPlan, PrefillPlanner


class PrefillAdderActor(Actor):
    accepts = (TokenizedGenerateReq, PlanPrefillReq, RequeueReqs, AbortReq, StopStrMatched, AbortAllReq)

    def __init__(
        self, planner: PrefillPlanner, eos_token_ids: frozenset[int], context_len: int, pool_tokens: int
    ) -> None:
        super().__init__("prefill_adder")
        self.planner = planner
        self.eos_token_ids = eos_token_ids
        self.context_len = context_len
        self.pool_tokens = pool_tokens  # KV pool size: a prompt that never fits is refused here
        self.scheduler: Actor | None = None  # PrefillPlanReply, WaitingCount
        self.output: Actor | None = None  # BatchTokenOut for requests aborted while waiting
        self.recorder: FlightRecorder | None = None  # the flight recorder, when on
        self.version = 0  # of the queue length last told to the scheduler (WaitingCount, replies)
        self._told = 0

    async def run(self) -> None:
        while True:
            self.contain(self.handle_message, await self.recv())
            for msg in self.drain():  # a burst of arrivals is one WaitingCount, not one each
                self.contain(self.handle_message, msg)
            if len(self.planner) != self._told:
                self._told = len(self.planner)
                self.version += 1
                self.scheduler.send(WaitingCount(self._told, self.version))

    def handle_message(self, msg: msgspec.Struct) -> None:
        if isinstance(msg, PlanPrefillReq):
            plan = self.planner.plan(msg.budget)
            if self.recorder is not None:
                self.recorder.plan(msg.reply_id, describe_plan(plan))
            self._told = plan.num_waiting
            self.version += 1
            self.scheduler.send(PrefillPlanReply(msg.reply_id, plan, self.version))
        elif isinstance(msg, TokenizedGenerateReq):
            self._add(msg)
        elif isinstance(msg, RequeueReqs):
            self.planner.requeue(msg.reqs)
        elif isinstance(msg, AbortReq):
            req = self.planner.remove(msg.rid)
            if req is not None:
                req.abort(msg.message)
                self.output.send(BatchTokenOut.finished([req]))
        elif isinstance(msg, AbortAllReq):  # the scheduler ended what it held; the queue ends here
            reqs, self.planner.waiting = self.planner.waiting, []
            for req in reqs:
                req.abort(msg.message)
            if reqs:
                self.output.send(BatchTokenOut.finished(reqs))
        elif isinstance(msg, StopStrMatched):  # its text already ended: just forget it
            req = self.planner.remove(msg.rid)
            if req is not None:
                req.finished_reason = Finished(FinishReason.STOP, matched=msg.matched)

    def on_message_error(self, msg: msgspec.Struct, exc: Exception) -> None:
        """Fail what the message was about: the new request, the requeued ones, or (a plan that
        cannot be made) every waiting request; the scheduler waiting for a plan gets an empty one."""
        error = f"internal error in the prefill adder: {type(exc).__name__}: {exc}"
        out = BatchTokenOut()
        if isinstance(msg, TokenizedGenerateReq):
            if self.planner.remove(msg.rid) is None:
                out.add_aborted(msg.rid, error)
        elif isinstance(msg, RequeueReqs):
            for req in msg.reqs:
                self.planner.remove(req.rid)
                req.abort(error)
                out.add(req, -1)
        elif isinstance(msg, PlanPrefillReq):
            for req in self.planner.waiting:
                req.abort(error)
                out.add(req, -1)
            self.planner.waiting.clear()
            self.version += 1
            self._told = 0
            empty = PrefillPlan([], None, 0, 0, 0)
            self.scheduler.send(PrefillPlanReply(msg.reply_id, empty, self.version))
        if out.rids:
            self.output.send(out)

    def _add(self, msg: TokenizedGenerateReq) -> None:
        req = Req(
            msg.rid,
            msg.input_ids,
            msg.sampling_params,
            seed=msg.seed,
            eos_token_ids=self.eos_token_ids,
            max_context_len=self.context_len,
            return_logprob=msg.return_logprob,
            top_logprobs_num=msg.top_logprobs_num,
            grammar=msg.grammar,
            logprob_start_len=msg.logprob_start_len,
            pooling=msg.pooling,
            lora_path=msg.lora_path,
            lora_key=msg.lora_key,
        )
        if len(msg.input_ids) + self.planner.page_size > self.pool_tokens:
            req.abort(
                f"the prompt has {len(msg.input_ids)} tokens but the KV cache pool holds only "
                f"{self.pool_tokens}; it can never fit"
            )
            self.output.send(BatchTokenOut.finished([req]))
            return
        self.planner.add(req)
