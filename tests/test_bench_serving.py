"""The load-test harness `python -m bench.serving` against the real server (subprocess, tiny
random model with the real SmolLM2 tokenizer), plus its dataset generators and arrival schedule.

Runs are in-process (`run_benchmark`, `main`) except one through the real command line; the
shared tiny server of tests/server_helpers.py is reused.
"""

from __future__ import annotations

import itertools
import json
import math
import subprocess
import sys

import numpy as np
import pytest

from bench import serving
from bench.serving_datasets import (
    Conversation,
    RandomText,
    ShareGPTSynthetic,
    Turn,
    multi_turn_dataset,
    random_dataset,
    sample_lengths,
    shared_prefix_dataset,
    sharegpt_synthetic_dataset,
    sharegpt_synthetic_lengths,
)
from bench.serving_report import RequestRecord
from bench.serving_tail import band_of, itl_tail
from tests.server_helpers import REPO, free_port, server_env, tiny_model_dir, tiny_server  # noqa: F401 (fixtures)

pytestmark = pytest.mark.timeout(180)


def _args(url: str, *extra: str) -> list[str]:
    return ["--base-url", url, "--disable-tqdm", "--warmup-requests", "0", *extra]


async def _run(url: str, tokenizer, *extra: str, conversations=None):
    return await serving.run_benchmark(serving.parse_args(_args(url, *extra)), tokenizer, conversations)


# ---- against the server -----------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["openai", "native", "ws"])
async def test_random_dataset_per_backend(tiny_server, default_tokenizer, tmp_path, backend):
    out_file = tmp_path / "result.json"
    res = await _run(
        tiny_server.url,
        default_tokenizer,
        "--backend",
        backend,
        "--num-prompts",
        "5",
        "--random-input-len",
        "40",
        "--random-output-len",
        "12",
        "--random-range-ratio",
        "0.5",
        "--warmup-requests",
        "1",
        "--output-file",
        str(out_file),
    )
    m = res.metrics
    assert (m.completed, m.failed) == (5, 0), m.errors
    expected = random_dataset(default_tokenizer, 5, 40, 12, 0.5, seed=1)  # the same seed: the same prompts
    for rec, conv in zip(res.records, expected):
        assert rec.success and rec.token_count_source == "server"
        assert rec.output_tokens == rec.requested_output_len == conv.turns[0].output_len  # ignore_eos: exact
        assert rec.prompt_tokens == conv.turns[0].prompt_len  # our re-encoded count is the server's
        assert 0 < rec.ttft_ms <= rec.e2e_ms
        assert len(rec.itl_ms) == len(rec.chunk_times_ms) - 1
        if backend != "openai":  # these protocols say how many tokens each chunk held
            assert sum(rec.chunk_tokens) == rec.output_tokens
    assert m.total_output_tokens == sum(c.turns[0].output_len for c in expected)
    assert 0 < m.ttft_ms.median <= m.e2e_ms.p99 and m.tpot_ms.mean > 0 and m.itl_ms.mean > 0
    chunks = sum(len(rec.chunk_times_ms) for rec in res.records)
    assert m.tokens_per_chunk == pytest.approx(m.total_output_tokens / chunks) and m.tokens_per_chunk >= 1
    assert "Output tokens per chunk:" in serving.format_table(res)
    tail = m.itl_tail
    assert tail is not None and tail.p99_ms == pytest.approx(m.itl_ms.p99)
    assert sum(b.itls for b in tail.by_in_flight) == sum(len(rec.itl_ms) for rec in res.records)
    assert all(1 <= b.low <= b.high <= 5 for b in tail.by_in_flight)  # 5 requests at most in flight
    assert "ITL by streams in flight" in serving.format_table(res)
    data = json.loads(out_file.read_text())
    assert data["metrics"]["itl_tail"]["tail_itls"] == tail.tail_itls
    for key in ("completed", "failed", "duration_s", "request_throughput", "output_throughput", "mean_concurrency"):
        assert key in data["metrics"], key
    for key in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
        assert set(data["metrics"][key]) == {"mean", "median", "p99"}
    assert len(data["requests"]) == 5 and data["config"]["backend"] == backend
    assert all(r["ttft_ms"] <= r["e2e_ms"] for r in data["requests"])


async def test_shared_prefix_dataset_runs(tiny_server, default_tokenizer):
    res = await _run(
        tiny_server.url,
        default_tokenizer,
        "--backend",
        "native",
        "--dataset",
        "shared-prefix",
        "--gsp-num-groups",
        "2",
        "--gsp-prompts-per-group",
        "3",
        "--gsp-system-prompt-len",
        "64",
        "--gsp-question-len",
        "8",
        "--gsp-output-len",
        "6",
        "--max-concurrency",
        "1",
    )
    assert (res.metrics.completed, res.metrics.failed) == (6, 0), res.metrics.errors
    assert [r.group for r in res.records] == [0, 0, 0, 1, 1, 1]
    assert all(r.output_tokens == 6 for r in res.records)
    # One at a time: every prompt after a group's first finds the shared system prefix cached.
    for r in res.records:
        if r.index % 3:
            assert r.cached_tokens >= 48, r


@pytest.mark.parametrize("backend", ["openai", "ws"])
async def test_multi_turn_dataset_runs(tiny_server, default_tokenizer, backend):
    res = await _run(
        tiny_server.url,
        default_tokenizer,
        "--backend",
        backend,
        "--dataset",
        "multi-turn",
        "--num-prompts",
        "2",
        "--multi-turn-num-turns",
        "3",
        "--random-input-len",
        "24",
        "--random-output-len",
        "6",
        "--random-range-ratio",
        "0.5",
    )
    assert (res.metrics.completed, res.metrics.failed) == (6, 0), res.metrics.errors
    for conv in (0, 1):
        turns = [r for r in res.records if r.conversation == conv]
        assert [r.turn for r in turns] == [0, 1, 2]
        for prev, nxt in itertools.pairwise(turns):
            assert nxt.start_ms >= prev.start_ms + prev.e2e_ms  # sent after the previous reply ended
            assert nxt.prompt_tokens > prev.prompt_tokens + 8  # the history grows by a turn of >= 12 tokens
            assert nxt.cached_tokens > 0  # ... and the server reuses it


async def test_failures_are_counted_not_fatal(tiny_server, default_tokenizer):
    maker = RandomText(default_tokenizer)
    rng = np.random.default_rng(0)
    ok_text, ok_len = maker.make(rng, 16)
    long_text, long_len = maker.make(rng, 2100)  # beyond the tiny model's 2048-token context
    convs = [Conversation([Turn(t, n, 4, n)]) for t, n in [(ok_text, ok_len), (long_text, long_len), (ok_text, ok_len)]]
    for backend in ("openai", "native", "ws"):
        res = await _run(tiny_server.url, default_tokenizer, "--backend", backend, conversations=convs)
        assert (res.metrics.completed, res.metrics.failed) == (2, 1), backend
        assert not res.records[1].success and "context length" in res.records[1].error, res.records[1].error
        assert res.metrics.errors == [{"message": res.records[1].error, "count": 1}]
        assert "context length" in serving.format_table(res)
    # Nothing listening: every request fails with the connection error, the run still returns.
    dead = f"http://127.0.0.1:{free_port()}"
    res = await _run(
        dead,
        default_tokenizer,
        "--backend",
        "native",
        "--model",
        "m",
        "--tokenizer",
        "t",
        "--num-prompts",
        "3",
        "--random-input-len",
        "8",
        "--random-output-len",
        "2",
    )
    assert (res.metrics.completed, res.metrics.failed) == (0, 3)
    assert "Connect" in res.records[0].error, res.records[0].error


async def test_flush_cache(tiny_server, default_tokenizer):
    flags = (
        "--backend",
        "native",
        "--num-prompts",
        "3",
        "--random-input-len",
        "24",
        "--random-output-len",
        "2",
        "--random-range-ratio",
        "1",
        "--seed",
        "11",
        "--max-concurrency",
        "1",
    )
    await _run(tiny_server.url, default_tokenizer, *flags)
    again = await _run(tiny_server.url, default_tokenizer, *flags)
    assert all(r.cached_tokens >= 20 for r in again.records)  # the same prompts: cached
    flushed = await _run(tiny_server.url, default_tokenizer, *flags, "--flush-cache")
    assert flushed.metrics.completed == 3 and all(r.cached_tokens == 0 for r in flushed.records)
    assert flushed.metrics.total_cached_tokens == 0


def test_cli_all_failed_exits_1_with_report(tiny_server, tiny_model_dir, tmp_path):
    """The real command line, once: a wrong --model fails every request (exit status 1 by the
    documented policy), yet the report and the JSON file are complete."""
    out_file = tmp_path / "fail.json"
    cmd = [
        sys.executable,
        "-m",
        "bench.serving",
        *_args(
            tiny_server.url,
            "--model",
            "no-such-model",
            "--tokenizer",
            tiny_model_dir,
            "--num-prompts",
            "3",
            "--random-input-len",
            "8",
            "--random-output-len",
            "4",
            "--output-file",
            str(out_file),
        ),
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=server_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "Serving Benchmark Result" in proc.stdout
    assert "Failed requests:                         3" in proc.stdout
    assert "[3x] HTTP 404: the model 'no-such-model' does not exist" in proc.stdout, proc.stdout
    data = json.loads(out_file.read_text())
    assert data["metrics"]["completed"] == 0 and data["metrics"]["failed"] == 3
    assert all("no-such-model" in r["error"] for r in data["requests"])


def test_main_plot_and_poisson_rate(tiny_server, tiny_model_dir, tmp_path, capsys):
    png, out_file = tmp_path / "plot.png", tmp_path / "r.json"
    rc = serving.main(
        _args(
            tiny_server.url,
            "--backend",
            "openai",
            "--tokenizer",
            tiny_model_dir,
            "--num-prompts",
            "4",
            "--random-input-len",
            "16",
            "--random-output-len",
            "8",
            "--request-rate",
            "20",
            "--seed",
            "3",
            "--plot",
            str(png),
            "--output-file",
            str(out_file),
        )
    )
    assert rc == 0
    assert "Successful requests:                     4" in capsys.readouterr().out
    blob = png.read_bytes()
    assert len(blob) > 1000 and blob[:8] == b"\x89PNG\r\n\x1a\n"
    # Requests were sent on the Poisson schedule, not all at once.
    starts = [r["start_ms"] / 1000 for r in json.loads(out_file.read_text())["requests"]]
    for start, offset in zip(starts, serving.poisson_arrivals(4, 20.0, 3)):
        assert offset - 0.005 <= start <= offset + 0.25
    assert starts[-1] > 0.02


# ---- generators and schedule (no server) ------------------------------------------------------


def test_sample_lengths_convention():
    rng = np.random.default_rng(0)
    got = sample_lengths(rng, 10, 0.5, 2000)
    assert set(got) == set(range(5, 11))  # [floor(10 * 0.5), 10], both ends included
    assert sample_lengths(rng, 7, 1.0, 50) == [7] * 50
    assert set(sample_lengths(rng, 3, 0.0, 500)) == {1, 2, 3}  # never 0
    assert set(sample_lengths(rng, 9, 0.125, 3000)) == set(range(1, 10))  # floor(1.125) = 1


def test_random_dataset_deterministic_and_lengths(default_tokenizer):
    a = random_dataset(default_tokenizer, 24, 64, 32, 0.25, seed=7)
    b = random_dataset(default_tokenizer, 24, 64, 32, 0.25, seed=7)
    c = random_dataset(default_tokenizer, 24, 64, 32, 0.25, seed=8)
    assert a == b and a != c
    special = set(default_tokenizer.all_special_ids)
    exact = 0
    for conv in a:
        (t,) = conv.turns
        assert 16 <= t.target_len <= 64 and 8 <= t.output_len <= 32
        ids = default_tokenizer.encode(t.text, add_special_tokens=False)
        assert t.prompt_len == len(ids) and not special & set(ids)
        assert abs(t.prompt_len - t.target_len) <= 2
        exact += t.prompt_len == t.target_len
    assert exact >= 20  # the fix-up rounds almost always land on the target


def test_shared_prefix_dataset_groups(default_tokenizer):
    convs = shared_prefix_dataset(default_tokenizer, 3, 4, 32, 8, 5, seed=2)
    assert convs == shared_prefix_dataset(default_tokenizer, 3, 4, 32, 8, 5, seed=2)
    assert [c.group for c in convs] == [g for g in range(3) for _ in range(4)]
    systems = [c.turns[0].text.split("\n\n")[0] for c in convs]
    questions = [c.turns[0].text[len(s) :] for c, s in zip(convs, systems)]
    for g in range(3):
        assert len(set(systems[4 * g : 4 * g + 4])) == 1  # one prefix per group
        assert len(set(questions[4 * g : 4 * g + 4])) == 4  # distinct questions
    assert len(set(systems)) == 3
    assert all(c.turns[0].output_len == 5 and abs(c.turns[0].prompt_len - 40) <= 4 for c in convs)


def test_multi_turn_dataset_shape(default_tokenizer):
    convs = multi_turn_dataset(default_tokenizer, 3, 4, 20, 10, 0.5, seed=5)
    assert convs == multi_turn_dataset(default_tokenizer, 3, 4, 20, 10, 0.5, seed=5)
    assert [len(c.turns) for c in convs] == [4, 4, 4]
    assert all(10 <= t.target_len <= 20 and 5 <= t.output_len <= 10 for c in convs for t in c.turns)


def test_sharegpt_synthetic(default_tokenizer):
    p = ShareGPTSynthetic()
    rng = np.random.default_rng(0)
    pairs = sharegpt_synthetic_lengths(rng, 4000, p)
    assert pairs == sharegpt_synthetic_lengths(np.random.default_rng(0), 4000, p)
    ins, outs = np.array(pairs).T
    assert ins.min() >= p.min_len and outs.min() >= p.min_len and ins.max() <= p.max_input_len
    assert (ins + outs).max() <= p.max_total_len
    assert 0.85 < np.median(ins) / p.input_median < 1.15 and 0.85 < np.median(outs) / p.output_median < 1.15
    assert 150 < ins.mean() < 260 and 150 < outs.mean() < 240  # ShareGPT-like means (see the docstring)
    convs = sharegpt_synthetic_dataset(default_tokenizer, 6, seed=4)
    assert convs == sharegpt_synthetic_dataset(default_tokenizer, 6, seed=4)
    assert [(c.turns[0].target_len, c.turns[0].output_len) for c in convs] == sharegpt_synthetic_lengths(
        np.random.default_rng(4), 6, p
    )


def test_poisson_arrivals():
    times = serving.poisson_arrivals(400, 10.0, seed=0)
    assert times == serving.poisson_arrivals(400, 10.0, seed=0)
    assert times != serving.poisson_arrivals(400, 10.0, seed=1)
    assert times[0] == 0.0 and all(b > a for a, b in itertools.pairwise(times))
    gaps = np.diff(times)
    assert 0.085 < gaps.mean() < 0.115  # mean 1 / rate
    assert 0.8 < gaps.std() / gaps.mean() < 1.2  # exponential: coefficient of variation 1
    assert serving.poisson_arrivals(5, math.inf, seed=0) == [0.0] * 5


def _record(index: int, start: float, chunks: list[float], success: bool = True) -> RequestRecord:
    return RequestRecord(
        index, index, 0, None, 8, len(chunks), success, "", 8, len(chunks), "server", None,
        start_ms=start, ttft_ms=chunks[0] - start, e2e_ms=chunks[-1] - start,
        itl_ms=[b - a for a, b in itertools.pairwise(chunks)], chunk_times_ms=chunks,
    )  # fmt: skip


def test_itl_tail_splits_gaps_by_streams_in_flight_and_prefills_spanned():
    """A streams alone, B joins at 15 ms and its first token lands at 35 ms, inside A's last gap;
    A ends at 40 ms, so B's gaps end with one stream in flight. A failed request counts nowhere."""
    a = _record(0, 0.0, [10.0, 20.0, 30.0, 40.0])
    b = _record(1, 15.0, [35.0, 45.0, 50.0])
    failed = _record(2, 12.0, [13.0, 60.0], success=False)
    tail = itl_tail([a, b, failed])
    assert tail is not None
    assert tail.p99_ms == pytest.approx(10.0) and tail.tail_itls == 4  # gaps 10, 10, 10, 10, 5
    bands = {(x.low, x.high): x for x in tail.by_in_flight}
    assert set(bands) == {(1, 1), (2, 2)}
    assert (bands[1, 1].itls, bands[1, 1].median_ms, bands[1, 1].at_or_above_p99) == (2, 7.5, 1)
    assert (bands[2, 2].itls, bands[2, 2].median_ms, bands[2, 2].at_or_above_p99) == (3, 10.0, 3)
    assert (tail.spanning_prefill, tail.spanning_prefill_at_or_above_p99) == (1, 1)  # A's 30-40 gap
    assert itl_tail([_record(0, 0.0, [5.0])]) is None  # one chunk: no gaps


def test_in_flight_bands():
    assert [band_of(n) for n in (1, 8, 9, 16, 17, 100)] == [(1, 1), (8, 8), (9, 16), (9, 16), (17, 32), (65, 128)]
