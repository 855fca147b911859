"""N-gram drafts from a request's own tokens (SGLang's NGRAM, vLLM's prompt lookup).

Text that quotes or edits a given document, or completes code over a given file, repeats what
came before: after the last few tokens, the tokens that followed their previous occurrence are a
cheap guess at what comes next. The target model checks all of them in one forward
(engine/speculative/verify.py), so a good guess yields several tokens per forward and a bad one
costs only the wider forward.

`NgramIndex` is kept per request and updated incrementally as tokens arrive (O(new tokens) per
step, never a rescan of the context). `DraftLength` adapts how many tokens to propose from the
request's recent acceptance, and stops proposing for a request whose drafts keep failing.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_NGRAM = 4  # longest suffix matched
MIN_NGRAM = 2  # shortest: a single token repeats too often to predict anything


class NgramIndex:
    """Where each n-gram (MIN_NGRAM..MAX_NGRAM tokens) of a token sequence last ended, and where
    it ended the time before (the suffix's own occurrence is always the latest one)."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self._last: dict[tuple[int, ...], int] = {}  # n-gram -> end (exclusive) of its latest occurrence
        self._before: dict[tuple[int, ...], int] = {}  # n-gram -> end of the occurrence before that

    def extend(self, tokens: list[int]) -> None:
        seq = self.tokens
        for tok in tokens:
            seq.append(tok)
            end = len(seq)
            for n in range(MIN_NGRAM, min(MAX_NGRAM, end) + 1):
                key = tuple(seq[end - n :])
                prev = self._last.get(key)
                if prev is not None:
                    self._before[key] = prev
                self._last[key] = end

    def propose(self, k: int) -> list[int]:
        """`k` tokens that followed the longest earlier occurrence of the current suffix (none
        if the suffix never occurred before). When that occurrence is recent, its continuation
        runs into the drafts themselves: a repeating pattern is continued with its own period."""
        seq = self.tokens
        for n in range(min(MAX_NGRAM, len(seq) - 1), MIN_NGRAM - 1, -1):
            start = self._before.get(tuple(seq[-n:]))
            if start is not None:
                out = seq[start : start + k]
                while len(out) < k:
                    at = start + len(out) - len(seq)  # < len(out): start is before the end
                    out.append(out[at])
                return out
        return []


@dataclass
class DraftLength:
    """How many tokens to propose for one request, from an average of its recent acceptance.

    Starts at the configured maximum; each verify step moves the average toward the fraction of
    drafted tokens accepted. Below `OFF_BELOW` after `WARMUP` steps, the request stops drafting
    for `PAUSE` tokens (its forwards go back to one token), then tries again.
    """

    max_tokens: int
    rate: float = 1.0
    steps: int = 0
    paused_until: int = 0  # output length before which this request does not draft

    SMOOTHING = 0.3
    OFF_BELOW = 0.15
    WARMUP = 4
    PAUSE = 32

    def wanted(self, output_len: int) -> int:
        if output_len < self.paused_until:
            return 0
        return max(1, min(self.max_tokens, round(self.max_tokens * self.rate + 0.49)))

    def record(self, drafted: int, accepted: int, output_len: int) -> None:
        if drafted <= 0:
            return
        self.steps += 1
        self.rate += self.SMOOTHING * (accepted / drafted - self.rate)
        if self.steps >= self.WARMUP and self.rate < self.OFF_BELOW:
            self.paused_until = output_len + self.PAUSE
            self.rate, self.steps = 0.5, 0  # a fresh start after the pause
