"""Child processes that do not outlive their parent: a killed engine, controller or test run must
leave nothing running (a server holding its port and memory, a TP rank waiting in a collective).

Two mechanisms, for two kinds of child:
- `die_with_parent` (Linux `PR_SET_PDEATHSIG`, set in the child before exec): the kernel sends the
  child SIGTERM when the parent *thread* that forked it ends. Exact and free, so it is the choice
  where the forking thread lives as long as the parent does (a main thread, an event-loop thread):
  the DP controller's replicas, the servers benchmarks and tests launch.
- `exit_when_orphaned` (a daemon thread in the child polling its parent pid): for children forked
  from a thread that may end before the parent (the engine forks its TP ranks from whichever thread
  loads the model), where the death signal would fire too early.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

PR_SET_PDEATHSIG = 1


def _prctl():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


PRCTL = _prctl()  # resolved here, not in the child between fork and exec


def die_with_parent(parent: int) -> None:
    """For `Popen(preexec_fn=lambda: die_with_parent(os.getpid()))`: runs in the child before exec;
    SIGTERM when the parent thread dies (and at once if the parent is already gone)."""
    if PRCTL is not None:
        PRCTL(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGTERM)


def exit_when_orphaned(parent: int, interval_s: float = 1.0, status: int = 1) -> threading.Thread:
    """Start a daemon thread that ends this process (`os._exit`, no teardown: a half-dead peer group
    must not block it) once `parent` (the pid that started it, passed down: by the time the child
    runs this, the parent may already be gone) is no longer its parent."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval_s)
        print(f"pid {os.getpid()}: parent {parent} is gone; exiting", file=sys.stderr, flush=True)
        os._exit(status)

    thread = threading.Thread(target=watch, name="exit-when-orphaned", daemon=True)
    thread.start()
    return thread
