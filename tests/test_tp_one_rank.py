"""A one-rank tensor-parallel group joined through `TPGroup.init`, exactly as a TP rank builds it
(device group + CPU group): gloo on a CPU, NCCL on a GPU (`gpu` mark; bench/gpu_check.sh runs it).

One GPU cannot hold two NCCL ranks (NCCL refuses a duplicate device), so this is the check a single
GPU allows: NCCL creates its communicator and launches every collective the TP path uses, on device
tensors, with the right values; the step-message and sampled-id broadcasts work; and greedy tokens
from a runner built on the group equal those of a runner without one.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from engine import SyncScheduler
from engine.distributed.launcher import free_port
from engine.distributed.parallel_state import TPGroup
from engine.model_executor.model_runner import ModelRunner
from engine.models.loader import resolve_model
from engine.sampling import SamplingParams
from tests.sched_harness import make_runner, make_tiny_llama, random_prompts

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture
def one_rank_group(request: pytest.FixtureRequest):
    device = torch.device(request.param)
    group = TPGroup.init(0, 1, 1, f"tcp://127.0.0.1:{free_port()}", device, rendezvous_s=60.0)
    try:
        yield group, device
    finally:
        group.destroy()  # a no-op at one rank: the default process group is this test's to end
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.parametrize("one_rank_group", DEVICES, indirect=True)
def test_collectives_on_a_one_rank_group(one_rank_group) -> None:
    group, device = one_rank_group
    assert dist.get_backend(group.device_group) == ("nccl" if device.type == "cuda" else "gloo")
    x = torch.randn(64, 576, generator=torch.Generator().manual_seed(0)).to(device)
    y = x.clone()
    dist.all_reduce(y, group=group.device_group)
    parts = [torch.full_like(x, float("nan"))]
    dist.gather(x, parts, dst=0, group=group.device_group)
    z = x.clone()
    dist.broadcast(z, src=0, group=group.device_group)
    gathered = [torch.full_like(x, float("nan"))]
    dist.all_gather(gathered, x, group=group.device_group)
    for out in (y, parts[0], z, gathered[0]):
        assert torch.equal(out, x)
    payload = b"step message \x00\xff" * 100
    assert group.broadcast_bytes(payload) == payload
    ids = torch.arange(7, device=device)
    assert torch.equal(group.broadcast_ids(ids.clone()), ids)


@pytest.mark.parametrize("one_rank_group", DEVICES, indirect=True)
def test_greedy_on_the_group_equals_without(one_rank_group, tmp_path: Path) -> None:
    group, device = one_rank_group
    folder = make_tiny_llama(tmp_path)
    prompts = random_prompts(6, 3, 40, seed=3)
    params = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    plain, args = make_runner(folder, device=device.type)
    on_group = ModelRunner(args, resolve_model(str(folder)), tp=group)
    outs = []
    for runner in (on_group, plain):
        sched = SyncScheduler(runner, args)
        reqs = [sched.add_request(p, params) for p in prompts]
        sched.run_until_idle()
        outs.append([list(r.output_ids) for r in reqs])
    assert outs[0] == outs[1] and all(len(o) == 12 for o in outs[0])
