"""What the flight recorder writes: tagged msgspec Structs, one per event, and the summaries of
the scheduler's decisions that replay compares.

Two kinds of events, in one global order (every actor runs on one event loop, so a single
counter orders them):

* `RecvEvent`: a message an actor took out of its mailbox. Plain-data messages are stored as they
  are. The three that carry `Req` objects by reference (`PlanPrefillReq`, `PrefillPlanReply`,
  `RequeueReqs`) are stored as their summaries (`BudgetRec`, `PlanRec`, rids): replay rebuilds
  those objects itself and checks it built the same ones.
* Decisions, written where they are made: `RoundEvent` (the prefill budget a round starts with),
  `PlanEvent` (what the PrefillAdder admitted), `BatchEvent` (the batch the scheduler launched,
  with retractions and requeues), `ResultEvent` (the sampled tokens and what they finished, stop
  strings included), `FailEvent` (a forward raised).

A decision's summary is computed by the same function when recording and when replaying, so
"the same decision" means equal summaries.

What users sent: output text and logprobs are never recorded (`StrOutRec`, `TokenOutRec`). The
prompt's token ids, stop strings and grammar specs are recorded only with
`flight_recorder_record_prompts`; by default (`Header.prompts_recorded` False) `redact.py`
replaces them in `TokenizedGenerateReq`, `RegisterReq` and `StopStrMatched` with stand-in ids
that keep prefix sharing, and lengths.
"""

from __future__ import annotations

from typing import Any

import msgspec

from engine.actors.messages import (
    AbortAllReq,
    AbortReq,
    BatchStrOut,
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
    RegisterReq,
    RequeueReqs,
    SetInternalStateReq,
    StopStrMatched,
    TokenizedGenerateReq,
    UpdateWeightsReq,
    WaitingCount,
    WeightGroupReq,
)
from engine.scheduler.batch import ScheduleBatch
from engine.scheduler.req import Req
from engine.scheduler.waiting_queue import PrefillBudget, PrefillPlan

FORMAT_VERSION = 1


class Header(msgspec.Struct, frozen=True):
    """Everything replay needs to rebuild the scheduler: its options and its memory's shape."""

    format_version: int
    build: str  # the engine build that recorded (replay may run another one)
    created: float  # wall-clock time the recording started
    args: dict[str, Any]  # ServerArgs, as a dict
    vocab_size: int
    context_len: int
    eos_token_ids: list[int]
    req_pool_rows: int  # ReqToTokenPool(size, max_context_len)
    req_pool_width: int
    kv_pool_slots: int  # TokenToKVPoolAllocator(size, page_size): the constructor's size
    page_size: int
    enable_overlap: bool
    torch_threads: int | None = None
    # False: prompts are stand-in ids, stop strings and grammar specs their lengths (redact.py).
    # True by default because dumps written before the option had them.
    prompts_recorded: bool = True
    # Hybrid SWA memory (engine/cache/swa_pool.py): the SWA pool's constructor size and the window
    # it releases behind; 0: a plain pool.
    swa_pool_slots: int = 0
    swa_window: int = 0


# ---- summaries (compared by replay) -----------------------------------------------------------


class BudgetRec(msgspec.Struct, frozen=True, array_like=True):
    rem_total_tokens: int
    rem_input_tokens: int
    rem_chunk_tokens: int | None
    max_new_reqs: int
    chunked_rid: str | None
    in_flight_heads: int


class PlanRec(msgspec.Struct, frozen=True, array_like=True):
    rids: list[str]
    prefix_lens: list[int]
    extend_lens: list[int]
    new_chunked_rid: str | None
    hit_tokens: int
    input_tokens: int
    num_waiting: int


class BatchRec(msgspec.Struct, frozen=True, array_like=True):
    mode: str
    rids: list[str]
    seq_lens: list[int]
    extend_lens: list[int]
    num_tokens: int  # KV slots the forward writes


class OutRec(msgspec.Struct, frozen=True, array_like=True):
    rids: list[str]
    token_ids: list[int]
    finish_reasons: list[str | None]


# ---- recorded forms of the messages that carry Reqs --------------------------------------------


class PlanPrefillRec(msgspec.Struct, frozen=True, tag=True):
    reply_id: int
    budget: BudgetRec


class PrefillPlanReplyRec(msgspec.Struct, frozen=True, tag=True):
    reply_id: int
    plan: PlanRec
    version: int


class RequeueRec(msgspec.Struct, frozen=True, tag=True):
    rids: list[str]


class TokenOutRec(msgspec.Struct, frozen=True, tag=True):
    """A `BatchTokenOut` as the output processor received it, without logprobs (replay compares
    tokens and finishes; top logprobs would be most of a big batch's bytes)."""

    rids: list[str]
    token_ids: list[int]
    finish_reasons: list[str | None]


class StrOutRec(msgspec.Struct, frozen=True, tag=True):
    """A `BatchStrOut` without its text: users' outputs stay out of dump files (and it is the
    bulk of a step's bytes); replay needs none of it."""

    rids: list[str]
    chars: list[int]
    finish_reasons: list[str | None]


RecordedMsg = (
    TokenizedGenerateReq
    | AbortReq
    | StopStrMatched
    | FlushCacheReq
    | GetInternalStateReq
    | SetInternalStateReq
    | UpdateWeightsReq
    | PauseGenerationReq
    | MemoryOccupationReq
    | WeightGroupReq
    | LoRAAdapterReq
    | ContinueGenerationReq
    | AbortAllReq
    | ControlReply
    | PlanPrefillRec
    | PrefillPlanReplyRec
    | RequeueRec
    | WaitingCount
    | RegisterReq
    | TokenOutRec
    | StrOutRec
)


# ---- events ------------------------------------------------------------------------------------


class RecvEvent(msgspec.Struct, frozen=True, tag="recv", array_like=True):
    seq: int
    t: float
    actor: str
    msg: RecordedMsg


class RoundEvent(msgspec.Struct, frozen=True, tag="round", array_like=True):
    seq: int
    t: float
    budget: BudgetRec | None  # None: nothing to prefill this round


class PlanEvent(msgspec.Struct, frozen=True, tag="plan", array_like=True):
    seq: int
    t: float
    reply_id: int
    plan: PlanRec


class BatchEvent(msgspec.Struct, frozen=True, tag="batch", array_like=True):
    seq: int
    t: float
    step: int  # the scheduler's launch counter (a ResultEvent names it)
    batch: BatchRec | None  # None: nothing to run
    requeued: list[str]  # retracted (or planned but not placed), back to the waiting queue
    self_aborted: list[str]  # ended by the scheduler (can never fit)
    num_retractions: int  # the scheduler's running total
    new_token_ratio: float
    available_tokens: int  # the allocator's free slots after placing the batch
    evictable_tokens: int


class ResultEvent(msgspec.Struct, frozen=True, tag="result", array_like=True):
    seq: int
    t: float
    step: int
    token_ids: list[int]  # sampled, one per request of the batch, in batch order
    forward_s: float
    out: OutRec
    accepted: list[int] | None = None  # TARGET_VERIFY: drafts accepted per request
    # The scheduler's stop-string finishes: (rid, output length at the match). Replay applies them,
    # as it applies the sampled tokens: a redacted dump has no stop strings to check.
    stops: list[tuple[str, int]] | None = None


class FailEvent(msgspec.Struct, frozen=True, tag="fail", array_like=True):
    seq: int
    t: float
    step: int
    error: str
    out: OutRec


class ControlEvent(msgspec.Struct, frozen=True, tag="control", array_like=True):
    """A rollout control step of the scheduler actor, between forwards (generation_control.py):
    a pause taking hold, a memory or weight-group change or a weight update beginning and
    ending, with the device's error if it failed (a replay takes the recorded outcome)."""

    seq: int
    t: float
    action: str  # "pause", "memory", "group", "update"
    phase: str  # "begin", "end" (a pause: "end" only)
    error: str | None = None


Event = RecvEvent | RoundEvent | PlanEvent | BatchEvent | ResultEvent | FailEvent | ControlEvent


class Dump(msgspec.Struct, frozen=True):
    """A dump file: the header, why it was written, and the events in order."""

    header: Header
    reason: str
    dropped: int  # events the ring had already dropped (replay needs 0: a run from its start)
    events: list[Event]


# ---- summary functions (one definition for recording and replay) -------------------------------


def describe_budget(budget: PrefillBudget | None) -> BudgetRec | None:
    if budget is None:
        return None
    chunked = budget.chunked_req.rid if budget.chunked_req is not None else None
    return BudgetRec(
        budget.rem_total_tokens,
        budget.rem_input_tokens,
        budget.rem_chunk_tokens,
        budget.max_new_reqs,
        chunked,
        len(budget.in_flight_heads),
    )


def describe_plan(plan: PrefillPlan) -> PlanRec:
    return PlanRec(
        [r.rid for r in plan.reqs],
        [len(r.prefix_indices) for r in plan.reqs],
        [r.extend_input_len for r in plan.reqs],
        plan.new_chunked_req.rid if plan.new_chunked_req is not None else None,
        plan.hit_tokens,
        plan.input_tokens,
        plan.num_waiting,
    )


def describe_batch(batch: ScheduleBatch | None) -> BatchRec | None:
    if batch is None:
        return None
    loc = batch.out_cache_loc
    return BatchRec(
        batch.forward_mode.name,
        [r.rid for r in batch.reqs],
        list(batch.seq_lens_cpu),
        list(batch.extend_lens),
        int(loc.numel()) if loc is not None else 0,
    )


def describe_out(out: BatchTokenOut) -> OutRec:
    return OutRec(list(out.rids), list(out.token_ids), list(out.finish_reasons))


def describe_stops(reqs: list[Req], out: BatchTokenOut) -> list[tuple[str, int]] | None:
    """The requests of `reqs` that `out` ends on a stop string (the scheduler's own check), each
    with its output length at the match; None if none."""
    ended = {
        rid
        for rid, reason, m in zip(out.rids, out.finish_reasons, out.matched)
        if reason == "stop" and isinstance(m, str)
    }
    return [(r.rid, len(r.output_ids)) for r in reqs if r.rid in ended] or None


def recorded_form(msg: msgspec.Struct) -> msgspec.Struct:
    """`msg` as the recorder stores it: as is, or its summary when it carries `Req` objects (or a
    compiled grammar, which replay compiles again from the request's sampling params)."""
    if isinstance(msg, PlanPrefillReq):
        return PlanPrefillRec(msg.reply_id, describe_budget(msg.budget))  # type: ignore[arg-type]
    if isinstance(msg, PrefillPlanReply):
        return PrefillPlanReplyRec(msg.reply_id, describe_plan(msg.plan), msg.version)
    if isinstance(msg, RequeueReqs):
        return RequeueRec([r.rid for r in msg.reqs])
    if isinstance(msg, BatchTokenOut):
        return TokenOutRec(list(msg.rids), list(msg.token_ids), list(msg.finish_reasons))
    if isinstance(msg, BatchStrOut):
        deltas = msg.deltas
        return StrOutRec([d.rid for d in deltas], [len(d.text) for d in deltas], [d.finish_reason for d in deltas])
    if isinstance(msg, ControlReply) and msg.payload:  # state dumps (the dashboard polls them)
        return msgspec.structs.replace(msg, payload={})
    if isinstance(msg, UpdateWeightsReq) and msg.named_tensors is not None:  # names only, no values
        return msgspec.structs.replace(msg, named_tensors=[name for name, _ in msg.named_tensors])
    if isinstance(msg, TokenizedGenerateReq) and msg.grammar is not None:
        return msgspec.structs.replace(msg, grammar=None)
    return msg
