"""Profiler endpoints (issue 18, item 3): torch.profiler around the engine's forwards, in process
and through POST /start_profile and /stop_profile; each trace is a Chrome trace that loads and
holds the forwards' `forward:<mode>` annotations."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import pytest

from engine import FORWARD_ANNOTATION, InvalidRequestError, SamplingParams
from tests.server_helpers import TINY_ARGS, ServerProcess, tiny_model_dir  # noqa: F401  (the fixture)
from tests.test_engine import tiny_engine, tiny_tok_folder  # noqa: F401  (the fixture)

PARAMS = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)


def forward_events(path: str | Path) -> list[str]:
    trace = json.loads(Path(path).read_text())
    return [e["name"] for e in trace["traceEvents"] if str(e.get("name", "")).startswith(FORWARD_ANNOTATION)]


async def test_profile_until_stopped_and_for_n_steps(tiny_tok_folder, tmp_path):
    async with tiny_engine(tiny_tok_folder) as engine:
        with pytest.raises(InvalidRequestError):
            await engine.stop_profile()
        path = await engine.start_profile(output_dir=str(tmp_path))
        with pytest.raises(InvalidRequestError):
            await engine.start_profile(output_dir=str(tmp_path))
        await engine.generate([5, 6, 7, 8], PARAMS)
        assert await engine.stop_profile() == path
        names = forward_events(path)
        assert names.count(FORWARD_ANNOTATION + "extend") >= 1 and names.count(FORWARD_ANNOTATION + "decode") >= 5

        path = await engine.start_profile(output_dir=str(tmp_path / "n"), num_steps=2)
        await engine.generate([9, 10, 11], PARAMS)  # 6 forwards: the profile ends after 2
        async with asyncio.timeout(30):
            while engine.last_profile != path:
                await asyncio.sleep(0.02)
        assert len(forward_events(path)) == 2  # overlap is off on a CPU: exactly the 2 asked for
        with pytest.raises(InvalidRequestError):
            await engine.start_profile(num_steps=0)
        with pytest.raises(InvalidRequestError):
            await engine.start_profile(activities=["TPU"])

        left_running = await engine.start_profile(output_dir=str(tmp_path / "left"))
    assert Path(left_running).exists()  # written when the engine stopped


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    profiles = tmp_path_factory.mktemp("profiles")
    logs = tmp_path_factory.mktemp("profile-server-logs")
    srv = ServerProcess(tiny_model_dir, *TINY_ARGS, "--profile-dir", str(profiles), log_dir=logs)
    srv.profiles = profiles
    yield srv.start()
    srv.stop()


async def test_profile_endpoints(server):
    async with aiohttp.ClientSession() as s:
        gen = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 5, "ignore_eos": True}}
        async with s.post(server.url + "/start_profile") as r:  # no body: until stopped
            assert r.status == 200, await r.text()
            trace = (await r.json())["trace"]
        assert Path(trace).parent == server.profiles
        async with s.post(server.url + "/generate", json=gen) as r:
            assert r.status == 200
        async with s.post(server.url + "/stop_profile") as r:
            assert r.status == 200 and (await r.json())["trace"] == trace
        assert forward_events(trace)
        async with s.post(server.url + "/stop_profile") as r:
            assert r.status == 400 and (await r.json())["error"]["param"] == "profile"

        async with s.post(server.url + "/start_profile", json={"num_steps": 2, "output_dir": "/etc"}) as r:
            assert r.status == 200
            trace = (await r.json())["trace"]
        assert Path(trace).parent == server.profiles  # output_dir from a client is ignored
        async with s.post(server.url + "/generate", json=gen) as r:
            assert r.status == 200
        async with asyncio.timeout(30):
            while not Path(trace).exists():
                await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)  # written by the profiler's own task: let the write finish
        assert forward_events(trace)
        async with s.post(server.url + "/start_profile", json={"num_steps": 0}) as r:
            assert r.status == 400 and (await r.json())["error"]["param"] == "num_steps"
