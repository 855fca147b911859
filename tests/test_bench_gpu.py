"""bench/gpu.py on CPU: argument parsing, the no-GPU exit, and the pure arithmetic (bandwidth floor,
idle time from a profiler trace). The benchmark itself needs a GPU: `python -m bench.gpu`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.gpu import MODELS, parse_args
from bench.gpu_metrics import (
    STEP_PREFIX,
    bandwidth_floor_s,
    copy_bandwidth,
    decode_bytes_read,
    format_table,
    idle_between_steps,
    step_spans,
)

ROOT = Path(__file__).resolve().parents[1]


def test_parse_args_defaults_and_overrides():
    a = parse_args([])
    assert a.models == list(MODELS) and a.batch_sizes == [1, 32, 256] and not a.skip_hf and a.json is None
    a = parse_args(
        ["--models", "smollm2-135m", "--batch-sizes", "4", "8", "--input-len", "64", "--skip-hf", "--json", "out.json"]
    )
    assert a.models == ["smollm2-135m"] and a.batch_sizes == [4, 8] and a.input_len == 64 and a.skip_hf
    assert a.json == Path("out.json")
    assert a.throughput_workload == "W1x8"
    assert parse_args(["--throughput-workload", "uniform"]).throughput_workload == "uniform"
    bad_args = (["--batch-sizes", "0"], ["--decode-steps", "0"], ["--input-len", "x"])
    bad_args += (["--throughput-workload", "W1x0"], ["--throughput-workload", "W2"])
    for bad in bad_args:
        with pytest.raises(SystemExit) as e:
            parse_args(bad)
        assert e.value.code == 2


def test_bandwidth_floor_arithmetic():
    # 1 GB of weights, 12 KiB of K/V per token, 32 requests at 512 tokens, 2 TB/s
    kv = 12 * 1024
    assert decode_bytes_read(10**9, kv, [512] * 32) == 10**9 + kv * 512 * 32
    floor = bandwidth_floor_s(10**9, kv, [512] * 32, 2e12)
    assert floor == pytest.approx((10**9 + 201_326_592) / 2e12)
    assert bandwidth_floor_s(10**9, kv, [], 1e12) == pytest.approx(1e-3)  # weights alone
    assert copy_bandwidth(10**9, 0.001) == 2e12  # a copy reads and writes every byte
    with pytest.raises(ValueError):
        bandwidth_floor_s(1, 1, [1], 0.0)
    with pytest.raises(ValueError):
        copy_bandwidth(1, 0.0)


def _trace() -> list[dict]:
    """Three decode steps and one extend on the host; kernels joined to launches by correlation id."""
    ev: list[dict] = []

    def step(mode: str, ts: float, dur: float) -> None:
        ev.append({"ph": "X", "cat": "user_annotation", "name": STEP_PREFIX + mode, "ts": ts, "dur": dur})
        ev.append({"ph": "X", "cat": "gpu_user_annotation", "name": STEP_PREFIX + mode, "ts": ts + 1, "dur": dur})

    def launch(corr: int, ts: float, gpu_ts: float, gpu_dur: float, cat: str = "kernel") -> None:
        ev.append(
            {
                "ph": "X",
                "cat": "cuda_runtime",
                "name": "cudaLaunchKernel",
                "ts": ts,
                "dur": 1,
                "args": {"correlation": corr},
            }
        )
        ev.append({"ph": "X", "cat": cat, "name": "k", "ts": gpu_ts, "dur": gpu_dur, "args": {"correlation": corr}})

    step("decode", 0, 10)
    launch(1, 1, 5, 20)
    launch(2, 2, 25, 75)  # step 0 GPU span: 5..100
    step("decode", 20, 10)
    launch(3, 21, 110, 40, cat="gpu_memcpy")  # step 1: 110..150 (gap 10)
    step("decode", 40, 10)
    launch(4, 41, 150, 50)  # step 2: 150..200 (no gap)
    step("extend", 60, 5)
    launch(5, 61, 230, 10)  # step 3 (extend): 230..240
    step("decode", 70, 5)  # no GPU work: left out
    launch(6, 90, 300, 5)  # launched outside any step: ignored
    ev.append({"ph": "s", "cat": "ac2g", "name": "ac2g", "id": 1, "ts": 1})  # flow events carry no args
    return ev


def test_step_spans_and_idle_from_trace():
    spans = step_spans(_trace())
    assert spans == [("decode", 5, 100), ("decode", 110, 150), ("decode", 150, 200), ("extend", 230, 240)]
    frac, gap, pairs = idle_between_steps(spans)
    assert pairs == 2 and gap == pytest.approx(5.0)  # gaps 10 and 0
    assert frac == pytest.approx(10 / (10 + 40 + 0 + 50))
    assert idle_between_steps(spans, mode="extend") == (0.0, 0.0, 0)
    assert idle_between_steps([]) == (0.0, 0.0, 0)


def test_format_table():
    text = format_table(["model", "ms"], [["a", 1.23456], ["bb", None], ["c", 12345.6]])
    assert text.splitlines() == ["model     ms", "-----  -----", "    a   1.23", "   bb      -", "    c  12346"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU exit")
def test_exits_fast_without_cuda():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-m", "bench.gpu", "--skip-hf"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2, proc.stderr
    assert "needs a CUDA GPU" in proc.stderr and "torch.cuda.is_available() is False" in proc.stderr
