"""OverlapScheduler: the actor that owns the `Scheduler` (memory, running batch) and the device.

Event loop of one step (SGLang's overlap loop, on asyncio):

    handle queued messages -> plan batch N+1 -> launch it on the device stream ->
    await batch N's result (still handling messages: an abort frees memory mid-forward) ->
    process N's result (one step late) -> send tokens to the OutputProcessor.

Planning is `Scheduler.prefill_budget` -> the PrefillAdder actor (`PlanPrefillReq`, waited for
with a selective receive that leaves every other message queued) -> `Scheduler.next_batch`; the
same calls `SyncScheduler` makes directly. With overlap off, or when batch N holds a request
whose next token depends on N's (penalties count it, a grammar's mask follows it:
`LaunchedBatch.needs_sync`), N's result is processed before N+1 is planned.
Outputs are identical either way.

Aborts and stop strings come here first. The scheduler holds every request that is not in the
waiting queue, and requests only move from the queue to the scheduler inside a plan round trip,
which this actor completes before it handles its next message; so a request it does not hold is
waiting (or on its way there), and the message is forwarded to the PrefillAdder, whose mailbox
already has every earlier hand-off of that request.
"""

from __future__ import annotations

import itertools
import logging
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from engine.actors.messages import (
    AbortReq,
    BatchTokenOut,
    ControlReply,
    FlushCacheReq,
    GetInternalStateReq,
    PlanPrefillReq,
    PrefillPlanReply,
    RequeueReqs,
    SetInternalStateReq,
    StopStrMatched,
    WaitingCount,
)
from engine.actors.runtime import Actor
from engine.api import StepRecord
from engine.device import DeviceHandle, DeviceStream
from engine.errors import InvalidRequestError, WatchdogTimeoutError
from engine.scheduler.batch import FinishReason, Req
from engine.scheduler.internal_state import check_internal_state
from engine.scheduler.scheduler import LaunchedBatch, MemoryLeakError, Scheduler
from engine.scheduler.step import TimedResult, run_batch

log = logging.getLogger(__name__)

STEP_HISTORY = 4096  # StepRecords kept (Engine.recent_steps)


@dataclass
class InFlight:
    """A launched batch and the handle its result arrives on."""

    lb: LaunchedBatch
    handle: DeviceHandle[TimedResult]
    num_tokens: int  # tokens whose KV the forward writes (the batch object changes after launch)


class OverlapScheduler(Actor):
    accepts = (
        AbortReq,
        StopStrMatched,
        FlushCacheReq,
        GetInternalStateReq,
        SetInternalStateReq,
        PrefillPlanReply,
        WaitingCount,
    )

    def __init__(
        self,
        scheduler: Scheduler,
        stream: DeviceStream,
        enable_overlap: bool = True,
        watchdog_timeout: float | None = None,
    ) -> None:
        super().__init__("scheduler")
        self.sched = scheduler
        self.stream = stream
        self.enable_overlap = enable_overlap
        self.watchdog_timeout = watchdog_timeout  # seconds a forward may run; None: no watchdog
        self.adder: Actor | None = None  # PrefillAdderActor: PlanPrefillReq, RequeueReqs, forwarded aborts
        self.output: Actor | None = None  # OutputProcessor: BatchTokenOut
        self.replies: Actor | None = None  # Receiver: ControlReply
        self.memory_errors: list[str] = []  # invariant violations seen when idle (tests read them)
        self.steps: deque[StepRecord] = deque(maxlen=STEP_HISTORY)
        self._checked_idle = True
        self.num_forwards = 0  # forwards completed (or failed) so far: the profiler's step count
        self.on_forward: Callable[[int], None] | None = None  # called with num_forwards after each
        self._plan_ids = itertools.count()
        self._waiting_version = 0

    # ---- main loop ----------------------------------------------------------------------------

    async def run(self) -> None:
        inflight: InFlight | None = None
        while True:
            for msg in self.drain():
                self.contain(self._handle, msg)
            if inflight is not None and (not self.enable_overlap or inflight.lb.needs_sync):
                await self._finish(inflight)
                inflight = None
            launched = await self._launch_next()
            if inflight is not None:
                await self._finish(inflight)
            inflight = launched
            if inflight is None and not self._has_work():
                self._check_idle_memory()
                self.contain(self._handle, await self.recv())

    async def _launch_next(self) -> InFlight | None:
        sched = self.sched
        budget = sched.prefill_budget()
        plan = None
        if budget is not None:
            reply_id = next(self._plan_ids)
            self.adder.send(PlanPrefillReq(reply_id, budget))
            reply = await self.recv_matching(lambda m: isinstance(m, PrefillPlanReply) and m.reply_id == reply_id)
            assert isinstance(reply, PrefillPlanReply)
            self._waiting_version = reply.version
            plan = reply.plan
        batch = sched.next_batch(plan)
        if requeue := sched.take_requeue():
            self.adder.send(RequeueReqs(requeue))
        if aborted := sched.take_self_aborted():
            self.output.send(BatchTokenOut.finished(aborted))
        if batch is None:
            return None
        self._checked_idle = False
        lb = sched.launched(batch)
        mwb = batch.get_model_worker_batch()
        return InFlight(lb, self.stream.launch(run_batch, sched.runner, mwb), int(mwb.out_cache_loc.numel()))

    async def _finish(self, inflight: InFlight) -> None:
        lb, fut = inflight.lb, inflight.handle.future
        deadline = None if self.watchdog_timeout is None else lb.launched_at + self.watchdog_timeout
        while True:  # wait for the device, serving messages (aborts, control) meanwhile
            remaining = None if deadline is None else max(0.0, deadline - time.perf_counter())
            try:
                msg, done = await self.recv_or(fut, remaining)
            except TimeoutError:
                self._watchdog_fired(lb)
            if msg is not None:
                self.contain(self._handle, msg)
            if done:
                break
        self.num_forwards += 1
        if self.on_forward is not None:
            self.on_forward(self.num_forwards)
        try:
            result, t0, t1 = fut.result()
        except Exception as e:  # a failed forward fails its requests, not the engine
            log.exception("forward failed; failing %d request(s)", len(lb.reqs))
            out = self.sched.fail_batch(lb, e)
        else:
            self.steps.append(StepRecord(lb.mode.name, len(lb.reqs), inflight.num_tokens, t0, t1))
            out = self.sched.process_batch_result(lb, result)
        if out.rids:
            self.output.send(out)

    def _watchdog_fired(self, lb: LaunchedBatch) -> None:
        """A forward hangs: log every thread's stack, fail its requests, and die (the engine turns
        unhealthy; `on_crash` fails every other request this scheduler holds)."""
        waited = time.perf_counter() - lb.launched_at
        log.error(
            "watchdog: a %s forward of %d request(s) has run for %.1f s (watchdog_timeout=%s s); "
            "stacks of every thread:\n%s",
            lb.mode.name,
            len(lb.reqs),
            waited,
            self.watchdog_timeout,
            all_thread_stacks(),
        )
        error = WatchdogTimeoutError(f"the forward did not complete within {self.watchdog_timeout} s")
        out = self.sched.fail_batch(lb, error)
        if out.rids:
            self.output.send(out)
        raise error

    def _has_work(self) -> bool:
        return not self.sched.is_idle()

    def _check_idle_memory(self) -> None:
        if self._checked_idle or not self.sched.holds_nothing():
            return
        self._checked_idle = True
        self.sched.running_batch.filter_batch()
        try:
            self.sched.check_memory()
        except MemoryLeakError as e:
            self.memory_errors.append(str(e))

    # ---- messages -----------------------------------------------------------------------------

    def _handle(self, msg: msgspec.Struct) -> None:
        if isinstance(msg, AbortReq):
            req = self.sched.abort_request(msg.rid, msg.message)
            if req is None:
                self.adder.send(msg)  # waiting (or over): the PrefillAdder decides
            else:
                self.output.send(BatchTokenOut.finished([req]))
        elif isinstance(msg, StopStrMatched):
            if self.sched.abort_request(msg.rid, None, reason=FinishReason.STOP, matched=msg.matched) is None:
                self.adder.send(msg)
        elif isinstance(msg, WaitingCount):
            if msg.version > self._waiting_version:  # a count older than the last plan is stale
                self._waiting_version = msg.version
                self.sched.num_waiting = msg.num_waiting
        elif isinstance(msg, FlushCacheReq):
            ok = self.sched.flush_cache()
            self.replies.send(ControlReply(msg.reply_id, ok, error=None if ok else "requests are running"))
        elif isinstance(msg, GetInternalStateReq):
            state = self.sched.internal_state()
            state["memory_errors"] = list(self.memory_errors)
            self.replies.send(ControlReply(msg.reply_id, True, state))
        elif isinstance(msg, SetInternalStateReq):
            self.replies.send(self._set_state(msg))
        elif isinstance(msg, PrefillPlanReply):  # only ever awaited inside _launch_next
            log.error("unexpected plan reply %d outside a planning round; dropped", msg.reply_id)

    def _set_state(self, msg: SetInternalStateReq) -> ControlReply:
        try:
            state = check_internal_state(msg.state)
        except InvalidRequestError as e:
            return ControlReply(msg.reply_id, False, error=str(e))
        if "max_running_requests" in state:
            self.sched.max_running_requests = min(int(state["max_running_requests"]), self.sched.req_to_token_pool.size)
        if "new_token_ratio" in state:
            self.sched.new_token_ratio = float(state["new_token_ratio"])
        return ControlReply(msg.reply_id, True, self.sched.internal_state())

    def on_message_error(self, msg: msgspec.Struct, exc: Exception) -> None:
        """A control call gets its error as the reply; anything else was logged and counted."""
        if isinstance(msg, (FlushCacheReq, GetInternalStateReq, SetInternalStateReq)):
            self.replies.send(ControlReply(msg.reply_id, False, error=f"{type(exc).__name__}: {exc}"))

    async def on_crash(self, exc: BaseException) -> None:
        """The scheduler itself broke: every request it holds ends with an error."""
        reqs: list[Req] = list(self.sched.reqs_by_rid.values())
        for req in reqs:
            req.abort(f"engine error: {exc!r}")
        if reqs and self.output is not None and self.output.running:
            self.output.send(BatchTokenOut.finished(reqs))


def all_thread_stacks() -> str:
    """Every thread's current stack, as text (what the watchdog logs)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    return "\n".join(
        f"--- thread {names.get(ident, '?')} ({ident}) ---\n{''.join(traceback.format_stack(frame))}"
        for ident, frame in sys._current_frames().items()
    )
