"""One request's progress through its grammar: xgrammar's matcher, plus the bookkeeping the
scheduler needs (how many tokens it has accepted, a rebuild from the output ids)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import xgrammar as xgr

from engine.constrained.backend import CompiledGrammar
from engine.constrained.json_bounds import JsonLexer


class GrammarState:
    """A request's grammar matcher. Not thread-safe: one owner (the scheduler) drives it.

    The invariant the scheduler keeps: the state has accepted exactly the request's output ids
    (`num_accepted == len(req.output_ids)`), i.e. it accepts a token where the token is
    appended, never for a token dropped (a stale overlap result). `rebuild` restores that
    invariant from the ids when in doubt (a retraction, a failed forward).

    Stop tokens: a completed grammar allows only its stop tokens (the model's EOS ids, from the
    backend, plus the request's own `extra_stop_token_ids`, e.g. SamplingParams.stop_token_ids),
    and accepting one terminates it. Before completion the stop tokens are masked out, so a
    constrained request cannot stop in the middle of its JSON.

    JSON bounds: for a JSON grammar with `compiled.json_bounds`, a lexer follows the accepted
    text and `fill_bitmask` narrows the mask once a cap is reached (engine/constrained/
    json_bounds.py), so open strings, numbers, arrays, whitespace and nesting end.
    """

    __slots__ = ("_history", "_lexer", "_matcher", "compiled", "num_accepted", "stop_token_ids")

    def __init__(self, compiled: CompiledGrammar, extra_stop_token_ids: Iterable[int] = ()) -> None:
        self.compiled = compiled
        extra = {i for i in extra_stop_token_ids if 0 <= i < compiled.vocab_size} - set(compiled.stop_token_ids)
        self.stop_token_ids: tuple[int, ...] = tuple(sorted(set(compiled.stop_token_ids) | extra))
        override = list(self.stop_token_ids) if extra else None
        self._matcher = xgr.GrammarMatcher(compiled.handle, override_stop_tokens=override)
        self.num_accepted = 0
        self._lexer: JsonLexer | None = None
        if compiled.json_bounds is not None and compiled.token_classes is not None:
            self._lexer = JsonLexer(compiled.json_bounds, compiled.token_classes)
        # The lexer's state before each accepted token, for `rollback`.
        self._history: list[tuple] = []

    @property
    def matcher(self) -> xgr.GrammarMatcher:
        """xgrammar's matcher, for batch operations (a threaded mask fill); drive the state
        through this class's methods, which keep `num_accepted` right."""
        return self._matcher

    def accept_token(self, token_id: int) -> bool:
        """Advance by one sampled token. False (state unchanged) when the grammar does not allow
        it: a masked sampler never produces such a token, so False means a bug upstream (the
        mask was not applied, or was applied to another row) and the caller should report it."""
        if not 0 <= token_id < self.compiled.vocab_size or self._matcher.is_terminated():
            return False  # checked here: xgrammar would also print a warning to stderr
        if not self._matcher.accept_token(token_id):
            return False
        self.num_accepted += 1
        if self._lexer is not None:
            self._history.append(self._lexer.snapshot())
            self._lexer.feed(self._lexer.classes.vocab[token_id] if token_id < len(self._lexer.classes.vocab) else b"")
        return True

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> bool:
        """Write the allowed next tokens into `bitmask[row]` (a CPU int32 bitmask from
        `allocate_bitmask`). Returns whether the row restricts anything (False: every token is
        allowed, so applying it could be skipped).

        A terminated state (its stop token accepted, while a stale overlap step still carries
        the request) gets a row allowing only the stop tokens rather than an error: whatever is
        sampled there is dropped anyway.
        """
        if self._matcher.is_terminated():
            allow_only(bitmask, row, self.stop_token_ids)
            return True
        restricts = bool(self._matcher.fill_next_token_bitmask(bitmask, row))
        return self.apply_bounds(bitmask, row) or restricts

    def apply_bounds(self, bitmask: torch.Tensor, row: int) -> bool:
        """Narrow `bitmask[row]`, already filled by the grammar, by the JSON caps reached (a
        threaded batch fill calls this after filling). Returns whether it narrowed the row."""
        if self._lexer is None or self._matcher.is_terminated():
            return False
        return self._lexer.restrict(bitmask[row])

    def is_terminated(self) -> bool:
        """A stop token was accepted: the constrained output is complete and the request ends."""
        return self._matcher.is_terminated()

    def is_completed(self) -> bool:
        """The output so far is a full match of the grammar (a stop token would now be allowed)."""
        return self._matcher.is_completed()

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (speculative decoding, jump-forward).

        xgrammar 0.2.x keeps the whole history (its `max_rollback_tokens` is deprecated and
        unlimited), so the only bound is what was accepted."""
        if not 0 <= num_tokens <= self.num_accepted:
            raise ValueError(f"cannot roll back {num_tokens} tokens: {self.num_accepted} were accepted")
        if num_tokens:
            self._matcher.rollback(num_tokens)
            self.num_accepted -= num_tokens
            if self._lexer is not None:
                self._lexer.restore(self._history[-num_tokens])
                del self._history[-num_tokens:]

    def rebuild(self, output_ids: Sequence[int]) -> bool:
        """Reset to the grammar's start and accept `output_ids` again (a retracted or re-queued
        request whose state may not match its ids). False when some id is rejected: the state
        then holds the ids before it, `num_accepted` says how many."""
        self._matcher.reset()
        self.num_accepted = 0
        if self._lexer is not None:
            self._lexer = JsonLexer(self._lexer.bounds, self._lexer.classes)
            self._history.clear()
        return all(self.accept_token(int(t)) for t in output_ids)


def allow_only(bitmask: torch.Tensor, row: int, token_ids: Iterable[int]) -> None:
    """Set `bitmask[row]` to allow exactly `token_ids` (bit i of word w is token 32*w + i)."""
    words: dict[int, int] = {}
    for token_id in token_ids:
        words[token_id >> 5] = words.get(token_id >> 5, 0) | (1 << (token_id & 31))
    line = bitmask[row]
    line.zero_()
    for word, bits in words.items():
        line[word] = bits - (1 << 32) if bits >= 1 << 31 else bits  # int32 storage
