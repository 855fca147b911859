"""Messages between the engine's actors: tagged msgspec Structs, one mailbox union per actor.

Flow (SGLang's names where they exist):

    Engine -> Receiver.submit --TokenizedGenerateReq, AbortReq, control--> Dispatcher
    Dispatcher: TokenizedGenerateReq -> PrefillAdderActor
                AbortReq, StopStrMatched, FlushCacheReq, Get/SetInternalStateReq,
                UpdateWeightsReq, WeightGroupReq, Pause/ContinueGenerationReq, MemoryOccupationReq,
                LoRAAdapterReq, AbortAllReq -> OverlapScheduler
    OverlapScheduler --PlanPrefillReq--> PrefillAdderActor --PrefillPlanReply--> OverlapScheduler
    OverlapScheduler --RequeueReqs (retracted), AbortReq/StopStrMatched (not running), AbortAllReq--> PrefillAdderActor
    PrefillAdderActor --WaitingCount--> OverlapScheduler
    OverlapScheduler, PrefillAdderActor --BatchTokenOut--> OutputProcessor --BatchStrOut--> Receiver
    Receiver --RegisterReq--> OutputProcessor
    OutputProcessor --StopStrMatched (a fallback: the scheduler ends stop strings itself)--> Dispatcher
    OverlapScheduler --ControlReply--> Receiver

Most messages carry plain data (ids, token lists, deltas), so their unions decode from msgpack
(TokenizedGenerateReq's compiled grammar is a shared read-only object, like the tokenizer).
Three carry `Req` objects by reference (`PlanPrefillReq`, `PrefillPlanReply`, `RequeueReqs`):
they hand a request between the PrefillAdder and the scheduler, and ownership moves with the
message (the sender does not touch it afterwards). That boundary stays inside one process: the
PrefillAdder reads the scheduler's radix tree.
"""

from __future__ import annotations

from typing import Any

import msgspec

from engine.api import StreamDelta
from engine.constrained import CompiledGrammar
from engine.sampling import SamplingParams
from engine.scheduler.output import BatchTokenOut
from engine.scheduler.req import Req
from engine.scheduler.waiting_queue import PrefillBudget, PrefillPlan

__all__ = [
    "AbortAllReq",
    "AbortReq",
    "BatchStrOut",
    "BatchTokenOut",
    "ContinueGenerationReq",
    "ControlReply",
    "FlushCacheReq",
    "GetInternalStateReq",
    "LoRAAdapterReq",
    "MemoryOccupationReq",
    "PauseGenerationReq",
    "PlanPrefillReq",
    "PrefillPlanReply",
    "RegisterReq",
    "RequeueReqs",
    "SetInternalStateReq",
    "StopStrMatched",
    "StreamDelta",
    "TokenizedGenerateReq",
    "UpdateWeightsReq",
    "WaitingCount",
    "WeightGroupReq",
]


class TokenizedGenerateReq(msgspec.Struct, tag=True):
    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    seed: int  # resolved: the user's seed, or one drawn at submission
    return_logprob: bool = False
    top_logprobs_num: int = 0
    # Prompt log-probs from this position on (resolved by the Receiver: -1 = none).
    logprob_start_len: int = -1
    # An embedding request: how its prompt's final hidden states are pooled (None: generation)
    pooling: str | None = None
    # The compiled grammar of sampling_params' json_schema/regex/ebnf, by reference: a shared,
    # read-only object (like the tokenizer). Across a process boundary it would be re-fetched
    # from that side's grammar cache by sampling_params.grammar_spec().
    grammar: CompiledGrammar | None = None
    # Multi-LoRA: the adapter's name (None: the base model) and its radix cache key (resolved by
    # the Receiver from the adapters loaded now)
    lora_path: str | None = None
    lora_key: int = 0


class AbortReq(msgspec.Struct, tag=True):
    rid: str
    message: str = "aborted by the client"


class StopStrMatched(msgspec.Struct, tag=True):
    """The output processor saw a stop string complete in a token the scheduler did not end with it
    (a fallback: the scheduler checks stop strings itself): the request ends, its memory is freed."""

    rid: str
    matched: str


class FlushCacheReq(msgspec.Struct, tag=True):
    reply_id: int


class GetInternalStateReq(msgspec.Struct, tag=True):
    reply_id: int
    detail: bool = False  # add the radix summary and request timelines (the dashboard)


class SetInternalStateReq(msgspec.Struct, tag=True):
    reply_id: int
    state: dict[str, Any]


class WeightGroupReq(msgspec.Struct, tag=True):
    """Join (`init`) or leave (`destroy`) a trainer's weight-update group
    (engine/distributed/weight_sync.py); `params` are SGLang's request fields."""

    reply_id: int
    action: str  # "init" | "destroy"
    params: dict[str, Any] = {}


class UpdateWeightsReq(msgspec.Struct, tag=True, kw_only=True):
    """New weights (SGLang's update_weights_from_disk / _from_tensor): a checkpoint folder or
    .gguf (`model_path`), or Hugging Face-named tensors, by reference (in process only, like the
    Req-carrying messages). Applied once no request holds memory (engine/actors/generation_control.py)."""

    reply_id: int
    model_path: str | None = None
    named_tensors: Any = None  # list[tuple[str, torch.Tensor]]
    # or broadcast by a trainer's group: {"group_name", "names", "dtypes", "shapes"}
    from_group: dict[str, Any] | None = None
    weight_version: str | None = None  # None: the number of updates applied so far, as a string
    abort_all_requests: bool = False
    flush_cache: bool = True


class PauseGenerationReq(msgspec.Struct, tag=True):
    """SGLang's /pause_generation: "abort" ends every request; "retract" sends the running ones
    back to the waiting queue (their KV freed, recomputed on continue); "in_place" keeps them and
    their KV. Until ContinueGenerationReq nothing is launched; new requests wait in the queue."""

    reply_id: int
    mode: str = "abort"


class ContinueGenerationReq(msgspec.Struct, tag=True):
    reply_id: int


class MemoryOccupationReq(msgspec.Struct, tag=True):
    """SGLang's release_memory_occupation (`release`) / resume_memory_occupation: free or bring
    back the KV pool ("kv_cache") and/or the weights ("weights"). Released, nothing is launched;
    running requests are retracted first and wait in the queue with new ones until resumed."""

    reply_id: int
    release: bool
    tags: list[str] = []


class LoRAAdapterReq(msgspec.Struct, tag=True):
    """Load (`path` given) or unload a LoRA adapter by name at run time (SGLang's
    /load_lora_adapter, /unload_lora_adapter): engine/actors/lora_control.py."""

    reply_id: int
    action: str  # "load" | "unload"
    name: str
    path: str | None = None


class AbortAllReq(msgspec.Struct, tag=True):
    """End every request, running or waiting (SGLang's /abort_request with abort_all)."""

    message: str = "aborted by the operator"


class ControlReply(msgspec.Struct, tag=True):
    reply_id: int
    ok: bool
    payload: dict[str, Any] = {}
    error: str | None = None


class PlanPrefillReq(msgspec.Struct, tag=True):
    """Scheduler -> PrefillAdder, once per round with something to prefill: what it can afford."""

    reply_id: int
    budget: PrefillBudget


class PrefillPlanReply(msgspec.Struct, tag=True):
    """PrefillAdder -> scheduler: the requests to prefill now (ownership moves to the scheduler)."""

    reply_id: int
    plan: PrefillPlan
    version: int  # orders it against WaitingCount messages (the newer queue length wins)


class RequeueReqs(msgspec.Struct, tag=True):
    """Scheduler -> PrefillAdder: requests back to the head of the waiting queue, in order
    (retracted, or planned but not placed); ownership moves to the PrefillAdder."""

    reqs: list[Req]


class WaitingCount(msgspec.Struct, tag=True):
    """PrefillAdder -> scheduler: the waiting queue's length changed (a request came or went)."""

    num_waiting: int
    version: int  # increases with every length the PrefillAdder reports


class RegisterReq(msgspec.Struct, tag=True):
    """Receiver -> OutputProcessor, before the request reaches the scheduler: how to detokenize it."""

    rid: str
    prompt_ids: list[int]  # the prompt's last few ids: context for the first token's leading space
    skip_special_tokens: bool
    stop_strs: list[str]


class BatchStrOut(msgspec.Struct, tag=True):
    deltas: list[StreamDelta]
