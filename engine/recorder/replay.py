"""Deterministic replay of a flight-recorder dump, without the model.

The scheduler's decisions are a function of the messages its two actors received, in the order
they received them, and of the tokens the model sampled. A dump has all of that (engine/recorder/
events.py), so replay rebuilds the same `Scheduler`, `OverlapScheduler` and `PrefillAdderActor`
(not started: no event loop, no device) from the recorded options and memory shape (the model
runner's stand-in, with the LoRA pool's slots when adapters were served: recorder/stand_in.py),
and walks the events in order:

* a message the scheduler or the PrefillAdder received is handed to its `handle_message`. Messages
  from outside the two (new requests, aborts, control calls, queue lengths) are taken from the
  dump; those one of them sent the other (plan requests and replies, requeues, forwarded aborts)
  are taken from what the replayed actor sent, after checking they match the recording;
* a recorded decision makes the replayed actor take the same step (`begin_round`, `place_batch`,
  `complete_step` with the recorded tokens: the stand-in model, and the recorded stop-string
  finishes: the stand-in tokenizer; `fail_step`), and the decision it records must equal the
  recorded one;
* a `BatchTokenOut` the output processor received must be one the replayed actors sent;
* a rollout control (pause, weight update, memory release or resume, weight-group join) is queued
  as the scheduler actor queued it, and each `ControlEvent` makes it take the same step between
  forwards (engine/actors/generation_control.py `replay_control`), the device's outcome (an
  update that failed, and why) taken from the recording as the sampled tokens are.

A dump recorded without prompts (the default: `Header.prompts_recorded` False) replays the same:
its stand-in prompt ids share exactly the page-aligned prefixes the real prompts shared
(recorder/redact.py), and the scheduler looks at prompts only to match prefixes and count them.
What it cannot replay: a grammar (only its length is recorded: a `ReplayError`); a radix hit
that runs on into an earlier request's output tokens (multi-turn chat: stand-in ids never equal
real ones); speculative decoding's drafts looked up in the prompt (stand-in ids never repeat).
The first such difference is a divergence; record prompts to replay those.

The first difference is a `Divergence`, reported with the events before it. Replay runs the
scheduler code of the build it runs in, so a dump from another build checks a scheduler change.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections import deque
from typing import Any

import msgspec
import torch

from engine.actors.messages import (
    AbortAllReq,
    AbortReq,
    LoRAAdapterReq,
    PrefillPlanReply,
    StopStrMatched,
    TokenizedGenerateReq,
)
from engine.actors.overlap_scheduler import OverlapScheduler
from engine.actors.prefill_adder import PrefillAdderActor
from engine.constrained import GrammarBackend
from engine.errors import InvalidRequestError
from engine.model_executor.model_runner import GenerationBatchResult
from engine.models.loader import resolve_model
from engine.recorder.events import (
    BatchEvent,
    ControlEvent,
    Dump,
    FailEvent,
    Header,
    OutRec,
    PlanEvent,
    PlanPrefillRec,
    PrefillPlanReplyRec,
    RecvEvent,
    RequeueRec,
    ResultEvent,
    RoundEvent,
    TokenOutRec,
    describe_out,
    recorded_form,
)
from engine.recorder.ring import FlightRecorder, load_dump
from engine.recorder.stand_in import stand_in_runner
from engine.sampling import SamplerOutput
from engine.scheduler.launched import LaunchedBatch
from engine.scheduler.scheduler import Scheduler
from engine.server_args import ServerArgs

log = logging.getLogger(__name__)

SCHEDULER, ADDER, OUTPUT = "scheduler", "prefill_adder", "output_processor"
DECISIONS = (RoundEvent, PlanEvent, BatchEvent, ResultEvent, FailEvent, ControlEvent)


class ReplayError(Exception):
    """The dump cannot be replayed at all (truncated, another format, a grammar that will not
    compile here): not a divergence, a reason replay could not check anything past some point."""


@dataclasses.dataclass
class Divergence:
    """The first point where the replayed scheduler did not do what the recording says."""

    index: int  # position in the dump's events
    what: str
    recorded: Any
    replayed: Any
    context: list[Any]  # the events before it

    def describe(self) -> str:
        lines = [f"divergence at event {self.index}: {self.what}"]
        lines.append(f"  recorded: {_show(self.recorded)}")
        lines.append(f"  replayed: {_show(self.replayed)}")
        if isinstance(self.recorded, msgspec.Struct) and isinstance(self.replayed, msgspec.Struct):
            for field in self.recorded.__struct_fields__:
                a, b = getattr(self.recorded, field), getattr(self.replayed, field, None)
                if field not in ("seq", "t") and a != b:
                    lines.append(f"    {field}: recorded {_show(a)} != replayed {_show(b)}")
        lines.append(f"  the {len(self.context)} events before it:")
        lines.extend(f"    {_show(e)}" for e in self.context)
        return "\n".join(lines)


@dataclasses.dataclass
class ReplayReport:
    events: int
    decisions: int  # decisions compared
    steps: int  # batches launched
    requests: int
    build: str  # the build that recorded
    divergence: Divergence | None

    @property
    def ok(self) -> bool:
        return self.divergence is None


class _Outbox:
    """Stands in for a mailbox a replayed actor sends to: keeps what it sent, in order."""

    def __init__(self) -> None:
        self.sent: deque[msgspec.Struct] = deque()
        self.running = True

    def send(self, msg: msgspec.Struct) -> None:
        self.sent.append(msg)


class _DecisionLog(FlightRecorder):
    """The replayed actors' recorder: keeps their decisions as Structs, to compare."""

    def __init__(self, header: Header) -> None:
        super().__init__(1, header, os.devnull)
        self.produced: deque[msgspec.Struct] = deque()

    def _put(self, event: msgspec.Struct) -> None:
        self.produced.append(event)


def _server_args(header: Header, overrides: dict[str, Any]) -> ServerArgs:
    known = {f.name for f in dataclasses.fields(ServerArgs)}
    values = {k: v for k, v in header.args.items() if k in known}  # a newer/older build's extras go
    unknown = set(overrides) - known
    if unknown:
        raise ReplayError(f"unknown server options: {', '.join(sorted(unknown))}")
    return ServerArgs(**{**values, **overrides})


class Replayer:
    """Replays one dump; `run()` returns the report (the first divergence, if any)."""

    def __init__(self, dump: Dump, overrides: dict[str, Any] | None = None, context: int = 8) -> None:
        if dump.dropped:
            raise ReplayError(
                f"the dump starts mid-run: the ring had dropped its first {dump.dropped} events; replay needs "
                "a recording from the engine's start (raise --flight-recorder-size)"
            )
        self.dump, self.context = dump, context
        header = dump.header
        args = _server_args(header, overrides or {})
        self.sched = Scheduler(stand_in_runner(header, args), args)  # type: ignore[arg-type]
        self.actor = OverlapScheduler(self.sched, None, header.enable_overlap)  # type: ignore[arg-type]
        alloc = self.sched.allocator
        self.adder = PrefillAdderActor(
            self.sched.new_planner(), frozenset(header.eos_token_ids), header.context_len, alloc.size
        )
        self.log = _DecisionLog(header)
        self.actor.recorder = self.adder.recorder = self.log
        self.to_adder, self.to_scheduler = _Outbox(), _Outbox()
        self.sched_out, self.adder_out = _Outbox(), _Outbox()
        self.actor.adder, self.actor.output, self.actor.replies = self.to_adder, self.sched_out, _Outbox()  # type: ignore[assignment]
        self.adder.scheduler, self.adder.output = self.to_scheduler, self.adder_out  # type: ignore[assignment]
        self.plan = None
        self.launched: dict[int, LaunchedBatch] = {}
        self.rids: set[str] = set()
        self.decisions = 0
        self._grammars: GrammarBackend | None = None

    # ---- the walk -----------------------------------------------------------------------------

    def run(self) -> ReplayReport:
        divergence = None
        for i, event in enumerate(self.dump.events):
            problem = self._step(event)
            if problem is not None:
                what, recorded, replayed = problem
                before = self.dump.events[max(0, i - self.context) : i]
                divergence = Divergence(i, what, recorded, replayed, list(before))
                break
        if divergence is None and self.log.produced:
            extra = self.log.produced[0]
            divergence = Divergence(len(self.dump.events), "a decision the recording does not have", None, extra, [])
        return ReplayReport(
            len(self.dump.events),
            self.decisions,
            len(self.launched),
            len(self.rids),
            self.dump.header.build,
            divergence,
        )

    def _step(self, event: Any) -> tuple[str, Any, Any] | None:
        if isinstance(event, RecvEvent):
            return self._recv(event.actor, event.msg)
        if isinstance(event, RoundEvent):
            ask = self.actor.begin_round()
            if ask is not None:
                self.to_adder.send(ask)
        elif isinstance(event, BatchEvent):
            plan, self.plan = self.plan, None
            placed = self.actor.place_batch(plan)
            if placed is not None:
                self.launched[placed[0]] = placed[1]
        elif isinstance(event, (ResultEvent, FailEvent)):
            lb = self.launched.get(event.step)
            if lb is None:
                return "a result for a batch replay never launched", event, None
            if isinstance(event, FailEvent):
                self.actor.fail_step(event.step, lb, RuntimeError(event.error))
            elif len(event.token_ids) != len(lb.reqs):
                return "the recorded tokens do not fit the replayed batch", event, [r.rid for r in lb.reqs]
            else:
                for rid, at in event.stops or ():
                    req = next((r for r in lb.reqs if r.rid == rid), None)
                    if req is None:
                        return "a stop-string finish of a request not in the batch", event, [r.rid for r in lb.reqs]
                    req.stop_check = RecordedStop(at)
                self.actor.complete_step(
                    event.step, lb, _stand_in_result(event.token_ids, event.accepted), event.forward_s
                )
        elif isinstance(event, ControlEvent):
            if not self._control_expected(event):
                return "a control step the replayed scheduler has nothing for", event, None
            self.actor.replay_control(event.action, event.phase, event.error)
        # PlanEvent: produced while handling the PlanPrefillReq before it
        return self._compare(event)

    def _control_expected(self, event: ControlEvent) -> bool:
        """Whether the replayed scheduler has the step the recording took queued (a pause,
        a memory/group change, a ready update), so taking it cannot fail in the actor."""
        control = self.actor.control
        if event.phase == "end" and event.action != "pause":
            return self.actor.replaying_control() is not None
        if event.action == "pause":
            return control.pending_pause is not None
        if event.action == "update":
            return control.update_ready(self.sched)
        return bool(control.device_ops)

    def _compare(self, event: Any) -> tuple[str, Any, Any] | None:
        self.decisions += 1
        produced = self.log.produced.popleft() if self.log.produced else None
        if produced is None or _strip(produced) != _strip(event):
            return f"a different {type(event).__name__.removesuffix('Event').lower()} decision", event, produced
        return None

    def _recv(self, actor: str, msg: msgspec.Struct) -> tuple[str, Any, Any] | None:
        if actor == ADDER:
            if isinstance(msg, TokenizedGenerateReq):
                self.rids.add(msg.rid)
                if msg.lora_path is not None:
                    self.sched.runner.lora.registry.learn(msg.lora_path, msg.lora_key)
                self.adder.handle_message(self._with_grammar(msg))
                return None
            if isinstance(msg, (PlanPrefillRec, RequeueRec, AbortReq, StopStrMatched, AbortAllReq)):
                return self._internal(self.to_adder, msg, self.adder.handle_message)
        elif actor == SCHEDULER:
            if isinstance(msg, PrefillPlanReplyRec):

                def take(reply: msgspec.Struct) -> None:
                    assert isinstance(reply, PrefillPlanReply)
                    self.plan = self.actor.take_plan(PrefillPlanReply(reply.reply_id, reply.plan, msg.version))

                return self._internal(self.to_scheduler, msg, take)
            if isinstance(msg, LoRAAdapterReq):
                self._lora(msg)
                return None
            self.actor.handle_message(msg)  # a rollout control is queued; its ControlEvents apply it
        elif actor == OUTPUT and isinstance(msg, TokenOutRec):
            recorded = OutRec(msg.rids, msg.token_ids, msg.finish_reasons)
            for box in (self.sched_out, self.adder_out):
                if box.sent and describe_out(box.sent[0]) == recorded:  # type: ignore[arg-type]
                    box.sent.popleft()
                    return None
            heads = [describe_out(b.sent[0]) for b in (self.sched_out, self.adder_out) if b.sent]  # type: ignore[arg-type]
            return "output the replayed actors did not send", recorded, heads
        return None

    def _lora(self, msg: LoRAAdapterReq) -> None:
        """A run-time adapter load or unload, as the scheduler actor takes it (lora_control.py):
        a load only names the adapter (requests name it after the reply); an unload frees its
        cached prefixes and slot now, or is refused as it was live (an adapter in use)."""
        lora = self.sched.runner.lora
        if lora is None:
            return  # refused live: LoRA off
        if msg.action == "load":
            lora.registry.add(msg.name)
        elif msg.action == "unload":
            try:
                self.sched.lora.unload(msg.name, self.sched.reqs_by_rid.values(), self.sched.tree_cache)
            except InvalidRequestError:
                pass

    def _internal(self, box: _Outbox, recorded: msgspec.Struct, handle: Any) -> tuple[str, Any, Any] | None:
        """A message one replayed actor sent the other: it must be the one the recording has."""
        sent = box.sent.popleft() if box.sent else None
        if sent is None or _strip_msg(recorded_form(sent)) != _strip_msg(recorded):
            return f"a different {type(recorded).__name__} between the actors", recorded, sent and recorded_form(sent)
        handle(sent)
        return None

    def _with_grammar(self, msg: TokenizedGenerateReq) -> TokenizedGenerateReq:
        spec = msg.sampling_params.grammar_spec()
        if spec is None:
            return msg
        if not self.dump.header.prompts_recorded:
            # Its spec is only a length in the dump: the grammar's finishes cannot be rebuilt.
            raise ReplayError(
                f"request {msg.rid} has a grammar, and the dump has only its length (recorded without "
                "--flight-recorder-record-prompts)"
            )
        if self._grammars is None:
            header = self.dump.header
            try:
                tokenizer = resolve_model(str(header.args["model_path"])).load_tokenizer()
            except Exception as e:
                raise ReplayError(
                    f"request {msg.rid} has a grammar, and the model's tokenizer cannot be loaded: {e}"
                ) from e
            self._grammars = GrammarBackend(tokenizer, header.vocab_size, frozenset(header.eos_token_ids))
        return msgspec.structs.replace(msg, grammar=self._grammars.compile(*spec))


class RecordedStop:
    """A recorded stop-string finish, as a request's `stop_check`: the stop string completes when
    its output reaches `at` tokens (the recorded decision stands in for the tokenizer, as the
    recorded tokens stand in for the model; the stop strings themselves may be redacted)."""

    def __init__(self, at: int) -> None:
        self.at = at

    def check(self, req: Any) -> str | None:
        return "<recorded stop string>" if len(req.output_ids) == self.at else None


def _stand_in_result(token_ids: list[int], accepted: list[int] | None = None) -> GenerationBatchResult:
    """The stand-in model: the recorded tokens (and accepted drafts), as a forward's result."""
    ids = torch.tensor(token_ids, dtype=torch.int64)
    return GenerationBatchResult(ids, SamplerOutput(ids), accept_lens=accepted)


def _strip(event: msgspec.Struct) -> msgspec.Struct:
    return msgspec.structs.replace(event, seq=0, t=0.0)


def _strip_msg(msg: msgspec.Struct) -> msgspec.Struct:
    # A plan reply's version counts WaitingCount messages, which only a running PrefillAdder sends.
    return msgspec.structs.replace(msg, version=0) if isinstance(msg, PrefillPlanReplyRec) else msg


def _show(value: Any, limit: int = 600) -> str:
    """One line for a report: a Struct's type and set fields, long lists cut to their head."""
    text = _fmt(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _fmt(value: Any) -> str:
    if isinstance(value, msgspec.Struct):
        fields = ((f, getattr(value, f)) for f in value.__struct_fields__ if f != "seq")
        shown = ", ".join(f"{f}={_fmt(v)}" for f, v in fields if v not in (None, [], {}, ""))
        return f"{type(value).__name__}({shown})"
    if isinstance(value, (list, tuple)):
        more = f", ... {len(value)} in all" if len(value) > 8 else ""
        return "[" + ", ".join(_fmt(v) for v in value[:8]) + more + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_fmt(v)}" for k, v in value.items()) + "}"
    if isinstance(value, float):
        return f"{value:.6g}"
    return repr(value)


def replay(dump: Dump | bytes | str | os.PathLike[str], overrides: dict[str, Any] | None = None) -> ReplayReport:
    """Replay a dump (a `Dump`, its bytes or its path) with this build's scheduler."""
    loaded = dump if isinstance(dump, Dump) else load_dump(dump)
    return Replayer(loaded, overrides).run()


__all__ = ["Divergence", "ReplayError", "ReplayReport", "Replayer", "replay"]
