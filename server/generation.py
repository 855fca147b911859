"""`GenerationGroup`: the engine generations behind one client request, opened together,
merged into one `(index, delta)` sequence, and always closed.

One client request can mean several generations (`n > 1`, a batch of prompts). Opening them
validates eagerly (typed errors raise in `__aenter__`, before a streaming response commits to
200). Leaving the `async with` early for any reason (the client disconnected, a write failed,
the handler was cancelled, an error) aborts whatever still runs, so its KV memory is freed at
once, and releases the admission slots.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

from engine import Prompt, RequestStream, ResultBuilder, SamplingParams, StreamDelta
from server.state import ServerState

_END = object()


@dataclass
class GenSpec:
    prompt: Prompt
    params: SamplingParams
    rid: str | None = None
    return_logprob: bool = False
    top_logprobs_num: int = 0


class GenerationGroup:
    def __init__(self, state: ServerState, specs: list[GenSpec]) -> None:
        self.state = state
        self.specs = specs
        self._streams: list[RequestStream] = []
        self._tasks: list[asyncio.Task] = []
        self._queue: asyncio.Queue = asyncio.Queue()
        self._release = None

    async def __aenter__(self) -> GenerationGroup:
        self._release = self.state.admit(len(self.specs))
        try:
            engine = self.state.engine
            for s in self.specs:
                self._streams.append(
                    engine.open_stream(s.prompt, s.params, s.rid, s.return_logprob, s.top_logprobs_num)
                )
        except BaseException:
            await self.aclose()
            raise
        self._tasks = [asyncio.create_task(self._pump(i, s)) for i, s in enumerate(self._streams)]
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        try:
            for t in self._tasks:
                t.cancel()
            if self._tasks:
                await asyncio.gather(*self._tasks, return_exceptions=True)
        finally:
            for s in self._streams:  # also those whose pump never got to run
                await s.aclose()
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
            index, item = await self._queue.get()
            if item is _END:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item

    async def collect(self) -> list[ResultBuilder]:
        outs = [ResultBuilder() for _ in self.specs]
        async for i, delta in self:
            outs[i].add(delta)
        return outs
