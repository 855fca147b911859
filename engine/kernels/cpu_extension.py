"""The CPU kernels' C++ extension (csrc/): build once per machine, load, or fall back to torch.

One extension holds every CPU kernel: paged attention (cpu_attention.py) and the fused
elementwise ops (cpu_elementwise.py). It is compiled with torch's extension builder (`-O3
-march=native`, so it uses this machine's vector width; 2.5-3.5 min on 2 cores) through
cached_build.py: one folder under ~/.cache/asyncllm/kernels per build key (sources,
flags, compiler, torch install and version, Python ABI, CPU features), published only once
complete, with a build lock that a killed build cannot leave behind (cached_build.py says how). `make
setup` builds it (`python -m engine.kernels.build`), so servers and tests load the cached .so;
otherwise the first ModelRunner builds it, with a log line before and after. Anything that stops
the build (no compiler, no ninja, an exotic CPU) leaves the torch paths in charge: `load()`
returns None, logs why once, and the engine stays correct, only slower.
`ASYNCLLM_CPU_KERNELS=0` turns the kernels off (A/B runs, bisecting).
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from types import ModuleType

import torch

from engine.kernels import cached_build

log = logging.getLogger(__name__)

NAME = "asyncllm_cpu_kernels"
CSRC = Path(__file__).parent / "csrc"
# Compiled units; the headers (*.h) only enter the build key.
SOURCES = (
    "cpu_attention.cpp",
    "cpu_attention_bf16.cpp",
    "cpu_elementwise.cpp",
    "cpu_argmax.cpp",
    "cpu_quant_gemv.cpp",
    "cpu_quant_gemv_f32.cpp",
    "cpu_quant_lanes.cpp",
    "cpu_quant_tiles.cpp",
    "cpu_vnni_linear.cpp",
    "cpu_gemv.cpp",
    "cpu_decode_layers.cpp",
    "cpu_moe_quant.cpp",
    "cpu_decode_f32_ops.cpp",
    "cpu_lora.cpp",
    "cpu_moe.cpp",
    "cpu_moe_router.cpp",
    "bindings.cpp",
)
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-std=c++17"]
LDFLAGS = ["-fopenmp"]

_lock = threading.Lock()
_module: ModuleType | None = None
_tried = False


def _build_args() -> dict:
    # Read at call time: tests swap CFLAGS to force a failing build.
    return {
        "sources": [CSRC / s for s in SOURCES],
        "depends": sorted(CSRC.glob("*.h")),
        "cflags": CFLAGS,
        "ldflags": LDFLAGS,
    }


def build_directory() -> Path:
    args = _build_args()
    return cached_build.build_folder(NAME, args["sources"], args["depends"], args["cflags"], args["ldflags"])


def enabled() -> bool:
    return os.environ.get("ASYNCLLM_CPU_KERNELS", "1") not in ("0", "false", "no")


def load() -> ModuleType | None:
    """The compiled module, building it on the first call; None when it cannot be built. The
    loading thread (the engine's forward thread, building its model) has its count settled at
    once (`adopt_thread_count`)."""
    global _module, _tried
    if not enabled():
        return None
    if _tried:
        return _module
    with _lock:
        if not _tried:
            try:
                _module = cached_build.cached_build(NAME, what="the CPU kernels", **_build_args())
            except Exception as e:  # any build failure means "use the torch path"
                log.warning("CPU kernels unavailable, using the torch paths: %s", e)
                _module = None
            _tried = True
            adopt_thread_count()
    return _module


def module_or_raise() -> ModuleType:
    """The built module, for a kernel call. Once a build was tried this skips `load()`'s
    environment check: whether to use the kernels is decided when a layer or backend is built (a
    call costs ~0.5 µs, and a decode step makes ~150 of them)."""
    module = _module if _tried else load()
    if module is None:
        raise RuntimeError("the CPU kernels are not available")
    return module


def adopt_thread_count() -> None:
    """Settle, on the calling thread, how many intra-op threads these kernels use: the thread's
    own torch count now. This library carries its own copy of ATen's once-per-thread init, which
    otherwise runs at its first parallel kernel on the thread and takes torch's process-wide
    count, the last `torch.set_num_threads` of any thread: the engine's event-loop thread sets
    itself 1 after the model loads, so a forward thread whose first kernel call came later ran
    every later forward on one thread (a 1B model's decode step: ~280 ms instead of ~140).
    `load` calls it on the loading thread, `CpuDeviceStream` on a forward thread started once the
    library is loaded; a no-op without the kernels."""
    module = _module if _tried else None  # only a module some layer already loaded
    if module is not None and hasattr(module, "num_threads"):
        torch.set_num_threads(torch.get_num_threads())  # torch's process-wide count := this thread's
        module.num_threads()
