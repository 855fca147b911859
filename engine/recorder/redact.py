"""What a flight recorder keeps of users' requests when `flight_recorder_record_prompts` is off
(the default): no prompt token ids, no stop strings, no grammar specs.

A prompt becomes stand-in ids, one per token: page k's ids come from a keyed blake2b of the
prompt's first k+1 pages (a running hash, so it covers the whole prefix), offset by the token's
place in the page. So two prompts get equal stand-in ids exactly as far as they share whole
pages, which is all the radix cache compares (it matches page-aligned prefixes, page by page):
replay, fed the stand-in ids, makes the same prefix-sharing decisions. The ids sit above any
vocabulary (from `STAND_IN_BASE`), so they never equal a real token id (an output token the
cache also holds).

The key is drawn per recorder and never written: without it a hash cannot be checked against a
guessed prompt (a page of 1 token would otherwise be found by trying the whole vocabulary), and
replay needs only equality, not the key. What a redacted dump still shows: each prompt's length,
which prompts share which prefix lengths, the sampled output token ids (the stand-in model),
stop_token_ids and the other numeric sampling parameters.
"""

from __future__ import annotations

import collections
import hashlib
import os
from array import array

import msgspec

from engine.actors.messages import RegisterReq, StopStrMatched, TokenizedGenerateReq
from engine.sampling import SamplingParams

# Stand-in ids start at 2**40: above every vocabulary, and (at most 2**62 + page size) within int64,
# which the scheduler's tensors hold token ids in.
STAND_IN_BASE = 1 << 40
_SPAN = 1 << 62
_MEMO = 256  # prompts remembered: the dispatcher and the prefill adder both receive each request


def redacted_text(text: str) -> str:
    """What stands in for a stop string or a grammar spec: its length only."""
    return f"<redacted: {len(text)} chars>"


class Redactor:
    """Turns the messages that carry what users sent into their redacted forms (see the module)."""

    def __init__(self, page_size: int) -> None:
        self.page_size = max(1, page_size)
        self._key = os.urandom(32)  # never leaves this object: see the module docstring
        self._memo: collections.OrderedDict[str, tuple[list[int], list[int]]] = collections.OrderedDict()

    def stand_in_ids(self, ids: list[int]) -> list[int]:
        """The prompt's stand-in ids: equal to another prompt's exactly over their common whole pages."""
        data = memoryview(array("q", ids).tobytes())
        running = hashlib.blake2b(key=self._key, digest_size=8)
        update, snapshot = running.update, running.copy
        step, out = 8 * self.page_size, []
        for start in range(0, len(data), step):
            update(data[start : start + step])
            base = STAND_IN_BASE + int.from_bytes(snapshot().digest(), "little") % _SPAN
            out.extend(range(base, base + min(step, len(data) - start) // 8))
        return out

    def _prompt(self, rid: str, ids: list[int]) -> list[int]:
        # The same request reaches two actors (one list object): hash its prompt once.
        hit = self._memo.get(rid)
        if hit is not None and hit[0] is ids:
            return hit[1]
        stand_in = self.stand_in_ids(ids)
        self._memo[rid] = (ids, stand_in)
        if len(self._memo) > _MEMO:
            self._memo.popitem(last=False)
        return stand_in

    def redact(self, msg: msgspec.Struct) -> msgspec.Struct:
        """`msg` (already in its recorded form) without prompt ids, stop strings or grammar specs."""
        if isinstance(msg, TokenizedGenerateReq):
            return msgspec.structs.replace(
                msg, input_ids=self._prompt(msg.rid, msg.input_ids), sampling_params=redact_params(msg.sampling_params)
            )
        if isinstance(msg, RegisterReq):
            return msgspec.structs.replace(msg, prompt_ids=[], stop_strs=[redacted_text(s) for s in msg.stop_strs])
        if isinstance(msg, StopStrMatched):
            return msgspec.structs.replace(msg, matched=redacted_text(msg.matched))
        return msg


def redact_params(params: SamplingParams) -> SamplingParams:
    """Sampling parameters without their texts: stop strings and grammar specs become lengths."""
    changes: dict[str, object] = {}
    if params.stop is not None:
        changes["stop"] = [redacted_text(s) for s in ([params.stop] if isinstance(params.stop, str) else params.stop)]
    spec = params.grammar_spec()
    if spec is not None:
        changes[spec[0]] = redacted_text(spec[1])
    return msgspec.structs.replace(params, **changes) if changes else params
