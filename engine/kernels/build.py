"""`python -m engine.kernels.build`: compile the CPU kernels now (run by `make setup`).

Never fails: a machine that cannot build them still serves, on the torch paths.
"""

from __future__ import annotations

import logging
import time

from engine.kernels import cpu_extension


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    started = time.perf_counter()
    built = cpu_extension.load() is not None
    state = "built" if built else "not available (the engine will use its torch paths)"
    print(f"CPU kernels {state}: {cpu_extension.build_directory()} ({time.perf_counter() - started:.1f} s)")


if __name__ == "__main__":
    main()
