"""`python -m engine.kernels.build` (what `make setup` runs): build the CPU kernels now, or load
them from the cache, so that no server or test start compiles anything. The build machinery is
cached_build.py; this module is only its command line (kept apart so the extension's loader can
import the machinery without an import loop)."""

from __future__ import annotations

import logging
import time

from engine.kernels import cpu_extension


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    started = time.perf_counter()
    built = cpu_extension.load() is not None
    state = "ready" if built else "not available (the engine will use its torch paths)"
    print(f"CPU kernels {state}: {cpu_extension.build_directory()} ({time.perf_counter() - started:.1f} s)")


if __name__ == "__main__":
    main()
