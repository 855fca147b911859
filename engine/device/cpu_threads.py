"""How many threads the CPU forward should use, read from the machine (issue 17, item 0).

torch's own default counts the host's physical cores: in a container limited by a CPU quota, or
a process pinned to a few cores (taskset, cgroups cpusets), that oversubscribes and every
OpenMP barrier waits on a descheduled thread. The forward thread gets one thread per physical
core this process may actually use; the event-loop thread gets one (see `Engine.start`), so the
two never run competing OpenMP teams.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

SYS_CPU = Path("/sys/devices/system/cpu")
CGROUP = Path("/sys/fs/cgroup")


def allowed_cpus() -> set[int]:
    """The logical CPUs this process may run on (its affinity mask)."""
    try:
        return set(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return set(range(os.cpu_count() or 1))


def physical_cores(cpus: set[int], sys_cpu: Path = SYS_CPU) -> int:
    """Distinct physical cores among `cpus` (SMT siblings count once); len(cpus) if unknown."""
    cores = set()
    for cpu in cpus:
        topology = sys_cpu / f"cpu{cpu}" / "topology"
        try:
            cores.add(
                (topology / "physical_package_id").read_text().strip()
                + ":"
                + (topology / "core_id").read_text().strip()
            )
        except OSError:
            return len(cpus)
    return len(cores) or len(cpus)


def cpu_quota(cgroup: Path = CGROUP) -> float | None:
    """The cgroup CPU quota in CPUs (cgroup v2 `cpu.max`, else v1 `cpu.cfs_quota_us`), or None."""
    try:
        quota, period = (cgroup / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota_us = int((cgroup / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((cgroup / "cpu" / "cpu.cfs_period_us").read_text())
        return quota_us / period_us if quota_us > 0 and period_us > 0 else None
    except (OSError, ValueError):
        return None


def default_torch_threads() -> int:
    """Threads for the CPU forward: the physical cores this process may use, capped by its CPU
    quota (rounded up); at least 1."""
    threads = physical_cores(allowed_cpus())
    quota = cpu_quota()
    if quota is not None:
        threads = min(threads, math.ceil(quota))
    return max(1, threads)
