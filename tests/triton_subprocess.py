"""Running a Triton check script (tests/lora_triton_checks.py, moe_triton_checks.py) in a
subprocess: TRITON_INTERPRET must be set (or unset) before triton is first imported, so each run
gets a fresh interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 240


def run_checks(args: list[str], interpret: bool) -> tuple[int, str]:
    """(exit code, stdout + stderr) of `python *args` from the repository root."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    return proc.returncode, proc.stdout + proc.stderr


def assert_all_ok(rc: int, out: str) -> None:
    assert rc == 0 and out.rstrip().endswith("ALL OK"), f"exit code {rc}; output:\n{out}"


def compile_for_gpu(fn, signature: dict[str, str], constexprs: dict, arch: int = 90) -> str:
    """'' when Triton's own compiler and bundled ptxas build kernel `fn` for sm_<arch> (no GPU
    needed: the interpreter never compiles, so this is where what only the compiler rejects shows
    up), else why not. Imported by the check scripts, in their own processes."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    try:
        compiled = triton.compile(
            ASTSource(fn=fn, signature=signature, constexprs=constexprs),
            target=GPUTarget("cuda", arch, 32),
            options={"num_warps": 4, "num_stages": 2},
        )
    except Exception as e:
        return f"{type(e).__name__}: {str(e)[:2000]}"
    return "" if compiled.asm.get("cubin") else "no cubin"
