"""The scheduler's side of n-gram speculative decoding (`--speculative-algorithm NGRAM`).

Each decode round, `Speculation.drafts` proposes up to `speculative_num_draft_tokens` tokens per
running request from its own prompt and output (engine/speculative/ngram.py), within the verify
forward's row budget (`speculative_max_verify_tokens`: a larger forward costs more than its
drafts save, so a full batch does not draft); if any request has a draft, the round is a
TARGET_VERIFY forward (`ScheduleBatch.prepare_for_verify`) instead of a decode. A request
speculates when verification reproduces its plain decoding: greedy ones exactly (argmax),
sampling ones in distribution (rejection sampling); not with a grammar, logprobs, penalties or a
logit bias, nor before its `min_new_tokens`. The others ride in the same forward with no draft
and are sampled as in a decode.

`Speculation.process` then emits, per request, its accepted drafts and the next token (stopping
early at a finish: EOS, a stop id, the length limit), frees the KV slots of the rejected drafts
at once, and adapts the request's draft length. Memory stays exact: a request's committed KV is
its tokens but the last (as after a decode), every other slot of the forward is back in the
allocator. A request aborted or retracted while its verify runs was freed in full by that path
(its committed length covered every draft slot) and is skipped here, as a decode would be.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator
from engine.model_executor.model_runner import GenerationBatchResult
from engine.scheduler.launched import LaunchedBatch
from engine.scheduler.output import BatchTokenOut, StepLogprobs
from engine.scheduler.req import Req
from engine.speculative.ngram import DraftLength, NgramIndex


@dataclass
class SpecState:
    """One request's n-gram index (prompt and output so far), draft length policy, and what its
    speculation did (reported with its output: `StreamDelta.spec_*`)."""

    index: NgramIndex
    length: DraftLength
    verify_ct: int = 0  # verify forwards in which it had drafts
    draft_tokens: int = 0  # drafts it had verified
    accepted_tokens: int = 0  # of those, accepted and emitted

    def sync(self, req: Req) -> None:
        """Bring the index up to the request's current tokens."""
        have, prompt = len(self.index.tokens), req.origin_input_ids
        if have < len(prompt):
            self.index.extend(prompt[have:])
            have = len(prompt)
        self.index.extend(req.output_ids[have - len(prompt) :])


def can_speculate(req: Req) -> bool:
    """Whether verification reproduces this request's plain decoding: exactly (greedy, by argmax)
    or in distribution (sampling, by rejection sampling over temperature, top-k/p and min-p)."""
    p = req.sampling_params
    return (
        req.grammar is None
        and not req.return_logprob
        and not p.has_penalties()
        and req.logit_bias is None
        and len(req.output_ids) >= p.min_new_tokens
    )


class Speculation:
    def __init__(
        self, max_draft_tokens: int, max_verify_tokens: int, pool: ReqToTokenPool, allocator: TokenToKVPoolAllocator
    ) -> None:
        self.max_draft_tokens = max_draft_tokens
        self.max_verify_tokens = max_verify_tokens  # rows of a verify forward, the batch's own included
        self.pool, self.allocator = pool, allocator
        self.verify_steps = self.draft_tokens = self.accepted_tokens = 0
        self.verify_rows = 0  # requests with drafts, summed over the verify forwards

    def drafts(self, reqs: list[Req]) -> list[list[int]]:
        """Each request's drafts this round (empty: it decodes one token). The requests share the
        verify forward's rows left after their own (`max_verify_tokens`) evenly, in batch order;
        a batch that fills them alone does not draft."""
        budget = self.max_verify_tokens - len(reqs)
        if budget <= 0:  # the indexes catch up when drafting resumes (SpecState.sync)
            return [[] for _ in reqs]
        wanted = [self._wanted(req) for req in reqs]
        drafting = sum(k > 0 for k in wanted)
        out: list[list[int]] = []
        for req, k in zip(reqs, wanted):
            if k <= 0 or budget <= 0:
                out.append([])
                continue
            k = min(k, budget // drafting) if budget >= drafting else 1
            drafting -= 1
            draft = req.spec.index.propose(k)
            budget -= len(draft)
            out.append(draft)
        return out

    def _wanted(self, req: Req) -> int:
        """How many tokens `req` would draft this round on its own (0: none)."""
        if not can_speculate(req):
            return 0
        if req.spec is None:
            req.spec = SpecState(NgramIndex(), DraftLength(self.max_draft_tokens))
        req.spec.sync(req)
        room = min(
            req.sampling_params.max_new_tokens - len(req.output_ids) - 1,  # the next token is extra
            req.max_context_len - req.seqlen - 1,
        )
        return min(req.spec.length.wanted(len(req.output_ids)), room)

    def process(
        self,
        lb: LaunchedBatch,
        result: GenerationBatchResult,
        logprobs: StepLogprobs,
        release: Callable[[Req], None],
    ) -> BatchTokenOut:
        """A verify forward's result: tokens out, rejected slots freed (see the module doc)."""
        drafts = lb.drafts
        next_ids = result.next_token_ids_list()
        accepted = result.accept_lens or [0] * len(lb.reqs)
        self.verify_steps += 1
        msg = BatchTokenOut()
        for i, req in enumerate(lb.reqs):
            if req.finished() or lb.epochs[i] != req.epoch:
                continue  # aborted or retracted meanwhile: its slots, drafts' included, are freed
            written = req.kv_committed_len  # positions with a slot after this forward
            start = written - len(drafts[i]) - 1  # its last token's position
            emitted = 0
            if drafts[i]:  # counted before the tokens go out: the last one's delta carries them
                req.spec.verify_ct += 1
                req.spec.draft_tokens += len(drafts[i])
                self.verify_rows += 1
                self.draft_tokens += len(drafts[i])
                self.accepted_tokens += accepted[i]
            for tok in [*drafts[i][: accepted[i]], next_ids[i]]:
                req.accept_token(tok)
                if emitted < accepted[i]:
                    req.spec.accepted_tokens += 1
                emitted += 1
                msg.add(req, tok, *logprobs.of(i, req))  # log-probs: only a request that drafted nothing
                if req.finished():
                    break
            # KV is valid for the last token and the accepted drafts that were emitted.
            keep = start + emitted
            if keep < written:
                self.allocator.free(self.pool.req_to_token[req.req_pool_idx, keep:written].to(torch.int64))
            req.kv_committed_len = keep
            req.kv_computed_len = max(req.kv_computed_len, keep)
            if drafts[i]:
                req.spec.length.record(len(drafts[i]), accepted[i], len(req.output_ids))
            if req.finished():
                release(req)
        return msg

    def stats(self) -> dict[str, float | int]:
        """Totals since start. `accept_length`: tokens a request gets from one verify forward it
        drafted in (its accepted drafts plus the target's own next token; SGLang's
        spec_accept_length); 0 before any."""
        rate = self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0
        length = (self.accepted_tokens + self.verify_rows) / self.verify_rows if self.verify_rows else 0.0
        return {
            "verify_steps": self.verify_steps,
            "verify_rows": self.verify_rows,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "accept_rate": rate,
            "accept_length": length,
        }
