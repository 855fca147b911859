"""Correctness checks of the Triton attention kernels against torch references.

Run by tests/test_triton_kernels.py in a subprocess, on CPU under the Triton interpreter:

    TRITON_INTERPRET=1 python tests/triton_checks.py [--group kernels|backend]   # CPU, interpreter
    python tests/triton_checks.py --device cuda                                   # GPU, compiled
    python tests/triton_checks.py --group compile        # compile for sm_90 without a GPU (ptxas)

Inputs are drawn from seed 0, so the suite sees the same numbers on every run; `--seed N` (or
TRITON_CHECK_SEED=N) draws others, `--seed random` a fresh one (printed, `seed=...`, to replay).
Shapes are tiny because the interpreter is slow. Exit status 0 and a final `ALL OK` line mean
every check passed; failures are listed and exit with status 1.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F

TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 1e-2}
FAILURES: list[str] = []


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.float(), ref.float()
    return ((out - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()


_T_LAST = [time.perf_counter()]


def _elapsed() -> str:
    now = time.perf_counter()
    dt, _T_LAST[0] = now - _T_LAST[0], now
    return f"[{dt:.1f}s]"


def check(name: str, out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.shape == ref.shape, (name, out.shape, ref.shape)
    err = rel_err(out, ref)
    ok = err < TOL[dtype] and bool(torch.isfinite(out.float()).all())
    print(f"{'ok  ' if ok else 'FAIL'} {name}: rel_err={err:.2e} (tol {TOL[dtype]:.0e}) {_elapsed()}", flush=True)
    if not ok:
        FAILURES.append(f"{name}: rel_err={err:.2e}")


# ------------------------------------------------------------------------------------------
# slot layouts: every request gets `length` positions mapped to pool slots
# ------------------------------------------------------------------------------------------


def make_layout(
    lens: list[int], page_size: int, max_ctx: int, gen: torch.Generator, device
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A req_to_token table whose rows map positions to shuffled slots (whole shuffled pages when
    page_size > 1; slot 0 / page 0 is left unused as padding). Rows are used in shuffled order too.
    Returns (req_to_token int32 [rows, max_ctx], req_pool_indices int64 [B], num_slots)."""
    rows = len(lens) + 2
    pages_per_req = [-(-n // page_size) for n in lens]
    num_pages = sum(pages_per_req) + 3  # + padding page + a few never used
    perm = torch.randperm(num_pages - 1, generator=gen) + 1
    table = torch.zeros((rows, max_ctx), dtype=torch.int32)
    row_ids = torch.randperm(rows, generator=gen)[: len(lens)]
    used = 0
    for i, n in enumerate(lens):
        pages = perm[used : used + pages_per_req[i]]
        used += pages_per_req[i]
        slots = (pages[:, None] * page_size + torch.arange(page_size)[None, :]).reshape(-1)[:n]
        table[row_ids[i], :n] = slots.to(torch.int32)
    return table.to(device), row_ids.to(device), num_pages * page_size


def gather_seq(buf: torch.Tensor, table: torch.Tensor, row: int, n: int) -> torch.Tensor:
    return buf[table[row, :n].long()]  # [n, KVH, D]


# ------------------------------------------------------------------------------------------
# kernel checks
# ------------------------------------------------------------------------------------------


def check_store_kv(K, device, gen, dtype_in, dtype_pool, kvh, d):
    n_slots, t = 40, 11
    k_buf = torch.zeros((n_slots, kvh, d), dtype=dtype_pool, device=device)
    v_buf = torch.zeros_like(k_buf)
    loc = (torch.randperm(n_slots - 1, generator=gen)[:t] + 1).to(device)
    # non-contiguous inputs: slices of a fused qkv-like tensor
    fused = torch.randn((t, 3, kvh, d), generator=gen).to(device=device, dtype=dtype_in)
    k, v = fused[:, 1], fused[:, 2]
    K.store_kv(k_buf, v_buf, loc, k, v)
    ref_k = torch.zeros_like(k_buf)
    ref_v = torch.zeros_like(v_buf)
    ref_k[loc] = k.to(dtype_pool)
    ref_v[loc] = v.to(dtype_pool)
    name = f"store_kv {str(dtype_in)[6:]}->{str(dtype_pool)[6:]} kvh={kvh} d={d}"
    ok = torch.equal(k_buf, ref_k) and torch.equal(v_buf, ref_v)
    print(f"{'ok  ' if ok else 'FAIL'} {name} {_elapsed()}", flush=True)
    if not ok:
        FAILURES.append(name)


def windowed_reference(q, k, v, q_pos, k_pos, scale, window, softcap):
    """Attention of q [Q, H, D] over k/v [N, KVH, D] at positions q_pos [Q] / k_pos [N] in fp32:
    causal, keys `window` or more positions back hidden (window > 0), scores capped as Gemma 2
    does (softcap > 0: softcap * tanh(score / softcap), after the scale, before the mask)."""
    group = q.shape[1] // k.shape[1]
    kk, vv = k.float().repeat_interleave(group, dim=1), v.float().repeat_interleave(group, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.float(), kk) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    visible = k_pos[None, :] <= q_pos[:, None]
    if window:
        visible &= q_pos[:, None] - k_pos[None, :] < window
    p = torch.softmax(s.masked_fill(~visible, float("-inf")), dim=-1)
    return torch.einsum("hqk,khd->qhd", p, vv)


def released(buf, table, row, n):
    """Poison the first `n` positions of a request's slots (as if hybrid SWA memory had released
    them): a kernel that reads any of them returns NaN."""
    if n > 0:
        buf[table[row, :n].long()] = float("nan")


def check_decode(K, device, gen, dtype, h, kvh, d, lens, page_size, splits, block_n=16, window=0, softcap=0.0):
    b = len(lens)
    table, rows, n_slots = make_layout(lens, page_size, max(lens) + 8, gen, device)
    k_buf = torch.randn((n_slots, kvh, d), generator=gen).to(device=device, dtype=dtype)
    v_buf = torch.randn((n_slots, kvh, d), generator=gen).to(device=device, dtype=dtype)
    q = torch.randn((b, h, d), generator=gen).to(device=device, dtype=dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int64, device=device)
    scale = 1.0 / math.sqrt(d)
    ref = torch.empty((b, h, d), dtype=torch.float32, device=device)
    for i, n in enumerate(lens):
        if window or softcap:
            kk, vv = gather_seq(k_buf, table, int(rows[i]), n), gather_seq(v_buf, table, int(rows[i]), n)
            pos = torch.arange(n, device=device)
            ref[i] = windowed_reference(q[i : i + 1], kk, vv, pos[-1:], pos, scale, window, softcap)[0]
            continue
        kk = gather_seq(k_buf, table, int(rows[i]), n).float().transpose(0, 1)  # [KVH, n, D]
        vv = gather_seq(v_buf, table, int(rows[i]), n).float().transpose(0, 1)
        ref[i] = F.scaled_dot_product_attention(q[i].float()[:, None, :], kk, vv, scale=scale, enable_gqa=True)[:, 0, :]
    if window:  # positions before each window are never read
        for i, n in enumerate(lens):
            released(k_buf, table, int(rows[i]), n - window)
            released(v_buf, table, int(rows[i]), n - window)
    o = torch.full_like(q, float("nan"))
    K.decode_attention_fwd(
        q, k_buf, v_buf, o, table, rows, seq_lens, splits, scale, block_n=block_n, window=window, softcap=softcap
    )
    extra = f" window={window}" * bool(window) + f" softcap={softcap}" * bool(softcap)
    name = f"decode {str(dtype)[6:]} H={h} KVH={kvh} D={d} lens={lens} page={page_size} splits={splits}{extra}"
    check(name, o, ref, dtype)


def check_extend(
    K, device, gen, dtype, h, kvh, d, prefix, ext, page_size, block_m=16, block_n=16, window=0, softcap=0.0
):
    b = len(ext)
    seq = [p + e for p, e in zip(prefix, ext)]
    table, rows, n_slots = make_layout(seq, page_size, max(seq) + 8, gen, device)
    k_buf = torch.randn((n_slots, kvh, d), generator=gen).to(device=device, dtype=dtype)
    v_buf = torch.randn((n_slots, kvh, d), generator=gen).to(device=device, dtype=dtype)
    t = sum(ext)
    q = torch.randn((t, h, d), generator=gen).to(device=device, dtype=dtype)
    k = torch.randn((t, kvh, d), generator=gen).to(device=device, dtype=dtype)
    v = torch.randn((t, kvh, d), generator=gen).to(device=device, dtype=dtype)
    starts = [sum(ext[:i]) for i in range(b)]
    i32 = dict(dtype=torch.int32, device=device)
    ref = torch.empty((t, h, d), dtype=torch.float32, device=device)
    for i in range(b):
        s, e, p = starts[i], ext[i], prefix[i]
        if window or softcap:
            kk = torch.cat([gather_seq(k_buf, table, int(rows[i]), p), k[s : s + e]])
            vv = torch.cat([gather_seq(v_buf, table, int(rows[i]), p), v[s : s + e]])
            pos = torch.arange(p + e, device=device)
            ref[s : s + e] = windowed_reference(q[s : s + e], kk, vv, pos[p:], pos, 1.0 / math.sqrt(d), window, softcap)
            continue
        kk = torch.cat([gather_seq(k_buf, table, int(rows[i]), p), k[s : s + e]]).float().transpose(0, 1)
        vv = torch.cat([gather_seq(v_buf, table, int(rows[i]), p), v[s : s + e]]).float().transpose(0, 1)
        mask = torch.arange(p + e, device=device)[None, :] <= torch.arange(p, p + e, device=device)[:, None]
        out = F.scaled_dot_product_attention(
            q[s : s + e].float().transpose(0, 1), kk, vv, attn_mask=mask, scale=1.0 / math.sqrt(d), enable_gqa=True
        )
        ref[s : s + e] = out.transpose(0, 1)
    if window:  # prefix positions before the first new token's window are never read
        for i in range(b):
            released(k_buf, table, int(rows[i]), prefix[i] - window + 1)
            released(v_buf, table, int(rows[i]), prefix[i] - window + 1)
    o = torch.full_like(q, float("nan"))
    K.extend_attention_fwd(
        q,
        k,
        v,
        o,
        k_buf,
        v_buf,
        table,
        rows,
        torch.tensor(seq, **i32),
        torch.tensor(ext, **i32),
        torch.tensor(starts, **i32),
        torch.tensor(prefix, **i32),
        1.0 / math.sqrt(d),
        block_m=block_m,
        block_n=block_n,
        window=window,
        softcap=softcap,
    )
    extra = f" window={window}" * bool(window) + f" softcap={softcap}" * bool(softcap)
    name = f"extend {str(dtype)[6:]} H={h} KVH={kvh} D={d} prefix={prefix} ext={ext} page={page_size}{extra}"
    check(name, o, ref, dtype)


# ------------------------------------------------------------------------------------------
# backend check: TritonAttnBackend against TorchAttnBackend through ForwardBatch
# ------------------------------------------------------------------------------------------


def check_backend(device, gen, dtype, page_size, layers, windows=(), softcap=None):
    """`windows` (one per layer) / `softcap`: both backends as `create_attention_backend` builds them
    for such a model: Triton with windows and the cap in its kernels, torch wrapped in
    `WindowedAttnBackend`'s torch plans (the reference)."""
    from engine.cache.memory_pool import KVCache, ReqToTokenPool, TokenToKVPoolAllocator
    from engine.layers.attention_backend import create_attention_backend
    from engine.layers.attention_ops import HeadLayout
    from engine.layers.attention_torch import TorchAttnBackend
    from engine.layers.attention_triton import TritonAttnBackend
    from engine.model_executor.forward_batch_info import ForwardBatch, ForwardMode, ModelWorkerBatch

    h, kvh, d = 4, 2, 24
    layout = HeadLayout(h, kvh, d, d**-0.5)
    if windows or softcap is not None:
        triton_be = create_attention_backend("triton", layout, windows=windows, softcap=softcap)
        torch_be = create_attention_backend("torch", layout, windows=windows, softcap=softcap)
        assert triton_be.native and not torch_be.native  # type: ignore[attr-defined]
        triton_be.inner.num_kv_splits = 3  # type: ignore[attr-defined]
    else:
        triton_be = TritonAttnBackend(layout, num_kv_splits=3)
        torch_be = TorchAttnBackend(layout)
    rtp = ReqToTokenPool(6, 64, device=device)
    alloc = TokenToKVPoolAllocator(128, page_size=page_size, device=device)
    # throw away a random number of pages first so slots are not at the start of the pool
    alloc.alloc(page_size * int(torch.randint(0, 4, (1,), generator=gen)))
    # The reference runs in fp32 on the same (bf16-representable) values: the ground truth.
    caches = {
        "triton": KVCache(128, layers, kvh, d, dtype, device=device),
        "torch": KVCache(128, layers, kvh, d, torch.float32, device=device),
    }
    rows = rtp.alloc(3)[::-1]
    row_idx = torch.tensor(rows, dtype=torch.int64)
    lens = [0, 0, 0]

    def run(mode, ext_lens, prefix_lens):
        out_locs = []
        for i, (p, e) in enumerate(zip(prefix_lens, ext_lens)):
            last = int(rtp.req_to_token[rows[i], p - 1]) if p else 0
            slots = alloc.alloc_extend(last, p, e)
            assert slots is not None
            rtp.write(rows[i], p, slots)
            out_locs.append(slots)
            lens[i] = p + e
        t = sum(ext_lens)
        seq_lens = torch.tensor(lens, dtype=torch.int64)
        batch = ModelWorkerBatch(
            forward_mode=mode,
            input_ids=torch.zeros(t, dtype=torch.int64),
            req_pool_indices=row_idx,
            seq_lens=seq_lens,
            out_cache_loc=torch.cat(out_locs).cpu(),
            seq_lens_cpu=list(lens),
            extend_seq_lens=list(ext_lens),
            extend_prefix_lens=list(prefix_lens),
        )
        outs = {}
        for name, be in (("triton", triton_be), ("torch", torch_be)):
            fb = ForwardBatch.init_new(batch, rtp, caches[name], be)  # the host tensors go to the device here
            be.init_forward_metadata(fb)
            cast = (lambda x: x) if name == "triton" else (lambda x: x.float())
            outs[name] = [be.forward(*map(cast, qkv), layer, fb) for layer, qkv in enumerate(inputs)]
        return outs

    def rand_inputs(t):
        return [
            (
                torch.randn((t, h, d), generator=gen).to(device=device, dtype=dtype),
                torch.randn((t, kvh, d), generator=gen).to(device=device, dtype=dtype),
                torch.randn((t, kvh, d), generator=gen).to(device=device, dtype=dtype),
            )
            for _ in range(layers)
        ]

    steps = [
        (ForwardMode.EXTEND, [5, 1, 13], [0, 0, 0]),  # prefill
        (ForwardMode.DECODE, [1, 1, 1], None),
        (ForwardMode.EXTEND, [3, 9, 1], None),  # extend on top of the cached prefix (partial pages)
        (ForwardMode.DECODE, [1, 1, 1], None),
    ]
    for mode, ext_lens, prefix_lens in steps:
        prefix_lens = prefix_lens if prefix_lens is not None else list(lens)
        inputs = rand_inputs(sum(ext_lens))
        outs = run(mode, ext_lens, prefix_lens)
        for layer in range(layers):
            extra = f" windows={windows}" * bool(windows) + f" softcap={softcap}" * (softcap is not None)
            check(
                f"backend {mode.name.lower()} {str(dtype)[6:]} page={page_size} layer={layer} lens={lens}{extra}",
                outs["triton"][layer],
                outs["torch"][layer],
                dtype,
            )
    same_pool = all(
        torch.equal(caches["triton"].k_buffer[layer].float(), caches["torch"].k_buffer[layer])
        and torch.equal(caches["triton"].v_buffer[layer].float(), caches["torch"].v_buffer[layer])
        for layer in range(layers)
    )
    print(f"{'ok  ' if same_pool else 'FAIL'} backend pools identical page={page_size} {_elapsed()}", flush=True)
    if not same_pool:
        FAILURES.append(f"backend pools differ page={page_size}")


# ------------------------------------------------------------------------------------------
# compile check: the interpreter never compiles, so build the kernels for an H100 (sm_90) ahead of
# time (Triton's bundled ptxas; no GPU needed) to catch what only the compiler rejects
# ------------------------------------------------------------------------------------------


def check_compile(K, dt: str = "bf16", arch: int = 90) -> None:
    from tests.triton_subprocess import compile_for_gpu

    tensors = ("Q", "K_Buffer", "V_Buffer", "Out", "K", "V", "Q_Extend", "K_Extend", "V_Extend", "O_Extend")
    ptr = dict.fromkeys(tensors, dt)
    ptr |= {
        "Req_to_token": "i32",
        "Req_pool_indices": "i64",
        "Seq_lens": "i64",
        "Loc": "i64",
        "Extend_seq_lens": "i64",  # ForwardBatch's extend index vectors are int64
        "Extend_start_loc": "i64",
        "Prefix_lens": "i64",
        "Mid_O": "fp32",
        "Mid_Lse": "fp32",
    }
    common = dict(DOT_PRECISION="ieee" if dt == "fp32" else "tf32", UPCAST_DOT=False)
    stage1 = dict(kv_group_num=4, head_dim=64, num_kv_splits=8, BLOCK_H=16, BLOCK_N=32, BLOCK_DMODEL=64, **common)
    extend = dict(kv_group_num=4, head_dim=64, BLOCK_M=32, BLOCK_N=32, BLOCK_DMODEL=64, **common)
    kernels = [
        ("decode stage1", K.decode_stage1_kernel, dict(stage1, SOFTCAP=False)),
        ("decode stage1 softcap", K.decode_stage1_kernel, dict(stage1, SOFTCAP=True)),
        ("decode stage2", K.decode_stage2_kernel, dict(head_dim=64, num_kv_splits=8, BLOCK_DMODEL=64)),
        ("extend", K.extend_kernel, dict(extend, SOFTCAP=False, WINDOW=False)),
        ("extend window softcap", K.extend_kernel, dict(extend, SOFTCAP=True, WINDOW=True)),
        ("store_kv", K.store_kv_kernel, dict(BLOCK_H=2, BLOCK_D=64)),
    ]
    for name, fn, consts in kernels:
        sig = {}
        for arg in fn.arg_names:
            if arg in consts:
                sig[arg] = "constexpr"
            elif arg in ptr:
                sig[arg] = "*" + ptr[arg]
            else:
                sig[arg] = "fp32" if arg in ("qk_scale", "sm_scale", "softcap") else "i32"
        label = f"compile {name} {dt} sm_{arch}"
        error = compile_for_gpu(fn, sig, consts, arch)
        ok, label = not error, f"{label}: {error}" if error else label
        print(f"{'ok  ' if ok else 'FAIL'} {label} {_elapsed()}", flush=True)
        if not ok:
            FAILURES.append(label)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", default=os.environ.get("TRITON_CHECK_SEED", "0"), help="an integer, or 'random'")
    ap.add_argument("--group", choices=("all", "kernels", "backend", "compile"), default="all")
    args = ap.parse_args()
    args.seed = time.time_ns() % 2**31 if args.seed == "random" else int(args.seed)
    device = torch.device(args.device)
    if args.group == "compile":
        if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
            print("the compile group needs TRITON_INTERPRET unset", file=sys.stderr)
            return 2
    elif device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        print("set TRITON_INTERPRET=1 to run the kernels on CPU", file=sys.stderr)
        return 2
    print(f"seed={args.seed} device={device} group={args.group} (replay: --seed {args.seed})", flush=True)
    gen = torch.Generator().manual_seed(args.seed)
    torch.set_num_threads(1)
    t0 = time.perf_counter()

    from engine.kernels import triton_attention as K

    _elapsed()
    f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
    if args.group in ("all", "kernels"):
        check_store_kv(K, device, gen, f32, f32, 2, 24)
        check_store_kv(K, device, gen, f32, bf16, 3, 16)  # cast into a bf16 pool (RTNE like torch)

        # decode: GQA group 2, head_dim 16 and 24 (not a power of two); seq len 1 leaves empty splits
        check_decode(K, device, gen, f32, 4, 2, 16, [1, 7, 19], page_size=1, splits=4)
        check_decode(K, device, gen, f32, 4, 2, 24, [1, 7, 19], page_size=4, splits=3)
        check_decode(K, device, gen, bf16, 4, 2, 24, [1, 7, 19], page_size=1, splits=4)
        check_decode(K, device, gen, f16, 4, 1, 16, [3, 33], page_size=4, splits=1)  # group 4, 3 blocks
        check_decode(K, device, gen, f32, 2, 2, 24, [19, 2], page_size=4, splits=2)  # MHA

        # extend: no prefix, short prefix, prefix spanning blocks; 19 new tokens = 2 query blocks
        check_extend(K, device, gen, f32, 4, 2, 16, [0, 5, 18], [1, 7, 19], page_size=1)
        check_extend(K, device, gen, f32, 4, 2, 24, [0, 5, 18], [1, 7, 19], page_size=4)
        check_extend(K, device, gen, bf16, 4, 2, 24, [3, 0, 17], [19, 2, 1], page_size=4)
        check_extend(K, device, gen, f16, 2, 1, 16, [2, 0], [17, 5], page_size=1)

        # sliding windows (slots before each window poisoned: never read) and Gemma 2's soft-cap;
        # windows shorter than a block hide whole blocks from some rows
        check_decode(K, device, gen, f32, 4, 2, 16, [1, 7, 40], page_size=1, splits=4, window=5)
        check_decode(K, device, gen, f32, 4, 2, 24, [3, 33], page_size=4, splits=2, softcap=2.0)
        check_decode(K, device, gen, bf16, 4, 2, 16, [2, 30], page_size=1, splits=3, window=9, softcap=5.0)
        check_extend(K, device, gen, f32, 4, 2, 16, [0, 5, 30], [1, 7, 35], page_size=1, window=5)
        check_extend(K, device, gen, f32, 4, 2, 24, [20, 0], [19, 40], page_size=4, window=17, softcap=3.0)
        check_extend(K, device, gen, bf16, 2, 1, 16, [9, 3], [5, 20], page_size=1, softcap=2.0)

    if args.group in ("all", "backend"):
        check_backend(device, gen, f32, page_size=1, layers=2)
        check_backend(device, gen, bf16, page_size=4, layers=1)
        # Mistral/Gemma-style: a local layer whose window binds (sequences reach 25) beside a
        # global one, and Gemma 2's cap on every layer
        check_backend(device, gen, f32, page_size=1, layers=2, windows=(4, 0))
        check_backend(device, gen, f32, page_size=4, layers=2, windows=(0, 7), softcap=2.0)

    if args.group == "compile":
        check_compile(K, "bf16")

    print(f"checks took {time.perf_counter() - t0:.1f}s", flush=True)
    if FAILURES:
        print(f"{len(FAILURES)} FAILED (seed={args.seed}):", *FAILURES, sep="\n  ", flush=True)
        return 1
    print("ALL OK", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
