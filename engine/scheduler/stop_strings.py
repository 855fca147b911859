"""Stop strings checked by the scheduler, in the step whose token completes one (SGLang checks
them in `Req.check_finished`): the request finishes there with reason "stop" and `matched` = the
stop string, as an EOS would, so no forward planned after that step includes it.

The check sees exactly the text the OutputProcessor will show the user: the same
`IncrementalDetokenizer` (the prompt's last tokens as context, the request's
`skip_special_tokens`, the same decode call) and the same `StopStringMatcher`, fed the same
tokens (every output token except one that ended the request as EOS / a stop id, whose text is
never shown). Both are functions of the token sequence alone, so the scheduler matches at the
very token at which the OutputProcessor cuts the text, with the same stop string.

Why not SGLang's `tokenizer.decode(output_ids[-(max_stop_len + k):])`: a window counted in
tokens can hold fewer characters than the stop string (skipped special tokens, byte tokens of one
character), and its first token decodes without its context (a SentencePiece decoder drops its
leading space; a window starting inside a character begins with U+FFFD), so it could miss or move
a match the OutputProcessor finds. The incremental detokenizer's window is bounded as well (a few
tokens: one or two decodes of a short window per step).

Only requests with stop strings get a check (`attach_stop_check`, when the scheduler first places
them), so only they pay the decode.
"""

from __future__ import annotations

import logging
from typing import Any

from engine.detokenizer import IncrementalDetokenizer, StopStringMatcher
from engine.scheduler.req import Req

log = logging.getLogger(__name__)


class StopStringCheck:
    """One request's stop strings on the scheduler's side (`Req.stop_check`)."""

    __slots__ = ("detok", "matcher")

    def __init__(self, tokenizer: Any, req: Req) -> None:
        params = req.sampling_params
        self.detok = IncrementalDetokenizer(
            tokenizer, req.origin_input_ids, params.skip_special_tokens, keep_text=False
        )
        self.matcher = StopStringMatcher(params.stop_strs)

    def check(self, req: Req) -> str | None:
        """Feed `req`'s newest output token; the stop string its text completes, if any."""
        try:
            text = self.detok.add(req.output_ids[-1:])
            return self.matcher.push(text)[1] if text else None
        except Exception:
            # Never crash the scheduler over one request's text: stop checking it here. The
            # OutputProcessor (whose own detokenization would fail too) ends it, or its fallback
            # (`StopStrMatched`) does if it still finds the stop string.
            log.exception("stop-string check failed for request %s; left to the output processor", req.rid)
            req.stop_check = None
            return None


def attach_stop_check(req: Req, tokenizer: Any) -> None:
    """Give `req` its stop-string check if it has stop strings and has none yet (a retracted
    request keeps its own: its output so far is already fed)."""
    if tokenizer is not None and req.stop_check is None and req.sampling_params.stop_strs:
        req.stop_check = StopStringCheck(tokenizer, req)
