"""Cascade decode attention: shared KV prefixes attended once per group, merged exactly.

- the planner finds the groups (and declines when sharing would not pay);
- the cascade output equals the plain decode path's on a layout with groups of different sizes
  and prefix lengths, a request in no group, and members whose sequences diverge;
- end to end, fp32: requests sharing a system prompt, decoded together, stay token-identical to
  transformers, and the cascade path really ran.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from engine import Engine
from engine.cache.memory_pool import KVCache, ReqToTokenPool
from engine.kernels import cpu_attention
from engine.layers import shared_prefix
from engine.layers.attention_cpu import CpuAttnBackend
from engine.layers.attention_ops import HeadLayout
from engine.layers.attention_torch import TorchAttnBackend
from engine.layers.cascade import CascadeDecodePlan
from engine.layers.shared_prefix import grouped_queries, plan_shared_prefix
from engine.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from engine.sampling import SamplingParams
from tests.hf_reference import hf_greedy_outputs

H, KVH, D = 6, 2, 64


def _layout(gen: torch.Generator) -> tuple[torch.Tensor, list[int]]:
    """Slot table rows for 10 requests: groups {0,1,2,3} (prefix 70) and {4,5} (prefix 40, whose
    first 20 slots are also the first group's: a template both start with), {6,7,8} (only 20 slots
    in common: below the threshold), {9} alone."""
    pool_slots = torch.randperm(4000, generator=gen)
    taken = iter(pool_slots.tolist())

    def fresh(n: int) -> list[int]:
        return [next(taken) for _ in range(n)]

    seq_lens = [90, 75, 120, 71, 55, 41, 60, 80, 33, 100]
    shared_a, shared_c = fresh(70), fresh(20)
    shared_b = shared_a[:20] + fresh(20)
    rows = []
    for b, n in enumerate(seq_lens):
        head = shared_a if b < 4 else shared_b if b < 6 else shared_c if b < 9 else []
        rows.append(head + fresh(n - len(head)))
    width = max(seq_lens) + 5
    table = torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int64)
    return table, seq_lens


def test_planner_finds_groups_and_prefix_lengths():
    table, seq_lens = _layout(torch.Generator().manual_seed(0))
    plan = plan_shared_prefix(table, seq_lens)
    assert plan is not None
    assert (plan.num_groups, plan.max_prefix, plan.max_members) == (2, 70, 4)
    assert plan.prefix_pad is not None and plan.prefix_pad.sum(1).tolist() == [0, 30]
    # Requests 6..9 share nothing worth a GEMM: they point at the null member slot.
    assert plan.has_ungrouped and plan.member_slot[6:].tolist() == [2 * 4] * 4
    # Suffix lengths: the own part of each request.
    own = [90 - 70, 75 - 70, 120 - 70, 71 - 70, 55 - 40, 41 - 40, 60, 80, 33, 100]
    assert plan.max_suffix == max(own)
    assert (~plan.suffix_pad).sum(1).tolist() == own


def test_grouped_queries_are_the_kernels_rows():
    """The prefix half as the decode kernel takes it: one slot row per group, the members' queries
    group by group, each over its own group's prefix length (not the padded longest)."""
    table, seq_lens = _layout(torch.Generator().manual_seed(0))
    plan = plan_shared_prefix(table, seq_lens)
    grouped = grouped_queries(plan)
    assert grouped.order.tolist() == [0, 1, 2, 3, 4, 5] and grouped.starts.tolist() == [0, 4, 6]
    assert grouped.lens.tolist() == [70] * 4 + [40] * 2
    assert torch.equal(grouped.rows[0], table[0, :70]) and torch.equal(grouped.rows[1, :40], table[4, :40])


def test_planner_declines_when_sharing_does_not_pay():
    gen = torch.Generator().manual_seed(1)
    table, seq_lens = _layout(gen)
    assert plan_shared_prefix(table[:1], seq_lens[:1]) is None  # one request
    assert plan_shared_prefix(table[6:], seq_lens[6:]) is None  # common run below MIN_SHARED_PREFIX
    # Two requests sharing 70 of ~500 slots each: saves under a quarter of the reads.
    long_rows = torch.cat([table[:2], torch.randint(5000, 9000, (2, 400), generator=gen)], 1)
    assert plan_shared_prefix(long_rows, [490, 495]) is None
    # A request whose only token is the one decoded now shares nothing; nor do short batches
    # (rows narrower than the shared-prefix threshold).
    assert plan_shared_prefix(table[:2], [1, 1]) is None
    assert plan_shared_prefix(table[:3, :5], [5, 4, 5]) is None
    assert (
        plan_shared_prefix(table[:3, : shared_prefix.MIN_SHARED_PREFIX], [shared_prefix.MIN_SHARED_PREFIX] * 3) is None
    )


@pytest.mark.parametrize("cpu_kernel", [True, False], ids=["kernel", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cascade_decode_equals_plain_decode(dtype, cpu_kernel):
    """Cascade vs plain, with the suffixes through the C++ kernel or the torch path."""
    gen = torch.Generator().manual_seed(2)
    table, seq_lens = _layout(gen)
    b = len(seq_lens)
    rtp = ReqToTokenPool(b, table.shape[1])
    rtp.req_to_token[:] = table.to(rtp.req_to_token.dtype)
    cache = KVCache(4000, 2, KVH, D, dtype)
    for layer in range(2):
        cache.k_buffer[layer].copy_(torch.randn(4000, KVH, D, generator=gen))
        cache.v_buffer[layer].copy_(torch.randn(4000, KVH, D, generator=gen))
    outs = {}
    backend_class = CpuAttnBackend if cpu_kernel else TorchAttnBackend
    for cascade in (True, False):
        be = backend_class(HeadLayout(H, KVH, D, D**-0.5), cascade=cascade)
        last = torch.tensor([table[i, n - 1] for i, n in enumerate(seq_lens)])
        fb = ForwardBatch(
            forward_mode=ForwardMode.DECODE,
            batch_size=b,
            input_ids=torch.zeros(b, dtype=torch.int64),
            positions=torch.tensor(seq_lens) - 1,
            req_pool_indices=torch.arange(b),
            seq_lens=torch.tensor(seq_lens),
            seq_lens_cpu=list(seq_lens),
            out_cache_loc=last,
            req_to_token_pool=rtp,
            token_to_kv_pool=cache,
            attn_backend=be,
        )
        be.init_forward_metadata(fb)
        assert isinstance(be.plan, CascadeDecodePlan) == cascade
        if cascade and cpu_kernel:  # the prefix half in the kernel exactly where it reads a row once
            assert (be.plan.grouped is not None) == cpu_attention.shares_rows(dtype)
            bf16_dot = torch.cpu._is_avx512_bf16_supported()  # the kernels are built for this CPU
            assert cpu_attention.shares_rows(dtype) == (dtype == torch.bfloat16 and bf16_dot)
        torch.manual_seed(3)  # the same q and new k/v (the decoded token's, written to its own slot)
        outs[cascade] = [
            be.forward(
                torch.randn(b, H, D).to(dtype),
                torch.randn(b, KVH, D).to(dtype),
                torch.randn(b, KVH, D).to(dtype),
                layer,
                fb,
            )
            for layer in range(2)
        ]
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for layer in range(2):
        torch.testing.assert_close(outs[True][layer].float(), outs[False][layer].float(), atol=tol, rtol=tol)


_SYSTEM = (
    "You are a meticulous assistant for a lighthouse museum. Answer visitors' questions about the "
    "history of the lighthouse, its keepers, the lens and the lamp, the ships that passed and the "
    "birds of the island. Keep answers short and factual, and say so when you do not know."
)
_QUESTIONS = [
    ["When was the lighthouse built?", "Who was the first keeper?", "How bright is the lamp?"],
    ["Which birds nest here?", "Can I climb the tower?"],
]


NEW_TOKENS = 24


@pytest.fixture(scope="module")
def shared_system_prompts(default_tokenizer) -> list[list[int]]:
    prompts = []
    for g, questions in enumerate(_QUESTIONS):
        system = _SYSTEM if g == 0 else _SYSTEM.replace("lighthouse museum", "seabird reserve")
        for q in questions:
            msgs = [{"role": "system", "content": system}, {"role": "user", "content": q}]
            ids = default_tokenizer.apply_chat_template(
                msgs, add_generation_prompt=True, tokenize=True, return_dict=False
            )
            prompts.append(list(ids))
    return prompts


@pytest.fixture(scope="module")
def hf_refs(hf_default_model, shared_system_prompts) -> list[list[int]]:
    return hf_greedy_outputs(hf_default_model, shared_system_prompts, NEW_TOKENS)


@pytest.mark.parametrize("kernels", ["1", "0"], ids=["cpu-kernels", "torch-path"])
async def test_shared_system_prompts_decode_with_cascade_token_identical(
    shared_system_prompts, hf_refs, monkeypatch, kernels
):
    """fp32 end to end, with the C++ attention kernels and without (ASYNCLLM_CPU_KERNELS=0): the
    backend chosen at start-up is the kernel one, or the torch one, and it alone runs."""
    monkeypatch.setenv("ASYNCLLM_CPU_KERNELS", kernels)
    prompts, refs, new_tokens = shared_system_prompts, hf_refs, NEW_TOKENS

    plans: list[bool] = []

    def counting_plan(rows, seq_lens):
        plan = plan_shared_prefix(rows, seq_lens)
        plans.append(plan is not None)
        return plan

    used: set[str] = set()
    for cls in (CpuAttnBackend, TorchAttnBackend):

        def counting_metadata(self, fb, _inner=cls.init_forward_metadata, _name=cls.__name__):
            used.add(_name)
            return _inner(self, fb)

        monkeypatch.setattr(cls, "init_forward_metadata", counting_metadata)
    monkeypatch.setattr(shared_prefix, "plan_shared_prefix", counting_plan)
    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens)
    engine = Engine(
        "smollm2-135m", dtype="float32", device="cpu", torch_threads=1, max_total_tokens=8192, max_running_requests=8
    )
    async with engine:
        async with asyncio.timeout(300):
            outs = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
        st = await engine.get_internal_state()
    assert sum(plans) >= new_tokens // 2, plans
    assert used == {"CpuAttnBackend" if kernels == "1" else "TorchAttnBackend"}, used
    for i, (out, ref) in enumerate(zip(outs, refs)):
        assert out.token_ids == ref, f"prompt {i}"
    assert st["available_tokens"] + st["evictable_tokens"] == st["total_tokens"], st


def test_thresholds_are_sane():
    assert shared_prefix.MIN_SHARED_PREFIX >= 1 and 0 < shared_prefix.MIN_SAVED_FRACTION < 1
