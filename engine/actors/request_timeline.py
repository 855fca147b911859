"""Per-request timelines for operators (the dashboard): queued -> prefill chunks -> decode ->
finished, kept by the scheduler actor for its live requests and the latest finished ones.

Why in the scheduler actor: it is the one place that sees every phase change (a prefill chunk
launched, the first decode, a retraction, the end) as it happens. Updates are dict operations per
request and phase change, never per decoded token, so keeping them costs nothing measurable.
Times are `time.perf_counter()` seconds, like `StepRecord`s.
"""

from __future__ import annotations

import collections

import msgspec

from engine.scheduler.output import BatchTokenOut
from engine.scheduler.req import Req

KEEP_FINISHED = 32  # finished timelines kept for the dashboard
MAX_LIVE = 1024  # live timelines kept (the oldest are dropped past it: a bound, not a limit)


class Phase(msgspec.Struct, frozen=True, array_like=True):
    name: str  # "prefill" | "decode" | "retracted" | "finished"
    t: float
    tokens: int = 0  # prefill: tokens computed by the chunk


class RequestTimeline(msgspec.Struct):
    rid: str
    queued_at: float
    prompt_tokens: int
    phases: list[Phase] = []
    output_tokens: int = 0
    finish_reason: str | None = None


class RequestTimelines:
    def __init__(self) -> None:
        self.live: collections.OrderedDict[str, RequestTimeline] = collections.OrderedDict()
        self.finished: collections.deque[RequestTimeline] = collections.deque(maxlen=KEEP_FINISHED)
        self._decoding: set[str] = set()

    def _get(self, req: Req) -> RequestTimeline:
        tl = self.live.get(req.rid)
        if tl is None:
            tl = self.live[req.rid] = RequestTimeline(req.rid, req.queued_at, len(req.origin_input_ids))
            if len(self.live) > MAX_LIVE:
                self.live.popitem(last=False)
        return tl

    def on_prefill(self, reqs: list[Req], extend_lens: list[int], now: float) -> None:
        for req, n in zip(reqs, extend_lens):
            self._get(req).phases.append(Phase("prefill", now, n))
            self._decoding.discard(req.rid)

    def on_decode(self, reqs: list[Req], now: float) -> None:
        decoding = self._decoding
        for req in reqs:
            if req.rid not in decoding:
                decoding.add(req.rid)
                self._get(req).phases.append(Phase("decode", now))

    def on_retracted(self, reqs: list[Req], now: float) -> None:
        for req in reqs:
            self._decoding.discard(req.rid)
            if req.rid in self.live:
                self.live[req.rid].phases.append(Phase("retracted", now))

    def on_output(self, out: BatchTokenOut, now: float) -> None:
        for rid, token, reason in zip(out.rids, out.token_ids, out.finish_reasons):
            tl = self.live.get(rid)
            if tl is None:
                continue
            if token >= 0:
                tl.output_tokens += 1
            if reason is not None:
                tl.finish_reason = reason
                tl.phases.append(Phase("finished", now))
                self.finished.append(self.live.pop(rid))
                self._decoding.discard(rid)

    def snapshot(self, max_live: int = 64) -> list[RequestTimeline]:
        """The newest `max_live` live timelines and the kept finished ones (copies: the caller
        may encode them after this actor goes on)."""
        live = list(self.live.values())[-max_live:]
        return [msgspec.structs.replace(t, phases=list(t.phases)) for t in [*self.finished, *live]]
