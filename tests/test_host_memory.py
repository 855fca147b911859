"""engine.host_memory: the idle-time heap trim runs on glibc, on every busy -> idle edge; the CPU KV
pool's buffers are zeroed, 2 MiB-aligned and (where the system allows) on huge pages."""

from __future__ import annotations

import sys
from pathlib import Path

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


def _thp_mode() -> str | None:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return None
    return text.split("[")[1].split("]")[0]


def _huge_kib_at(address: int) -> int:
    """AnonHugePages (KiB) of the mapping that holds `address`, from /proc/self/smaps."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


def test_kv_buffers_are_zeroed_writable_and_outlive_their_mapping_name():
    import gc

    import torch

    t = host_memory.zeros_on_huge_pages((5000, 3, 64), torch.bfloat16)  # 1.9 MB: plain zeros
    assert t.shape == (5000, 3, 64) and t.dtype == torch.bfloat16 and not t.any()
    big = host_memory.zeros_on_huge_pages((20000, 3, 64), torch.bfloat16)  # 7.7 MB
    assert big.shape == (20000, 3, 64) and big.is_contiguous() and not big.any()
    gc.collect()  # the tensor alone keeps the mapping alive
    big[7] = 1.5
    big[-1] = -2.0
    assert big.sum().item() == 1.5 * 192 - 2.0 * 192


@pytest.mark.skipif(_thp_mode() not in ("always", "madvise"), reason="this system has transparent huge pages off")
def test_kv_buffers_sit_on_huge_pages():
    import torch

    big = host_memory.zeros_on_huge_pages((40000, 3, 64), torch.bfloat16)  # 15.4 MB
    assert big.data_ptr() % host_memory.HUGE_PAGE == 0
    assert _huge_kib_at(big.data_ptr()) >= 2048


@pytest.mark.skipif(not hasattr(__import__("mmap"), "MADV_HUGEPAGE"), reason="no MADV_HUGEPAGE on this platform")
def test_the_cpu_kv_pool_uses_them():
    import torch

    from engine.cache.memory_pool import KVCache

    pool = KVCache(20000, 2, 3, 64, torch.bfloat16, "cpu")
    assert all(b.data_ptr() % host_memory.HUGE_PAGE == 0 for b in pool.k_buffer + pool.v_buffer)
    assert not any(b.any() for b in pool.k_buffer + pool.v_buffer)
