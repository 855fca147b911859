"""Pure arithmetic behind bench/gpu.py (no GPU, no torch): tested on CPU.

- The memory-bandwidth floor of a decode step: a step must at least read every weight once and
  every cached K/V row of every request once, so no engine can beat
  `(weight bytes + KV bytes read) / memory bandwidth`. The bandwidth is measured on the same GPU
  with a large device-to-device copy, which reads and writes each byte once (2 bytes of traffic
  per byte copied).
- GPU idle time between decode steps, from a torch.profiler Chrome trace: each step's forward is
  wrapped in a `record_function` range on the host; every GPU activity (kernel, memcpy, memset)
  is attributed to the step whose host range contains the runtime call that launched it (joined
  on the trace's `correlation` id), so a step's GPU span is [first activity start, last
  activity end]. The idle time between two consecutive decode steps is the gap between one's
  span end and the next one's span start.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable, Sequence
from typing import Any

from engine import FORWARD_ANNOTATION

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
STEP_PREFIX = FORWARD_ANNOTATION  # the engine annotates each forward as this + its mode ("decode", "extend")


def copy_bandwidth(bytes_copied: int, seconds: float) -> float:
    """Bytes per second of memory traffic for a device-to-device copy (each byte read and written)."""
    if seconds <= 0:
        raise ValueError(f"copy time must be > 0, got {seconds}")
    return 2 * bytes_copied / seconds


def decode_bytes_read(weight_bytes: int, kv_bytes_per_token: int, context_lens: Iterable[int]) -> int:
    """Bytes a decode step must read at least: all weights once + every request's cached K/V once."""
    return weight_bytes + kv_bytes_per_token * sum(context_lens)


def bandwidth_floor_s(
    weight_bytes: int, kv_bytes_per_token: int, context_lens: Iterable[int], bandwidth: float
) -> float:
    """Lowest possible decode-step time in seconds at `bandwidth` bytes/s."""
    if bandwidth <= 0:
        raise ValueError(f"bandwidth must be > 0, got {bandwidth}")
    return decode_bytes_read(weight_bytes, kv_bytes_per_token, context_lens) / bandwidth


def step_spans(events: Sequence[dict[str, Any]], prefix: str = STEP_PREFIX) -> list[tuple[str, float, float]]:
    """(mode, GPU start us, GPU end us) per annotated step, in host order; steps with no GPU work are left out.

    `events` is a Chrome trace's `traceEvents`. Host ranges: complete events (`ph == "X"`) named
    `prefix + mode`. Launches: events with a `correlation` arg that are not GPU activity.
    """
    steps = sorted(
        (e["ts"], e["ts"] + e.get("dur", 0), e["name"][len(prefix) :])
        for e in events
        if e.get("ph") == "X" and str(e.get("name", "")).startswith(prefix) and e.get("cat") != "gpu_user_annotation"
    )
    starts = [s[0] for s in steps]
    launch_step: dict[Any, int] = {}
    for e in events:
        corr = (e.get("args") or {}).get("correlation")
        if corr is None or e.get("cat") in GPU_CATEGORIES:
            continue
        i = bisect.bisect_right(starts, e["ts"]) - 1
        if i >= 0 and e["ts"] <= steps[i][1]:
            launch_step[corr] = i
    spans: dict[int, list[float]] = {}
    for e in events:
        if e.get("cat") not in GPU_CATEGORIES:
            continue
        i = launch_step.get((e.get("args") or {}).get("correlation"))
        if i is None:
            continue
        start, end = e["ts"], e["ts"] + e.get("dur", 0)
        span = spans.setdefault(i, [start, end])
        span[0], span[1] = min(span[0], start), max(span[1], end)
    return [(steps[i][2], spans[i][0], spans[i][1]) for i in sorted(spans)]


def idle_between_steps(spans: Sequence[tuple[str, float, float]], mode: str = "decode") -> tuple[float, float, int]:
    """(idle fraction, mean gap in us, pairs counted) over consecutive `mode` steps.

    Idle fraction = sum of gaps / sum of (gap + next step's GPU span): the share of the time
    from one step's end to the next step's end that the GPU spent waiting for work. Pairs where
    another kind of step sits between are skipped; overlapping spans count as zero gap.
    """
    gaps, periods = [], []
    for (m0, _, end0), (m1, start1, end1) in itertools.pairwise(spans):
        if m0 == mode and m1 == mode:
            gap = max(0.0, start1 - end0)
            gaps.append(gap)
            periods.append(gap + (end1 - start1))
    if not gaps:
        return 0.0, 0.0, 0
    return sum(gaps) / sum(periods), sum(gaps) / len(gaps), len(gaps)


def format_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Right-aligned plain-text table; floats with 3 significant digits (no exponent from 1000 up:
    whole numbers), None as '-'."""

    def cell(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.0f}" if abs(v) >= 1000 else f"{v:.3g}"
        return str(v)

    text = [[cell(v) for v in row] for row in [list(header), *rows]]
    widths = [max(len(r[i]) for r in text) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in text]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
