"""A killed parent leaves no child behind (issue 32, item 8: a killed test run leaves no processes).

Both mechanisms of engine/child_process.py, for real: an intermediate process starts a long-lived
child and is then SIGKILLed (nothing of it runs: no atexit, no finally); the child must go.
- `die_with_parent` (PR_SET_PDEATHSIG): the servers that tests and `bench.soak` launch, DP replicas;
- `exit_when_orphaned` (a parent-pid watch): TP ranks, forked from a thread that may end first.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

DEATH_SIGNAL_PARENT = """
import os, subprocess, sys, time
from engine.child_process import die_with_parent
parent = os.getpid()
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                         preexec_fn=lambda: die_with_parent(parent))
print(child.pid, flush=True)
time.sleep(600)
"""

ORPHAN_WATCH_PARENT = """
import os, subprocess, sys, time
code = "import sys, time; from engine.child_process import exit_when_orphaned; "
code += "exit_when_orphaned(int(sys.argv[1]), 0.05); time.sleep(600)"
child = subprocess.Popen([sys.executable, "-c", code, str(os.getpid())])
print(child.pid, flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    """Running (a zombie left for a non-reaping init counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG and /proc are Linux's")
@pytest.mark.parametrize("parent_code", [DEATH_SIGNAL_PARENT, ORPHAN_WATCH_PARENT], ids=["pdeathsig", "orphan-watch"])
def test_child_goes_when_its_parent_is_killed(parent_code: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    parent = subprocess.Popen([sys.executable, "-c", parent_code], env=env, stdout=subprocess.PIPE, text=True)
    child = -1
    try:
        child = int(parent.stdout.readline())
        assert _alive(child)
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        while _alive(child):  # a child that never goes hangs here: the suite's pytest-timeout ends it
            time.sleep(0.05)
    finally:
        if parent.poll() is None:
            parent.kill()
        if child > 0 and _alive(child):
            os.kill(child, signal.SIGKILL)
