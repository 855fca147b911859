// Paged attention kernels for CPUs: queries against their requests' KV slots, read in place.
//
// decode_attention: one query token per request. Why a kernel: the torch path gathers every
// request's K and V rows into a padded copy and then runs two batched GEMVs over it, so each
// step moves the KV cache through memory three times (read scattered, write the copy, read the
// copy). At batch 64 x 450 tokens that was 60% of a bf16 decode step on a 2-core CPU. Here each
// (request, KV head) task streams its K and V rows once, straight from the pool, with an online
// softmax (Flash-decoding style), and never pads.
//
// extend_attention: the new tokens of prefill/extend requests, causal over prefix + themselves
// (their own K/V are already in the pool). Tasks are (request, KV head, block of 16 queries); each
// block of K/V rows is read by all 16 x G query rows while it sits in L1. torch's CPU flash SDPA
// reached 40-110 GFLOP/s on these shapes (9 heads of 64, a few hundred tokens).
//
// Layout: q [T, H, D]; k_buf/v_buf [S, KVH, D] (one layer of the pool); slots [R, L] int64 (row r
// holds request r's slot ids). decode also returns lse [B, H] fp32 (natural-log sum of exp of the
// scaled scores), so callers can merge it with attention over other keys (cascade attention).
// Grouped-query heads share each K/V row load.
//
// Vectors are the machine's own width (vec_native.h: 16 fp32 lanes with AVX-512, 8 with AVX2), and
// K/V rows are read in place, bf16 widened as loaded; D must be a multiple of 16 (64, 128 and 256
// are built: Gemma's heads are 256 wide). Gemma 2's attention-logit soft-cap (`softcap` > 0) caps
// every scaled score before the mask, as transformers does.
//
// This file holds the entry points (argument checks) and the fp32-FMA kernels, used for fp32 and
// for bf16 on CPUs without AVX512-BF16; cpu_attention_bf16.cpp has the faster bf16 kernels.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <optional>
#include <vector>

// No implicit fused multiply-adds in this file: with GCC's default contraction the compiler fuses
// `x * y + z` where it sees fit, and two inlined copies of one loop fused differently, so a prompt
// token's attention output changed (by an ulp in fp32) with where its prefill chunk started:
// deterministic inference was not batch-invariant. The hot products fuse explicitly (fmadd).
#pragma GCC optimize("fp-contract=off")
#include "attention.h"
#include "vec_native.h"

using namespace asyncllm::native;
using asyncllm::kPrefetch;
using asyncllm::prefetch_l2;

namespace {

constexpr int kKeys = kWidth;  // keys per block: one vector of scores per query row
constexpr int64_t kQueries = 16;  // an extend task's block of queries (all share each key block)

// The scores of keys krow[0 .. N) for one query row, as a pairwise tree evaluated depth first
// (a few vectors live at a time, not N): lane t of the kKeys-key result holds key t's score.
template <int N, int NV, typename T>
inline vf score_tree(const vf* q, const T* const* krow) {
  if constexpr (N == 1) {
    // Two chains (even and odd vectors): half the sequential rounding of one, and two FMAs in flight.
    static_assert(NV % 2 == 0, "head_dim a multiple of 2 vectors");
    const T* k = krow[0];
    vf a = q[0] * load(k), b = q[1] * load(k + kWidth);
    for (int j = 2; j < NV; j += 2) {
      a = fmadd(q[j], load(k + kWidth * j), a);
      b = fmadd(q[j + 1], load(k + kWidth * (j + 1)), b);
    }
    return a + b;
  } else {
    return pair_sums(score_tree<N / 2, NV>(q, krow), score_tree<N / 2, NV>(q, krow + N / 2));
  }
}

// One query row (one token, one head) across key blocks: the online softmax.
template <int NV>
struct RowState {
  vf acc[NV];
  float run_max, run_sum;
};

template <int NV>
inline void init_row(RowState<NV>& st) {
  for (int j = 0; j < NV; ++j) st.acc[j] = broadcast(0.0f);
  st.run_max = -std::numeric_limits<float>::infinity();
  st.run_sum = 0.0f;
}

// One block of keys for one query row: scores (soft-capped when cap > 0), the online-softmax
// update, P @ V. krow/vrow: the block's K and V rows, read in place; only keys from .. cnt - 1
// count (the rest repeat a real row; `from` > 0: a window starts inside the block), at least one.
template <int NV, typename T>
inline void attend_block(const vf* q, const T* const* krow, const T* const* vrow, int cnt, float cap,
                         RowState<NV>& st, int from = 0) {
  const vi valid = from > 0 ? lanes_below(cnt) & ~lanes_below(from) : lanes_below(cnt);
  vf s = score_tree<kKeys, NV>(q, krow);
  if (cap > 0.0f) s = softcap(s, cap);
  s = valid ? s : broadcast(-std::numeric_limits<float>::infinity());
  const float new_max = std::max(st.run_max, hmax(s));
  const float alpha = std::exp(st.run_max - new_max);
  vf p = exp_nonpos(s - new_max);
  p = valid ? p : broadcast(0.0f);
  st.run_sum = st.run_sum * alpha + hsum(p);
  st.run_max = new_max;
  vf a[NV];
  for (int j = 0; j < NV; ++j) a[j] = st.acc[j] * alpha;
  for (int t = from; t < cnt; ++t) {
    const vf w = broadcast(p[t]);
    const T* v = vrow[t];
    for (int j = 0; j < NV; ++j) a[j] = fmadd(w, load(v + kWidth * j), a[j]);
  }
  for (int j = 0; j < NV; ++j) st.acc[j] = a[j];
}

// The K/V row pointers of one KV head for slots sl[0 .. cnt), padded to a whole block with the
// first read one; slots before `first` (outside every query's window) read as slot `first`'s.
template <typename T>
inline void block_rows(const T* kb, const T* vb, const int64_t* sl, int cnt, int64_t row, int64_t head_off,
                       const T** krow, const T** vrow, int first = 0) {
  for (int t = 0; t < kKeys; ++t) {
    const int64_t off = sl[t < cnt && t >= first ? t : first] * row + head_off;
    krow[t] = kb + off;
    vrow[t] = vb + off;
  }
}

// The normalised output row; returns the row's log-sum-exp.
template <int NV, typename T>
inline float store_row(const RowState<NV>& st, T* o) {
  const float inv = 1.0f / st.run_sum;
  for (int j = 0; j < NV; ++j) {
    const vf v = st.acc[j] * inv;
    for (int i = 0; i < kWidth; ++i) o[kWidth * j + i] = static_cast<T>(v[i]);
  }
  return st.run_max + std::log(st.run_sum);
}

template <int NV, typename T>
void decode_kernel(const T* q, const T* kb, const T* vb, const int64_t* slots, const int64_t* lens, T* out,
                   float* lse, int64_t B, int64_t H, int64_t KVH, int64_t max_len, float scale, float cap) {
  constexpr int64_t D = NV * kWidth;
  const int64_t G = H / KVH;
  const int64_t row = KVH * D;  // elements between consecutive slots of the pool
  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<vf> qv(G * NV);
    std::vector<RowState<NV>> st(G);
    const T* krow[kKeys];
    const T* vrow[kKeys];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / KVH, kh = task % KVH, n = lens[b];
      const int64_t* sl = slots + b * max_len;
      for (int64_t g = 0; g < G; ++g) {
        const T* qg = q + (b * H + kh * G + g) * D;
        for (int j = 0; j < NV; ++j) qv[g * NV + j] = load(qg + kWidth * j) * scale;
        init_row(st[g]);
      }
      for (int64_t t0 = 0; t0 < n; t0 += kKeys) {
        const int cnt = static_cast<int>(n - t0 < kKeys ? n - t0 : kKeys);
        // Rows kPrefetch blocks ahead, while this one computes: the slots are scattered, so the
        // hardware prefetchers cannot guess them.
        const int64_t ahead = t0 + kPrefetch * kKeys;
        const int64_t next = n - ahead < kKeys ? n - ahead : kKeys;
        for (int64_t t = 0; t < next; ++t) {
          const int64_t off = sl[ahead + t] * row + kh * D;
          for (int64_t byte = 0; byte < D * int64_t(sizeof(T)); byte += 64) {
            prefetch_l2(reinterpret_cast<const char*>(kb + off) + byte);
            prefetch_l2(reinterpret_cast<const char*>(vb + off) + byte);
          }
        }
        block_rows(kb, vb, sl + t0, cnt, row, kh * D, krow, vrow);
        for (int64_t g = 0; g < G; ++g) attend_block<NV>(qv.data() + g * NV, krow, vrow, cnt, cap, st[g]);
      }
      for (int64_t g = 0; g < G; ++g) {
        const int64_t h = kh * G + g;
        lse[b * H + h] = store_row<NV>(st[g], out + (b * H + h) * D);
      }
    }
  });
}

template <int NV, typename T>
void extend_kernel(const T* q, const T* kb, const T* vb, const int64_t* slots, int64_t L, const int64_t* prefix,
                   const int64_t* ext, const int64_t* qstart, int64_t R, T* out, int64_t H, int64_t KVH, float scale,
                   float cap, int64_t window) {
  constexpr int64_t D = NV * kWidth;
  const int64_t G = H / KVH;
  const int64_t row = KVH * D;
  std::vector<int64_t> task_req, task_block;  // (request, first query of a block of queries)
  for (int64_t r = 0; r < R; ++r)
    for (int64_t i0 = 0; i0 < ext[r]; i0 += kQueries) {
      task_req.push_back(r);
      task_block.push_back(i0);
    }
  const int64_t ntask = static_cast<int64_t>(task_req.size());
  at::parallel_for(0, ntask * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<vf> qv(kQueries * G * NV);
    std::vector<RowState<NV>> st(kQueries * G);
    const T* krow[kKeys];
    const T* vrow[kKeys];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task_req[task / KVH], i0 = task_block[task / KVH], kh = task % KVH;
      const int64_t nq = ext[r] - i0 < kQueries ? ext[r] - i0 : kQueries;
      const int64_t first_pos = prefix[r] + i0, last_pos = first_pos + nq - 1;
      const int64_t* sl = slots + r * L;
      for (int64_t i = 0; i < nq; ++i)
        for (int64_t g = 0; g < G; ++g) {
          const T* qr = q + ((qstart[r] + i0 + i) * H + kh * G + g) * D;
          for (int j = 0; j < NV; ++j) qv[(i * G + g) * NV + j] = load(qr + kWidth * j) * scale;
          init_row(st[i * G + g]);
        }
      // A window: no query of the block sees a key before `lo`; blocks stay aligned to kKeys
      // from position 0, so a token's sums do not depend on where its prefill chunk starts.
      const int64_t lo = window > 0 ? std::max<int64_t>(0, first_pos - window + 1) : 0;
      for (int64_t t0 = lo / kKeys * kKeys; t0 <= last_pos; t0 += kKeys) {
        const int cnt = static_cast<int>(last_pos + 1 - t0 < kKeys ? last_pos + 1 - t0 : kKeys);
        block_rows(kb, vb, sl + t0, cnt, row, kh * D, krow, vrow, static_cast<int>(lo > t0 ? lo - t0 : 0));
        // Query i sees keys 0..first_pos + i (a window: from first_pos + i - window + 1): the
        // block's first t0 - first_pos queries see none of it.
        for (int64_t i = t0 > first_pos ? t0 - first_pos : 0; i < nq; ++i) {
          const int64_t seen = first_pos + i + 1 - t0;
          const int upto = static_cast<int>(seen < cnt ? seen : cnt);
          const int64_t start = window > 0 ? first_pos + i - window + 1 - t0 : 0;
          if (start >= upto) continue;  // the window starts past this block
          const int from = static_cast<int>(start > 0 ? start : 0);
          for (int64_t g = 0; g < G; ++g)
            attend_block<NV>(qv.data() + (i * G + g) * NV, krow, vrow, upto, cap, st[i * G + g], from);
        }
      }
      for (int64_t i = 0; i < nq; ++i)
        for (int64_t g = 0; g < G; ++g) store_row<NV>(st[i * G + g], out + ((qstart[r] + i0 + i) * H + kh * G + g) * D);
    }
  });
}

template <typename T>
void dispatch_head_dim(int64_t D, const T* q, const T* kb, const T* vb, const int64_t* slots, const int64_t* lens,
                       T* out, float* lse, int64_t B, int64_t H, int64_t KVH, int64_t max_len, float scale,
                       float cap) {
  switch (D) {
    case 64:
      return decode_kernel<64 / kWidth, T>(q, kb, vb, slots, lens, out, lse, B, H, KVH, max_len, scale, cap);
    case 128:
      return decode_kernel<128 / kWidth, T>(q, kb, vb, slots, lens, out, lse, B, H, KVH, max_len, scale, cap);
    case 256:
      return decode_kernel<256 / kWidth, T>(q, kb, vb, slots, lens, out, lse, B, H, KVH, max_len, scale, cap);
    default:
      TORCH_CHECK(false, "decode_attention: head_dim 64, 128 or 256, got ", D);
  }
}

template <typename T>
void dispatch_extend(int64_t D, const T* q, const T* kb, const T* vb, const int64_t* slots, int64_t L,
                     const int64_t* prefix, const int64_t* ext, const int64_t* qstart, int64_t R, T* out, int64_t H,
                     int64_t KVH, float scale, float cap, int64_t w) {
  switch (D) {
    case 64:
      return extend_kernel<64 / kWidth, T>(q, kb, vb, slots, L, prefix, ext, qstart, R, out, H, KVH, scale, cap, w);
    case 128:
      return extend_kernel<128 / kWidth, T>(q, kb, vb, slots, L, prefix, ext, qstart, R, out, H, KVH, scale, cap, w);
    case 256:
      return extend_kernel<256 / kWidth, T>(q, kb, vb, slots, L, prefix, ext, qstart, R, out, H, KVH, scale, cap, w);
    default:
      TORCH_CHECK(false, "extend_attention: head_dim 64, 128 or 256, got ", D);
  }
}

}  // namespace

std::vector<torch::Tensor> decode_attention(torch::Tensor q, torch::Tensor k_buf, torch::Tensor v_buf,
                                            torch::Tensor slots, torch::Tensor lens, double scale,
                                            std::optional<torch::Tensor> query_starts, double softcap) {
  TORCH_CHECK(q.device().is_cpu() && k_buf.device().is_cpu() && v_buf.device().is_cpu(), "CPU tensors");
  TORCH_CHECK(q.dim() == 3 && k_buf.dim() == 3 && v_buf.dim() == 3, "q [B, H, D], k/v [S, KVH, D]");
  TORCH_CHECK(q.is_contiguous() && k_buf.is_contiguous() && v_buf.is_contiguous(), "contiguous q, k, v");
  TORCH_CHECK(slots.scalar_type() == torch::kInt64 && slots.dim() == 2 && slots.is_contiguous(), "slots int64 [R, L]");
  TORCH_CHECK(lens.scalar_type() == torch::kInt64 && lens.dim() == 1 && lens.is_contiguous(), "lens int64 [B]");
  TORCH_CHECK(q.scalar_type() == k_buf.scalar_type() && q.scalar_type() == v_buf.scalar_type(), "one dtype");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), KVH = k_buf.size(1), S = k_buf.size(0);
  const int64_t R = slots.size(0), L = slots.size(1);
  TORCH_CHECK(KVH > 0 && H % KVH == 0 && k_buf.size(2) == D && v_buf.sizes() == k_buf.sizes(), "head shapes");
  TORCH_CHECK(lens.size(0) == B, "one length per query");
  std::vector<int64_t> one_each;  // without query_starts: row r's query is query r
  const int64_t* qs = nullptr;
  if (query_starts.has_value()) {
    const torch::Tensor& st = *query_starts;
    TORCH_CHECK(st.scalar_type() == torch::kInt64 && st.dim() == 1 && st.is_contiguous() && st.size(0) == R + 1,
                "query_starts int64 [R + 1]");
    qs = st.data_ptr<int64_t>();
    TORCH_CHECK(qs[0] == 0 && qs[R] == B, "query_starts run from 0 to the number of queries");
    for (int64_t r = 0; r < R; ++r) TORCH_CHECK(qs[r + 1] > qs[r], "every slot row has a query");
  } else {
    TORCH_CHECK(R == B, "one slot row per query");
    one_each.resize(R + 1);
    for (int64_t r = 0; r <= R; ++r) one_each[r] = r;
    qs = one_each.data();
  }
  const int64_t* lp = lens.data_ptr<int64_t>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) {
    int64_t longest = 0;
    for (int64_t b = qs[r]; b < qs[r + 1]; ++b) {
      TORCH_CHECK(lp[b] >= 1 && lp[b] <= L, "length out of range");
      longest = std::max(longest, lp[b]);
    }
    for (int64_t t = 0; t < longest; ++t) TORCH_CHECK(sp[r * L + t] >= 0 && sp[r * L + t] < S, "slot out of range");
  }
  auto out = torch::empty_like(q);
  auto lse = torch::empty({B, H}, q.options().dtype(torch::kFloat));
  TORCH_CHECK(softcap >= 0.0, "softcap: > 0, or 0 for none");
  const float sc = static_cast<float>(scale), cap = static_cast<float>(softcap);
  if (q.scalar_type() == torch::kBFloat16) {
    using bf = c10::BFloat16;
    if (asyncllm::decode_attention_bf16dot(D, q.data_ptr<bf>(), k_buf.data_ptr<bf>(), v_buf.data_ptr<bf>(), sp, lp, qs,
                                           out.data_ptr<bf>(), lse.data_ptr<float>(), R, H, KVH, L, sc, cap))
      return {out, lse};
  }
  if (query_starts.has_value()) {  // the fp32-FMA kernels take one slot row per query: repeat each row
    auto owner = torch::repeat_interleave(torch::arange(R), query_starts->diff());
    slots = slots.index_select(0, owner).contiguous();
    sp = slots.data_ptr<int64_t>();
  }
  if (q.scalar_type() == torch::kFloat) {
    dispatch_head_dim<float>(D, q.data_ptr<float>(), k_buf.data_ptr<float>(), v_buf.data_ptr<float>(), sp, lp,
                             out.data_ptr<float>(), lse.data_ptr<float>(), B, H, KVH, L, sc, cap);
  } else if (q.scalar_type() == torch::kBFloat16) {
    using bf = c10::BFloat16;
    dispatch_head_dim<bf>(D, q.data_ptr<bf>(), k_buf.data_ptr<bf>(), v_buf.data_ptr<bf>(), sp, lp,
                          out.data_ptr<bf>(), lse.data_ptr<float>(), B, H, KVH, L, sc, cap);
  } else {
    TORCH_CHECK(false, "decode_attention: float32 or bfloat16 only");
  }
  return {out, lse};
}

torch::Tensor extend_attention(torch::Tensor q, torch::Tensor k_buf, torch::Tensor v_buf, torch::Tensor slots,
                               torch::Tensor prefix_lens, torch::Tensor extend_lens, double scale, double softcap,
                               int64_t window) {
  TORCH_CHECK(q.device().is_cpu() && k_buf.device().is_cpu() && v_buf.device().is_cpu(), "CPU tensors");
  TORCH_CHECK(q.dim() == 3 && k_buf.dim() == 3 && v_buf.dim() == 3, "q [T, H, D], k/v [S, KVH, D]");
  TORCH_CHECK(q.is_contiguous() && k_buf.is_contiguous() && v_buf.is_contiguous(), "contiguous q, k, v");
  TORCH_CHECK(slots.scalar_type() == torch::kInt64 && slots.dim() == 2 && slots.is_contiguous(), "slots int64 [R, L]");
  for (const auto& t : {prefix_lens, extend_lens})
    TORCH_CHECK(t.scalar_type() == torch::kInt64 && t.dim() == 1 && t.is_contiguous() && t.size(0) == slots.size(0),
                "prefix/extend lengths int64 [R]");
  TORCH_CHECK(q.scalar_type() == k_buf.scalar_type() && q.scalar_type() == v_buf.scalar_type(), "one dtype");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), KVH = k_buf.size(1), S = k_buf.size(0);
  TORCH_CHECK(KVH > 0 && H % KVH == 0 && k_buf.size(2) == D && v_buf.sizes() == k_buf.sizes(), "head shapes");
  const int64_t R = slots.size(0), L = slots.size(1);
  const int64_t* pp = prefix_lens.data_ptr<int64_t>();
  const int64_t* ep = extend_lens.data_ptr<int64_t>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  std::vector<int64_t> qstart(R);
  int64_t total = 0;
  TORCH_CHECK(window >= 0, "window: > 0, or 0 for none");
  for (int64_t r = 0; r < R; ++r) {
    TORCH_CHECK(pp[r] >= 0 && ep[r] >= 1 && pp[r] + ep[r] <= L, "length out of range");
    // a window's keys only: slots before the first query's window are never read
    const int64_t first = window > 0 ? std::max<int64_t>(0, pp[r] - window + 1) : 0;
    for (int64_t t = first; t < pp[r] + ep[r]; ++t)
      TORCH_CHECK(sp[r * L + t] >= 0 && sp[r * L + t] < S, "slot out of range");
    qstart[r] = total;
    total += ep[r];
  }
  TORCH_CHECK(total == T, "extend lengths must add up to the query tokens");
  auto out = torch::empty_like(q);
  TORCH_CHECK(softcap >= 0.0, "softcap: > 0, or 0 for none");
  const float sc = static_cast<float>(scale), cap = static_cast<float>(softcap);
  if (q.scalar_type() == torch::kFloat) {
    dispatch_extend<float>(D, q.data_ptr<float>(), k_buf.data_ptr<float>(), v_buf.data_ptr<float>(), sp, L, pp, ep,
                           qstart.data(), R, out.data_ptr<float>(), H, KVH, sc, cap, window);
  } else if (q.scalar_type() == torch::kBFloat16) {
    using bf = c10::BFloat16;
    if (asyncllm::extend_attention_bf16dot(D, q.data_ptr<bf>(), k_buf.data_ptr<bf>(), v_buf.data_ptr<bf>(), sp, L, pp,
                                           ep, qstart.data(), R, out.data_ptr<bf>(), H, KVH, sc, cap, window))
      return out;
    dispatch_extend<bf>(D, q.data_ptr<bf>(), k_buf.data_ptr<bf>(), v_buf.data_ptr<bf>(), sp, L, pp, ep, qstart.data(),
                        R, out.data_ptr<bf>(), H, KVH, sc, cap, window);
  } else {
    TORCH_CHECK(false, "extend_attention: float32 or bfloat16 only");
  }
  return out;
}
