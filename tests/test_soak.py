"""The soak harness (bench/soak.py): its plan and its judge on made-up outcomes, then the short run
(200 requests: chat stream and not with n 1-3, /generate, /ws sessions; 30% aborted by disconnect,
/abort_request, ws cancel or ws close) against a real server with the tiny model, whose report must
pass every check, and a shorter one spread over LoRA adapters. The full 2,000-request run and its
numbers are in docs/RELIABILITY.md."""

from __future__ import annotations

import aiohttp
import pytest

from bench.soak import SoakConfig, run_soak
from bench.soak_checks import judge
from bench.soak_clients import Choice, Outcome
from bench.soak_plan import KINDS, AbortPlan, SoakRequest, build_plan
from bench.soak_server import write_adapters
from tests.server_helpers import TINY_ARGS, ServerProcess, tiny_model_dir  # noqa: F401 (fixture)


def test_the_plan_is_a_function_of_the_seed():
    a, b, c = build_plan(300, seed=7), build_plan(300, seed=7), build_plan(300, seed=8)
    assert [r.__dict__ for r in a.requests] == [r.__dict__ for r in b.requests]
    assert [r.__dict__ for r in a.requests] != [r.__dict__ for r in c.requests]
    reqs = a.requests
    assert sorted(r.index for r in reqs) == list(range(300))
    assert sum(r.abort is not None for r in reqs) == 90
    assert {r.kind for r in reqs} == set(KINDS)
    assert all(1 <= r.max_tokens <= 64 for r in reqs)
    assert {r.n for r in reqs if r.kind.startswith("chat")} == {1, 2, 3}
    assert any(r.greedy for r in reqs) and not all(r.greedy for r in reqs)
    ws_units = [u for u in a.units if u.kind == "ws"]
    assert ws_units and max(len(u.requests) for u in ws_units) > 1
    for u in ws_units:  # a socket is closed at most once
        assert sum(r.abort is not None and r.abort.mode == "ws_close" for r in u.requests) <= 1
    good = [u for u in a.units if u.kind != "invalid"]
    assert len(a.units) - len(good) == len(good) // 50  # one bad request after every 50 units
    warm = sum(len(u.requests) for u in a.units[: a.warmup_units])
    assert 30 <= warm < 30 + 6
    lora = build_plan(300, seed=7, adapters=["x", "y"])  # the same requests, each under an adapter or the base
    assert [{**r.__dict__, "adapter": None} for r in lora.requests] == [r.__dict__ for r in reqs]
    assert {r.adapter for r in lora.requests} == {None, "x", "y"} and lora.adapters == ["x", "y"]


def _req(kind: str = "generate", n: int = 1, max_tokens: int = 5, abort: AbortPlan | None = None) -> SoakRequest:
    return SoakRequest(0, kind, None, "", "hi", max_tokens, n, 0.0, False, abort)


def _out(kind: str, *choices: Choice, usage: int | None = None) -> Outcome:
    return Outcome(0, kind, list(choices), usage_completion=usage)


def test_judge_requires_exact_counts_and_length():
    exact = Choice("t", [1, 2, 3, 4, 5], 5, 5, "length")
    assert judge(_req(), _out("generate", exact)) == "ok"
    short = Choice("t", [1, 2, 3, 4], 4, 4, "length")
    out = _out("generate", short)
    assert judge(_req(), out) == "failed" and "4 tokens in the response" in out.errors[0]
    out = _out("generate", Choice("t", [1], 1, 1, "stop"))
    assert judge(_req(), out) == "failed" and "'stop'" in out.errors[0]
    chat = _req("chat", n=2)
    assert judge(chat, _out("chat", Choice(finish="length"), Choice(finish="length"), usage=10)) == "ok"
    out = _out("chat", Choice(finish="length"), Choice(finish="length"), usage=9)
    assert judge(chat, out) == "failed" and "usage.completion_tokens=9" in out.errors[0]


def test_judge_aborts():
    aborted = Choice("t", [1, 2], 2, 2, "abort")
    out = _out("generate", aborted)
    assert judge(_req(), out) == "failed" and "nobody aborted it" in out.errors[0]
    planned = _req(abort=AbortPlan("abort_request", 2, 0.5))
    out = _out("generate", aborted)
    out.abort_sent = True
    assert judge(planned, out) == "aborted"
    out = _out("generate", Choice("t", [1, 2, 3, 4, 5], 5, 5, "length"))
    out.abort_sent = True  # the request finished before the abort landed: checked as usual
    assert judge(planned, out) == "ok"
    out = _out("ws", Choice(token_ids=[1], counted=1))
    out.disconnected = out.collateral = True
    assert judge(_req("ws"), out) == "aborted"


@pytest.fixture
def soak_server(tmp_path, tiny_model_dir):
    """A server of its own: its log must have no traceback, its RSS is measured."""
    srv = ServerProcess(tiny_model_dir, *TINY_ARGS, log_dir=tmp_path).start()
    yield srv
    srv.stop()


@pytest.mark.timeout(300)
async def test_short_soak_passes(soak_server):
    cfg = SoakConfig(
        url=soak_server.url,
        num_requests=200,
        concurrency=16,
        seed=0,
        greedy_sample=10,
        server_pid=soak_server.proc.pid,
        server_log=soak_server.log_path,
    )
    report = await run_soak(cfg)
    assert "error" not in report, report["error"]
    totals = report["totals"]
    assert totals["requests"] == 200 and totals["ok"] + totals["aborted"] + totals.get("failed", 0) == 200
    for kind, counts in report["per_endpoint"].items():  # every endpoint both completed and aborted
        assert counts.get("ok", 0) > 0 and counts.get("aborted", 0) > 0, (kind, counts)
    assert report["greedy"]["checked"] == 10 and report["bad_requests"]["sent"] > 0
    assert report["rss_mb"]["growth"] is not None and report["server_log"] is not None
    summary = {k: report[k] for k in ("checks", "failures", "server_errors_5xx", "greedy", "idle", "memory")}
    assert report["passed"], summary


@pytest.mark.timeout(300)
async def test_short_soak_with_adapters_passes(tmp_path, tiny_model_dir):
    """Requests spread over three LoRA adapters and the base model, at most two adapters per
    forward (so the pool's slots are swapped all along); the greedy re-runs use the same adapter."""
    names = ["s0", "s1", "s2"]
    adapters = write_adapters(tiny_model_dir, names, tmp_path)
    lora = ["--enable-lora", "--max-loras-per-batch", "2", "--lora-paths", *adapters]
    srv = ServerProcess(tiny_model_dir, *TINY_ARGS, *lora, log_dir=tmp_path).start()
    try:
        cfg = SoakConfig(
            url=srv.url,
            num_requests=120,
            concurrency=16,
            seed=3,
            greedy_sample=12,
            server_pid=srv.proc.pid,
            server_log=srv.log_path,
            adapters=names,
        )
        report = await run_soak(cfg)
        outputs = set()  # the adapters do change the tokens: a server ignoring them would not pass this
        async with aiohttp.ClientSession() as s:
            for name in [None, *names]:
                body = {"text": "Document 1: the river", "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
                async with s.post(srv.url + "/generate", json=body | {"lora_path": name}) as r:
                    outputs.add(tuple((await r.json())["output_ids"]))
    finally:
        srv.stop()
    assert len(outputs) == 4, outputs
    assert "error" not in report, report["error"]
    assert set(report["per_adapter"]) == {"(base model)", *names}
    for name, counts in report["per_adapter"].items():
        assert counts.get("ok", 0) > 0, (name, counts)
    assert report["greedy"]["checked"] == 12 and report["http_statuses"].get("/generate 400", 0) > 0
    summary = {k: report[k] for k in ("checks", "failures", "server_errors_5xx", "greedy", "idle", "memory")}
    assert report["passed"], summary
