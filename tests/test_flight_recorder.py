"""Flight recorder and deterministic replay (issue 18 items 1-2).

A real run of the default model (chunked prefill, a retraction, aborts while decoding and while
waiting) is recorded, dumped and replayed with zero divergences; a changed scheduling rule makes
replay report the first divergence; the CLI's exit codes; the dump triggers (API, crash).
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp
import msgspec
import pytest

from engine import Engine, SamplingParams
from engine.errors import InvalidRequestError
from engine.recorder.events import BatchEvent, PlanEvent, RecvEvent, ResultEvent, RoundEvent, StrOutRec
from engine.recorder.replay import ReplayError, replay
from engine.recorder.ring import load_dump
from engine.scheduler.scheduler import Scheduler
from tests.sched_harness import build_tiny_folder
from tests.server_helpers import TINY_ARGS, ServerProcess, tiny_model_dir  # noqa: F401  (the fixture)

TIMEOUT = 300


def _workload(seed: int = 0) -> list[list[int]]:
    """Prompts of 20-180 tokens, half of them behind one of two shared prefixes."""
    rng = random.Random(seed)
    shared = [[rng.randrange(100, 40000) for _ in range(60)] for _ in range(2)]
    prompts = []
    for i in range(10):
        tail = [rng.randrange(100, 40000) for _ in range(rng.randint(20, 120))]
        prompts.append(shared[i % 2] + tail if i % 3 else tail)
    return prompts


async def _run_mixed(engine: Engine, prompts: list[list[int]]) -> list:
    """Concurrent requests; one aborted mid-decode, one aborted before it ran."""
    params = [SamplingParams(temperature=0.0, max_new_tokens=30 + 10 * (i % 4), ignore_eos=True) for i in range(10)]
    long = SamplingParams(temperature=0.0, max_new_tokens=200, ignore_eos=True)

    async def aborted_mid_decode() -> int:
        n = 0
        async for _ in engine.stream(prompts[0], long, rid="abort-mid"):
            n += 1
            if n == 3:
                await engine.abort("abort-mid")
        return n

    tasks = [asyncio.ensure_future(engine.generate(p, sp)) for p, sp in zip(prompts, params)]
    mid = asyncio.ensure_future(aborted_mid_decode())
    waiting = engine.open_stream(prompts[1], long, rid="abort-waiting")  # queued behind the others
    await engine.abort("abort-waiting")
    async with asyncio.timeout(TIMEOUT):
        outs = await asyncio.gather(*tasks, mid)
    await waiting.aclose()
    return outs


@pytest.fixture(scope="module")
def recorded_run(tmp_path_factory):
    """One real run of the default model: its dump's path and the engine's final state."""
    folder = tmp_path_factory.mktemp("flight")

    async def main():
        opts = dict(
            max_total_tokens=420, chunked_prefill_size=64, max_running_requests=6, flight_recorder_dir=str(folder)
        )
        async with Engine("smollm2-135m", **opts) as engine:
            await engine.set_internal_state(new_token_ratio=0.05)  # admit optimistically: a retraction follows
            await _run_mixed(engine, _workload())
            state = await engine.get_internal_state()
            return engine.dump_flight_recorder("test"), state

    return asyncio.run(main())


def test_real_run_replays_with_zero_divergences(recorded_run):
    path, state = recorded_run
    assert state["num_retractions"] > 0, "the workload must retract"
    dump = load_dump(path)
    assert dump.dropped == 0 and dump.reason == "test"
    kinds = {type(e) for e in dump.events}
    assert {RecvEvent, RoundEvent, PlanEvent, BatchEvent, ResultEvent} <= kinds
    modes = {e.batch.mode for e in dump.events if isinstance(e, BatchEvent) and e.batch is not None}
    assert modes == {"EXTEND", "DECODE"}
    chunks = [e for e in dump.events if isinstance(e, PlanEvent) and e.plan.new_chunked_rid is not None]
    assert chunks, "the workload must chunk a prompt"
    assert any(e.requeued for e in dump.events if isinstance(e, BatchEvent)), "a retraction is recorded"
    aborts = [
        e
        for e in dump.events
        if isinstance(e, RecvEvent) and e.actor == "scheduler" and e.msg.__class__.__name__ == "AbortReq"
    ]
    assert {a.msg.rid for a in aborts} >= {"abort-mid", "abort-waiting"}
    # Users' text never goes into a dump.
    received = [type(e.msg) for e in dump.events if isinstance(e, RecvEvent) and e.actor == "receiver"]
    assert StrOutRec in received and "BatchStrOut" not in {t.__name__ for t in received}

    report = replay(path)
    assert report.divergence is None, report.divergence.describe()
    assert report.decisions > 50 and report.steps > 10 and report.requests == 12


def test_changed_scheduling_rule_reports_first_divergence(recorded_run, monkeypatch):
    path, _ = recorded_run
    dump = load_dump(path)
    # A different rule for the decode headroom retraction keeps: the same run decides otherwise.
    monkeypatch.setattr("engine.scheduler.scheduler.RETRACT_DECODE_STEPS", 2)
    report = replay(dump)
    div = report.divergence
    assert div is not None
    text = div.describe()
    assert "divergence at event" in text and "recorded:" in text and "replayed:" in text
    assert div.context and len(div.context) <= 8
    # It is the first: every decision before it matched.
    first_retraction = next(i for i, e in enumerate(dump.events) if isinstance(e, BatchEvent) and e.requeued)
    assert div.index <= first_retraction


def test_replay_cli(recorded_run, tmp_path):
    path, _ = recorded_run
    ok = subprocess.run([sys.executable, "-m", "engine.replay", path], capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "0 divergences" in ok.stdout
    changed = subprocess.run(
        [sys.executable, "-m", "engine.replay", path, "--set", "chunked_prefill_size=32"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert changed.returncode == 1 and "divergence at event" in changed.stdout, changed.stdout + changed.stderr
    bad = tmp_path / "bad.msgpack"
    bad.write_bytes(b"not a dump")
    broken = subprocess.run([sys.executable, "-m", "engine.replay", str(bad)], capture_output=True, text=True)
    assert broken.returncode == 2 and "cannot replay" in broken.stderr


def test_truncated_dump_is_refused(recorded_run):
    path, _ = recorded_run
    dump = load_dump(path)
    truncated = msgspec.structs.replace(dump, dropped=5, events=dump.events[5:])
    with pytest.raises(ReplayError, match="starts mid-run"):
        replay(truncated)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory, default_tokenizer):
    return build_tiny_folder(tmp_path_factory.mktemp("tiny-flight"), default_tokenizer)


async def test_overlap_run_replays_and_ring_is_bounded(tiny_folder, tmp_path):
    opts = dict(dtype="float32", device="cpu", torch_threads=1, max_total_tokens=600, chunked_prefill_size=48)
    async with Engine(tiny_folder, enable_overlap=True, flight_recorder_dir=str(tmp_path), **opts) as engine:
        await _run_mixed(engine, _workload(1))
        path = engine.dump_flight_recorder()
        state = await engine.get_internal_state()
    assert state["flight_recorder"]["dropped"] == 0 and state["flight_recorder"]["last_dump"] == path
    report = replay(path)
    assert report.divergence is None, report.divergence.describe()
    async with Engine(tiny_folder, flight_recorder_size=50, flight_recorder_dir=str(tmp_path), **opts) as engine:
        await _run_mixed(engine, _workload(1))
        dump = load_dump(engine.dump_flight_recorder())
    assert len(dump.events) == 50 and dump.dropped > 0
    async with Engine(tiny_folder, flight_recorder_size=0, **opts) as engine:
        with pytest.raises(InvalidRequestError, match="off"):
            engine.dump_flight_recorder()
        assert "flight_recorder" not in await engine.get_internal_state()


async def test_crash_dumps_the_recorder(tiny_folder, tmp_path, monkeypatch):
    opts = dict(dtype="float32", device="cpu", torch_threads=1, flight_recorder_dir=str(tmp_path))
    async with Engine(tiny_folder, **opts) as engine:
        await engine.generate([5, 6, 7, 8], SamplingParams(max_new_tokens=3))

        def boom(*_: object) -> None:
            raise RuntimeError("scheduler bug")

        monkeypatch.setattr(Scheduler, "prefill_budget", boom)  # a crash outside message handling
        res = await engine.generate([5, 6, 7, 9], SamplingParams(max_new_tokens=3))
        assert res.finish_reason == "abort" and "scheduler bug" in res.error
        await asyncio.wait_for(engine.wait_unhealthy(), 10)
    dumps = list(tmp_path.glob("flight-*.msgpack"))
    assert len(dumps) == 1
    dump = load_dump(dumps[0])
    assert "scheduler bug" in dump.reason
    assert any(isinstance(e, ResultEvent) for e in dump.events)


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    dumps = tmp_path_factory.mktemp("flight-dumps")
    logs = tmp_path_factory.mktemp("flight-server-logs")
    args = (*TINY_ARGS, "--api-key", "sekrit", "--flight-recorder-dir", str(dumps), "--chunked-prefill-size", "16")
    srv = ServerProcess(tiny_model_dir, *args, log_dir=logs)
    srv.dumps = dumps
    yield srv.start()
    srv.stop()


async def test_dump_endpoint_and_sigusr1_replay(server):
    auth = {"Authorization": "Bearer sekrit"}
    gen = {"input_ids": list(range(5, 45)), "sampling_params": {"max_new_tokens": 6, "ignore_eos": True}}
    async with aiohttp.ClientSession() as s:
        for _ in range(2):
            async with s.post(server.url + "/generate", json=gen, headers=auth) as r:
                assert r.status == 200
        async with s.post(server.url + "/dump_flight_recorder") as r:
            assert r.status == 401  # an operator endpoint: behind the API key
        async with s.post(server.url + "/dump_flight_recorder", headers=auth) as r:
            assert r.status == 200, await r.text()
            body = await r.json()
    path = Path(body["path"])
    assert path.parent == server.dumps and body["dropped"] == 0 and body["recorded"] > 0
    report = replay(path)
    assert report.divergence is None and report.requests == 2 and report.steps >= 4
    os.kill(server.pid, signal.SIGUSR1)
    async with asyncio.timeout(30):
        while len(list(server.dumps.glob("flight-*.msgpack"))) < 2:
            await asyncio.sleep(0.05)
    newest = max(server.dumps.glob("flight-*.msgpack"), key=lambda p: p.stat().st_mtime)
    assert load_dump(newest).reason == "SIGUSR1"
    assert server.proc.poll() is None  # still serving
