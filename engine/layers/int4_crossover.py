"""Up to how many rows a quantized kernel beats the dense matmul, measured on this machine at start-up.

Why measure instead of a constant: the crossover is where reading a quarter of the weight bytes
(int4) stops paying for the int4 kernel's per-row unpacking, and both sides depend on the CPU: its
bf16 matmul throughput (AMX, AVX512-BF16 or plain FMAs differ several-fold per row), its memory
bandwidth per core, and the forward's thread count. On the 2-core development machine (AVX512-BF16,
no AMX) SmolLM2-135M's projections cross over near 8 rows at one thread and 12 at two against the
oneDNN-prepacked dense form; an AMX CPU's dense side is several times faster per row, a
bandwidth-starved many-core server's slower. A default tuned on one machine is wrong on the next,
so the engine asks the machine (an explicit `q4_max_tokens` skips this).

The 4-bit layer weights and the Q8_0 LM head (q8.py) are measured apart: different kernels.

How: the model's own `QuantLinear` projections, the quantized kernel against the form each falls
back to (the same blocks' dequantized tiles; a dense form beside torch's int4pack one), at doubling
row counts from 1 until the quantized side loses. The projections timed are the first ones whose
quantized forms add up to twice the last-level cache, so every pass of either side reads its
weights from memory as a real forward does (one layer, timed alone, would sit in the cache and
flatter the dense side 2-3x; a prefix sized by the dense bytes left the 4-bit side cached and put
the crossover at 34 rows, where a real batch of 32 decoded 15% slower than dense). Projections that
add up to less (the LM head, measured alone; a small model's layers) are timed after a read of an
eviction buffer twice the cache's size: in a forward the other projections' weights pass through
the cache between two calls of one. Timed hot, the default model's Q8_0 head (28 MB, inside a 32 MB
L3) lost to the dense head from 3 rows, while whole decode steps of 3 rows were 0.6 ms faster with
it and even at 4; timed cold the crossover is 4-5. Each point is the minimum of a few alternating
repeats (noise on a shared machine only ever adds time, and alternation exposes both sides to the
same load); the answer is interpolated between the last win and the first loss, where a win means
beating the dense side by REQUIRED_WIN (see there). Results are cached per process for the same
shapes and thread count. Where the quantized side still wins at the last point, a prefill-sized
point decides whether it runs every row count (PREFILL_ROWS, see there).
About 0.4 s for the default model, ~2 s for a 1B-class one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch

from engine.kernels import cpu_quant
from engine.layers.int4 import TiledQ4Weight
from engine.layers.linear import BatchInvariantLinear, QuantLinear, VnniLinear

Q = TypeVar("Q", QuantLinear, BatchInvariantLinear)

log = logging.getLogger(__name__)

CANDIDATE_ROWS = (1, 2, 4, 8, 16, 32, 64, 128)
REPEATS = 3
# Stop doubling past BUDGET_S once MIN_ROWS are measured: the last winning row count stands. A
# point times a few passes over twice the last-level cache of quantized weights and their dense
# forms; on a 300 MB L3 with a 1B-class model that is ~0.5 s a point, and a budget alone stopped
# it after the first point, leaving every batch above one row on the dense weights.
BUDGET_S = 0.5
MIN_ROWS = 4
# The quantized side must beat the dense one by this fraction when timed alone to win in a real
# forward. Default model, 2 threads, our 4-bit kernel: timed alone it won by 30% at 16 rows and 6%
# at 32, while whole decode steps were 15% faster at 16, even at 24 and 14% slower at 32 (the
# rest of the step's traffic costs the multi-pass small-batch kernel more than oneDNN's GEMM).
REQUIRED_WIN = 0.2
# Where the quantized side still wins at the last row count timed, one more point decides whether
# it wins at prefill sizes too (then it runs every row count: ALL_ROWS). With --q4-int8-activations
# bf16's 4-bit loops read x in int8 blocks, twice the products per instruction of the dequantized
# tiles' bf16 GEMM: on an AVX512-BF16 CPU without AMX the default model's 4-bit projections took
# 0.61-0.77x the tiles' time at 32-512 rows, and M2 ran 1.09-1.25x faster with them at every row
# count. The exact bf16 loops lose to the tiles from a few dozen rows: no such point for them. An
# AMX build's tiles hand 64+ rows to oneDNN, several times faster per row, and there the bound
# stays. Timed hot (a prefill chunk is compute-bound) on the first projections holding
# PREFILL_WEIGHTS parameters; the quantized side must win by PREFILL_WIN (no decode traffic rides
# on a prefill chunk's margin).
PREFILL_ROWS = 256
PREFILL_WEIGHTS = 8 << 20
PREFILL_WIN = 0.05
ALL_ROWS = 1 << 30
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


def cold_cache_prefix(linears: Sequence[Q], quantized: Callable[[Q], Any] = lambda m: m.packed) -> list[Q]:
    """The first projections whose quantized forms (the smaller side) reach twice the last-level
    cache (or all): then neither side's weights stay cached between passes."""
    return _prefix(linears, lambda m: quantized(m).nbytes, 2 * last_level_cache_bytes())


def _prefix(linears: Sequence[Q], size: Callable[[Q], int], target: int) -> list[Q]:
    """The first of `linears` whose sizes add up to `target` (or all of them)."""
    total, chosen = 0, []
    for linear in linears:
        chosen.append(linear)
        total += size(linear)
        if total >= target:
            break
    return chosen


def _evict(buffer: torch.Tensor | None) -> None:
    """Read `buffer` (twice the last-level cache) so the next pass finds no weights cached."""
    if buffer is not None:
        buffer.sum()


def _side_time(
    fns: Sequence[Callable[[torch.Tensor], torch.Tensor]], xs: Sequence[torch.Tensor], evict: torch.Tensor | None
) -> float:
    _evict(evict)
    start = time.perf_counter()
    for fn, x in zip(fns, xs):
        fn(x)
    return time.perf_counter() - start


def _eviction_buffer(quantized_bytes: int) -> torch.Tensor | None:
    """A buffer twice the last-level cache when the timed forms fit in it (cold_cache_prefix took
    them all), read before each timed pass; None when they overflow the cache on their own."""
    twice_llc = 2 * last_level_cache_bytes()
    return torch.ones(twice_llc // 4, dtype=torch.float32) if quantized_bytes < twice_llc else None


def _best_times(
    a: tuple[Sequence[Callable[[torch.Tensor], torch.Tensor]], Sequence[torch.Tensor]],
    b: tuple[Sequence[Callable[[torch.Tensor], torch.Tensor]], Sequence[torch.Tensor]],
    evict: torch.Tensor | None,
) -> tuple[float, float]:
    """The best of REPEATS alternating passes of side a and side b (functions, inputs), after one
    warm-up pass each (first calls at a new shape allocate and plan)."""
    _side_time(*a, None)
    _side_time(*b, None)
    t_a = t_b = float("inf")
    for _ in range(REPEATS):
        t_a = min(t_a, _side_time(*a, evict))
        t_b = min(t_b, _side_time(*b, evict))
    return t_a, t_b


def measure_int4_crossover(linears: Sequence[QuantLinear], dtype: torch.dtype = torch.bfloat16) -> int:
    """The largest row count for which the int4 kernel is faster than the forms it falls back to
    (`QuantLinear.big`: the blocks' dequantized tiles, or a dense form), summed over (a
    cache-defeating prefix of) `linears` with `dtype` inputs (the model's); 0 when the int4
    kernel loses even for one row."""
    chosen = cold_cache_prefix(linears)
    shapes = tuple((m.out_features, m.in_features, type(m.packed).__name__, type(m.big).__name__) for m in chosen)
    key = (shapes, str(dtype), torch.get_num_threads(), cpu_quant.int8_activations())
    if key in _cache:
        return _cache[key]
    started = time.perf_counter()
    gen = torch.Generator().manual_seed(0)
    int4_fns = [m.packed.matmul for m in chosen]
    dense_fns = [m.big for m in chosen]
    evict = _eviction_buffer(sum(m.packed.nbytes for m in chosen))
    prev_rows, prev_gain, result, lost = 0, 0.0, CANDIDATE_ROWS[-1], False
    with torch.inference_mode():
        for rows in CANDIDATE_ROWS:
            inputs = {k: torch.randn(rows, k, generator=gen).to(dtype) for k in {m.in_features for m in chosen}}
            xs = [inputs[m.in_features] for m in chosen]
            t_int4, t_dense = _best_times((int4_fns, xs), (dense_fns, xs), evict)
            gain = (1.0 - REQUIRED_WIN) * t_dense - t_int4
            if gain <= 0:  # the zero of the gain, linear between the last win and this loss
                result = prev_rows + int((rows - prev_rows) * prev_gain / (prev_gain - gain)) if prev_rows else 0
                lost = True
                break
            prev_rows, prev_gain = rows, gain
            if rows >= MIN_ROWS and time.perf_counter() - started > BUDGET_S:
                result = rows
                break
        int8_loops = dtype == torch.bfloat16 and cpu_quant.int8_activations()
        if not lost and int8_loops and all(isinstance(m.packed, TiledQ4Weight) for m in linears):
            result = ALL_ROWS if _wins_at_prefill(linears, dtype, gen) else result
    log.info(
        "quantized loops vs %s crossover (%s): %s rows (%d projections timed%s in %.2f s, %d threads)",
        "dequantized tiles" if type(chosen[0].big).__name__ == "DequantTilesLinear" else "dense",
        str(dtype).removeprefix("torch."),
        bound_text(result),
        len(chosen),
        " cold" if evict is not None else "",
        time.perf_counter() - started,
        torch.get_num_threads(),
    )
    _cache[key] = result
    return result


def bound_text(rows: int) -> str:
    """A quantized path's row bound as the logs say it."""
    return "any number of" if rows >= ALL_ROWS else f"<= {rows}"


def _wins_at_prefill(linears: Sequence[QuantLinear], dtype: torch.dtype, gen: torch.Generator) -> bool:
    """Whether the quantized kernel beats the fallback form by PREFILL_WIN on PREFILL_ROWS rows."""
    chosen = _prefix(linears, lambda m: m.out_features * m.in_features, PREFILL_WEIGHTS)
    inputs = {k: torch.randn(PREFILL_ROWS, k, generator=gen).to(dtype) for k in {m.in_features for m in chosen}}
    xs = [inputs[m.in_features] for m in chosen]
    t_quant, t_big = _best_times(([m.packed.matmul for m in chosen], xs), ([m.big for m in chosen], xs), None)
    log.info("quantized loops at %d rows: %.2f ms, the fallback form %.2f ms", PREFILL_ROWS, 1e3 * t_quant, 1e3 * t_big)
    return t_quant <= (1.0 - PREFILL_WIN) * t_big


def blocks_beat_padded_tiles(linears: Sequence[BatchInvariantLinear], dtype: torch.dtype) -> bool:
    """Deterministic inference (linear.RowTiles.decode_blocks): whether decode steps should run the
    projections' block loops at every row count rather than the dense form on padded tiles of
    `tiles.decode` rows. Timed as the crossover is (cold, alternating, best of REPEATS): the
    blocks on a half-full tile's rows against the dense form on a full tile, which every decode
    step of up to that many rows pays (VNNI pairs need no tiles: on the same half-full rows). On an
    AVX512-BF16 CPU without AMX the blocks cost 39 ms of the default model's step at 32 rows
    against 54 for oneDNN's 64-row tile; AMX runs the tile several times faster per row, and there
    the tiles stay."""
    chosen = cold_cache_prefix(linears, lambda m: m.blocks)
    tile = chosen[0].tiles.decode
    shapes = tuple((m.out_features, m.in_features, type(m.blocks).__name__) for m in chosen)
    key = ("tiles", shapes, str(dtype), tile, torch.get_num_threads())
    if key in _cache:
        return bool(_cache[key])
    gen = torch.Generator().manual_seed(0)
    evict = _eviction_buffer(sum(m.blocks.nbytes for m in chosen))
    inputs = {k: torch.randn(tile, k, generator=gen).to(dtype) for k in {m.in_features for m in chosen}}
    full = [inputs[m.in_features] for m in chosen]
    half = [x[: max(1, tile // 2)] for x in full]
    if all(isinstance(m.inner, VnniLinear) for m in chosen):
        full = half
    with torch.inference_mode():
        t_blocks, t_tiles = _best_times(
            ([m.blocks.matmul for m in chosen], half), ([m.inner for m in chosen], full), evict
        )
    log.info(
        "deterministic decode: block loops %.2f ms at %d rows, the dense form %.2f ms at %d rows: %s",
        1e3 * t_blocks,
        len(half[0]),
        1e3 * t_tiles,
        len(full[0]),
        "blocks" if t_blocks <= t_tiles else "tiles",
    )
    _cache[key] = int(t_blocks <= t_tiles)
    return t_blocks <= t_tiles
