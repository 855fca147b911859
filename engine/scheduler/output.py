"""`BatchTokenOut`: what one scheduler step tells the output side (a tagged message Struct).

Built by the scheduler (a forward's sampled tokens, requests it ended) and by the PrefillAdder
(requests aborted while waiting); read by the OutputProcessor, which turns ids into text.
"""

from __future__ import annotations

import itertools

import msgspec
import torch

from engine.api import PromptLogprobs
from engine.model_executor.model_runner import GenerationBatchResult
from engine.model_executor.prompt_logprobs import PromptLogprobsOut
from engine.sampling import SamplerOutput
from engine.scheduler.req import Finished, Req


def take_prompt_logprobs(req: Req) -> PromptLogprobs | None:
    """`req`'s gathered prompt log-probs, once (the request holds them no more); None if it asked
    for none or they went out already."""
    got = req.input_logprobs
    if got is None:
        return None
    req.input_logprobs = None
    ids = req.origin_input_ids[req.logprob_start_len :]
    top = [None, *got.top] if req.top_logprobs_num else None
    return PromptLogprobs(ids, [None, *got.values], top)


class BatchTokenOut(msgspec.Struct, tag=True):
    """One step's results for the requests that produced (or ended with) a token.

    Per request: the new token id (-1 when a request ended without one, e.g. an abort or a
    scoring / embedding request, which generates nothing), the finish reason ('stop' | 'length' |
    'abort' | None), matched stop token id or stop string, error message, prompt length, cached
    tokens, queue time, optional logprobs, and a request's prompt log-probs or embedding once its
    prompt is done.
    """

    rids: list[str] = []
    token_ids: list[int] = []
    finish_reasons: list[str | None] = []
    matched: list[int | str | None] = []  # a stop id (EOS included) or a stop string (the scheduler's check)
    messages: list[str | None] = []
    prompt_tokens: list[int] = []
    cached_tokens: list[int] = []
    queue_times: list[float | None] = []  # seconds from entering the waiting queue to the first prefill
    logprobs: list[float | None] = []
    top_logprobs: list[list[tuple[int, float]] | None] = []
    # (verify forwards with drafts, drafts verified, drafts accepted) of a request that speculated
    spec: list[tuple[int, int, int] | None] = []
    # Prompt log-probs, on a request's first entry only (None elsewhere)
    input_logprobs: list[PromptLogprobs | None] = []
    # An embedding request's pooled, L2-normalised embedding (None for everyone else)
    embeddings: list[list[float] | None] = []
    # The weights that produced this step's tokens (ServerArgs.weight_version, then each update's):
    # a step never spans a weight update, which runs with nothing in flight
    weight_version: str = ""

    def add(
        self,
        req: Req,
        token_id: int,
        logprob: float | None = None,
        top: list[tuple[int, float]] | None = None,
        prompt: PromptLogprobs | None = None,
        embedding: list[float] | None = None,
    ) -> None:
        """Append `req`'s entry: its new token (-1: none) and, if it ended, how."""
        fin: Finished | None = req.finished_reason
        self.rids.append(req.rid)
        self.token_ids.append(token_id)
        self.finish_reasons.append(fin.reason.value if fin is not None else None)
        self.matched.append(fin.matched if fin is not None else None)
        self.messages.append(fin.message if fin is not None else None)
        self.prompt_tokens.append(len(req.origin_input_ids))
        self.cached_tokens.append(req.cached_tokens)
        self.queue_times.append(req.queue_time)
        self.logprobs.append(logprob)
        self.top_logprobs.append(top)
        s = req.spec
        self.spec.append((s.verify_ct, s.draft_tokens, s.accepted_tokens) if s is not None else None)
        self.input_logprobs.append(prompt)
        self.embeddings.append(embedding)

    def add_aborted(self, rid: str, message: str) -> None:
        """End request `rid` with an error when no `Req` is at hand (its handling failed)."""
        self.rids.append(rid)
        self.token_ids.append(-1)
        self.finish_reasons.append("abort")
        self.matched.append(None)
        self.messages.append(message)
        self.prompt_tokens.append(0)
        self.cached_tokens.append(0)
        self.queue_times.append(None)
        self.logprobs.append(None)
        self.top_logprobs.append(None)
        self.spec.append(None)
        self.input_logprobs.append(None)
        self.embeddings.append(None)

    @classmethod
    def finished(cls, reqs: list[Req]) -> BatchTokenOut:
        """The final entries of requests that ended without a new token (aborts)."""
        out = cls()
        for req in reqs:
            out.add(req, -1)
        return out


class StepPromptLogprobs:
    """One extend's prompt log-probs on the host (read once), handed to each request's gather."""

    def __init__(self, out: PromptLogprobsOut) -> None:
        self.counts = out.counts
        self.values = out.values.tolist()
        self.top_idx = out.top_idx.tolist() if out.top_idx is not None else None
        self.top_val = out.top_val.tolist() if out.top_val is not None else None
        self.starts = list(itertools.accumulate(self.counts, initial=0))

    def gather(self, i: int, req: Req) -> None:
        """Append row block `i` (request `req`'s rows of this forward) to what it gathered."""
        if i >= len(self.counts) or not self.counts[i] or req.input_logprobs is None:
            return
        lo, hi = self.starts[i], self.starts[i + 1]
        req.input_logprobs.values.extend(self.values[lo:hi])
        if req.top_logprobs_num and self.top_idx is not None and self.top_val is not None:
            n = req.top_logprobs_num
            req.input_logprobs.top.extend(
                list(zip(idx[:n], val[:n])) for idx, val in zip(self.top_idx[lo:hi], self.top_val[lo:hi])
            )


class StepEmbeddings:
    """One extend's pooled rows on the host (read once), summed into each embedding request."""

    def __init__(self, hidden: torch.Tensor, counts: list[int]) -> None:
        self.hidden = hidden.cpu()
        self.counts = counts
        self.starts = list(itertools.accumulate(counts, initial=0))

    def gather(self, i: int, req: Req) -> None:
        """Add request `req`'s rows of this forward (row block `i`) to its running sum."""
        if i >= len(self.counts) or not self.counts[i] or req.pooling is None:
            return
        rows = self.hidden[self.starts[i] : self.starts[i + 1]]
        total, n = req.pooled if req.pooled is not None else (torch.zeros(rows.shape[1]), 0)
        req.pooled = (total + rows.sum(0), n + rows.shape[0])


class PromptOutputs:
    """What one extend computed for its requests' prompts besides the next token: their scored
    prompt log-probs and their pooled rows; `of` is None when the batch asked for neither."""

    def __init__(self, result: GenerationBatchResult) -> None:
        lps, pooled = result.prompt_logprobs, result.embed_hidden
        self.logprobs = StepPromptLogprobs(lps) if lps is not None else None
        self.pooled = StepEmbeddings(*pooled) if pooled is not None else None

    @classmethod
    def of(cls, result: GenerationBatchResult) -> PromptOutputs | None:
        return cls(result) if result.prompt_logprobs is not None or result.embed_hidden is not None else None

    def gather(self, i: int, req: Req) -> None:
        """Hand row block `i` of each to request `req` (the batch's i-th)."""
        if self.logprobs is not None:
            self.logprobs.gather(i, req)
        if self.pooled is not None:
            self.pooled.gather(i, req)


def take_embedding(req: Req) -> list[float] | None:
    """`req`'s embedding once its prompt is done: the mean of its pooled rows (one row for last /
    cls pooling), L2-normalised."""
    if req.pooling is None or req.pooled is None:
        return None
    total, n = req.pooled
    req.pooled = None
    return torch.nn.functional.normalize(total / n, dim=0).tolist()


class StepLogprobs:
    """One step's log-probs on the host (read once): what each request asked for of its row."""

    def __init__(self, out: SamplerOutput) -> None:
        self.lps = out.logprobs.tolist() if out.logprobs is not None else None
        self.top_idx = out.top_logprobs_idx.tolist() if out.top_logprobs_idx is not None else None
        self.top_val = out.top_logprobs_val.tolist() if out.top_logprobs_val is not None else None

    def of(self, i: int, req: Req) -> tuple[float | None, list[tuple[int, float]] | None]:
        """Row `i`'s (logprob, top-N pairs) for `req`, or None for what it did not ask."""
        if not req.return_logprob or self.lps is None:
            return None, None
        top = None
        if req.top_logprobs_num and self.top_idx is not None and self.top_val is not None:
            n = req.top_logprobs_num
            top = list(zip(self.top_idx[i][:n], self.top_val[i][:n]))
        return self.lps[i], top
