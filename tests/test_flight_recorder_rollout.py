"""Flight-recorder replay of an RL rollout (engine/actors/generation_control.py): the rollout
controls, each a recorded step between forwards (`ControlEvent`), replay with zero divergences,
with overlap scheduling off and on."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine import Engine, SamplingParams
from engine.recorder.events import ControlEvent
from engine.recorder.replay import replay
from engine.recorder.ring import load_dump
from tests.sched_harness import build_tiny_folder

_rng = random.Random(2)
PROMPTS = [[_rng.randrange(100, 40000) for _ in range(n)] for n in (30, 75, 52, 110)]


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory, default_tokenizer):
    return build_tiny_folder(tmp_path_factory.mktemp("tiny-rollout"), default_tokenizer)


@pytest.mark.parametrize("overlap", [False, True])
async def test_a_rollout_with_pauses_updates_and_memory_release_replays(tiny_folder, tmp_path, overlap):
    """The rollout controls, each a recorded step between forwards (`ControlEvent`), replay with
    zero divergences: a pause that retracts requests mid-decode, an update applied while paused in
    place (the paused requests retracted first), a failed update (its recorded error stands in for
    the device's), an update waiting for the running requests to end, a memory release and resume."""
    opts = dict(dtype="float32", device="cpu", torch_threads=1, max_total_tokens=600, chunked_prefill_size=48)
    sp = SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True)
    prompts = PROMPTS
    async with Engine(tiny_folder, enable_overlap=overlap, flight_recorder_dir=str(tmp_path), **opts) as engine:

        async def rollout(pause_mode: str) -> list:
            streams = [engine.open_stream(p, sp) for p in prompts]
            firsts = [await s.__anext__() for s in streams]  # every request is decoding
            rest = [asyncio.ensure_future(_drain(s)) for s in streams]
            await engine.pause_generation(pause_mode)
            if pause_mode == "in_place":
                assert await engine.update_weights_from_disk(tiny_folder, weight_version="v-paused") == "v-paused"
            await engine.continue_generation()
            return [1 + n for n in await asyncio.gather(*rest)] if firsts else []

        assert await rollout("retract") == [40] * 4
        assert await rollout("in_place") == [40] * 4
        name, weight = next((n, t) for n, t in _named_weights(tiny_folder))
        with pytest.raises(Exception, match="shape"):  # checked on the device stream: nothing swapped
            await engine.update_weights_from_tensor([(name, torch.zeros(*weight.shape, 3))])
        running = [asyncio.ensure_future(engine.generate(p, sp)) for p in prompts]
        await asyncio.sleep(0)
        assert await engine.update_weights_from_disk(tiny_folder, weight_version="v-waited") == "v-waited"
        assert all(len(r.token_ids) == 40 for r in await asyncio.gather(*running))
        await engine.release_memory_occupation(["kv_cache"])
        late = asyncio.ensure_future(engine.generate(prompts[0], sp))  # queued while released
        await engine.resume_memory_occupation(["kv_cache"])
        assert len((await late).token_ids) == 40
        path = engine.dump_flight_recorder("rollout")
    dump = load_dump(path)
    steps = [(e.action, e.phase, e.error is not None) for e in dump.events if isinstance(e, ControlEvent)]
    assert ("pause", "end", False) in steps and ("update", "end", True) in steps
    assert steps.count(("update", "end", False)) == 2 and steps.count(("memory", "end", False)) == 2
    report = replay(path)
    assert report.divergence is None, report.divergence.describe()


async def _drain(stream) -> int:
    return sum([1 async for _ in stream])


def _named_weights(folder) -> list[tuple[str, torch.Tensor]]:
    return sorted(load_file(str(Path(folder) / "model.safetensors")).items())
