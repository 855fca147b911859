"""What a serving run's ITL tail is made of: each gap by the streams in flight when it ended, and
whether another request's first token arrived inside it.

Why: "ITL p99 against the median TPOT" says how far the tail sits out, not what puts it there.
Two things do: a decode step's cost grows with the number of streams decoding together (on a CPU
each stream adds its rows of compute and its KV reads; 4.2 ms for one stream and ~10 ms for five
on the development machine), and a prompt's prefill stalls the streams beside it (one long
forward, mixed chunk or not). A change aimed at one of them can only be judged on its part of the
tail, so the report splits the gaps both ways (the ~1% of gaps at or above p99 most of all).

Definitions, on the client's clock (successful requests only):
- a gap (ITL) ends when its chunk arrives; the streams in flight then are the requests sent and
  not yet finished at that moment (the gap's own request included);
- a gap spans a prefill when another request's first chunk arrived inside it (after the gap's
  start, up to its end): that request's prompt was computed while this stream waited.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

EXACT_UP_TO = 8  # in-flight counts up to this are their own band; above, powers of two (9-16, ...)


class _Timed(Protocol):
    """The fields of a serving_report.RequestRecord this module reads."""

    success: bool
    start_ms: float
    e2e_ms: float
    itl_ms: list[float]
    chunk_times_ms: list[float]


@dataclass
class InFlightBand:
    """Gaps that ended with `low`..`high` streams in flight."""

    low: int
    high: int
    itls: int
    median_ms: float
    p99_ms: float
    at_or_above_p99: int  # of these gaps, those at or above the run's overall ITL p99

    @property
    def label(self) -> str:
        return str(self.low) if self.low == self.high else f"{self.low}-{self.high}"


@dataclass
class ItlTail:
    p99_ms: float  # the run's ITL p99 (the same as Metrics.itl_ms.p99)
    tail_itls: int  # gaps at or above it
    by_in_flight: list[InFlightBand]
    spanning_prefill: int  # gaps inside which another request's first chunk arrived
    spanning_prefill_at_or_above_p99: int


def band_of(in_flight: int) -> tuple[int, int]:
    """The band an in-flight count falls in: itself up to EXACT_UP_TO, then 9-16, 17-32, ..."""
    if in_flight <= EXACT_UP_TO:
        return in_flight, in_flight
    high = EXACT_UP_TO
    while high < in_flight:
        high *= 2
    return high // 2 + 1, high


def itl_tail(records: Sequence[_Timed]) -> ItlTail | None:
    """The split of the run's gaps; None when no request streamed two chunks."""
    ok = [r for r in records if r.success]
    gaps = [(r, i) for r in ok for i in range(len(r.itl_ms))]
    if not gaps:
        return None
    starts = sorted(r.start_ms for r in ok)
    ends = sorted(r.start_ms + r.e2e_ms for r in ok)
    firsts = sorted(r.chunk_times_ms[0] for r in ok if r.chunk_times_ms)
    values = np.array([r.itl_ms[i] for r, i in gaps], dtype=np.float64)
    p99 = float(np.percentile(values, 99))
    bands: dict[tuple[int, int], list[float]] = {}
    spanning = spanning_tail = 0
    for (r, i), itl in zip(gaps, values):
        begin, end = r.chunk_times_ms[i], r.chunk_times_ms[i + 1]
        in_flight = bisect_right(starts, end) - bisect_left(ends, end)
        bands.setdefault(band_of(max(in_flight, 1)), []).append(float(itl))
        if bisect_right(firsts, end) - bisect_right(firsts, begin) > 0:
            spanning += 1
            spanning_tail += bool(itl >= p99)
    by_band = []
    for (low, high), xs in sorted(bands.items()):
        a = np.asarray(xs)
        by_band.append(
            InFlightBand(low, high, len(xs), float(np.median(a)), float(np.percentile(a, 99)), int((a >= p99).sum()))
        )
    return ItlTail(p99, int((values >= p99).sum()), by_band, spanning, spanning_tail)


def format_tail(tail: ItlTail) -> list[str]:
    """The report's lines (50 columns, as the rest of serving_report's table)."""
    lines = [f"{'streams':<10}{'ITLs':>8}{'median':>10}{'p99':>10}{'>= run p99':>12}"]
    for b in tail.by_in_flight:
        lines.append(f"{b.label:<10}{b.itls:>8}{b.median_ms:>10.2f}{b.p99_ms:>10.2f}{b.at_or_above_p99:>12}")
    lines.append(
        f"Spanning another's first token: {tail.spanning_prefill} ({tail.spanning_prefill_at_or_above_p99} of"
        f" the {tail.tail_itls} >= p99)"
    )
    return lines
