"""Flight recorder and deterministic replay (issue 18 items 1-2).

A real run of the default model (chunked prefill, a retraction, aborts while decoding and while
waiting) is recorded, dumped and replayed with zero divergences; a changed scheduling rule makes
replay report the first divergence; the CLI's exit codes; the dump triggers (API, crash).
Privacy: dumps are 0600 files in a 0700 folder of ours, written atomically; by default they hold
no prompt token ids, prompt text or stop strings, and still replay with zero divergences.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import stat
import subprocess
import sys
from pathlib import Path

import aiohttp
import msgspec
import pytest

from engine import Engine, SamplingParams
from engine.actors.messages import RegisterReq, StopStrMatched, TokenizedGenerateReq
from engine.errors import InvalidRequestError
from engine.recorder.events import (
    BatchEvent,
    Header,
    PlanEvent,
    RecvEvent,
    ResultEvent,
    RoundEvent,
    StrOutRec,
)
from engine.recorder.redact import STAND_IN_BASE, Redactor, redact_params
from engine.recorder.replay import ReplayError, replay
from engine.recorder.ring import FlightRecorder, load_dump
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

    # The default keeps no prompt: stand-in ids of the same lengths, and the prefixes the
    # workload shares still hit the radix cache in the recording, which replay rebuilds.
    assert dump.header.prompts_recorded is False
    assert sum(e.plan.hit_tokens for e in dump.events if isinstance(e, PlanEvent)) > 0
    _assert_no_prompt(Path(path).read_bytes(), dump, _workload())

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
    assert "0 divergences" in ok.stdout and "prompts redacted" in ok.stdout
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
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(server.dumps.stat().st_mode) == 0o700
    dump = load_dump(path)  # the server's default: no prompts
    assert dump.header.prompts_recorded is False
    _assert_no_prompt(path.read_bytes(), dump, [gen["input_ids"]])
    report = replay(path)
    assert report.divergence is None and report.requests == 2 and report.steps >= 4
    os.kill(server.pid, signal.SIGUSR1)
    async with asyncio.timeout(30):
        while len(list(server.dumps.glob("flight-*.msgpack"))) < 2:
            await asyncio.sleep(0.05)
    newest = max(server.dumps.glob("flight-*.msgpack"), key=lambda p: p.stat().st_mtime)
    assert load_dump(newest).reason == "SIGUSR1"
    assert server.proc.poll() is None  # still serving


# ---- privacy --------------------------------------------------------------------------------------


def _generate_reqs(dump) -> list[TokenizedGenerateReq]:
    return [e.msg for e in dump.events if isinstance(e, RecvEvent) and isinstance(e.msg, TokenizedGenerateReq)]


def _window_bytes(ids: list[int]) -> bytes:
    """How a run of token ids looks inside a msgpack list (each id encoded after the other)."""
    return b"".join(msgspec.msgpack.encode(t) for t in ids)


def _assert_no_ids(raw: bytes, ids: list[int]) -> None:
    for start in range(0, len(ids) - 7, 8):
        assert _window_bytes(ids[start : start + 8]) not in raw, f"prompt ids at {start} are in the dump"


def _assert_no_prompt(raw: bytes, dump, prompts: list[list[int]]) -> None:
    """No prompt's ids (any 8 in a row) in the dump's bytes; its requests carry stand-in ids."""
    for prompt in prompts:
        _assert_no_ids(raw, prompt)
    reqs = _generate_reqs(dump)
    assert reqs and all(min(r.input_ids) >= STAND_IN_BASE for r in reqs)
    assert {len(p) for p in prompts} <= {len(r.input_ids) for r in reqs}  # the lengths are kept
    for msg in (e.msg for e in dump.events if isinstance(e, RecvEvent) and isinstance(e.msg, RegisterReq)):
        assert msg.prompt_ids == []


def _header(prompts_recorded: bool, page_size: int = 1) -> Header:
    return Header(1, "test", 0.0, {}, 100, 64, [2], 4, 64, 64, page_size, False, prompts_recorded=prompts_recorded)


def test_dump_files_are_private(tmp_path, monkeypatch):
    recorder = FlightRecorder(10, _header(True), tmp_path / "a" / "dumps")
    recorder.recv("prefill_adder", TokenizedGenerateReq("r1", [5, 6, 7], SamplingParams(), 0))
    old_umask = os.umask(0)  # even a umask that lets everything through
    try:
        path = recorder.dump("test")
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert os.listdir(path.parent) == [path.name]  # the temp file was renamed, not left
    assert load_dump(path).events[0].msg.input_ids == [5, 6, 7]

    # A folder of ours others can read is tightened.
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o755)
    os.chmod(loose, 0o755)
    path = recorder.dump("test", loose)
    assert stat.S_IMODE(loose.stat().st_mode) == 0o700 and stat.S_IMODE(path.stat().st_mode) == 0o600

    # A failed write leaves neither the dump nor its temp file.
    def broken_replace(*_: object, **__: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        recorder.dump("test", loose)
    monkeypatch.undo()
    assert os.listdir(loose) == [path.name]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make files another user owns")
def test_dump_refuses_folders_and_symlinks_of_other_users(tmp_path):
    recorder = FlightRecorder(10, _header(False), tmp_path / "unused")
    recorder.recv("prefill_adder", TokenizedGenerateReq("r1", [5, 6, 7], SamplingParams(), 0))
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o777)
    os.chown(theirs, 12345, 12345)
    with pytest.raises(PermissionError, match="belongs to uid 12345"):
        recorder.dump("test", theirs)
    assert os.listdir(theirs) == []
    ours = tmp_path / "ours"
    ours.mkdir(mode=0o700)
    planted = tmp_path / "planted"
    planted.symlink_to(ours)
    os.lchown(planted, 12345, 12345)
    with pytest.raises(PermissionError, match="symlink owned by uid 12345"):
        recorder.dump("test", planted)
    assert os.listdir(ours) == []


def test_redactor_keeps_page_aligned_prefix_sharing():
    for page in (1, 4):
        redactor = Redactor(page)
        base = list(range(100, 120))
        same, forked = redactor.stand_in_ids(base), redactor.stand_in_ids(base[:9] + [7] + base[10:])
        assert redactor.stand_in_ids(base) == same and len(same) == len(base)
        shared = 9 // page * page  # whole pages before the changed token
        assert same[:shared] == forked[:shared]
        assert all(a != b for a, b in zip(same[shared:], forked[shared:]))
        assert min(same) >= STAND_IN_BASE
    # Another recorder draws another key: its ids cannot be matched against a guessed prompt.
    assert Redactor(1).stand_in_ids(base) != Redactor(1).stand_in_ids(base)

    params = redact_params(SamplingParams(stop=["swordfish", "x"], regex="[a-z]+secret", max_new_tokens=9))
    assert params.stop == ["<redacted: 9 chars>", "<redacted: 1 chars>"]
    assert params.regex == "<redacted: 12 chars>" and params.max_new_tokens == 9
    schema = redact_params(SamplingParams(json_schema={"title": "secret"})).json_schema
    assert "secret" not in schema
    redacted = Redactor(1).redact(StopStrMatched("r", "swordfish"))
    assert redacted.matched == "<redacted: 9 chars>"


SECRET_TEXT = "the vault passphrase is correct horse battery staple, tell nobody"
SECRET_STOP = "swordfish-stop"


async def _private_run(engine: Engine, prompts: list[list[int]]) -> None:
    """A shared prefix cached first (a radix hit for the rest), then a mixed concurrent run and
    a text prompt with a stop string."""
    await engine.generate(prompts[1], SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True))
    await _run_mixed(engine, prompts)
    params = SamplingParams(temperature=0.0, max_new_tokens=8, stop=[SECRET_STOP])
    await engine.generate(SECRET_TEXT, params)


async def test_default_dump_holds_no_prompt_and_replays(tiny_folder, tmp_path, default_tokenizer):
    opts = dict(dtype="float32", device="cpu", torch_threads=1, max_total_tokens=600, chunked_prefill_size=48)
    prompts = _workload(2)
    text_ids = default_tokenizer.encode(SECRET_TEXT, add_special_tokens=False)

    async with Engine(tiny_folder, flight_recorder_dir=str(tmp_path / "off"), **opts) as engine:
        await _private_run(engine, prompts)
        path = Path(engine.dump_flight_recorder("test"))
    raw = path.read_bytes()
    dump = load_dump(raw)
    assert dump.header.prompts_recorded is False
    assert sum(e.plan.hit_tokens for e in dump.events if isinstance(e, PlanEvent)) > 0, "a radix hit is recorded"
    assert any(isinstance(e, PlanEvent) and e.plan.new_chunked_rid for e in dump.events), "a prompt is chunked"
    _assert_no_prompt(raw, dump, prompts)
    _assert_no_ids(raw, text_ids[1:])  # (the engine's own tokenization may differ at its start)
    for secret in (SECRET_TEXT, "passphrase", SECRET_STOP):
        assert secret.encode() not in raw
    stops = [r.sampling_params.stop for r in _generate_reqs(dump) if r.sampling_params.stop]
    assert stops and all(s == [f"<redacted: {len(SECRET_STOP)} chars>"] for s in stops)
    report = replay(path)
    assert report.divergence is None, report.divergence.describe()
    assert report.requests == len(prompts) + 4

    # Prompts on: recorded as they were, and the same run replays too.
    on = dict(opts, flight_recorder_record_prompts=True, flight_recorder_dir=str(tmp_path / "on"))
    async with Engine(tiny_folder, **on) as engine:
        await _private_run(engine, prompts)
        path = Path(engine.dump_flight_recorder("test"))
    raw = path.read_bytes()
    dump = load_dump(raw)
    assert dump.header.prompts_recorded is True
    recorded = [r.input_ids for r in _generate_reqs(dump)]
    assert all(p in recorded for p in prompts)
    assert msgspec.msgpack.encode(prompts[0]) in raw and SECRET_STOP.encode() in raw
    # The searches above would have found them: the same needles are in this dump.
    assert _window_bytes(prompts[3][8:16]) in raw and _window_bytes(text_ids[1:9]) in raw
    report = replay(path)
    assert report.divergence is None, report.divergence.describe()
