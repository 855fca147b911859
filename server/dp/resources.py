"""How N replicas share the hardware (issue 16, item 4): threads, KV memory, devices.

Why split at all: every replica is a whole server that, left alone, sizes itself for the whole
machine: on a CPU its forward takes one torch thread per physical core and its KV pool a share
of all free memory. N of them would oversubscribe the cores (every OpenMP barrier waiting on a
descheduled thread) and ask for N times the memory. So, on a CPU, unless the user chose:

- threads: `max(1, default_threads // N)`, the default computed as the engine computes it
  (`default_torch_threads`: affinity, SMT siblings once, cgroup quota);
- KV pool: `--mem-fraction-static` (the user's, or the engine's default for the device) divided by N,
  unless `--max-total-tokens` fixes the pool in tokens (then each replica gets that many).

On CUDA each replica gets its own GPU(s) and the full fraction: `--device cuda:i` for replica i
(with `--tp-size T`, replica i gets GPUs i*T .. i*T+T-1 through `CUDA_VISIBLE_DEVICES` and
`--device cuda`, so the engine's ranks number their devices from 0). An explicit
`--device cuda:K` means the user wants that one GPU: the replicas share it like a CPU, fraction / N.
Under Ray, Ray assigns the GPUs of each replica's bundle (it sets `CUDA_VISIBLE_DEVICES` in the
actor), so replicas get `--device cuda`.

`plan_replicas` is pure (the machine is an argument) so the split is unit-tested without
processes; `probe_machine` reads the real one.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from engine import default_mem_fraction


class ResourceError(ValueError):
    """The replicas cannot be placed as asked (e.g. more GPUs needed than visible): a usage error."""


@dataclass(frozen=True)
class Machine:
    """What the controller's host offers."""

    cpu_threads: int  # default torch threads of one server on this host
    gpus: tuple[str, ...] = ()  # visible CUDA devices (CUDA_VISIBLE_DEVICES entries, else indices)


@dataclass(frozen=True)
class ReplicaPlan:
    """One replica's share: the options it overrides, its environment, its Ray bundle."""

    index: int
    device: str | None = None  # --device for this replica (None: the user's, unchanged)
    torch_threads: int | None = None  # --torch-threads (None: the user's, unchanged)
    mem_fraction_static: float | None = None  # --mem-fraction-static (None: the user's, unchanged)
    env: Mapping[str, str] = field(default_factory=dict)  # added to the replica's environment
    bundle: Mapping[str, float] = field(default_factory=dict)  # Ray placement-group bundle

    def overrides(self) -> dict[str, str | None]:
        """Option name -> value for `replica_argv` (only the options this plan changes)."""
        out: dict[str, str | None] = {}
        if self.device is not None:
            out["device"] = self.device
        if self.torch_threads is not None:
            out["torch_threads"] = str(self.torch_threads)
        if self.mem_fraction_static is not None:
            out["mem_fraction_static"] = f"{self.mem_fraction_static:.6g}"
        return out


def _on_cuda(device: str, machine: Machine) -> bool:
    return device.startswith("cuda") or (device == "auto" and bool(machine.gpus))


def _shared_fraction(options: Mapping[str, Any], n: int, device_type: str) -> float | None:
    """The KV fraction of one of n replicas sharing a device; None when the pool is in tokens."""
    if options.get("max_total_tokens") is not None:
        return None
    base = options.get("mem_fraction_static")
    return (default_mem_fraction(device_type) if base is None else float(base)) / n


def plan_replicas(n: int, options: Mapping[str, Any], machine: Machine, ray: bool = False) -> list[ReplicaPlan]:
    """Each of n replicas' share; `options` are the engine options as the CLI parsed them."""
    if n < 1:
        raise ResourceError(f"--dp-size must be >= 1, got {n}")
    if n > 1 and (int(options.get("nnodes") or 1) > 1 or options.get("dist_init_addr")):
        # Every replica would run the same command line, so all would meet at one rendezvous.
        raise ResourceError(
            "--dp-size with --nnodes/--dist-init-addr is not supported: each replica's "
            "tensor-parallel ranks must stay on its host (leave both unset)"
        )
    device = options.get("device") or "auto"
    tp = int(options.get("tp_size") or 1)
    if not _on_cuda(device, machine):
        user_threads = options.get("torch_threads")
        # `--torch-threads` is per forward thread, i.e. per tensor-parallel rank: the n replicas'
        # n * tp ranks share the cores.
        threads = int(user_threads) if user_threads is not None else max(1, machine.cpu_threads // (n * tp))
        fraction = _shared_fraction(options, n, "cpu")
        return [
            ReplicaPlan(i, torch_threads=threads, mem_fraction_static=fraction, bundle={"CPU": float(threads * tp)})
            for i in range(n)
        ]
    if ray:  # Ray picks each bundle's GPUs and hides the others from the actor
        return [ReplicaPlan(i, device="cuda", bundle={"CPU": 1.0, "GPU": float(tp)}) for i in range(n)]
    if device.startswith("cuda:"):  # one GPU named by the user: shared, like a CPU
        fraction = _shared_fraction(options, n, "cuda")
        return [ReplicaPlan(i, mem_fraction_static=fraction) for i in range(n)]
    need = n * tp
    if need > len(machine.gpus):
        raise ResourceError(
            f"--dp-size {n} x --tp-size {tp} needs {need} GPUs, {len(machine.gpus)} visible "
            "(pass --device cuda:N to share one GPU between the replicas)"
        )
    if tp == 1:
        return [ReplicaPlan(i, device=f"cuda:{i}") for i in range(n)]
    return [
        ReplicaPlan(i, device="cuda", env={"CUDA_VISIBLE_DEVICES": ",".join(machine.gpus[i * tp : (i + 1) * tp])})
        for i in range(n)
    ]


def probe_machine(options: Mapping[str, Any]) -> Machine:
    """This host: its default torch threads and, unless the user asked for the CPU, its GPUs."""
    from engine import default_torch_threads

    gpus: tuple[str, ...] = ()
    if (options.get("device") or "auto") != "cpu":
        import torch  # the engine imports it anyway; only the device count is read (no CUDA context)

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        visible = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
        gpus = tuple(visible[:count]) if visible else tuple(str(i) for i in range(count))
    return Machine(cpu_threads=default_torch_threads(), gpus=gpus)


__all__ = ["Machine", "ReplicaPlan", "ResourceError", "plan_replicas", "probe_machine"]
