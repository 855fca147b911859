"""The operator's side of `Engine` (a base class it inherits): the torch profiler around the
forwards, the flight recorder's dump, the prefix cache's flush and the scheduler's run-time state
and knobs (what /start_profile, /dump_flight_recorder, /flush_cache, /get_server_info and the
dashboard call). The request API and the lifecycle are engine/engine.py's.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from engine.actors.messages import FlushCacheReq, GetInternalStateReq, SetInternalStateReq
from engine.errors import InvalidRequestError
from engine.scheduler.internal_state import check_internal_state


class EngineOperations:
    """Needs the engine's `_check()` (the Receiver of a healthy, started engine), `_loaded()`
    (its ModelRunner), `_profiler`, `_recorder`, `_system`, `_grammar_backend`,
    `_forward_threads` and `healthy`."""

    async def start_profile(
        self, output_dir: str | None = None, num_steps: int | None = None, activities: list[str] | None = None
    ) -> str:
        """Start torch.profiler around the forwards (SGLang's /start_profile); returns the path the
        trace will be written to (`output_dir`, default `profile_dir`). With `num_steps` it stops
        by itself after that many forwards; else `stop_profile()` stops it. `activities`: "CPU",
        "GPU" (default both, GPU only where there is one)."""
        self._check()
        return str(await self._profiler.start(output_dir, num_steps, activities))

    async def stop_profile(self) -> str:
        """Stop the running profile and write its Chrome-trace JSON; returns its path."""
        self._check()
        return str(await self._profiler.stop())

    @property
    def last_profile(self) -> str | None:
        """The latest trace written, by `stop_profile` or after `num_steps` forwards."""
        trace = self._profiler.last_trace if self._profiler is not None else None
        return str(trace) if trace is not None else None

    def dump_flight_recorder(self, reason: str = "requested", directory: str | None = None) -> str:
        """Write the flight recorder's events to a file (in `flight_recorder_dir`, or `directory`)
        and return its path; `python -m engine.replay PATH` replays it. Works on a dead engine too."""
        if self._recorder is None:
            raise InvalidRequestError("the flight recorder is off (flight_recorder_size=0)", "flight_recorder_size")
        return str(self._recorder.dump(reason, directory))

    async def flush_cache(self) -> bool:
        reply = await self._check().control(FlushCacheReq)
        return reply.ok

    async def get_internal_state(self, detail: bool = False) -> dict[str, Any]:
        """The scheduler's counters and the engine's health; `detail` adds the radix summary
        (`radix_top`), per-request timelines and the scheduler's clock (the dashboard's data)."""
        reply = await self._check().control(lambda reply_id: GetInternalStateReq(reply_id, detail))
        state = dict(reply.payload)
        stats = self._system.stats() if self._system else []
        state["healthy"] = self.healthy
        state["actors"] = [s.name + ":" + s.state for s in stats]
        state["message_errors"] = sum(s.message_errors for s in stats)  # handled, contained failures
        state["torch_threads"] = {"event_loop": torch.get_num_threads(), "forward": self._forward_threads}
        # Each tensor-parallel rank's placement, weight bytes and KV pool (one entry at tp size 1).
        state["tensor_parallel"] = self._loaded().tp_ranks
        if (rec := self._recorder) is not None:
            last = str(rec.last_dump) if rec.last_dump is not None else None
            state["flight_recorder"] = {
                "size": rec.size,
                "recorded": rec.recorded,
                "dropped": rec.dropped,
                "last_dump": last,
            }
        if self._grammar_backend is not None:
            state["grammar_cache"] = dataclasses.asdict(self._grammar_backend.cache_info())
        return state

    async def set_internal_state(self, **state: Any) -> dict[str, Any]:
        """Change scheduler knobs at run time (`max_running_requests`, `new_token_ratio`); a bad
        name or value is an InvalidRequestError naming it, and changes nothing."""
        receiver = self._check()
        check_internal_state(state)
        reply = await receiver.control(lambda reply_id: SetInternalStateReq(reply_id, state))
        if not reply.ok:
            raise InvalidRequestError(reply.error or "cannot set internal state", "state")
        return dict(reply.payload)
