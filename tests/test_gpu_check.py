"""bench/gpu_check.sh, the one prepared GPU check, starts on a CPU: `--dry-run` runs every step's entry
point (imports and argument parsing; the gpu tests are collected) and writes its summary JSON. The
real run needs a GPU (docs/PERFORMANCE.md has its results)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_check.sh"
STEPS = ["env", "tests", "parity", "bench", "soak"]


def _run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_dry_run_starts_every_step(tmp_path: Path) -> None:
    proc = _run(tmp_path, "--dry-run")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((tmp_path / "gpu_check.json").read_text())
    assert summary["dry_run"] and summary["passed"]
    assert [s["step"] for s in summary["steps"]] == STEPS
    assert all(s["status"] == "ok" and s["rc"] == 0 for s in summary["steps"])
    log = (tmp_path / "gpu_check.log").read_text()
    assert "engine does not import" not in log and "default model /" in log  # the env step's report
    for test in ("test_gpu_path.py::test_cuda_graphs_on_gpu", "test_tp_one_rank.py::test_collectives_on_a_one_rank"):
        assert f"tests/{test}" in log  # the gpu tests were collected
    for module in ("bench.gpu_parity", "bench.soak", "bench.gpu"):
        assert f"-m {module} --help" in log


def test_steps_run_in_the_order_given_and_bad_flags_are_refused(tmp_path: Path) -> None:
    proc = _run(tmp_path, "--dry-run", "--steps", "soak,parity")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [s["step"] for s in summary["steps"]] == ["soak", "parity"]
    for bad in (["--steps", "env,warp"], ["--frobnicate"]):
        proc = _run(tmp_path, "--dry-run", *bad)
        assert proc.returncode == 2 and "gpu_check.sh: unknown" in proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the step would run for real")
def test_a_failing_step_fails_the_check(tmp_path: Path) -> None:
    """The summary reports a failed step and the exit status is 1 (the real run on a CPU: the parity
    check refuses to start without CUDA, exit status 2)."""
    proc = _run(tmp_path, "--steps", "parity")
    assert proc.returncode == 1
    summary = json.loads((tmp_path / "gpu_check.json").read_text())
    assert not summary["passed"] and summary["steps"][0]["status"] == "failed" and summary["steps"][0]["rc"] == 2
