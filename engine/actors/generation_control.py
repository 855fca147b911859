"""Pause / continue and weight updates: the RL rollout controls the scheduler actor obeys.

SGLang's semantics, decided here, where the scheduler's data lives:

- **pause_generation** takes effect at the next point where no forward is in flight (the forward
  running when it arrives completes and its tokens are delivered); then, by mode:
  `abort` ends every request (running and waiting), `retract` sends the running requests back to
  the waiting queue (their KV freed; on continue they are prefilled again over prompt + output so
  far, so no token is lost or repeated), `in_place` keeps them and their KV. The reply comes once
  the pause holds. While paused nothing is launched; new requests wait in the queue.
  **continue_generation** lifts it.
- **A weight update** waits until no request holds memory: without a pause, requests already
  admitted run to their end while new ones wait in the queue (SGLang's update lock: an update
  never lands in the middle of a request); `abort_all_requests` ends everything first instead.
  While paused it applies at once; requests paused `in_place` are retracted first, because their
  KV belongs to the old weights and is never reused under the new ones. Their tokens from before
  the update keep the old version, and each output says so (`weight_versions`: more than one).
  The update runs on the device stream (the forward's thread), between forwards; a failed one
  changes nothing and says why. Then the prefix cache is flushed (`flush_cache`, default on:
  cached KV belongs to the old weights) and the version moves on.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any

from engine.actors.messages import (
    AbortAllReq,
    BatchTokenOut,
    ContinueGenerationReq,
    ControlReply,
    MemoryOccupationReq,
    PauseGenerationReq,
    UpdateWeightsReq,
    WeightGroupReq,
)
from engine.errors import InvalidRequestError
from engine.scheduler.batch import ScheduleBatch
from engine.scheduler.req import Req
from engine.scheduler.scheduler import Scheduler

log = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "retract", "in_place")
MEMORY_TAGS = ("kv_cache", "weights")
# what GenerationControlActions.handle_control takes
CONTROL_MESSAGES = (
    UpdateWeightsReq,
    PauseGenerationReq,
    ContinueGenerationReq,
    MemoryOccupationReq,
    WeightGroupReq,
    AbortAllReq,
)


def check_memory_tags(tags: list[str] | None) -> list[str]:
    """SGLang's tags (None: both), checked before anything is sent."""
    if tags is None:
        return list(MEMORY_TAGS)
    bad = [t for t in tags if t not in MEMORY_TAGS]
    if bad or not tags:
        raise InvalidRequestError(f"tags must be a non-empty list of {', '.join(MEMORY_TAGS)}; got {tags!r}", "tags")
    return list(dict.fromkeys(tags))


def check_pause_mode(mode: str) -> str:
    if mode not in PAUSE_MODES:
        raise InvalidRequestError(f"mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}", "mode")
    return mode


class GenerationControl:
    """The pause state, the updates waiting to run and the weight version, owned by the
    OverlapScheduler (which asks it what a turn may do)."""

    def __init__(self, weight_version: str) -> None:
        self.paused: str | None = None  # the mode in force
        self.pending_pause: PauseGenerationReq | None = None  # applied at the next quiet point
        self.updates: deque[UpdateWeightsReq] = deque()
        self.weight_version = weight_version
        self.num_updates = 0
        # memory release / resume and weight-group joins, applied at the next quiet point
        self.device_ops: deque[MemoryOccupationReq | WeightGroupReq] = deque()
        self.released: set[str] = set()  # tags whose memory is released now
        # the version of the checkpoint last loaded from disk: what resuming released weights
        # brings back (weights from tensors since then are not kept)
        self.disk_version = weight_version

    def blocks_launch(self) -> bool:
        """Nothing new is launched while paused, released, or about to be."""
        return self.paused is not None or self.pending_pause is not None or bool(self.released or self.device_ops)

    def has_pending(self) -> bool:
        return bool(self.updates or self.device_ops)

    def admits_new(self) -> bool:
        """Whether a plan may admit waiting requests (not while an update waits for the running
        ones to end: the chunked request still completes, it holds memory)."""
        return not self.updates

    def update_ready(self, sched: Scheduler) -> bool:
        return bool(self.updates) and (self.paused is not None or bool(self.released) or sched.holds_nothing())

    def next_version(self, msg: UpdateWeightsReq) -> str:
        self.num_updates += 1
        self.weight_version = msg.weight_version if msg.weight_version is not None else str(self.num_updates)
        if msg.model_path is not None:
            self.disk_version = self.weight_version
            self.released.discard("weights")  # a checkpoint loaded is weights resumed
        return self.weight_version


def abort_all_held(sched: Scheduler, message: str) -> list[Req]:
    """End every request the scheduler holds (freed now); the caller reports them and tells the
    PrefillAdder to end the waiting ones."""
    reqs = [sched.abort_request(rid, message) for rid in list(sched.reqs_by_rid)]
    return [r for r in reqs if r is not None]


def retract_all(sched: Scheduler) -> None:
    """Send every request holding memory back to the waiting queue (with nothing in flight); the
    caller hands `sched.take_requeue()` to the PrefillAdder."""
    sched.prefill_budget()  # merges the last prefill batch into the running batch
    chunked = sched.chunked_req
    if chunked is not None:
        sched.chunked_req = None
        alone = ScheduleBatch.init_new(
            [chunked], sched.req_to_token_pool, sched.allocator, sched.tree_cache, sched.vocab_size
        )
        sched.retract_one(alone)
    while sched.running_batch.reqs:
        sched.retract_one(sched.running_batch)


class RecordedError(Exception):
    """A control step's failure as a flight recording has it ("Type: message"), for its replay."""


class GenerationControlActions:
    """The scheduler actor's side of these controls (a base class of OverlapScheduler, which
    provides `sched`, `stream`, `control`, `recorder`, the mailboxes and `emit` / `hand_back`)."""

    _replaying: Any = None  # the control step a replay has begun

    def handle_control(
        self, msg: UpdateWeightsReq | PauseGenerationReq | ContinueGenerationReq | MemoryOccupationReq | AbortAllReq
    ) -> None:
        control = self.control
        if isinstance(msg, (MemoryOccupationReq, WeightGroupReq)):
            control.device_ops.append(msg)
        elif isinstance(msg, UpdateWeightsReq):
            if msg.abort_all_requests:
                self.abort_all("aborted for a weight update")
            control.updates.append(msg)
        elif isinstance(msg, PauseGenerationReq):
            if control.pending_pause is not None:  # the newer mode wins; the older call returns too
                self.replies.send(ControlReply(control.pending_pause.reply_id, True, {"mode": msg.mode}))
            control.pending_pause = msg
        elif isinstance(msg, ContinueGenerationReq):
            control.paused = None
            self.replies.send(ControlReply(msg.reply_id, True))
        else:
            self.abort_all(msg.message)

    async def control_turn(self) -> None:
        """With nothing in flight: apply a pending pause, then the memory and weight-group
        changes, then the updates that may run now. Each step is recorded as it begins and ends
        (`ControlEvent`: a replay takes the same steps with the recorded outcomes, `replay_control`)."""
        control, sched = self.control, self.sched
        if control.pending_pause is not None:
            self.apply_pause()
        while control.device_ops:
            op = self.begin_device_op()
            runner = sched.runner
            if isinstance(op, MemoryOccupationReq):
                fn = runner.release_memory_occupation if op.release else runner.resume_memory_occupation
                error = await self.on_device(fn, tuple(op.tags))
            elif op.action == "init":
                error = await self.on_device(runner.init_weights_update_group, **op.params)
            else:
                error = await self.on_device(runner.destroy_weights_update_group, **op.params)
            self.end_device_op(op, error)
        while control.update_ready(sched):
            msg = self.begin_update()
            if msg.model_path is not None:
                error = await self.on_device(sched.runner.update_weights_from_disk, msg.model_path)
            elif msg.from_group is not None:
                error = await self.on_device(sched.runner.update_weights_from_distributed, **msg.from_group)
            else:
                error = await self.on_device(sched.runner.update_weights_from_tensor, list(msg.named_tensors or ()))
            self.end_update(msg, error)

    def replay_control(self, action: str, phase: str, error: str | None) -> None:
        """A recorded control step taken again without the device: its outcome is the recorded one
        (engine/recorder/replay.py)."""
        failed = None if error is None else RecordedError(error)
        if action == "pause":
            self.apply_pause()
        elif action == "update":
            if phase == "begin":
                self._replaying = self.begin_update()
            else:
                msg, self._replaying = self._replaying, None
                self.end_update(msg, failed)
        elif phase == "begin":
            self._replaying = self.begin_device_op()
        else:
            op, self._replaying = self._replaying, None
            self.end_device_op(op, failed)

    def replaying_control(self) -> MemoryOccupationReq | WeightGroupReq | UpdateWeightsReq | None:
        """The step `replay_control` has begun and not yet ended."""
        return self._replaying

    def _record(self, action: str, phase: str, error: Exception | None = None) -> None:
        if self.recorder is not None:
            if error is not None and not isinstance(error, RecordedError):
                error = RecordedError(f"{type(error).__name__}: {error}")
            self.recorder.control(action, phase, None if error is None else str(error))

    def apply_pause(self) -> None:
        control = self.control
        pause = control.pending_pause
        assert pause is not None
        control.pending_pause, control.paused = None, pause.mode
        if pause.mode == "abort":
            self.abort_all("generation paused (mode=abort)")
        elif pause.mode == "retract":
            retract_all(self.sched)
            self.hand_back()
        self._record("pause", "end")
        self.replies.send(ControlReply(pause.reply_id, True, {"mode": pause.mode}))

    def begin_device_op(self) -> MemoryOccupationReq | WeightGroupReq:
        """The next memory or weight-group change; a release first retracts every request and
        drops every cached prefix (the KV it names is freed, or belongs to weights that may come
        back different)."""
        op = self.control.device_ops.popleft()
        if isinstance(op, MemoryOccupationReq) and op.release:
            if not self.sched.holds_nothing():
                retract_all(self.sched)
                self.hand_back()
            self.sched.flush_cache(waiting_ok=True)
        self._record("memory" if isinstance(op, MemoryOccupationReq) else "group", "begin")
        return op

    def end_device_op(self, op: MemoryOccupationReq | WeightGroupReq, error: Exception | None) -> None:
        """Its outcome: the released tags (or the weight version resumed) and the reply."""
        control = self.control
        self._record("memory" if isinstance(op, MemoryOccupationReq) else "group", "end", error)
        error_type = type(error).__name__ if error else None
        if isinstance(op, WeightGroupReq):
            payload: dict = {"error_type": error_type}
        else:
            tags = tuple(op.tags)
            if error is None and op.release:
                control.released.update(tags)
            elif error is None:
                if "weights" in tags and "weights" in control.released:
                    control.weight_version = control.disk_version
                control.released.difference_update(tags)
            what = "released" if op.release else "resumed"
            log.info("memory %s: %s (released now: %s)", what, ", ".join(tags), sorted(control.released) or "nothing")
            payload = {"released": sorted(control.released), "error_type": error_type}
        reply = ControlReply(op.reply_id, error is None, payload, error=None if error is None else str(error))
        self.replies.send(reply)

    def begin_update(self) -> UpdateWeightsReq:
        """The next weight update; requests paused in place are retracted first (their KV is the
        old weights')."""
        if not self.sched.holds_nothing():
            retract_all(self.sched)
            self.hand_back()
        self._record("update", "begin")
        return self.control.updates.popleft()

    def end_update(self, msg: UpdateWeightsReq, error: Exception | None) -> None:
        """The prefix cache flushed and the version moved on, or (failed: nothing was swapped) the
        old weights serve on; then the reply."""
        self._record("update", "end", error)
        if error is not None:
            log.warning("weight update failed; the weights are unchanged: %s", error)
            payload = {"error_type": type(error).__name__, "weight_version": self.control.weight_version}
            self.replies.send(ControlReply(msg.reply_id, False, payload, error=str(error)))
            return
        if msg.flush_cache:
            self.sched.flush_cache(waiting_ok=True)
        version = self.control.next_version(msg)
        log.info("weights updated (%s); weight_version=%s", msg.model_path or "from tensors", version)
        self.replies.send(ControlReply(msg.reply_id, True, {"weight_version": version}))

    async def on_device(self, fn, *args, **kwargs) -> Exception | None:
        """Run `fn(*args, **kwargs)` on the device stream (between forwards), serving messages meanwhile;
        the exception it raised, if any."""
        handle = self.stream.launch(fn, *args, **kwargs)
        while True:
            got, done = await self.recv_or(handle.future)
            if got is not None:
                self.contain(self.handle_message, got)
            if done:
                break
        try:
            handle.future.result()
        except Exception as e:
            return e
        return None

    def abort_all(self, message: str) -> None:
        """End every request: those held here now, the waiting ones in the PrefillAdder."""
        self.emit(BatchTokenOut.finished(abort_all_held(self.sched, message)))
        self.adder.send(AbortAllReq(message))
