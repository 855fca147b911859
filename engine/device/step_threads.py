"""How many torch threads each CPU forward runs with: all of them, or one fewer for small forwards.

With every core in the forward's OpenMP team, the event loop's work between steps (output
processing, detokenizing, streaming) preempts a team member and the whole team waits at the next
barrier. Whether leaving that core free pays depends on the model: on the 2-core development
machine SmolLM2-135M's 1-token decode step took 12.7-13.3 ms with 2 threads and 8.6-9.1 ms with 1,
while a 1B-class model's step (2 GB of weights, read from memory) took ~315 ms on one thread
and ~130 ms on two: one core cannot stream the weights fast enough, and what the second core
adds dwarfs any wait for the event loop. So the choice is measured per model at start-up
(`measure_small_step_threads`) instead of fixed for the default model.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable
from time import perf_counter

import torch

log = logging.getLogger(__name__)

SMALL_STEP_TOKENS = 8  # forwards of at most this many tokens are latency-bound (decode of a few streams)
# What a step on every core must save against one core fewer before it is worth the event loop's
# interruptions, where a small forward is one GIL-free C++ call (the fused decode loop), so the
# event loop really runs beside it on the core left free: about what those interruptions cost a
# 2-thread step of the default model (the team waits while the event loop's ~2-4 ms of work
# between steps runs on one of its cores).
EVENT_LOOP_MARGIN_S = 0.004
# Where a small forward runs Python between its kernels (no fused loop: fp32, or a layer shape the
# loop lacks), the event loop's work waits for the GIL the forward holds between ops whatever the
# thread count, so leaving a core free buys little: every core is kept if it cuts the pass by this
# fraction. Measured on a 2-core AVX2 CPU (Zen 3), default model in fp32: one-row passes of 10.6 ms
# on one thread and 6.3 ms on two (4.3 ms, at the margin above's edge) ran single stream at 42 and
# 62-65 tok/s; with its dense fp32 weights 20.7 vs 12.0 ms, 27 vs 33 tok/s.
PYTHON_STEP_MARGIN = 0.1
REPEATS = 3
BUDGET_S = 2.0  # fewer repeats for a model whose one-row pass is slow


class StepThreads:
    """Torch threads of each forward, set on the forward thread itself just before it runs.

    `small`: the threads of forwards of at most SMALL_STEP_TOKENS tokens (None: one fewer than
    the thread's own count; `measure_small_step_threads` decides it per model). Larger forwards
    use every thread.

    `pin_extend` (deterministic inference): every extend runs with all of them, as a GEMM's sums
    may change with the thread count (measured: oneDNN's 256-row bf16 tile of a 1536x576
    projection); decode's 64-row tiles come out the same with either count (tests/test_deterministic.py).
    """

    def __init__(self, pin_extend: bool = False, small: int | None = None) -> None:
        self.full: int | None = None  # the forward thread's own count, read at its first step
        self.small = small
        self.pin_extend = pin_extend

    def before(self, num_tokens: int, extend: bool = False) -> None:
        now = torch.get_num_threads()  # read each time (~1 us): a library's lazy init may change it
        if self.full is None:
            self.full = now
        small = num_tokens <= SMALL_STEP_TOKENS and not (extend and self.pin_extend)
        want = (self.small if self.small is not None else max(1, self.full - 1)) if small else self.full
        if want != now:
            torch.set_num_threads(want)


_measured: dict[tuple, int] = {}  # (the pass's key, full) -> the choice, per process


def measure_small_step_threads(
    one_row_pass: Callable[[], object], full: int, key: Hashable = None, gil_free: bool = True
) -> int:
    """The threads small forwards should run with: `full`, or `full - 1` where every core saves
    less than EVENT_LOOP_MARGIN_S per step (`gil_free`: a small forward is one GIL-free call) or
    less than PYTHON_STEP_MARGIN of the pass (a forward in Python between its kernels).
    `one_row_pass` runs a one-token step's weight reads (every projection of the model on one
    row); it is timed with both counts, alternately (noise on a shared machine only ever adds
    time, and alternation exposes both counts to it), the minimum of each kept. Must run on the
    forward's own thread, whose count it restores. A `key` (the model's projection forms and
    shapes) answers a later load of the same model in this process from the first measurement
    (a test suite starts hundreds of engines)."""
    if full <= 1:
        return full
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
    margin = EVENT_LOOP_MARGIN_S if gil_free else PYTHON_STEP_MARGIN * fewer
    choice = full if fewer - every >= margin else full - 1
    if key is not None:
        _measured[key, full] = choice
    log.info(
        "small forwards: %d threads (one-row pass %.1f ms with %d, %.1f ms with %d; measured in %.2f s)",
        choice,
        best[full - 1] * 1e3,
        full - 1,
        best[full] * 1e3,
        full,
        perf_counter() - started,
    )
    return choice
