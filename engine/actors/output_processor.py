"""OutputProcessor: token ids in, user-visible text deltas out.

Per request it keeps an incremental detokenizer (never emits broken UTF-8) and a stop-string
matcher (holds back text that may be the start of a stop string; removes the stop string).
Finishes come decided from the scheduler: EOS, stop ids, max tokens, aborts, and stop strings,
which the scheduler checks on the same tokens with the same detokenizer and matcher
(scheduler/stop_strings.py), so its "stop" arrives with the very token at which the text here is
cut. The text is still cut here, where it is shown.

Fallback: a stop string found here in a token the scheduler did not end is sent to the
scheduler (`StopStrMatched`), which frees the request then. That happens only when the scheduler
did not check the request (no tokenizer given to it, or its check failed on that request's
text); a request ends once (the scheduler holds a finished request no more, and the entry that
carries a finish ends the request here).
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from engine.actors.messages import AbortReq, BatchStrOut, BatchTokenOut, RegisterReq, StopStrMatched, StreamDelta
from engine.actors.runtime import Actor
from engine.detokenizer import IncrementalDetokenizer, StopStringMatcher


@dataclass
class _ReqState:
    detok: IncrementalDetokenizer
    matcher: StopStringMatcher | None
    completion_tokens: int = 0
    finished: bool = False


class OutputProcessor(Actor):
    accepts = (RegisterReq, BatchTokenOut)

    def __init__(self, tokenizer) -> None:
        super().__init__("output_processor")
        self.tokenizer = tokenizer
        self.receiver: Actor | None = None  # BatchStrOut
        self.dispatcher: Actor | None = None  # AbortReq, StopStrMatched (the fallback)
        self.states: dict[str, _ReqState] = {}

    async def handle(self, msg: msgspec.Struct) -> None:
        if isinstance(msg, RegisterReq):
            self.states[msg.rid] = _ReqState(
                IncrementalDetokenizer(self.tokenizer, msg.prompt_ids, msg.skip_special_tokens),
                StopStringMatcher(msg.stop_strs) if msg.stop_strs else None,
            )
            return
        deltas = []
        for i, rid in enumerate(msg.rids):
            try:
                delta = self._one(msg, i)
            except Exception as exc:  # one request's text failed: it alone ends, with the error
                self.message_failed(msg, exc)
                delta = self._fail(rid, f"internal error while detokenizing: {type(exc).__name__}: {exc}")
            if delta is not None:
                deltas.append(delta)
        if deltas:
            self.receiver.send(BatchStrOut(deltas))

    def on_message_error(self, msg: msgspec.Struct, exc: Exception) -> None:
        if isinstance(msg, RegisterReq):  # its output could never be shown: end it now
            self.receiver.send(BatchStrOut([self._fail(msg.rid, f"internal error: {type(exc).__name__}: {exc}")]))

    def _fail(self, rid: str, error: str) -> StreamDelta:
        """End `rid` with an error: its final (abort) delta, and the scheduler told to free it."""
        st = self.states.pop(rid, None)
        if st is not None:
            st.finished = True
        self.dispatcher.send(AbortReq(rid, error))
        done = st.completion_tokens if st is not None else 0
        return StreamDelta(rid, "", [], finish_reason="abort", error=error, completion_tokens=done)

    def _one(self, msg: BatchTokenOut, i: int) -> StreamDelta | None:
        rid = msg.rids[i]
        st = self.states.get(rid)
        if st is None or st.finished:
            return None  # unknown (never registered) or already ended by a stop string
        tok, reason = msg.token_ids[i], msg.finish_reasons[i]
        ids = [tok] if tok >= 0 else []
        st.completion_tokens += len(ids)
        # The token that ended a request by EOS / stop id is returned as an id but not as text.
        text = st.detok.add(ids) if ids and not (reason == "stop" and msg.matched[i] == tok) else ""
        matched_stop: int | str | None = msg.matched[i]
        hit = None
        if st.matcher is not None:
            text, hit = st.matcher.push(text)
        if reason is not None and hit is None:  # ending for another reason: release held text
            tail = st.detok.flush()
            if st.matcher is not None:
                tail, hit = st.matcher.push(tail)
                if hit is None:
                    tail += st.matcher.flush()
            text += tail
        if hit is not None:
            if reason is None:  # the fallback (see the module doc): the scheduler frees it now
                self.dispatcher.send(StopStrMatched(rid, hit))
            reason, matched_stop = "stop", hit
        if reason is not None:
            st.finished = True
            self.states.pop(rid, None)
        if not ids and not text and reason is None and msg.input_logprobs[i] is None:
            return None
        verify_ct, draft_tokens, accepted_tokens = msg.spec[i] or (None, None, None)
        return StreamDelta(
            rid=rid,
            text=text,
            token_ids=ids,
            finish_reason=reason,
            error=msg.messages[i] if reason == "abort" else None,
            prompt_tokens=msg.prompt_tokens[i],
            completion_tokens=st.completion_tokens,
            cached_tokens=msg.cached_tokens[i],
            matched_stop=matched_stop,
            queue_time=msg.queue_times[i],
            logprobs=[msg.logprobs[i]] if msg.logprobs[i] is not None and ids else None,
            top_logprobs=[msg.top_logprobs[i]] if msg.top_logprobs[i] is not None and ids else None,
            spec_verify_ct=verify_ct,
            spec_draft_tokens=draft_tokens,
            spec_accepted_tokens=accepted_tokens,
            input_logprobs=msg.input_logprobs[i],
            embedding=msg.embeddings[i],
            weight_version=msg.weight_version,
        )
