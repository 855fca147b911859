"""engine.host_memory: the idle-time heap trim runs on glibc, on every busy -> idle edge."""

from __future__ import annotations

import sys

import pytest

from engine import host_memory


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="malloc_trim is glibc's")
def test_trim_runs_on_glibc():
    assert host_memory.trim_host_memory() is True
    assert host_memory.trim_host_memory() is True  # every idle edge, no rate limit


def test_the_scheduler_trims_when_it_goes_idle(monkeypatch):
    from engine.scheduler import scheduler

    calls = []
    monkeypatch.setattr(scheduler, "trim_host_memory", lambda: calls.append(1))
    sched = scheduler.Scheduler.__new__(scheduler.Scheduler)  # on_idle needs no model
    sched.on_idle()
    assert calls == [1] and sched.ran_since_idle is False
