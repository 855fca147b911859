"""The operator's side of `Engine` (a base class it inherits): the torch profiler around the
forwards, the flight recorder's dump, the prefix cache's flush and the scheduler's run-time state
and knobs (what /start_profile, /dump_flight_recorder, /flush_cache, /get_server_info and the
dashboard call). The request API and the lifecycle are engine/engine.py's.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import torch

from engine.actors.generation_control import check_memory_tags, check_pause_mode
from engine.actors.messages import (
    AbortAllReq,
    ContinueGenerationReq,
    ControlReply,
    FlushCacheReq,
    GetInternalStateReq,
    MemoryOccupationReq,
    PauseGenerationReq,
    SetInternalStateReq,
    UpdateWeightsReq,
    WeightGroupReq,
)
from engine.distributed.weight_sync import check_weight_specs
from engine.errors import EngineError, InvalidRequestError, ModelLoadError
from engine.scheduler.internal_state import check_internal_state

_LOAD_FORMATS = (None, "auto", "safetensors", "gguf")


class EngineOperations:
    """Needs the engine's `_check()` (the Receiver of a healthy, started engine), `_loaded()`
    (its ModelRunner), `_scheduler`, `_profiler`, `_recorder`, `_system`, `_grammar_backend`,
    `_forward_threads` and `healthy`."""

    # ---- RL rollout: weight updates, pause / continue (engine/actors/generation_control.py) ----

    @property
    def weight_version(self) -> str:
        """The version of the weights serving now (`ServerArgs.weight_version`, then each update's)."""
        scheduler = self._scheduler
        return scheduler.control.weight_version if scheduler is not None else self.args.weight_version

    async def update_weights_from_disk(
        self,
        model_path: str,
        load_format: str | None = None,
        weight_version: str | None = None,
        abort_all_requests: bool = False,
        flush_cache: bool = True,
    ) -> str:
        """Serve the weights of another checkpoint of the same model (a folder or .gguf, as
        `model_path` at start-up); returns the new weight version. Requests already running end
        under the old weights first (new ones wait), unless `abort_all_requests`; while paused it
        applies at once. A checkpoint of other shapes or with a tensor missing is a
        ModelLoadError and the old weights keep serving."""
        if load_format not in _LOAD_FORMATS:
            raise InvalidRequestError(
                f"load_format must be auto, safetensors or gguf; got {load_format!r}", "load_format"
            )
        if not isinstance(model_path, str) or not model_path:
            raise InvalidRequestError("model_path must be a non-empty string", "model_path")
        options = dict(weight_version=weight_version, abort_all_requests=abort_all_requests, flush_cache=flush_cache)
        return await self._update_weights(model_path=model_path, **options)

    async def update_weights_from_tensor(
        self,
        named_tensors: list[tuple[str, torch.Tensor]],
        weight_version: str | None = None,
        abort_all_requests: bool = False,
        flush_cache: bool = True,
    ) -> str:
        """Overwrite weights by Hugging Face name (any subset: a trainer may send them in several
        calls, with `flush_cache=False` on all but the last); returns the new weight version.
        Every tensor is checked (name, shape, floating dtype) before any weight changes."""
        items = list(named_tensors)
        if not all(isinstance(i, tuple) and len(i) == 2 and isinstance(i[0], str) for i in items):
            raise InvalidRequestError("named_tensors must be (name, tensor) pairs", "named_tensors")
        options = dict(weight_version=weight_version, abort_all_requests=abort_all_requests, flush_cache=flush_cache)
        return await self._update_weights(named_tensors=items, **options)

    async def _update_weights(self, **fields: Any) -> str:
        """Send one `UpdateWeightsReq` (its source and options as `fields`) and await its outcome."""

        def make(reply_id: int) -> UpdateWeightsReq:
            return UpdateWeightsReq(reply_id=reply_id, **fields)

        reply = await self._check().control(make, timeout=None)  # waits for running requests
        if not reply.ok:
            message = f"weight update failed, the weights are unchanged: {reply.error}"
            kind = reply.payload.get("error_type")
            if kind == "InvalidRequestError":
                raise InvalidRequestError(message, "model_path" if "model_path" in fields else "named_tensors")
            raise (ModelLoadError if kind == "ModelLoadError" else EngineError)(message)
        return str(reply.payload["weight_version"])

    async def pause_generation(self, mode: str = "abort") -> None:
        """Stop generating (SGLang's modes: "abort" ends every request, "retract" sends the
        running ones back to the queue, "in_place" keeps them with their KV); returns once the
        pause holds. New requests queue until `continue_generation()`."""
        check_pause_mode(mode)
        await self._control(lambda reply_id: PauseGenerationReq(reply_id, mode))

    async def continue_generation(self) -> None:
        """Lift a pause: the paused and queued requests go on."""
        await self._control(ContinueGenerationReq)

    async def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Free the KV pool ("kv_cache") and/or the weights ("weights"; None: both) while a
        trainer uses the memory; running requests go back to the queue, and they and new ones
        wait there until `resume_memory_occupation`. Every cached prefix is dropped."""
        tags = check_memory_tags(tags)
        await self._control(lambda reply_id: MemoryOccupationReq(reply_id, True, tags))

    async def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Bring back what was released: a zeroed KV pool, and the weights of the checkpoint last
        loaded from disk (tensors sent since are not kept: send them again, as SGLang's trainers do);
        generation goes on once nothing is released."""
        tags = check_memory_tags(tags)
        await self._control(lambda reply_id: MemoryOccupationReq(reply_id, False, tags))

    async def abort_all(self, message: str = "aborted by the operator") -> None:
        """End every request, running or waiting (SGLang's abort_request with abort_all); returns
        once each has ended (its memory freed)."""
        receiver = self._check()
        open_now = list(receiver.streams)
        receiver.dispatcher.send(AbortAllReq(message))
        async with asyncio.timeout(30):
            while any(rid in receiver.streams for rid in open_now):
                await asyncio.sleep(0.001)

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "gloo",
    ) -> None:
        """Join a trainer's process group (the trainer is rank 0 and hosts it at
        master_address:master_port; this engine's ranks are rank_offset + tp rank); returns once
        every member has joined. The trainer side: engine/distributed/weight_sync.py."""
        params = dict(
            master_address=master_address,
            master_port=int(master_port),
            rank_offset=int(rank_offset),
            world_size=int(world_size),
            group_name=group_name,
            backend=backend,
        )
        await self._control(lambda reply_id: WeightGroupReq(reply_id, "init", params))

    async def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str = "weight_update_group",
        weight_version: str | None = None,
        abort_all_requests: bool = False,
        flush_cache: bool = True,
    ) -> str:
        """Take the weights the trainer broadcasts over the group, in the order of `names` (Hugging
        Face names, any subset, as `update_weights_from_tensor`); returns the new weight version.
        It waits for running requests as the other updates do; the trainer's sends wait for it."""
        check_weight_specs(names, dtypes, shapes)
        spec = {
            "group_name": group_name,
            "names": list(names),
            "dtypes": list(dtypes),
            "shapes": [list(s) for s in shapes],
        }
        options = dict(weight_version=weight_version, abort_all_requests=abort_all_requests, flush_cache=flush_cache)
        return await self._update_weights(from_group=spec, **options)

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> None:
        await self._control(lambda reply_id: WeightGroupReq(reply_id, "destroy", {"group_name": group_name}))

    async def _control(self, make) -> ControlReply:
        reply = await self._check().control(make, timeout=None)
        if not reply.ok:
            message = reply.error or "the scheduler refused"
            if reply.payload.get("error_type") == "InvalidRequestError":
                raise InvalidRequestError(message)
            raise EngineError(message)
        return reply

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
