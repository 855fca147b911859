"""OverlapScheduler: the actor that owns the `Scheduler` and drives the device stream.

Event loop of one step (SGLang's overlap loop, on asyncio):
    handle queued messages -> plan batch N+1 -> launch it on the device stream ->
    await batch N's result (still handling messages: an abort frees memory mid-forward) ->
    process N's result (one step late) -> send tokens to the OutputProcessor.
With overlap off, or when a running request uses penalties (they need every previous token),
N's result is processed before N+1 is planned. Outputs are identical either way.
"""

from __future__ import annotations

import logging

from engine.actors.messages import (
    SCHEDULER_INPUTS, AbortReq, BatchTokenOut, ControlReply, FlushCacheReq, GetInternalStateReq,
    SetInternalStateReq, StopStrMatched, TokenizedGenerateReq,
)  # fmt: skip
from engine.actors.runtime import Actor
from engine.actors.scheduler import LaunchedBatch, MemoryLeakError, Scheduler, _append, _empty_out
from engine.device_stream import DeviceHandle, DeviceStream
from engine.scheduler.batch import FinishReason, Req
from engine.scheduler.batch import _has_penalties as has_penalties

log = logging.getLogger(__name__)

InFlight = tuple[LaunchedBatch, DeviceHandle]


class OverlapScheduler(Actor):
    accepts = SCHEDULER_INPUTS

    def __init__(self, scheduler: Scheduler, stream: DeviceStream, output: Actor, replies: Actor,
                 eos_ids: frozenset[int], enable_overlap: bool = True) -> None:  # fmt: skip
        super().__init__("scheduler")
        self.sched = scheduler
        self.stream = stream
        self.output = output  # OutputProcessor: BatchTokenOut
        self.replies = replies  # Receiver: ControlReply
        self.eos_ids = eos_ids
        self.enable_overlap = enable_overlap
        self.memory_errors: list[str] = []  # invariant violations seen when idle (tests read them)
        self._checked_idle = True

    # ---- main loop ----------------------------------------------------------------------------

    async def run(self) -> None:
        inflight: InFlight | None = None
        while True:
            for msg in self.drain():
                self._handle(msg)
            if inflight is not None and (not self.enable_overlap or self._needs_sync()):
                await self._finish(inflight)
                inflight = None
            launched = self._launch_next()
            if inflight is not None:
                await self._finish(inflight)
            inflight = launched
            if inflight is None and not self._has_work():
                self._check_idle_memory()
                self._handle(await self.recv())

    def _launch_next(self) -> InFlight | None:
        batch = self.sched.get_next_batch_to_run()
        aborted = self.sched.take_self_aborted()
        if aborted:
            self._send_finished(aborted)
        if batch is None:
            return None
        self._checked_idle = False
        lb = self.sched.launched(batch)
        handle = self.stream.launch(self.sched.runner.forward_batch_generation, batch.get_model_worker_batch())
        return lb, handle

    async def _finish(self, inflight: InFlight) -> None:
        lb, handle = inflight
        fut = handle.future
        while True:  # wait for the device, serving messages (aborts, new requests) meanwhile
            msg, done = await self.recv_or(fut)
            if msg is not None:
                self._handle(msg)
            if done:
                break
        try:
            result = fut.result()
        except Exception as e:  # a failed forward fails its requests, not the engine
            log.exception("forward failed; failing %d request(s)", len(lb.reqs))
            out = self.sched.fail_batch(lb, e)
        else:
            out = self.sched.process_batch_result(lb, result)
        if out.rids:
            self.output.send(out)

    def _needs_sync(self) -> bool:
        return any(has_penalties(r.sampling_params) for r in self.sched.running_batch.reqs)

    def _has_work(self) -> bool:
        s = self.sched
        return bool(s.waiting_queue) or s.chunked_req is not None or not s.running_batch.is_empty() or (
            s.last_batch is not None
        )

    def _check_idle_memory(self) -> None:
        if self._checked_idle:
            return
        self._checked_idle = True
        self.sched.last_batch = None
        self.sched.running_batch.filter_batch()
        try:
            self.sched.check_memory()
        except MemoryLeakError as e:
            self.memory_errors.append(str(e))

    # ---- messages -----------------------------------------------------------------------------

    def _handle(self, msg) -> None:
        if isinstance(msg, TokenizedGenerateReq):
            self._add(msg)
        elif isinstance(msg, AbortReq):
            req = self.sched.abort_request(msg.rid, msg.message)
            if req is not None:
                self._send_finished([req])
        elif isinstance(msg, StopStrMatched):
            self.sched.abort_request(msg.rid, None, reason=FinishReason.STOP, matched=msg.matched)
        elif isinstance(msg, FlushCacheReq):
            ok = self.sched.flush_cache()
            self.replies.send(ControlReply(msg.reply_id, ok, error=None if ok else "requests are running"))
        elif isinstance(msg, GetInternalStateReq):
            state = self.sched.internal_state()
            state["memory_errors"] = list(self.memory_errors)
            self.replies.send(ControlReply(msg.reply_id, True, state))
        elif isinstance(msg, SetInternalStateReq):
            self.replies.send(self._set_state(msg))

    def _add(self, msg: TokenizedGenerateReq) -> None:
        sched = self.sched
        req = Req(
            msg.rid, msg.input_ids, msg.sampling_params, seed=msg.seed, eos_token_ids=self.eos_ids,
            max_context_len=sched.runner.context_len, return_logprob=msg.return_logprob,
            top_logprobs_num=msg.top_logprobs_num,
        )  # fmt: skip
        if len(msg.input_ids) + sched.page_size > sched.allocator.size:
            req.abort(f"the prompt has {len(msg.input_ids)} tokens but the KV cache pool holds only "
                      f"{sched.allocator.size}; it can never fit")  # fmt: skip
            self._send_finished([req])
            return
        sched.add_request(req)

    def _set_state(self, msg: SetInternalStateReq) -> ControlReply:
        allowed = {"max_running_requests", "new_token_ratio"}
        bad = set(msg.state) - allowed
        if bad:
            return ControlReply(msg.reply_id, False, error=f"cannot set {sorted(bad)}; settable: {sorted(allowed)}")
        if "max_running_requests" in msg.state:
            n = int(msg.state["max_running_requests"])
            self.sched.max_running_requests = max(1, min(n, self.sched.req_to_token_pool.size))
        if "new_token_ratio" in msg.state:
            self.sched.new_token_ratio = float(msg.state["new_token_ratio"])
        return ControlReply(msg.reply_id, True, self.sched.internal_state())

    def _send_finished(self, reqs: list[Req]) -> None:
        out: BatchTokenOut = _empty_out()
        for req in reqs:
            _append(out, req, -1, req.finished_reason, None, None)
        self.output.send(out)

    async def on_crash(self, exc: BaseException) -> None:
        """The scheduler itself broke: every request it owned ends with an error."""
        reqs = list(self.sched.reqs_by_rid.values())
        for req in reqs:
            req.abort(f"engine error: {exc!r}")
        if reqs and self.output.running:
            self._send_finished(reqs)
