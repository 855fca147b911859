"""How many torch threads each CPU forward runs with: all of them, or one fewer for small forwards.

With every core in the forward's OpenMP team, the event loop's work between steps (output
processing, detokenizing, streaming) preempts a team member and the whole team waits at the next
barrier. Whether leaving that core free pays depends on the model: on the 2-core development
machine SmolLM2-135M's 1-token decode step took 12.7-13.3 ms with 2 threads and 8.6-9.1 ms with 1,
while a 1B-class model's step (2 GB of weights, read from memory) took ~315 ms on one thread
and ~130 ms on two: one core cannot stream the weights fast enough, and what the second core
adds dwarfs any wait for the event loop. So the choice is measured per model at start-up
(`measure_small_step_threads`) instead of fixed for the default model, and made per step size:
the event loop's work grows with the streams a step serves.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable
from time import perf_counter

import torch

log = logging.getLogger(__name__)

SMALL_STEP_TOKENS = 8  # forwards of at most this many tokens are latency-bound (decode of a few streams)
# The event loop's work between steps (output processing, detokenizing, streaming), per token of a
# small step, where a small forward is one GIL-free C++ call (the fused decode loop), so the event
# loop really runs beside it on a core left free: a step of n tokens keeps every core only where
# that saves more than n times this. Its work grows with the requests a step serves, so a lone
# stream's steps gain from every core sooner than eight streams' do. From the 2-core AVX-512
# machine (default model, bf16, one-row passes 11.6 vs 7.9 ms; docs/PERFORMANCE.md, "Thread
# choice for small steps"), through the server at ~0.9 req/s: every core for every small step
# cut the median TPOT 25% but raised the ITL p99 34% against one fewer up to 8 tokens, and one
# fewer only up to 2 tokens left most of that tail (14.0 vs 15.4 ms): the tail comes from steps
# of several streams. 2 ms a token keeps every core there for a lone stream only. On a 2-core
# AVX2 CPU (default model, fp32, one-row passes 10.0-10.6 vs 5.9-6.7 ms) in-process single
# stream ran 90-104 tok/s on every core, 60-68 on one fewer.
EVENT_LOOP_S_PER_TOKEN = 0.002
# Where a small forward runs Python between its kernels (no fused loop: a layer shape the loop
# lacks), the event loop's work waits for the GIL the forward holds between ops whatever the
# thread count, so leaving a core free buys little: every core is kept if it cuts the pass by this
# fraction. Measured on a 2-core AVX2 CPU (Zen 3), default model in fp32 before the loop ran fp32:
# one-row passes of 10.6 ms on one thread and 6.3 ms on two ran single stream at 42 and 62-65
# tok/s; with its dense fp32 weights 20.7 vs 12.0 ms, 27 vs 33 tok/s.
PYTHON_STEP_MARGIN = 0.1
# Timed passes of each count (the minimum kept). A 128-expert Q4_K_M MoE model saves ~2.5-3 ms a
# one-row pass with every core, near one stream's EVENT_LOOP_S_PER_TOKEN: with 3 passes its start-up
# choice went to one fewer core for a lone stream in one of eight starts seen (86 against ~140
# tok/s single stream); 8 passes take ~0.1 s more on it.
REPEATS = 8
BUDGET_S = 2.0  # fewer repeats for a model whose one-row pass is slow


class StepThreads:
    """Torch threads of each forward, set on the forward thread itself just before it runs.

    A forward of at most SMALL_STEP_TOKENS tokens runs with one thread fewer than the thread's
    own count, except one of at most `every_core_tokens` tokens (`measure_small_step_threads`
    decides it per model; 0: none). Larger forwards use every thread.

    `pin_extend` (deterministic inference): every extend runs with all of them, as a GEMM's sums
    may change with the thread count (measured: oneDNN's 256-row bf16 tile of a 1536x576
    projection); decode's 64-row tiles come out the same with either count (tests/test_deterministic.py).
    """

    def __init__(self, pin_extend: bool = False, every_core_tokens: int = 0) -> None:
        self.full: int | None = None  # the forward thread's own count, read at its first step
        self.every_core_tokens = every_core_tokens
        self.pin_extend = pin_extend

    def threads_for(self, num_tokens: int, full: int, extend: bool = False) -> int:
        """The threads of a forward of `num_tokens` tokens on a thread of `full` threads."""
        every = num_tokens > SMALL_STEP_TOKENS or num_tokens <= self.every_core_tokens or (extend and self.pin_extend)
        return full if every else max(1, full - 1)

    def before(self, num_tokens: int, extend: bool = False) -> None:
        now = torch.get_num_threads()  # read each time (~1 us): a library's lazy init may change it
        if self.full is None:
            self.full = now
        want = self.threads_for(num_tokens, self.full, extend)
        if want != now:
            torch.set_num_threads(want)


_measured: dict[tuple, int] = {}  # (the pass's key, full) -> every_core_tokens, per process


def measure_small_step_threads(
    one_row_pass: Callable[[], object], full: int, key: Hashable = None, gil_free: bool = True
) -> int:
    """Up to how many tokens a small forward should keep every one of `full` threads
    (`StepThreads.every_core_tokens`): where a small forward is one GIL-free call (`gil_free`),
    the tokens n whose event-loop work (n x EVENT_LOOP_S_PER_TOKEN) every core's saving still
    exceeds; where a forward runs Python between its kernels, all of them (SMALL_STEP_TOKENS) if
    every core cuts the pass by PYTHON_STEP_MARGIN, else none. `one_row_pass` runs a one-token
    step's weight reads (every projection of the model on one row); it is timed with both counts,
    alternately (noise on a shared machine only ever adds time, and alternation exposes both
    counts to it), the minimum of each kept. Must run on the forward's own thread, whose count it
    restores. A `key` (the model's projection forms and shapes) answers a later load of the same
    model in this process from the first measurement (a test suite starts hundreds of engines)."""
    if full <= 1:
        return SMALL_STEP_TOKENS  # one thread: nothing to leave free
    key = None if key is None else (key, gil_free)
    if key is not None and (key, full) in _measured:
        return _measured[key, full]
    started = perf_counter()
    best = {full - 1: float("inf"), full: float("inf")}
    try:
        with torch.inference_mode():
            for threads in best:  # warm-up: the first call at a thread count starts its pool
                torch.set_num_threads(threads)
                one_row_pass()
            for _ in range(REPEATS):
                for threads in best:
                    torch.set_num_threads(threads)
                    t = perf_counter()
                    one_row_pass()
                    best[threads] = min(best[threads], perf_counter() - t)
                if perf_counter() - started > BUDGET_S:
                    break
    finally:
        torch.set_num_threads(full)
    fewer, every = best[full - 1], best[full]
    saving = fewer - every
    if gil_free:
        tokens = min(SMALL_STEP_TOKENS, max(0, int(saving / EVENT_LOOP_S_PER_TOKEN)))
    else:
        tokens = SMALL_STEP_TOKENS if saving >= PYTHON_STEP_MARGIN * fewer else 0
    if key is not None:
        _measured[key, full] = tokens
    log.info(
        "small forwards: every core (%d) up to %d tokens, %d above (one-row pass %.1f ms with %d, %.1f ms "
        "with %d; measured in %.2f s)",
        full,
        tokens,
        full - 1,
        fewer * 1e3,
        full - 1,
        every * 1e3,
        full,
        perf_counter() - started,
    )
    return tokens
