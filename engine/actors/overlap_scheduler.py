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

Stop strings end a request inside `Scheduler.process_batch_result`, in the step whose token
completes one (scheduler/stop_strings.py), like an EOS. `StopStrMatched` from the OutputProcessor
is only a fallback for a request the scheduler did not check.

Aborts (and that fallback) come here first. The scheduler holds every request that is not in the
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

from engine.actors.generation_control import CONTROL_MESSAGES, GenerationControl, GenerationControlActions
from engine.actors.lora_control import LoRAControlActions
from engine.actors.messages import (
    AbortAllReq,
    AbortReq,
    BatchTokenOut,
    ContinueGenerationReq,
    ControlReply,
    FlushCacheReq,
    GetInternalStateReq,
    LoRAAdapterReq,
    MemoryOccupationReq,
    PauseGenerationReq,
    PlanPrefillReq,
    PrefillPlanReply,
    RequeueReqs,
    SetInternalStateReq,
    StopStrMatched,
    UpdateWeightsReq,
    WaitingCount,
    WeightGroupReq,
)
from engine.actors.request_timeline import RequestTimelines
from engine.actors.runtime import Actor
from engine.api import StepRecord
from engine.device import DeviceHandle, DeviceStream
from engine.errors import DistributedError, InvalidRequestError, WatchdogTimeoutError
from engine.model_executor.model_runner import GenerationBatchResult
from engine.recorder.events import describe_batch, describe_budget, describe_out, describe_stops
from engine.recorder.ring import FlightRecorder
from engine.scheduler.internal_state import check_internal_state, scheduler_state
from engine.scheduler.launched import LaunchedBatch, MemoryLeakError
from engine.scheduler.req import FinishReason, Req
from engine.scheduler.scheduler import Scheduler
from engine.scheduler.step import TimedResult, run_batch
from engine.scheduler.waiting_queue import PrefillPlan

log = logging.getLogger(__name__)


class SchedulerStuckError(RuntimeError):
    """The scheduler holds work it can neither launch nor wait on (an impossible state)."""


STEP_HISTORY = 4096  # StepRecords kept (Engine.recent_steps)


@dataclass
class InFlight:
    """A launched batch and the handle its result arrives on."""

    lb: LaunchedBatch
    handle: DeviceHandle[TimedResult]
    num_tokens: int  # tokens whose KV the forward writes (the batch object changes after launch)
    step: int  # the launch counter (the flight recorder's step)


# control messages answered with a ControlReply (an error one if handling them raises)
_CONTROL = (
    FlushCacheReq,
    GetInternalStateReq,
    SetInternalStateReq,
    UpdateWeightsReq,
    PauseGenerationReq,
    MemoryOccupationReq,
    WeightGroupReq,
    LoRAAdapterReq,
)


class OverlapScheduler(GenerationControlActions, LoRAControlActions, Actor):
    accepts = (
        AbortReq,
        StopStrMatched,
        FlushCacheReq,
        GetInternalStateReq,
        SetInternalStateReq,
        PrefillPlanReply,
        WaitingCount,
        UpdateWeightsReq,
        PauseGenerationReq,
        ContinueGenerationReq,
        MemoryOccupationReq,
        WeightGroupReq,
        LoRAAdapterReq,
        AbortAllReq,
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
        self.num_launched = 0  # batches launched so far (a step's number)
        self.recorder: FlightRecorder | None = None  # the flight recorder, when on
        self.timelines = RequestTimelines()
        self.on_forward: Callable[[int], None] | None = None  # called with num_forwards after each
        self._plan_ids = itertools.count()
        self._waiting_version = 0
        self._asked_plan = False  # this turn of run() waited for a plan (it suspended)
        self.control = GenerationControl(scheduler.args.weight_version)  # pause, weight updates

    # ---- main loop ----------------------------------------------------------------------------

    async def run(self) -> None:
        # Every turn must suspend somewhere, or the loop (and /health, and the watchdog) freezes:
        # finishing a forward does (its handle resolves through a loop callback), so does asking
        # the PrefillAdder for a plan (another task answers) and waiting for a message when idle.
        # A turn with none of these (a quiet turn) that still has work sees no new message and
        # no result; it may still change the scheduler's state once (retracting every running
        # request requeues them, and the next turn asks for a plan), but a second quiet turn in
        # a row would repeat itself forever: `_no_progress` crashes the actor instead (the
        # engine turns unhealthy, open requests end with the error).
        inflight: InFlight | None = None
        quiet = 0
        while True:
            for msg in self.drain():
                self.contain(self.handle_message, msg)
            finished = inflight is not None
            quiet_now = self.control.blocks_launch() or self.control.has_pending()
            if inflight is not None and (not self.enable_overlap or inflight.lb.needs_sync or quiet_now):
                await self._finish(inflight)
                inflight = None
            if inflight is None and quiet_now:
                await self.control_turn()
            self._asked_plan = False
            launched = None if self.control.blocks_launch() else await self._launch_next()
            if inflight is not None:
                await self._finish(inflight)
            inflight = launched
            if inflight is None and not self._has_work():
                self._check_idle_memory()
                self.contain(self.handle_message, await self.recv())
                quiet = 0
            elif inflight is None and not finished and not self._asked_plan:
                quiet += 1
                if quiet >= 2:
                    self._no_progress()
            else:
                quiet = 0

    async def _launch_next(self) -> InFlight | None:
        plan = None
        if (ask := self.begin_round()) is not None:
            self.adder.send(ask)
            self._asked_plan = True
            reply = await self.recv_matching(lambda m: isinstance(m, PrefillPlanReply) and m.reply_id == ask.reply_id)
            assert isinstance(reply, PrefillPlanReply)
            plan = self.take_plan(reply)
        placed = self.place_batch(plan)
        if placed is None:
            return None
        step, lb = placed
        mwb = lb.batch.get_model_worker_batch()
        return InFlight(lb, self.stream.launch(run_batch, self.sched.runner, mwb), int(mwb.out_cache_loc.numel()), step)

    def begin_round(self) -> PlanPrefillReq | None:
        """Start a round: the plan request for the PrefillAdder, or None (nothing to prefill)."""
        budget = self.sched.prefill_budget()
        if budget is not None and not self.control.admits_new():  # an update waits: only the chunk goes on
            budget = None if budget.chunked_req is None else msgspec.structs.replace(budget, max_new_reqs=0)
        if self.recorder is not None:
            self.recorder.round(describe_budget(budget))
        return None if budget is None else PlanPrefillReq(next(self._plan_ids), budget)

    def take_plan(self, reply: PrefillPlanReply) -> PrefillPlan:
        """The PrefillAdder's answer to this round's plan request (newer than any queue length)."""
        self._waiting_version = reply.version
        return reply.plan

    def place_batch(self, plan: PrefillPlan | None) -> tuple[int, LaunchedBatch] | None:
        """Finish the round: the batch to launch (and its step number), or None."""
        sched = self.sched
        batch = sched.next_batch(plan)
        requeue, aborted = self.hand_back()
        step = self.num_launched
        if self.recorder is not None:
            self.recorder.batch(
                step,
                batch=describe_batch(batch),
                requeued=[r.rid for r in requeue],
                self_aborted=[r.rid for r in aborted],
                num_retractions=sched.num_retractions,
                new_token_ratio=sched.new_token_ratio,
                available_tokens=sched.allocator.available_size(),
                evictable_tokens=sched.tree_cache.evictable_size(),
            )
        if batch is None:
            return None
        self.num_launched += 1
        self._checked_idle = False
        lb = sched.launched(batch)
        now = time.perf_counter()
        n = lb.num_extend  # MIXED: prefill rows first, then the running requests' decode rows
        if n:
            self.timelines.on_prefill(lb.reqs[:n], batch.extend_lens[:n], now)
        if n < len(lb.reqs):
            self.timelines.on_decode(lb.reqs[n:], now)
        return step, lb

    async def _finish(self, inflight: InFlight) -> None:
        lb, fut = inflight.lb, inflight.handle.future
        deadline = None if self.watchdog_timeout is None else lb.launched_at + self.watchdog_timeout
        while True:  # wait for the device, serving messages (aborts, control) meanwhile
            remaining = None if deadline is None else max(0.0, deadline - time.perf_counter())
            try:
                msg, done = await self.recv_or(fut, remaining)
            except TimeoutError:
                self._watchdog_fired(inflight)
            if msg is not None:
                self.contain(self.handle_message, msg)
            if done:
                break
        self.num_forwards += 1
        if self.on_forward is not None:
            self.on_forward(self.num_forwards)
        try:
            result, t0, t1 = fut.result()
        except Exception as e:  # a failed forward fails its requests, not the engine...
            log.exception("forward failed; failing %d request(s)", len(lb.reqs))
            self.fail_step(inflight.step, lb, e)
            if isinstance(e, DistributedError):  # ...unless a tensor-parallel rank is lost: then both
                raise
        else:
            self.steps.append(StepRecord(lb.mode.name, len(lb.reqs), inflight.num_tokens, t0, t1))
            self.complete_step(inflight.step, lb, result, t1 - t0)

    def complete_step(self, step: int, lb: LaunchedBatch, result: GenerationBatchResult, forward_s: float) -> None:
        """Batch `step`'s result: tokens, finishes and frees, then the output."""
        out = self.sched.process_batch_result(lb, result)
        if self.recorder is not None:
            ids, stops = result.next_token_ids_list(), describe_stops(lb.reqs, out)
            self.recorder.result(step, ids, forward_s, describe_out(out), result.accept_lens, stops)
        self.emit(out)

    def fail_step(self, step: int, lb: LaunchedBatch, error: BaseException) -> None:
        """Batch `step`'s forward raised (or hung): its requests end with the error."""
        out = self.sched.fail_batch(lb, error)
        if self.recorder is not None:
            self.recorder.fail(step, repr(error), describe_out(out))
        self.emit(out)

    def hand_back(self) -> tuple[list[Req], list[Req]]:
        """Send retracted requests back to the queue and report those the scheduler ended."""
        requeue, aborted = self.sched.take_requeue(), self.sched.take_self_aborted()
        if requeue:
            self.adder.send(RequeueReqs(requeue))
            self.timelines.on_retracted(requeue, time.perf_counter())
        if aborted:
            self.emit(BatchTokenOut.finished(aborted))
        return requeue, aborted

    def emit(self, out: BatchTokenOut) -> None:
        out.weight_version = self.control.weight_version
        if out.rids:
            self.output.send(out)
            self.timelines.on_output(out, time.perf_counter())

    def _watchdog_fired(self, inflight: InFlight) -> None:
        """A forward hangs: log every thread's stack, fail its requests, and die (the engine turns
        unhealthy, dumps the flight recorder; `on_crash` fails every other request held here)."""
        lb = inflight.lb
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
        self.fail_step(inflight.step, lb, error)
        raise error

    def _has_work(self) -> bool:
        control = self.control
        if control.pending_pause is not None or control.device_ops or control.update_ready(self.sched):
            return True  # the next turn's control_turn applies it
        return not control.blocks_launch() and not self.sched.is_idle()  # paused / released: wait

    def _no_progress(self) -> None:
        """Two turns in a row launched nothing, had nothing in flight and asked for no plan, yet
        work remains: nothing else can run until this task yields, so every later turn would be
        the same (e.g. `prepare_for_decode` failing after the room check said it fits)."""
        sched = self.sched
        raise SchedulerStuckError(
            "the scheduler has work but cannot launch a batch: "
            f"running={len(sched.running_batch.reqs)} waiting={sched.num_waiting} "
            f"chunked={sched.chunked_req is not None} available_tokens={sched.allocator.available_size()}"
        )

    def _check_idle_memory(self) -> None:
        """The memory invariant, on the busy -> idle edge. A violation means the scheduler's
        accounting is wrong: it crashes the actor (the engine turns unhealthy and the server
        restarts) rather than serving on with slots that leak, or that two requests may share."""
        if self._checked_idle or not self.sched.holds_nothing():
            return
        self._checked_idle = True
        self.sched.running_batch.filter_batch()
        try:
            self.sched.check_memory()
        except MemoryLeakError as e:
            self.memory_errors.append(str(e))  # kept for the state and the flight recorder's dump
            raise

    # ---- messages -----------------------------------------------------------------------------

    def handle_message(self, msg: msgspec.Struct) -> None:
        """One message other than a plan reply (those are awaited inside a round)."""
        if isinstance(msg, AbortReq):
            req = self.sched.abort_request(msg.rid, msg.message)
            if req is None:
                self.adder.send(msg)  # waiting (or over): the PrefillAdder decides
            else:
                self.emit(BatchTokenOut.finished([req]))
        elif isinstance(msg, StopStrMatched):  # the fallback (OutputProcessor): stop strings end in the step
            req = self.sched.abort_request(msg.rid, None, reason=FinishReason.STOP, matched=msg.matched)
            if req is None:  # waiting, or over (a request ends once: a finished one is held no more)
                self.adder.send(msg)
            else:  # its text has ended already: nothing to send, but the timeline ends too
                self.timelines.on_output(BatchTokenOut.finished([req]), time.perf_counter())
        elif isinstance(msg, WaitingCount):
            if msg.version > self._waiting_version:  # a count older than the last plan is stale
                self._waiting_version = msg.version
                self.sched.num_waiting = msg.num_waiting
        elif isinstance(msg, FlushCacheReq):
            ok = self.sched.flush_cache()
            self.replies.send(ControlReply(msg.reply_id, ok, error=None if ok else "requests are running"))
        elif isinstance(msg, GetInternalStateReq):
            state = scheduler_state(self.sched)
            state["memory_errors"] = list(self.memory_errors)
            if msg.detail:  # the dashboard's extras: a walk of the tree, copies of the timelines
                state["radix_top"] = msgspec.to_builtins(self.sched.tree_cache.top_prefixes())
                state["timelines"] = msgspec.to_builtins(self.timelines.snapshot())
                state["clock"] = time.perf_counter()
            self.replies.send(ControlReply(msg.reply_id, True, state))
        elif isinstance(msg, SetInternalStateReq):
            self.replies.send(self._set_state(msg))
        elif isinstance(msg, CONTROL_MESSAGES):
            self.handle_control(msg)
        elif isinstance(msg, LoRAAdapterReq):
            self.handle_lora(msg)
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
        return ControlReply(msg.reply_id, True, scheduler_state(self.sched))

    def on_message_error(self, msg: msgspec.Struct, exc: Exception) -> None:
        """A control call gets its error as the reply; anything else was logged and counted."""
        if isinstance(msg, _CONTROL):
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
