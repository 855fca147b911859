// CPU paged attention in bf16 with AVX512-BF16 dot products (vdpbf16ps).
//
// The fp32-FMA kernels (cpu_attention.cpp) convert every K/V element to fp32 and spend most of their time on
// that conversion and on reducing 16-lane partial dots: at batch 60 x ~360 tokens they read the
// KV cache at ~10 GB/s when DRAM gives ~31. vdpbf16ps multiplies bf16 pairs straight from memory
// (exact products, fp32 sums), and the decode kernel below works in two passes per chunk of keys
// (all scores, then one softmax, then P @ V), so the online-softmax bookkeeping is paid per chunk
// rather than per 16 keys. P is rounded to bf16 for the P @ V dot products, as torch's flash
// attention does for bf16; scores, the max, the sums and the output stay fp32.

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <vector>

#include "attention.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>

namespace asyncllm {
namespace {

constexpr int kChunk = 128;  // keys per two-pass chunk: its K and V rows stay in L2

inline __m512bh as_bh(__m512i v) { return (__m512bh)v; }
inline __m512i load_bf16x32(const c10::BFloat16* p) { return _mm512_loadu_si512(p); }

// Scores of G query heads (bf16 vectors qv[g][DW]) against 16 K rows, soft-capped when cap > 0;
// lanes >= cnt are -inf. rows[t]: the K row of key t (rows past cnt repeat a valid row; their
// lanes are masked).
template <int DW>
inline void score_block(const __m512i* qv, int G, const c10::BFloat16* const* rows, int cnt, float scale,
                        float cap, float* s, int64_t s_stride, v16f* run_max) {
  const v16i valid = lanes_below(cnt);
  for (int g = 0; g < G; ++g) {
    v16f partial[kBlock];
    for (int t = 0; t < kBlock; ++t) {
      const c10::BFloat16* row = rows[t];
      __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), as_bh(qv[g * DW]), as_bh(load_bf16x32(row)));
      for (int j = 1; j < DW; ++j) a = _mm512_dpbf16_ps(a, as_bh(qv[g * DW + j]), as_bh(load_bf16x32(row + 32 * j)));
      partial[t] = (v16f)a;
    }
    v16f sc = transpose_sum16(partial) * scale;
    if (cap > 0.0f) sc = softcap(sc, cap);
    sc = valid ? sc : splat(-std::numeric_limits<float>::infinity());
    std::memcpy(s + g * s_stride, &sc, sizeof(sc));
    run_max[g] = run_max[g] > sc ? run_max[g] : sc;
  }
}

// P @ V for HG heads over n keys: acc[g][2 * DW] (lanes in unpacklo/unpackhi order, see
// store_unpacked) += sum_t p[g][t] * V[t], V[t] = vrows[t]. p holds bf16 pairs (an even count,
// zero-padded).
template <int DW, int HG>
inline void pv_pairs(const uint16_t* p, int64_t p_stride, const c10::BFloat16* const* vrows, int n, v16f* acc) {
  __m512 a[HG][2 * DW];
  for (int g = 0; g < HG; ++g)
    for (int j = 0; j < 2 * DW; ++j) a[g][j] = (__m512)acc[g * 2 * DW + j];
  for (int t = 0; t < n; t += 2) {
    const c10::BFloat16* r0 = vrows[t];
    const c10::BFloat16* r1 = t + 1 < n ? vrows[t + 1] : r0;  // its p is 0
    __m512i lo[DW], hi[DW];
    for (int j = 0; j < DW; ++j) {
      const __m512i v0 = load_bf16x32(r0 + 32 * j), v1 = load_bf16x32(r1 + 32 * j);
      lo[j] = _mm512_unpacklo_epi16(v0, v1);
      hi[j] = _mm512_unpackhi_epi16(v0, v1);
    }
    for (int g = 0; g < HG; ++g) {
      int32_t pair;
      std::memcpy(&pair, p + g * p_stride + t, sizeof(pair));
      const __m512bh pp = as_bh(_mm512_set1_epi32(pair));
      for (int j = 0; j < DW; ++j) {
        a[g][2 * j] = _mm512_dpbf16_ps(a[g][2 * j], as_bh(lo[j]), pp);
        a[g][2 * j + 1] = _mm512_dpbf16_ps(a[g][2 * j + 1], as_bh(hi[j]), pp);
      }
    }
  }
  for (int g = 0; g < HG; ++g)
    for (int j = 0; j < 2 * DW; ++j) acc[g * 2 * DW + j] = (v16f)a[g][j];
}

// Runs pv_pairs over G heads in groups that keep every accumulator in a register; the last group
// takes all the heads left (3 for SmolLM2's 9 query / 3 KV heads), so each V pair is loaded and
// interleaved once per group rather than once per head.
template <int DW>
inline void pv_heads(const uint16_t* p, int64_t p_stride, const c10::BFloat16* const* vrows, int n, v16f* acc,
                     int G) {
  constexpr int kMaxGroup = 8 / DW;  // 2 * DW accumulators per head, 16 in all
  int g = 0;
  for (; g + kMaxGroup <= G; g += kMaxGroup)
    pv_pairs<DW, kMaxGroup>(p + g * p_stride, p_stride, vrows, n, acc + g * 2 * DW);
  const int rest = G - g;  // fewer than kMaxGroup
  if constexpr (kMaxGroup > 3)
    if (rest == 3) return pv_pairs<DW, 3>(p + g * p_stride, p_stride, vrows, n, acc + g * 2 * DW);
  if constexpr (kMaxGroup > 2)
    if (rest == 2) return pv_pairs<DW, 2>(p + g * p_stride, p_stride, vrows, n, acc + g * 2 * DW);
  for (; g < G; ++g) pv_pairs<DW, 1>(p + g * p_stride, p_stride, vrows, n, acc + g * 2 * DW);
}

// acc lanes back to dimension order: unpacklo/hi_epi16 interleave within 128-bit lanes, so lane
// 4L+i of acc[2j] is dimension 32j + 8L + i and of acc[2j+1] is 32j + 8L + 4 + i.
template <int DW>
inline void store_unpacked(const v16f* acc, float inv, c10::BFloat16* o) {
  for (int j = 0; j < DW; ++j)
    for (int L = 0; L < 4; ++L)
      for (int i = 0; i < 4; ++i) {
        o[32 * j + 8 * L + i] = static_cast<c10::BFloat16>(acc[2 * j][4 * L + i] * inv);
        o[32 * j + 8 * L + 4 + i] = static_cast<c10::BFloat16>(acc[2 * j + 1][4 * L + i] * inv);
      }
}

// One chunk's softmax step for head g: new running max, rescale of sum and acc, p = exp(s - max)
// as bf16 (zero past n, padded to an even count).
template <int DW>
inline void softmax_chunk(const float* s, int n, float chunk_max, float& run_max, float& run_sum, v16f* acc,
                          uint16_t* p) {
  const float new_max = std::max(run_max, chunk_max);
  const float alpha = std::exp(run_max - new_max);  // 0 on the first chunk (run_max = -inf)
  v16f sum = splat(0.0f);
  for (int t0 = 0; t0 < n; t0 += kBlock) {
    v16f sc = load16(s + t0);
    v16f e = exp_nonpos(sc - new_max);  // masked lanes hold -inf: exp gives 0
    sum += e;
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + t0), (__m256i)_mm512_cvtneps_pbh((__m512)e));
  }
  run_sum = run_sum * alpha + hsum(sum);
  run_max = new_max;
  for (int j = 0; j < 2 * DW; ++j) acc[j] = acc[j] * alpha;
}

// Hands tasks [0, n) out one at a time to torch's threads: their costs vary with the requests'
// lengths, and a static split can leave one core idle at the end. body(claim) runs once per
// thread (scratch set up once) and loops on claim(), which returns -1 when no task is left.
template <typename Body>
void run_dynamic(int64_t n, const Body& body) {
  std::atomic<int64_t> next{0};
  auto claim = [&]() -> int64_t {
    const int64_t t = next.fetch_add(1, std::memory_order_relaxed);
    return t < n ? t : -1;
  };
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n));
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) { body(claim); });
}

// A row is one request's KV (slots[r, :]); its queries are q[qstart[r] .. qstart[r + 1]) (one per
// row in a plain decode), lens per query, all over the row's leading slots: a speculative
// verify's draft positions each attend as a decode query, and a row's K/V is read once for all.
// Each query's arithmetic is exactly the one-query kernel's: scores per key, a chunk's softmax
// step, P @ V in key order. Keys past a query's length are masked (score -inf, p 0), which adds
// exact zeros to its sums and rescales by exp(0) = 1.
template <int NV>
void decode_kernel_bf16dot(const c10::BFloat16* q, const c10::BFloat16* kb, const c10::BFloat16* vb,
                           const int64_t* slots, const int64_t* lens, const int64_t* qstart, c10::BFloat16* out,
                           float* lse, int64_t R, int64_t H, int64_t KVH, int64_t max_len, float scale,
                           float cap) {
  constexpr int DW = NV / 2;  // 32-element bf16 vectors per row
  constexpr int64_t D = NV * 16;
  const int G = static_cast<int>(H / KVH);
  const int64_t row = KVH * D;
  std::vector<int64_t> row_len(R);  // the longest query of each row: the keys the row reads
  int max_q = 1;
  for (int64_t r = 0; r < R; ++r) {
    row_len[r] = *std::max_element(lens + qstart[r], lens + qstart[r + 1]);
    max_q = std::max(max_q, static_cast<int>(qstart[r + 1] - qstart[r]));
  }
  // A task is one row's KV head kh: its G (x queries) heads read that head's part of each slot
  // record. Tasks that took all of a row's KV heads (whole records, when rows were plentiful)
  // were 4-17% slower per decode step at 8-64 rows (2 threads): a task's scratch and prefetch
  // window are a KV head's, and the threads share out three times as many tasks.
  const int64_t tasks = R * KVH;
  // Longest rows first, so the last tasks handed out are short ones.
  std::vector<int64_t> order(tasks);
  for (int64_t i = 0; i < tasks; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return row_len[a / KVH] > row_len[b / KVH]; });
  run_dynamic(tasks, [&](const auto& claim) {
    // Query heads of a task, ordered (query i, group g): P @ V shares each V row among all of them.
    const int max_heads = max_q * G;
    const int64_t p_stride = kChunk + kBlock;
    std::vector<__m512i> qv(max_heads * DW);
    std::vector<float> s(max_heads * kChunk);
    std::vector<uint16_t> p(max_heads * p_stride);
    std::vector<v16f> acc(max_heads * 2 * DW), run_max_v(max_heads);
    std::vector<float> run_max(max_heads), run_sum(max_heads);
    std::vector<const c10::BFloat16*> krows(kChunk + kBlock), vrows(kChunk);
    int64_t next = claim();
    while (next >= 0) {
      const int64_t task = order[next];
      next = claim();  // known now, so its first rows can be prefetched while this task ends
      const int64_t r = task / KVH, kh = task % KVH, n = row_len[r];
      const int64_t q0 = qstart[r];
      const int nq = static_cast<int>(qstart[r + 1] - q0);
      const int heads = nq * G;
      const int64_t* sl = slots + r * max_len;
      const int64_t nr = next >= 0 ? order[next] / KVH : -1;  // the next task's row and KV head
      const int64_t next_n = nr >= 0 ? row_len[nr] : 0, next_kh = next >= 0 ? order[next] % KVH : 0;
      for (int i = 0; i < nq; ++i)
        for (int g = 0; g < G; ++g) {
          const int hh = i * G + g;
          const int64_t head = (q0 + i) * H + kh * G + g;
          for (int j = 0; j < DW; ++j) qv[hh * DW + j] = load_bf16x32(q + head * D + 32 * j);
          for (int j = 0; j < 2 * DW; ++j) acc[hh * 2 * DW + j] = splat(0.0f);
          run_max[hh] = -std::numeric_limits<float>::infinity();
          run_sum[hh] = 0.0f;
        }
      for (int64_t c0 = 0; c0 < n; c0 += kChunk) {
        const int cn = static_cast<int>(n - c0 < kChunk ? n - c0 : kChunk);
        for (int t = 0; t < cn; ++t) {
          const int64_t off = sl[c0 + t] * row + kh * D;
          krows[t] = kb + off;
          vrows[t] = vb + off;
        }
        for (int t = cn; t < kChunk + kBlock; ++t) krows[t] = krows[0];  // score_block reads whole blocks
        for (int hh = 0; hh < heads; ++hh) run_max_v[hh] = splat(-std::numeric_limits<float>::infinity());
        for (int t0 = 0; t0 < cn; t0 += kBlock) {
          // K and V rows kPrefetch blocks ahead (the slots are scattered: the hardware cannot
          // guess them), so the P @ V pass finds this chunk's V rows in cache. The window counts
          // from the task's start and runs on past its end into the next task's first rows, so
          // the next chunk's (or task's) rows are on their way during this chunk's P @ V pass.
          const int64_t first = c0 + t0 == 0 ? 0 : c0 + t0 + kPrefetch * kBlock;
          for (int64_t t = first; t < n + next_n && t < c0 + t0 + (kPrefetch + 1) * kBlock; ++t) {
            const int64_t off = t < n ? sl[t] * row + kh * D : slots[nr * max_len + t - n] * row + next_kh * D;
            const char* kr = reinterpret_cast<const char*>(kb + off);
            const char* vr = reinterpret_cast<const char*>(vb + off);
            for (int64_t byte = 0; byte < D * 2; byte += 64) {
              prefetch_l2(kr + byte);
              prefetch_l2(vr + byte);
            }
          }
          const int cnt = cn - t0 < kBlock ? cn - t0 : kBlock;
          for (int i = 0; i < nq; ++i) {  // query i sees its own keys only: the rest score -inf
            const int64_t seen = lens[q0 + i] - (c0 + t0);
            const int qcnt = static_cast<int>(seen < cnt ? (seen > 0 ? seen : 0) : cnt);
            score_block<DW>(qv.data() + i * G * DW, G, krows.data() + t0, qcnt, scale, cap,
                            s.data() + i * G * kChunk + t0, kChunk, run_max_v.data() + i * G);
          }
        }
        const int padded = (cn + 1) & ~1;
        for (int hh = 0; hh < heads; ++hh) {
          uint16_t* pg = p.data() + hh * p_stride;
          softmax_chunk<DW>(s.data() + hh * kChunk, cn, hmax(run_max_v[hh]), run_max[hh], run_sum[hh],
                            acc.data() + hh * 2 * DW, pg);
          if (padded > cn) pg[cn] = 0;
        }
        pv_heads<DW>(p.data(), p_stride, vrows.data(), cn, acc.data(), heads);
      }
      for (int i = 0; i < nq; ++i)
        for (int g = 0; g < G; ++g) {
          const int hh = i * G + g;
          const int64_t head = (q0 + i) * H + kh * G + g;
          store_unpacked<DW>(acc.data() + hh * 2 * DW, 1.0f / run_sum[hh], out + head * D);
          lse[head] = run_max[hh] + std::log(run_sum[hh]);
        }
    }
  });
}

// ---- extend/prefill with vdpbf16ps --------------------------------------------------------------
//
// A task is (request, KV head, block of 16 query tokens). Its G heads x 16 queries are held
// transposed (qt: for each bf16 pair p of the head dimension, one vector per head whose 16 lanes
// are the 16 queries), so one vdpbf16ps with a key's pair p broadcast from memory advances 16
// scores at once: no per-key horizontal reductions. Scores, the online softmax and the running
// max/sum live in those "one lane per query" vectors; P goes to bf16 pairs of keys for P @ V,
// whose V pairs are interleaved once per chunk and shared by all the task's rows.

constexpr int kQueries = 16;  // query tokens per extend task: one lane each
constexpr int kKeys = 64;     // keys per online-softmax chunk

inline int32_t pair_at(const c10::BFloat16* row, int p) {
  int32_t x;
  std::memcpy(&x, row + 2 * p, sizeof(x));
  return x;
}

// S[k * G + v0 + r] = raw scores of keys krows[0..NK) against query vectors v0..v0+NR.
template <int DP, int NR, int NK>
inline void score_tile(const __m512i* qt, int G, int v0, const c10::BFloat16* const* krows, __m512* S) {
  __m512 acc[NK][NR];
  for (int k = 0; k < NK; ++k)
    for (int r = 0; r < NR; ++r) acc[k][r] = _mm512_setzero_ps();
  for (int p = 0; p < DP; ++p) {
    __m512i qv[NR];
    for (int r = 0; r < NR; ++r) qv[r] = qt[p * G + v0 + r];
    for (int k = 0; k < NK; ++k) {
      const __m512bh kk = as_bh(_mm512_set1_epi32(pair_at(krows[k], p)));
      for (int r = 0; r < NR; ++r) acc[k][r] = _mm512_dpbf16_ps(acc[k][r], as_bh(qv[r]), kk);
    }
  }
  for (int k = 0; k < NK; ++k)
    for (int r = 0; r < NR; ++r) S[k * G + v0 + r] = acc[k][r];
}

// Scores of keys krows[0..cn) (padded to a multiple of 8 with valid rows) for all G vectors.
template <int DP>
inline void score_chunk(const __m512i* qt, int G, const c10::BFloat16* const* krows, int cn, __m512* S) {
  for (int k0 = 0; k0 < cn; k0 += 8)
    for (int v0 = 0; v0 < G;) {
      const int nr = G - v0 < 4 ? G - v0 : 4;
      switch (nr) {
        case 4: score_tile<DP, 4, 4>(qt, G, v0, krows + k0, S + k0 * G);
                score_tile<DP, 4, 4>(qt, G, v0, krows + k0 + 4, S + (k0 + 4) * G); break;
        case 3: score_tile<DP, 3, 4>(qt, G, v0, krows + k0, S + k0 * G);
                score_tile<DP, 3, 4>(qt, G, v0, krows + k0 + 4, S + (k0 + 4) * G); break;
        case 2: score_tile<DP, 2, 8>(qt, G, v0, krows + k0, S + k0 * G); break;
        default: score_tile<DP, 1, 8>(qt, G, v0, krows + k0, S + k0 * G); break;
      }
      v0 += nr;
    }
}

// acc[R rows][2 * DW] += sum over key pairs of P(pair, row) * V(pair), rows' P pairs at pp[kp * ppk + lane[r]].
template <int DW, int R>
inline void pv_rows(const __m512i* vi, const int32_t* pp, int64_t ppk, const int* lane, int npairs, __m512* acc) {
  __m512 a[R][2 * DW];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 2 * DW; ++j) a[r][j] = acc[r * 2 * DW + j];
  for (int kp = 0; kp < npairs; ++kp) {
    __m512bh w[R];
    for (int r = 0; r < R; ++r) w[r] = as_bh(_mm512_set1_epi32(pp[kp * ppk + lane[r]]));
    for (int j = 0; j < 2 * DW; ++j) {
      const __m512bh v = as_bh(vi[kp * 2 * DW + j]);
      for (int r = 0; r < R; ++r) a[r][j] = _mm512_dpbf16_ps(a[r][j], v, w[r]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 2 * DW; ++j) acc[r * 2 * DW + j] = a[r][j];
}

template <int NV>
void extend_kernel_bf16dot(const c10::BFloat16* q, const c10::BFloat16* kb, const c10::BFloat16* vb,
                           const int64_t* slots, int64_t L, const int64_t* prefix, const int64_t* ext,
                           const int64_t* qstart, int64_t R, c10::BFloat16* out, int64_t H, int64_t KVH,
                           float scale, float cap, int64_t window) {
  constexpr int DW = NV / 2, DP = NV * 8;  // bf16 vectors and bf16 pairs per head row
  constexpr int64_t D = NV * 16;
  constexpr int RB = 8 / DW;  // rows per pv_rows call: 16 accumulators
  const int G = static_cast<int>(H / KVH);
  const int64_t row = KVH * D;
  struct Task {
    int64_t r, i0, kh, cost;
  };
  std::vector<Task> tasks;
  for (int64_t r = 0; r < R; ++r)
    for (int64_t i0 = 0; i0 < ext[r]; i0 += kQueries)
      for (int64_t kh = 0; kh < KVH; ++kh) tasks.push_back({r, i0, kh, prefix[r] + i0 + kQueries});
  // Longest first, so the last tasks handed out are short ones.
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.cost > b.cost; });
  // vpermw indices interleaving two 16-element halves: (a0, b0, a1, b1, ...).
  alignas(64) int16_t inter[32];
  for (int i = 0; i < 16; ++i) inter[2 * i] = static_cast<int16_t>(i), inter[2 * i + 1] = static_cast<int16_t>(16 + i);
  const __m512i interleave = _mm512_load_si512(inter);
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const float eff = cap > 0.0f ? 1.0f : scale;  // capped scores come scaled
  run_dynamic(static_cast<int64_t>(tasks.size()), [&](const auto& claim) {
    std::vector<__m512i> qt(DP * G), pp(kKeys / 2 * G), vi(kKeys / 2 * 2 * DW);
    std::vector<__m512> S(kKeys * G), acc(G * kQueries * 2 * DW), run_max(G), run_sum(G), alpha(G);
    std::vector<const c10::BFloat16*> krows(kKeys + 8), vrows(kKeys);
    for (int64_t ti = claim(); ti >= 0; ti = claim()) {
      const Task& task = tasks[ti];
      const int64_t r = task.r, i0 = task.i0, kh = task.kh;
      const int nq = static_cast<int>(ext[r] - i0 < kQueries ? ext[r] - i0 : kQueries);
      const int64_t first_pos = prefix[r] + i0, last_pos = first_pos + nq - 1;
      const int64_t* sl = slots + r * L;
      // qt[p * G + g] lane i: pair p of query i's head kh * G + g (zero for i >= nq).
      int32_t* qt32 = reinterpret_cast<int32_t*>(qt.data());
      for (int g = 0; g < G; ++g)
        for (int i = 0; i < kQueries; ++i) {
          const c10::BFloat16* qr = q + ((qstart[r] + i0 + i) * H + kh * G + g) * D;
          for (int p = 0; p < DP; ++p) qt32[(p * G + g) * 16 + i] = i < nq ? pair_at(qr, p) : 0;
        }
      for (int g = 0; g < G; ++g) {
        run_max[g] = _mm512_set1_ps(neg_inf);
        run_sum[g] = _mm512_setzero_ps();
      }
      for (auto& a : acc) a = _mm512_setzero_ps();
      // A window: no query of the block sees a key before `lo`. Chunks stay aligned to kKeys
      // from position 0 (a token's sums do not depend on where its prefill chunk starts); keys
      // of the first chunk before `lo` are masked, their rows read as key lo's (the table may
      // hold released slots there).
      const int64_t lo = window > 0 ? std::max<int64_t>(0, first_pos - window + 1) : 0;
      for (int64_t c0 = lo / kKeys * kKeys; c0 <= last_pos; c0 += kKeys) {
        const int cn = static_cast<int>(last_pos + 1 - c0 < kKeys ? last_pos + 1 - c0 : kKeys);
        for (int k = 0; k < cn; ++k) {
          const int64_t off = sl[std::max(c0 + k, lo)] * row + kh * D;
          krows[k] = kb + off;
          vrows[k] = vb + off;
        }
        for (int k = cn; k < kKeys + 8; ++k) krows[k] = krows[0];  // score tiles read 8 keys at a time
        // The next chunk's rows, into L2 while this one computes.
        for (int64_t t = c0 + kKeys; t <= last_pos && t < c0 + 2 * kKeys; ++t)
          for (int64_t byte = 0; byte < D * 2; byte += 64) {
            prefetch_l2(reinterpret_cast<const char*>(kb + sl[t] * row + kh * D) + byte);
            prefetch_l2(reinterpret_cast<const char*>(vb + sl[t] * row + kh * D) + byte);
          }
        score_chunk<DP>(qt.data(), G, krows.data(), cn, S.data());
        if (cap > 0.0f)  // scaled and capped here; `eff` below is then 1
          for (int k = 0; k < cn * G; ++k) S[k] = (__m512)softcap((v16f)S[k] * scale, cap);
        // Causal mask (key c0 + k is seen by queries i >= c0 + k - first_pos) and, with a window,
        // by queries i < c0 + k - first_pos + window only; running max, exp. A lane that has seen
        // no key yet (max -inf) takes 0 as its max here: its exps and rescale are then exact zeros,
        // not NaN (inf - inf).
        const int npairs = (cn + 1) / 2;
        for (int g = 0; g < G; ++g) {
          __m512 mx = run_max[g];
          for (int k = 0; k < cn; ++k) {
            __m512 sc = S[k * G + g];
            const int64_t hidden = c0 + k - first_pos;  // queries below this lane do not see key k
            const bool past = window > 0 && hidden + window < kQueries;  // lanes from hidden + window on
            if (hidden > 0 || past) {
              v16i seen = hidden > 0 ? ~lanes_below(hidden) : lanes_below(kQueries);
              if (past) seen &= lanes_below(hidden + window);
              sc = (__m512)(seen ? (v16f)sc : splat(neg_inf));
              S[k * G + g] = sc;
            }
            mx = _mm512_max_ps(mx, sc);
          }
          const v16f safe_max = (v16f)mx == splat(neg_inf) ? splat(0.0f) : (v16f)mx;
          const __m512 neg_m = _mm512_mul_ps((__m512)safe_max, _mm512_set1_ps(-eff));
          alpha[g] = (__m512)exp_nonpos((v16f)_mm512_fmadd_ps(run_max[g], _mm512_set1_ps(eff), neg_m));
          run_max[g] = mx;
          __m512 sum = _mm512_setzero_ps();
          for (int k = 0; k < cn; ++k) {
            const __m512 e = (__m512)exp_nonpos((v16f)_mm512_fmadd_ps(S[k * G + g], _mm512_set1_ps(eff), neg_m));
            S[k * G + g] = e;
            sum = _mm512_add_ps(sum, e);
          }
          run_sum[g] = _mm512_fmadd_ps(run_sum[g], alpha[g], sum);
          for (int kp = 0; kp < npairs; ++kp) {
            const __m512 a = S[2 * kp * G + g];
            const __m512 b = 2 * kp + 1 < cn ? S[(2 * kp + 1) * G + g] : _mm512_setzero_ps();
            pp[kp * G + g] = _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(b, a));
          }
        }
        for (int kp = 0; kp < npairs; ++kp) {
          const c10::BFloat16* r0 = vrows[2 * kp];
          const c10::BFloat16* r1 = 2 * kp + 1 < cn ? vrows[2 * kp + 1] : r0;  // its P is 0
          for (int j = 0; j < DW; ++j) {
            const __m512i v0 = load_bf16x32(r0 + 32 * j), v1 = load_bf16x32(r1 + 32 * j);
            vi[kp * 2 * DW + 2 * j] = _mm512_unpacklo_epi16(v0, v1);
            vi[kp * 2 * DW + 2 * j + 1] = _mm512_unpackhi_epi16(v0, v1);
          }
        }
        // Rescale and accumulate every live row (g, i < nq); pp as dwords: row (g, i) of key pair
        // kp at kp * 16 * G + g * 16 + i.
        const int32_t* pp32 = reinterpret_cast<const int32_t*>(pp.data());
        for (int g = 0; g < G; ++g) {
          alignas(64) float al[16];
          _mm512_store_ps(al, alpha[g]);
          for (int i0r = 0; i0r < nq; i0r += RB) {
            const int nr = nq - i0r < RB ? nq - i0r : RB;
            int lane[RB];
            for (int x = 0; x < RB; ++x) lane[x] = g * 16 + i0r + (x < nr ? x : 0);
            __m512* a = acc.data() + (g * kQueries + i0r) * 2 * DW;
            for (int x = 0; x < nr; ++x)
              for (int j = 0; j < 2 * DW; ++j) a[x * 2 * DW + j] = _mm512_mul_ps(a[x * 2 * DW + j], _mm512_set1_ps(al[i0r + x]));
            if (nr == RB) {
              pv_rows<DW, RB>(vi.data(), pp32, 16 * G, lane, npairs, a);
            } else {
              for (int x = 0; x < nr; ++x) pv_rows<DW, 1>(vi.data(), pp32, 16 * G, lane + x, npairs, a + x * 2 * DW);
            }
          }
        }
      }
      for (int g = 0; g < G; ++g) {
        alignas(64) float l[16];
        _mm512_store_ps(l, run_sum[g]);
        for (int i = 0; i < nq; ++i)
          store_unpacked<DW>(reinterpret_cast<const v16f*>(acc.data() + (g * kQueries + i) * 2 * DW), 1.0f / l[i],
                             out + ((qstart[r] + i0 + i) * H + kh * G + g) * D);
      }
    }
  });
}

}  // namespace

bool decode_attention_bf16dot(int64_t D, const c10::BFloat16* q, const c10::BFloat16* kb, const c10::BFloat16* vb,
                              const int64_t* slots, const int64_t* lens, const int64_t* qstart, c10::BFloat16* out,
                              float* lse, int64_t R, int64_t H, int64_t KVH, int64_t max_len, float scale, float cap) {
  switch (D) {
    case 64: decode_kernel_bf16dot<4>(q, kb, vb, slots, lens, qstart, out, lse, R, H, KVH, max_len, scale, cap); break;
    case 128: decode_kernel_bf16dot<8>(q, kb, vb, slots, lens, qstart, out, lse, R, H, KVH, max_len, scale, cap); break;
    case 256: decode_kernel_bf16dot<16>(q, kb, vb, slots, lens, qstart, out, lse, R, H, KVH, max_len, scale, cap); break;
    default: return false;
  }
  return true;
}

bool attention_bf16dot_built() { return true; }

bool extend_attention_bf16dot(int64_t D, const c10::BFloat16* q, const c10::BFloat16* kb, const c10::BFloat16* vb,
                              const int64_t* slots, int64_t L, const int64_t* prefix, const int64_t* ext,
                              const int64_t* qstart, int64_t R, c10::BFloat16* out, int64_t H, int64_t KVH,
                              float scale, float cap, int64_t window) {
  switch (D) {
    case 64: extend_kernel_bf16dot<4>(q, kb, vb, slots, L, prefix, ext, qstart, R, out, H, KVH, scale, cap, window); break;
    case 128: extend_kernel_bf16dot<8>(q, kb, vb, slots, L, prefix, ext, qstart, R, out, H, KVH, scale, cap, window); break;
    case 256: extend_kernel_bf16dot<16>(q, kb, vb, slots, L, prefix, ext, qstart, R, out, H, KVH, scale, cap, window); break;
    default: return false;
  }
  return true;
}

}  // namespace asyncllm

#else  // no AVX512-BF16: the fp32-FMA kernels run instead

namespace asyncllm {
bool attention_bf16dot_built() { return false; }
bool decode_attention_bf16dot(int64_t, const c10::BFloat16*, const c10::BFloat16*, const c10::BFloat16*,
                              const int64_t*, const int64_t*, const int64_t*, c10::BFloat16*, float*, int64_t, int64_t,
                              int64_t, int64_t, float, float) {
  return false;
}
bool extend_attention_bf16dot(int64_t, const c10::BFloat16*, const c10::BFloat16*, const c10::BFloat16*,
                              const int64_t*, int64_t, const int64_t*, const int64_t*, const int64_t*, int64_t,
                              c10::BFloat16*, int64_t, int64_t, float, float, int64_t) {
  return false;
}
}  // namespace asyncllm

#endif
