"""What the GPU check runs on (bench/gpu_check.sh's `env` step): the card, the driver, the versions of
what the engine uses, and whether the engine and the default model load here.

    python -m bench.gpu_env

Exit status 1 when the engine does not import; a missing GPU or default model is reported, not fatal
(the later steps say what they need).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import platform
import shutil
import subprocess
import sys

import torch


def main() -> int:
    print("python", sys.version.split()[0], platform.machine(), "| cpus", len(os.sched_getaffinity(0)))
    print("torch", torch.__version__, "| cuda", torch.version.cuda, "| available", torch.cuda.is_available())
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        print("gpu", p.name, f"{p.total_memory / 2**30:.1f} GiB", f"sm_{p.major}{p.minor}", p.multi_processor_count)
    for name in ("triton", "transformers", "cupy", "xgrammar", "msgspec", "aiohttp", "gguf", "tokenizers"):
        try:
            importlib.import_module(name)
            print(name, importlib.metadata.version(name.replace("cupy", "cupy-cuda13x")))
        except Exception as e:  # a report, not a check: the steps that need it fail with their reason
            print(name, "unavailable:", e)
    if shutil.which("nvidia-smi"):
        query = "name,driver_version,memory.total,memory.used,clocks.sm,clocks.mem,temperature.gpu"
        out = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv"], capture_output=True, text=True)
        print(out.stdout.strip() or out.stderr.strip())
    try:
        import engine  # noqa: F401 - the engine and the server import in this environment
        import server  # noqa: F401
    except Exception as e:
        print("the engine does not import:", repr(e))
        return 1
    from engine import resolve_model

    try:
        print("default model", resolve_model("smollm2-135m").path)
    except Exception as e:
        print("default model unavailable:", e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
