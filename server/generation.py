"""`GenerationGroup`: the engine generations behind one client request, opened together,
merged into one `(index, delta)` sequence, and always closed.

One client request can mean several generations (`n > 1`, a batch of prompts). Opening them
validates eagerly (typed errors raise in `__aenter__`, before a streaming response commits to
200). Leaving the `async with` early for any reason (the client disconnected, a write failed,
the handler was cancelled, an error) aborts whatever still runs, so its KV memory is freed at
once, and releases the admission slots.

`abort(error)` ends a group from outside its handler (shutdown past the grace period, a
WebSocket cancel): the consumer's iteration raises `error` at its next step, so every handler
answers it the way it answers any error (an SSE error event then [DONE], a 503 JSON body, a
WebSocket's final `abort` delta) and then leaves the `async with`, which aborts the engine side.
An open group is listed in `ServerState.live` so that shutdown can find it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from engine import InvalidRequestError, Prompt, RequestStream, ResultBuilder, SamplingParams, StreamDelta
from server.errors import ApiError, to_api_error
from server.state import ServerState

log = logging.getLogger(__name__)

_END = object()
_WAKE = object()  # queued by abort() so a consumer blocked on the queue sees the abort at once


@dataclass
class GenSpec:
    prompt: Prompt
    params: SamplingParams
    rid: str | None = None
    return_logprob: bool = False
    top_logprobs_num: int = 0
    chat_template_kwargs: dict[str, Any] | None = None
    logprob_start_len: int = -1  # prompt log-probs from this position (engine.Engine.submit)
    lora_path: str | None = None  # the LoRA adapter's name (None: the base model)


class GenerationGroup:
    def __init__(
        self, state: ServerState, specs: list[GenSpec], rename_param: Callable[[str | None], str | None] | None = None
    ) -> None:
        self.state = state
        self.specs = specs
        # The engine's name of a bad field -> the one the client sent (OpenAI's response_format
        # is the engine's json_schema), for errors raised while opening.
        self.rename_param = rename_param
        self.aborted: ApiError | None = None  # set by abort(): what the consumer's iteration raises
        self._streams: list[RequestStream] = []
        self._tasks: list[asyncio.Task] = []
        self._queue: asyncio.Queue = asyncio.Queue()
        self._release = None

    async def __aenter__(self) -> GenerationGroup:
        self._release = self.state.admit(len(self.specs))
        self.state.live.add(self)
        try:
            engine = self.state.engine
            for s in self.specs:
                # awaits a grammar's compile (off the loop); its errors raise here, before any 200
                self._streams.append(
                    await engine.submit(
                        s.prompt,
                        s.params,
                        s.rid,
                        s.return_logprob,
                        s.top_logprobs_num,
                        s.chat_template_kwargs,
                        s.logprob_start_len,
                        lora_path=s.lora_path,
                    )
                )
        except InvalidRequestError as e:
            await self.aclose()
            error = to_api_error(e)
            if error is not None and self.rename_param is not None:
                error.param = self.rename_param(error.param)
            raise error or e from None
        except BaseException:
            await self.aclose()
            raise
        self._tasks = [asyncio.create_task(self._pump(i, s)) for i, s in enumerate(self._streams)]
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def abort(self, error: ApiError) -> None:
        """End the group early with `error` (see the module doc); a no-op once aborted.

        Synchronous so shutdown can end every open group in one pass; the engine-side abort
        happens when the handler leaves the group, while the engine still runs.
        """
        if self.aborted is None:
            self.aborted = error
            self._queue.put_nowait((-1, _WAKE))

    async def aclose(self) -> None:
        """Abort whatever still runs and release the admission slots; idempotent."""
        self.state.live.discard(self)
        try:
            for t in self._tasks:
                t.cancel()
            if self._tasks:
                await asyncio.gather(*self._tasks, return_exceptions=True)
        finally:
            for s in self._streams:  # also those whose pump never got to run
                try:
                    await s.aclose()
                except Exception:  # one failed abort must not leak the others or the admission slots
                    log.warning("could not abort generation %s", s.rid, exc_info=True)
            if self._release is not None:
                self._release()

    async def _pump(self, index: int, stream: RequestStream) -> None:
        rec = self.state.metrics.track()
        try:
            async for delta in stream:
                rec.on_delta(delta)
                self._queue.put_nowait((index, delta))
        except Exception as e:  # surfaced to the consumer, in order
            self._queue.put_nowait((index, e))
        finally:
            await stream.aclose()
            rec.finish()
            self._queue.put_nowait((index, _END))

    async def __aiter__(self) -> AsyncIterator[tuple[int, StreamDelta]]:
        remaining = len(self._tasks)
        while remaining:
            if self.aborted is not None:
                raise self.aborted
            index, item = await self._queue.get()
            if self.aborted is not None:  # deltas still queued are dropped: the group is over
                raise self.aborted
            if item is _END:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            elif item is not _WAKE:
                yield index, item

    async def collect(self) -> list[ResultBuilder]:
        outs = [ResultBuilder() for _ in self.specs]
        async for i, delta in self:
            outs[i].add(delta)
        return outs
