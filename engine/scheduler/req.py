"""`Req`: one request's mutable state on the scheduler side (seed 000), and what it carries
besides its tokens: how it finished (`Finished`), its prompt log-probs gathered over prefill
chunks (`InputLogprobs`, `resolve_logprob_start_len`) and, for an embedding request, its pooling.

A `Req` is owned by one actor at a time (the PrefillAdder while it waits, the scheduler while it
holds memory); `ScheduleBatch` (batch.py) groups them for a forward.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.cache.base_prefix_cache import BasePrefixCache
from engine.constrained import CompiledGrammar, GrammarState
from engine.errors import InvalidRequestError
from engine.sampling import LogitBias, SamplingParams


class FinishReason(enum.Enum):
    STOP = "stop"  # EOS, stop token id or stop string
    LENGTH = "length"  # max_new_tokens or the context length
    ABORT = "abort"  # aborted by the user, a disconnect or an error


@dataclass(slots=True)
class Finished:
    reason: FinishReason
    matched: int | str | None = None  # the stop token id or stop string that ended it
    message: str | None = None  # why, for aborts


@dataclass(slots=True)
class InputLogprobs:
    """A request's prompt log-probs, gathered over its prefill chunks (the scored positions
    after `logprob_start_len`, in order; top-N pairs only when it asked for them)."""

    values: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)


def resolve_logprob_start_len(start: int, prompt_len: int, return_logprob: bool) -> int:
    """The first prompt position whose log-prob is reported, or -1 for none. SGLang's rule: -1
    (the default) with return_logprob means the last prompt position only; a position past the
    prompt is an error."""
    if start < -1:
        raise InvalidRequestError(f"logprob_start_len must be >= -1, got {start}", "logprob_start_len")
    if not return_logprob:
        return -1
    if start >= prompt_len:
        raise InvalidRequestError(
            f"logprob_start_len ({start}) must be less than the prompt's {prompt_len} tokens", "logprob_start_len"
        )
    return prompt_len - 1 if start == -1 else start


class Req:
    """One request's mutable state, owned by the scheduler side."""

    __slots__ = (
        "cached_tokens",
        "eos_token_ids",
        "epoch",
        "extend_input_len",
        "fill_ids",
        "finished_reason",
        "grammar",
        "input_logprobs",
        "is_chunked",
        "kv_committed_len",
        "kv_computed_len",
        "last_node",
        "logit_bias",
        "logprob_start_len",
        "lora_key",
        "lora_path",
        "lora_slot",
        "max_context_len",
        "origin_input_ids",
        "output_ids",
        "pooled",
        "pooling",
        "prefix_indices",
        "queue_time",
        "queued_at",
        "req_pool_idx",
        "return_logprob",
        "rid",
        "sampling_params",
        "seed",
        "spec",
        "stop_check",
        "stop_token_ids",
        "swa_released_len",
        "top_logprobs_num",
    )

    def __init__(
        self,
        rid: str,
        input_ids: list[int],
        sampling_params: SamplingParams,
        *,
        seed: int,
        eos_token_ids: frozenset[int] = frozenset(),
        max_context_len: int,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        grammar: CompiledGrammar | None = None,
        logprob_start_len: int = -1,
        pooling: str | None = None,
        lora_path: str | None = None,
        lora_key: int = 0,
    ) -> None:
        self.rid = rid
        self.origin_input_ids = list(input_ids)
        self.sampling_params = sampling_params
        self.output_ids: list[int] = []
        self.fill_ids: list[int] = []
        self.prefix_indices: torch.Tensor = torch.empty(0, dtype=torch.int64)
        self.extend_input_len = 0
        self.req_pool_idx: int | None = None
        self.finished_reason: Finished | None = None
        self.seed = seed
        self.eos_token_ids = eos_token_ids
        self.stop_token_ids = frozenset(sampling_params.stop_token_ids or ())
        self.logit_bias = LogitBias.from_params(sampling_params)  # arrays built once, packed every step
        # Structured output: the matcher has accepted exactly `output_ids` (see GrammarState).
        self.grammar = GrammarState(grammar, self.stop_token_ids) if grammar is not None else None
        self.max_context_len = max_context_len
        self.return_logprob = return_logprob
        self.top_logprobs_num = top_logprobs_num
        # Prompt log-probs (SGLang's `logprob_start_len`): -1 none, else the first prompt position
        # reported; positions after it are scored in the prefill forward(s) and gathered here,
        # chunk by chunk, until the first output token carries them out (then None again).
        self.logprob_start_len = logprob_start_len
        self.input_logprobs: InputLogprobs | None = InputLogprobs() if logprob_start_len >= 0 else None
        # An embedding request (max_new_tokens 0): its pooling method, and the sum of the pooled
        # rows' final hidden states and their count, gathered over its prefill chunks
        self.pooling = pooling
        self.pooled: tuple[torch.Tensor, int] | None = None
        self.last_node: Any = None  # radix tree node holding this request's cached prefix
        # Multi-LoRA: the adapter's name (None: the base model), its radix cache key (prefixes
        # computed under one adapter are only matched by requests on the same one) and its slot in
        # the LoRA pool while the scheduler holds the request (pinned; -1: none, lora_admission.py)
        self.lora_path, self.lora_key, self.lora_slot = lora_path, lora_key, -1
        self.cached_tokens = 0  # prompt tokens served from the prefix cache (first round)
        self.is_chunked = 0  # > 0 while the prompt is being prefilled chunk by chunk
        self.kv_committed_len = 0  # positions with KV slots (a running forward may still be writing some)
        self.kv_computed_len = 0  # positions whose KV a completed forward wrote (only these enter the tree)
        self.swa_released_len = 0  # hybrid SWA memory: positions below this gave back their SWA slots
        # Times this request was retracted: a result computed for an older epoch is dropped.
        self.epoch = 0
        self.queued_at = time.perf_counter()  # created as it enters the waiting queue
        self.queue_time: float | None = None  # until its first prefill is placed (SGLang's queue time)
        self.spec: Any = None  # speculative decoding's per-request state (engine/scheduler/speculation.py)
        # Its stop strings' check (scheduler/stop_strings.py), given by the scheduler when it places
        # a request that has stop strings; replay puts its recorded decisions here instead.
        self.stop_check: Any = None

    @property
    def seqlen(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    def finished(self) -> bool:
        return self.finished_reason is not None

    def mark_scheduled(self, now: float) -> None:
        """Its prefill was placed: the first time, its queue time is known (a retracted request
        keeps the one it had)."""
        if self.queue_time is None:
            self.queue_time = now - self.queued_at

    def needs_sync(self) -> bool:
        """Whether sampling this request's next token needs its previous one on the host
        (penalties count it, a grammar's mask follows it), so a batch holding it must be
        processed before the next batch is planned: no overlap for it."""
        return self.grammar is not None or self.sampling_params.has_penalties()

    def accept_token(self, token_id: int) -> None:
        """Append a sampled token (advancing the grammar, which must allow it) and check finish:
        token-level, then the stop strings."""
        self.output_ids.append(token_id)
        if self.grammar is not None and not self.grammar.accept_token(token_id):
            # The mask forbids what was sampled: a bug upstream. End the request rather than
            # hand out output its grammar does not allow.
            self.finished_reason = Finished(
                FinishReason.ABORT, message=f"internal error: token {token_id} violates the request's grammar"
            )
            return
        self.check_finished()
        if self.stop_check is not None:
            self.check_stop_strings()

    def init_next_round_input(self, tree_cache: BasePrefixCache | None = None) -> None:
        """Set fill_ids and the cached prefix before (re)scheduling a prefill of this request."""
        self.fill_ids = self.origin_input_ids + self.output_ids
        if self.grammar is not None and self.grammar.num_accepted != len(self.output_ids):
            self.grammar.rebuild(self.output_ids)  # never expected; cheap insurance on a re-prefill
        if tree_cache is not None:
            # Keep at least one token to compute: its logits produce the next token. Prompt
            # log-probs need the logits from `logprob_start_len` on, which a cached prefix does
            # not have: the match stops there and only that span is recomputed (SGLang's rule).
            limit = len(self.fill_ids) - 1
            if self.input_logprobs is not None:
                limit = min(limit, self.logprob_start_len)
            if self.pooling in ("mean", "cls"):  # pooled over rows a cached prefix has no states for
                limit = 0
            self.prefix_indices, self.last_node = tree_cache.match_prefix(self.fill_ids[:limit], self.lora_key)
        self.extend_input_len = len(self.fill_ids) - len(self.prefix_indices)

    def input_logprob_rows(self, prefix_len: int, extend_len: int) -> tuple[int, int]:
        """(first, count): which of this forward's new positions [prefix_len, prefix_len +
        extend_len) score a prompt token: position q predicts prompt token q + 1, for q from
        `logprob_start_len` to the prompt's second-to-last position. `first` is relative to the
        request's first new token."""
        if self.input_logprobs is None:
            return 0, 0
        lo = max(self.logprob_start_len, prefix_len)
        hi = min(len(self.origin_input_ids) - 1, prefix_len + extend_len)
        return lo - prefix_len, max(hi - lo, 0)

    def reset_prompt_outputs(self) -> None:
        """Retracted: what its prefill gathered is recomputed when it is prefilled again (prompt
        log-probs already sent stay sent)."""
        if self.input_logprobs is not None:
            self.input_logprobs = InputLogprobs()
        self.pooled = None

    def embed_rows(self, prefix_len: int, extend_len: int) -> tuple[int, int]:
        """(first, count): which of this forward's new positions an embedding request pools
        (relative to its first new token): every prompt position (mean), the first (cls) or the
        last (last)."""
        end = prefix_len + extend_len
        prompt_len = len(self.origin_input_ids)
        if self.pooling == "mean":
            return 0, max(min(prompt_len, end) - prefix_len, 0)
        q = {"cls": 0, "last": prompt_len - 1}.get(self.pooling or "", -1)
        return (q - prefix_len, 1) if prefix_len <= q < end else (0, 0)

    def check_stop_strings(self) -> None:
        """Whether the newest token's text completes a stop string: then the request finishes
        ("stop", matched = the stop string). Checked also on a token that reached the length limit
        (the output processor shows its text, so it reports the stop string), never on one that
        ended it as EOS / a stop id (whose text is not shown) or by an abort."""
        fin = self.finished_reason
        if fin is not None and fin.reason is not FinishReason.LENGTH:
            return
        hit = self.stop_check.check(self)
        if hit is not None:
            self.finished_reason = Finished(FinishReason.STOP, matched=hit)

    def check_finished(self) -> None:
        """Token-level finish checks (stop strings: `check_stop_strings`)."""
        if self.finished():
            return
        params = self.sampling_params
        if self.grammar is not None and self.grammar.is_terminated():
            # The grammar accepted a stop token (EOS or a stop_token_id): the structured output is
            # complete. Ends the request even under ignore_eos or before min_new_tokens.
            self.finished_reason = Finished(FinishReason.STOP, matched=self.output_ids[-1])
            return
        if len(self.output_ids) >= params.max_new_tokens:
            self.finished_reason = Finished(FinishReason.LENGTH)
            return
        if not self.output_ids:
            return
        last = self.output_ids[-1]
        if len(self.output_ids) >= params.min_new_tokens:
            if last in self.stop_token_ids or (not params.ignore_eos and last in self.eos_token_ids):
                self.finished_reason = Finished(FinishReason.STOP, matched=last)
                return
        if self.seqlen >= self.max_context_len:
            self.finished_reason = Finished(FinishReason.LENGTH)

    def abort(self, message: str) -> None:
        if not self.finished():
            self.finished_reason = Finished(FinishReason.ABORT, message=message)

    def __repr__(self) -> str:
        return f"Req(rid={self.rid!r}, in={len(self.origin_input_ids)}, out={len(self.output_ids)})"
