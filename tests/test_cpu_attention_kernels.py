"""The C++ CPU attention kernels (engine/kernels/csrc/cpu_attention.cpp): decode and extend.

Checked against a plain per-request softmax attention in fp64 on the same values: outputs (and
decode's log-sum-exps), fp32 and bf16, head sizes 64, 128 and 256, grouped-query ratios 1-8, lengths
from 1 to past several 16-token blocks, extends with and without a cached prefix, slots scattered
over the pool; Gemma 2's soft-capped scores. Bad inputs raise, never crash.
The kernel is built by the test session if it is not cached (the engine does the same at its
first decode); a machine that cannot build it fails here loudly rather than silently running the
torch path.
"""

from __future__ import annotations

import pytest
import torch

from engine.kernels import cpu_attention as kernel
from engine.kernels import cpu_extension


@pytest.fixture(scope="module", autouse=True)
def built():
    assert kernel.load() is not None, "the CPU decode-attention kernel did not build (see the log)"


def _capped(s: torch.Tensor, softcap: float | None) -> torch.Tensor:
    return s if softcap is None else torch.tanh(s / softcap) * softcap  # transformers' Gemma 2 order


def _reference(q, kb, vb, slots, lens, scale, softcap=None):
    outs, lses = [], []
    g = q.shape[1] // kb.shape[1]
    for b in range(q.shape[0]):
        n = int(lens[b])
        k = kb[slots[b, :n]].double().repeat_interleave(g, 1)  # [n, H, D]
        v = vb[slots[b, :n]].double().repeat_interleave(g, 1)
        s = _capped(torch.einsum("hd,nhd->hn", q[b].double(), k) * scale, softcap)
        outs.append(torch.einsum("hn,nhd->hd", s.softmax(-1), v))
        lses.append(s.logsumexp(-1))
    return torch.stack(outs), torch.stack(lses)


# Grouped-query ratios 1, 2, 3, 4, 5, 7 and 8: the bf16 kernels tile query heads by 4 (scores) and
# by 4 or 2 (P @ V), so these cover every remainder. Heads of 256: Gemma 2 2B's 8 on 4 KV heads.
HEAD_SHAPES = [
    (4, 4, 64), (12, 6, 64), (9, 3, 64), (8, 2, 128), (10, 2, 128), (14, 2, 64), (16, 2, 64), (8, 4, 256), (3, 1, 256)
]  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", HEAD_SHAPES)
def test_kernel_matches_reference(dtype, heads, kv_heads, head_dim):
    gen = torch.Generator().manual_seed(heads * 100 + head_dim)
    pool = 3000
    lens = torch.tensor([1, 2, 15, 16, 17, 33, 200, 64], dtype=torch.int64)
    width = int(lens.max()) + 3
    slots = torch.stack([torch.randperm(pool, generator=gen)[:width] for _ in lens])
    kb = (torch.randn(pool, kv_heads, head_dim, generator=gen) * 2).to(dtype)
    vb = torch.randn(pool, kv_heads, head_dim, generator=gen).to(dtype)
    q = (torch.randn(len(lens), heads, head_dim, generator=gen) * 2).to(dtype)
    scale = head_dim**-0.5
    out, lse = kernel.decode_attention(q, kb, vb, slots, lens, scale)
    ref, ref_lse = _reference(q, kb, vb, slots, lens, scale)
    assert out.dtype == dtype and out.shape == q.shape and lse.dtype == torch.float32
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the output's own rounding
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4, rtol=1e-5)
    # A length-1 request attends only to its one key: its output is that value row exactly.
    g = heads // kv_heads
    torch.testing.assert_close(out[0].float(), vb[slots[0, 0]].float().repeat_interleave(g, 0), atol=tol, rtol=tol)


def _extend_reference(q, kb, vb, slots, prefix, ext, scale, softcap=None, window=0):
    outs, start = [], 0
    g = q.shape[1] // kb.shape[1]
    for r in range(len(ext)):
        p, e = int(prefix[r]), int(ext[r])
        k = kb[slots[r, : p + e]].double().repeat_interleave(g, 1)
        v = vb[slots[r, : p + e]].double().repeat_interleave(g, 1)
        s = _capped(torch.einsum("thd,nhd->htn", q[start : start + e].double(), k) * scale, softcap)
        k_pos, q_pos = torch.arange(p + e)[None, :], torch.arange(p, p + e)[:, None]
        visible = (k_pos <= q_pos) & ((k_pos > q_pos - window) if window else True)
        s = s.masked_fill(~visible, float("-inf"))
        outs.append(torch.einsum("htn,nhd->thd", s.softmax(-1), v))
        start += e
    return torch.cat(outs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", HEAD_SHAPES)
def test_extend_kernel_matches_reference(dtype, heads, kv_heads, head_dim):
    gen = torch.Generator().manual_seed(heads + head_dim)
    pool = 3000
    # fresh prompts, extends on a cached prefix (block-aligned and not), a one-token extend
    prefix = torch.tensor([0, 0, 100, 16, 37, 5], dtype=torch.int64)
    ext = torch.tensor([70, 1, 33, 16, 1, 140], dtype=torch.int64)
    width = int((prefix + ext).max()) + 2
    slots = torch.stack([torch.randperm(pool, generator=gen)[:width] for _ in ext])
    kb = (torch.randn(pool, kv_heads, head_dim, generator=gen) * 2).to(dtype)
    vb = torch.randn(pool, kv_heads, head_dim, generator=gen).to(dtype)
    q = (torch.randn(int(ext.sum()), heads, head_dim, generator=gen) * 2).to(dtype)
    scale = head_dim**-0.5
    out = kernel.extend_attention(q, kb, vb, slots, prefix, ext, scale)
    assert out.dtype == dtype and out.shape == q.shape
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(
        out.double(), _extend_reference(q, kb, vb, slots, prefix, ext, scale), atol=tol, rtol=tol
    )
    # The last new token of each request is a decode over the same keys.
    last = torch.cumsum(ext, 0) - 1
    dec, _ = kernel.decode_attention(q[last].contiguous(), kb, vb, slots, prefix + ext, scale)
    torch.testing.assert_close(out[last].float(), dec.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 4, 256)])
@pytest.mark.parametrize("softcap", [50.0, 2.0])
def test_soft_capped_scores_match_reference(dtype, heads, kv_heads, head_dim, softcap):
    """Gemma 2's cap on every scaled score, before the mask: 50 as the released models (scores here
    reach ~+-20: tanh's polynomial and exponential branches both run) and a tight 2 that flattens
    most scores. Decode, a grouped decode (a verify's positions on one row) and extend."""
    gen = torch.Generator().manual_seed(head_dim + int(softcap))
    pool = 3000
    kb = (torch.randn(pool, kv_heads, head_dim, generator=gen) * 3).to(dtype)
    vb = torch.randn(pool, kv_heads, head_dim, generator=gen).to(dtype)
    scale = head_dim**-0.5
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    lens = torch.tensor([1, 17, 200, 129], dtype=torch.int64)
    slots = torch.stack([torch.randperm(pool, generator=gen)[:210] for _ in lens])
    q = (torch.randn(len(lens), heads, head_dim, generator=gen) * 3).to(dtype)
    out, lse = kernel.decode_attention(q, kb, vb, slots, lens, scale, softcap=softcap)
    ref, ref_lse = _reference(q, kb, vb, slots, lens, scale, softcap)
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4, rtol=1e-5)
    uncapped, _ = kernel.decode_attention(q, kb, vb, slots, lens, scale)
    assert not torch.allclose(out.float(), uncapped.float(), atol=tol, rtol=tol)  # the cap bites
    starts, per_query = torch.tensor([0, 2, 4]), torch.tensor([16, 17, 150, 199])  # two rows, two queries each
    grouped, _ = kernel.decode_attention(q, kb, vb, slots[:2].contiguous(), per_query, scale, starts, softcap)
    rows = slots[[0, 0, 1, 1]].contiguous()
    alone, _ = kernel.decode_attention(q, kb, vb, rows, per_query, scale, softcap=softcap)
    assert torch.equal(grouped, alone)
    prefix = torch.tensor([0, 100, 37], dtype=torch.int64)
    ext = torch.tensor([70, 33, 1], dtype=torch.int64)
    eq = (torch.randn(int(ext.sum()), heads, head_dim, generator=gen) * 3).to(dtype)
    got = kernel.extend_attention(eq, kb, vb, slots[:3].contiguous(), prefix, ext, scale, softcap=softcap)
    want = _extend_reference(eq, kb, vb, slots[:3], prefix, ext, scale, softcap)
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 4, 256)])
@pytest.mark.parametrize("window", [1, 5, 40, 64, 100])
def test_sliding_window_extend_matches_reference(dtype, heads, kv_heads, head_dim, window):
    """A sliding-window layer's extend: token p sees keys p - window + 1 .. p. Windows narrower than
    a 16-query block (some queries see nothing of a key block the block reads), at and around the
    64-key chunks; prefixes longer than the window whose old slots are released (garbage in the
    table: never read); with Gemma 2's cap; the same bits wherever the chunk starts."""
    gen = torch.Generator().manual_seed(window + head_dim)
    pool = 3000
    prefix = torch.tensor([0, 150, 37, 3], dtype=torch.int64)
    ext = torch.tensor([90, 40, 1, 20], dtype=torch.int64)
    width = int((prefix + ext).max()) + 2
    slots = torch.stack([torch.randperm(pool, generator=gen)[:width] for _ in ext])
    for r in range(len(ext)):  # released: before the first new token's window
        slots[r, : max(0, int(prefix[r]) - window + 1)] = -7
    kb = (torch.randn(pool, kv_heads, head_dim, generator=gen) * 2).to(dtype)
    vb = torch.randn(pool, kv_heads, head_dim, generator=gen).to(dtype)
    q = (torch.randn(int(ext.sum()), heads, head_dim, generator=gen) * 2).to(dtype)
    scale, tol = head_dim**-0.5, (1e-5 if dtype == torch.float32 else 1e-2)
    for cap in (None, 3.0):
        out = kernel.extend_attention(q, kb, vb, slots, prefix, ext, scale, cap, window)
        want = _extend_reference(q, kb, vb, slots.clamp(min=0), prefix, ext, scale, cap, window)
        torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)
    # request 0's tokens again as a chunk starting at 45: the same bits for each of them
    full = kernel.extend_attention(q[:90], kb, vb, slots[:1], prefix[:1], ext[:1], scale, None, window)
    tail = kernel.extend_attention(
        q[45:90], kb, vb, slots[:1], torch.tensor([45]), torch.tensor([45]), scale, None, window
    )
    assert torch.equal(full[45:], tail)
    # a window at least the sequence is plain causal attention
    wide = kernel.extend_attention(q[:90], kb, vb, slots[:1], prefix[:1], ext[:1], scale, None, 1000)
    assert torch.equal(wide, kernel.extend_attention(q[:90], kb, vb, slots[:1], prefix[:1], ext[:1], scale))
    with pytest.raises(RuntimeError):  # a released slot inside a wider window
        kernel.extend_attention(q[90:130], kb, vb, slots[1:2], prefix[1:2], ext[1:2], scale, None, 200)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 2, 128)])
def test_extend_token_is_the_same_bits_wherever_its_chunk_starts(dtype, heads, kv_heads, head_dim):
    """A prompt token's output depends on its position and keys only, not on which extend it was
    in: prefilled whole, or in a chunk that starts at any offset from a 16-token block (chunked
    prefill beside other requests splits a prompt so). Deterministic inference rests on it."""
    gen = torch.Generator().manual_seed(head_dim)
    n, pool = 48, 200
    slots = torch.randperm(pool, generator=gen)[:n][None]
    kb = (torch.randn(pool, kv_heads, head_dim, generator=gen) * 2).to(dtype)
    vb = torch.randn(pool, kv_heads, head_dim, generator=gen).to(dtype)
    q = (torch.randn(n, heads, head_dim, generator=gen) * 2).to(dtype)
    scale = head_dim**-0.5

    def extend(start: int, count: int) -> torch.Tensor:
        lens = torch.tensor([start]), torch.tensor([count])
        return kernel.extend_attention(q[start : start + count].contiguous(), kb, vb, slots, *lens, scale)

    whole = extend(0, n)
    for start in range(1, 18):
        chunk = extend(start, 32 - start)
        differ = [start + i for i in range(32 - start) if not torch.equal(chunk[i], whole[start + i])]
        assert not differ, (start, differ)


def test_extend_kernel_rejects_bad_inputs():
    kb = torch.zeros(10, 1, 64)
    slots = torch.zeros(2, 4, dtype=torch.int64)
    ok = dict(
        q=torch.zeros(3, 1, 64),
        k_buf=kb,
        v_buf=kb,
        slots=slots,
        prefix_lens=torch.tensor([1, 0]),
        extend_lens=torch.tensor([2, 1]),
        scale=1.0,
    )
    kernel.extend_attention(**ok)
    bad = [
        dict(extend_lens=torch.tensor([3, 1])),  # lengths do not add up to the query tokens
        dict(prefix_lens=torch.tensor([3, 0])),  # prefix + extend past the slot row
        dict(extend_lens=torch.tensor([3, 0]), q=torch.zeros(3, 1, 64)),  # an empty extend
        dict(slots=torch.full((2, 4), 10, dtype=torch.int64)),
        dict(prefix_lens=torch.tensor([1])),  # one length per request
    ]
    for change in bad:
        with pytest.raises(RuntimeError):
            kernel.extend_attention(**{**ok, **change})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_handles_large_score_ranges(dtype):
    """Scores spanning hundreds of units, the maximum in a late chunk of keys: the online softmax
    must neither overflow nor lose mass (decode, and extend over a long cached prefix)."""
    gen = torch.Generator().manual_seed(7)
    kb = (torch.randn(700, 1, 64, generator=gen) * 30).to(dtype)
    vb = torch.randn(700, 1, 64, generator=gen).to(dtype)
    q = (torch.randn(3, 2, 64, generator=gen) * 30).to(dtype)
    slots = torch.stack([torch.randperm(700, generator=gen)[:300] for _ in range(3)])
    lens = torch.tensor([300, 57, 3])
    out, lse = kernel.decode_attention(q, kb, vb, slots, lens, 0.125)
    ref, ref_lse = _reference(q, kb, vb, slots, lens, 0.125)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-3, rtol=1e-5)
    prefix, ext = torch.tensor([250, 0, 1]), torch.tensor([50, 57, 2])
    qe = (torch.randn(int(ext.sum()), 2, 64, generator=gen) * 30).to(dtype)
    out = kernel.extend_attention(qe, kb, vb, slots, prefix, ext, 0.125)
    assert torch.isfinite(out).all()
    ref = _extend_reference(qe, kb, vb, slots, prefix, ext, 0.125)
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_give_the_same_bits_on_any_thread_count(dtype):
    """Tasks are handed out dynamically to torch's threads; each is computed the same way
    wherever it runs, so the output must not depend on the thread count (and must not race)."""
    gen = torch.Generator().manual_seed(11)
    pool, heads, kv_heads = 4000, 9, 3
    lens = torch.randint(1, 400, (24,), generator=gen)
    slots = torch.stack([torch.randperm(pool, generator=gen)[:400] for _ in lens])
    kb = torch.randn(pool, kv_heads, 64, generator=gen).to(dtype)
    vb = torch.randn(pool, kv_heads, 64, generator=gen).to(dtype)
    q = torch.randn(len(lens), heads, 64, generator=gen).to(dtype)
    prefix = lens // 2
    ext = lens - prefix
    qe = torch.randn(int(ext.sum()), heads, 64, generator=gen).to(dtype)
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            out, lse = kernel.decode_attention(q, kb, vb, slots, lens, 0.125)
            results.append((out, lse, kernel.extend_attention(qe, kb, vb, slots, prefix, ext, 0.125)))
    finally:
        torch.set_num_threads(before)
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_grouped_decode_is_bitwise_each_query_alone(dtype, head_dim):
    """A verify's positions share their request's slot row (`query_starts`): the kernel reads the
    row once for all of them, and each query's output and log-sum-exp must be exactly those of
    the same query attended alone (speculative greedy output must not change). Lengths straddle
    the kernel's 16-key blocks and 128-key chunks, so some queries end a chunk before others."""
    gen = torch.Generator().manual_seed(5)
    pool, heads, kv_heads = 3000, 9, 3
    kb = torch.randn(pool, kv_heads, head_dim, generator=gen).to(dtype)
    vb = torch.randn(pool, kv_heads, head_dim, generator=gen).to(dtype)
    # (first length, queries) per request: across a chunk end (126..133), a block end, short ones
    shape = [(126, 8), (250, 5), (1, 3), (15, 2), (300, 1), (640, 4)]
    slots = torch.stack([torch.randperm(pool, generator=gen)[:700] for _ in shape])
    lens = torch.tensor([n + i for n, k in shape for i in range(k)])
    starts = torch.tensor([0, *torch.tensor([k for _, k in shape]).cumsum(0).tolist()])
    owner = torch.repeat_interleave(torch.arange(len(shape)), torch.tensor([k for _, k in shape]))
    q = torch.randn(len(lens), heads, head_dim, generator=gen).to(dtype)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            out, lse = kernel.decode_attention(q, kb, vb, slots, lens, 0.125, starts)
            alone, alone_lse = kernel.decode_attention(q, kb, vb, slots[owner].contiguous(), lens, 0.125)
            assert torch.equal(out, alone) and torch.equal(lse, alone_lse)
    finally:
        torch.set_num_threads(before)
    ref, ref_lse = _reference(q, kb, vb, slots[owner], lens, 0.125)
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-3, rtol=1e-5)
    bad = [
        torch.tensor([0, 8, 13, 16, 18, 19]),  # one row short
        torch.tensor([0, 8, 8, 16, 18, 19, 23]),  # a row without a query
        torch.tensor([1, 9, 14, 17, 19, 20, 23]),  # not from 0
        torch.tensor([0, 8, 13, 16, 18, 19, 22]),  # not to the number of queries
    ]
    for query_starts in bad:
        with pytest.raises(RuntimeError):
            kernel.decode_attention(q, kb, vb, slots, lens, 0.125, query_starts)


def test_kernel_rejects_bad_inputs():
    kb = torch.zeros(10, 1, 64)
    q = torch.zeros(1, 1, 64)
    slots = torch.zeros(1, 4, dtype=torch.int64)
    ok = dict(q=q, k_buf=kb, v_buf=kb, slots=slots, lens=torch.tensor([4]), scale=1.0)
    kernel.decode_attention(**ok)
    bad = [
        dict(lens=torch.tensor([5])),  # longer than the slot row
        dict(lens=torch.tensor([0])),  # nothing to attend to
        dict(slots=torch.full((1, 4), 10, dtype=torch.int64)),  # past the pool
        dict(slots=torch.full((1, 4), -1, dtype=torch.int64)),
        dict(slots=slots.to(torch.int32)),
        dict(q=torch.zeros(1, 1, 64, dtype=torch.float16), k_buf=kb.half(), v_buf=kb.half()),
        dict(q=torch.zeros(1, 1, 32), k_buf=torch.zeros(10, 1, 32), v_buf=torch.zeros(10, 1, 32)),  # head_dim 32
        dict(
            q=torch.zeros(1, 3, 64), k_buf=torch.zeros(10, 2, 64), v_buf=torch.zeros(10, 2, 64)
        ),  # 3 heads on 2 KV heads
    ]
    for change in bad:
        with pytest.raises(RuntimeError):
            kernel.decode_attention(**{**ok, **change})


def test_supports_and_switch(monkeypatch):
    cpu = torch.device("cpu")
    assert kernel.supports(cpu, torch.float32, 64)
    assert not kernel.supports(cpu, torch.float16, 64)
    assert not kernel.supports(cpu, torch.float32, 96)
    assert kernel.supports(cpu, torch.bfloat16, 256)  # Gemma's heads
    monkeypatch.setenv("ASYNCLLM_CPU_KERNELS", "0")
    assert not cpu_extension.enabled()


def test_failed_build_leaves_the_torch_path(tmp_path, monkeypatch, caplog):
    """A machine that cannot compile the kernels still decodes, on the torch path, with a warning:
    start-up picks the torch attention backend and the torch elementwise ops."""
    from engine.errors import InvalidRequestError
    from engine.layers.attention_backend import resolve_attention_backend
    from engine.layers.norm import RMSNorm

    monkeypatch.setenv("ASYNCLLM_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_extension, "CFLAGS", ["-fno-such-compiler-flag"])
    monkeypatch.setattr(cpu_extension, "_tried", False)
    monkeypatch.setattr(cpu_extension, "_module", None)
    assert kernel.load() is None
    assert "unavailable" in caplog.text
    cpu = torch.device("cpu")
    assert resolve_attention_backend("auto", cpu, torch.float32, 64) == "torch"
    with pytest.raises(InvalidRequestError):
        resolve_attention_backend("cpu", cpu, torch.float32, 64)
    assert not RMSNorm(64, 1e-6, cpu, torch.bfloat16).uses_cpu_kernel
