"""Up to how many rows the int4 kernel beats the dense matmul, measured on this machine at start-up.

Why measure instead of a constant: the crossover is where reading a quarter of the weight bytes
(int4) stops paying for the int4 kernel's per-row unpacking, and both sides depend on the CPU: its
bf16 matmul throughput (AMX, AVX512-BF16 or plain FMAs differ several-fold per row), its memory
bandwidth per core, and the forward's thread count. On the 2-core development machine (AVX512-BF16,
no AMX) SmolLM2-135M's projections cross over near 8 rows at one thread and 12 at two against the
oneDNN-prepacked dense form; an AMX CPU's dense side is several times faster per row, a
bandwidth-starved many-core server's slower. A default tuned on one machine is wrong on the next,
so the engine asks the machine (an explicit `q4_max_tokens` skips this).

How: the model's own `Int4Linear` projections, the int4 kernel against the dense form each falls
back to, at doubling row counts from 1 until the int4 side loses. The projections timed are the
first ones whose dense weights add up to twice the last-level cache, so every pass reads its
weights from memory as a real forward does (one layer, timed alone, would sit in the cache and
flatter the dense side 2-3x). Each point is the minimum of a few alternating repeats (noise on a
shared machine only ever adds time, and alternation exposes both sides to the same load); the
answer is interpolated between the last win and the first loss. Results are cached per process
for the same shapes and thread count. About 0.2 s for the default model.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from engine.layers.linear import Int4Linear

log = logging.getLogger(__name__)

CANDIDATE_ROWS = (1, 2, 4, 8, 16, 32, 64, 128)
REPEATS = 3
BUDGET_S = 0.5  # stop doubling past this (a very large model): the last winning row count stands
FALLBACK_LLC_BYTES = 64 << 20  # when the cache size cannot be read: larger than most CPUs' L3

_cache: dict[tuple, int] = {}


def last_level_cache_bytes() -> int:
    """The largest CPU cache of cpu0 (Linux sysfs), or FALLBACK_LLC_BYTES."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip().upper()
        except OSError:
            continue
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * unit)
    return max(sizes, default=FALLBACK_LLC_BYTES)


def cold_cache_prefix(linears: Sequence[Int4Linear]) -> list[Int4Linear]:
    """The first projections whose bf16 dense weights reach twice the last-level cache (or all)."""
    target, total, chosen = 2 * last_level_cache_bytes(), 0, []
    for linear in linears:
        chosen.append(linear)
        total += 2 * linear.in_features * linear.out_features
        if total >= target:
            break
    return chosen


def _side_time(fns: Sequence[Callable[[torch.Tensor], torch.Tensor]], xs: Sequence[torch.Tensor]) -> float:
    start = time.perf_counter()
    for fn, x in zip(fns, xs):
        fn(x)
    return time.perf_counter() - start


def measure_int4_crossover(linears: Sequence[Int4Linear]) -> int:
    """The largest row count for which the int4 kernel is faster than the dense forms, summed over
    (a cache-defeating prefix of) `linears`; 0 when the int4 kernel loses even for one row."""
    chosen = cold_cache_prefix(linears)
    shapes = tuple((m.out_features, m.in_features, m.packed.group_size, type(m.big).__name__) for m in chosen)
    key = (shapes, torch.get_num_threads())
    if key in _cache:
        return _cache[key]
    started = time.perf_counter()
    gen = torch.Generator().manual_seed(0)
    int4_fns = [m.packed.matmul for m in chosen]
    dense_fns = [m.big for m in chosen]
    prev_rows, prev_gain, result = 0, 0.0, CANDIDATE_ROWS[-1]
    with torch.inference_mode():
        for rows in CANDIDATE_ROWS:
            inputs = {
                k: torch.randn(rows, k, generator=gen).to(torch.bfloat16) for k in {m.in_features for m in chosen}
            }
            xs = [inputs[m.in_features] for m in chosen]
            _side_time(int4_fns, xs)  # warm-up: first calls at a new shape allocate and plan
            _side_time(dense_fns, xs)
            t_int4 = t_dense = float("inf")
            for _ in range(REPEATS):
                t_int4 = min(t_int4, _side_time(int4_fns, xs))
                t_dense = min(t_dense, _side_time(dense_fns, xs))
            gain = t_dense - t_int4
            if gain <= 0:  # the zero of the gain, linear between the last win and this loss
                result = prev_rows + int((rows - prev_rows) * prev_gain / (prev_gain - gain)) if prev_rows else 0
                break
            prev_rows, prev_gain = rows, gain
            if time.perf_counter() - started > BUDGET_S:
                result = rows
                break
    log.info(
        "int4 vs dense crossover: %d rows (%d projections timed in %.2f s, %d threads)",
        result,
        len(chosen),
        time.perf_counter() - started,
        torch.get_num_threads(),
    )
    _cache[key] = result
    return result
