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
// K/V block is converted once and used by all 16 x G query rows. torch's CPU flash SDPA reached
// 40-110 GFLOP/s on these shapes (9 heads of 64, a few hundred tokens).
//
// Layout: q [T, H, D]; k_buf/v_buf [S, KVH, D] (one layer of the pool); slots [R, L] int64 (row r
// holds request r's slot ids). decode also returns lse [B, H] fp32 (natural-log sum of exp of the
// scaled scores), so callers can merge it with attention over other keys (cascade attention).
// Grouped-query heads share each K/V row load.
//
// Vectors use GCC's vector extensions (16 floats), so -march=native picks the machine's widest
// registers (AVX-512 here) without intrinsics; D must be a multiple of 16 (64 and 128 are built).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));

constexpr int kBlock = 16;  // tokens scored together: one vector of scores per query head
constexpr int kPrefetch = 4;  // blocks of rows requested ahead of use

// Software prefetch into L2 (prefetcht2), not L1: the rows are scattered (decoded tokens of a
// request sit a batch apart in the pool), and with L1 prefetches the bf16 decode kernel ran 15%
// slower than with none on this 2-core EPYC, while L2 prefetches 4 blocks ahead made it 17% faster.
inline void prefetch_l2(const void* p) { __builtin_prefetch(p, 0, 1); }

inline v16f load16(const float* p) {
  v16f v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline v16f load16(const c10::BFloat16* p) {
  v16h h;
  std::memcpy(&h, p, sizeof(h));
  v16u u = __builtin_convertvector(h, v16u) << 16;  // bf16 is the top half of an fp32
  v16f v;
  std::memcpy(&v, &u, sizeof(v));
  return v;
}

inline v16f splat(float x) { return v16f{} + x; }

inline float hsum(v16f v) {
  typedef float v8f __attribute__((vector_size(32)));
  typedef float v4f __attribute__((vector_size(16)));
  v8f a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  v4f b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

inline float hmax(v16f v) {
  typedef float v8f __attribute__((vector_size(32)));
  typedef float v4f __attribute__((vector_size(16)));
  v8f lo = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7), hi = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  v8f a = lo > hi ? lo : hi;
  v4f l4 = __builtin_shufflevector(a, a, 0, 1, 2, 3), h4 = __builtin_shufflevector(a, a, 4, 5, 6, 7);
  v4f b = l4 > h4 ? l4 : h4;
  const float x = b[0] > b[1] ? b[0] : b[1], y = b[2] > b[3] ? b[2] : b[3];
  return x > y ? x : y;
}

// Pairwise-sum step of a 16-to-1 transpose reduction: lanes 0-7 get a's adjacent pair sums, 8-15 b's.
inline v16f pair_sums(v16f a, v16f b) {
  return __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

// out[t] = sum of the lanes of v[t], for 16 vectors at once (15 shuffle-add steps instead of 16
// separate horizontal sums). Four rounds of pair_sums keep the lanes in token order.
inline v16f transpose_sum16(v16f* v) {
  for (int width = 16; width > 1; width /= 2)
    for (int i = 0; i < width / 2; ++i) v[i] = pair_sums(v[2 * i], v[2 * i + 1]);
  return v[0];
}

// exp(x) for x <= 0 (scores minus their running max), 16 lanes: 2^n * p(r) with x = n ln2 + r,
// |r| <= ln2/2, p a degree-6 Taylor polynomial (relative error < 2e-7). Below -87 it returns 0.
inline v16f exp_nonpos(v16f x) {
  const v16f lo = splat(-87.0f);
  v16i dead = x < lo;
  x = x < lo ? lo : x;
  // n = round(x log2 e): x <= 0, so truncating (x log2 e - 0.5) toward zero rounds to nearest.
  v16f n = __builtin_convertvector(__builtin_convertvector(x * 1.44269504088896341f - 0.5f, v16i), v16f);
  v16f r = x - n * 0.693359375f + n * 2.12194440e-4f;
  v16f p = splat(1.0f / 720);
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  v16i bits = (__builtin_convertvector(n, v16i) + 127) << 23;
  v16f scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  v16f out = p * scale;
  return dead ? splat(0.0f) : out;
}

// State of one query row (one token, one head) across key blocks: the online softmax.
template <int NV>
struct RowState {
  v16f acc[NV];
  float run_max, run_sum;
};

// One 16-key block for one query row: scores (masked to `valid`), online-softmax update, P @ V.
template <int NV>
inline void attend_block(const v16f* qrow, const v16f* kf, const v16f* vf, v16i valid, int cnt, RowState<NV>& st,
                         v16f* partial) {
  for (int t = 0; t < kBlock; ++t) {
    v16f a = qrow[0] * kf[t * NV];
    for (int j = 1; j < NV; ++j) a += qrow[j] * kf[t * NV + j];
    partial[t] = a;
  }
  v16f s = transpose_sum16(partial);
  s = valid ? s : splat(-std::numeric_limits<float>::infinity());
  const float new_max = std::max(st.run_max, hmax(s));
  const float alpha = std::exp(st.run_max - new_max);
  v16f p = exp_nonpos(s - new_max);
  p = valid ? p : splat(0.0f);
  st.run_sum = st.run_sum * alpha + hsum(p);
  st.run_max = new_max;
  v16f a[NV];
  for (int j = 0; j < NV; ++j) a[j] = st.acc[j] * alpha;
  for (int t = 0; t < cnt; ++t) {
    const v16f w = splat(p[t]);
    for (int j = 0; j < NV; ++j) a[j] += w * vf[t * NV + j];
  }
  for (int j = 0; j < NV; ++j) st.acc[j] = a[j];
}

// Rows sl[0..cnt) of one KV head (elements at `head_off` within each slot row) converted to fp32
// into kf/vf ([kBlock][NV] vectors), zero past cnt.
template <int NV, typename T>
inline void load_kv_block(const T* kb, const T* vb, const int64_t* sl, int cnt, int64_t row, int64_t head_off,
                          v16f* kf, v16f* vf) {
  for (int t = 0; t < cnt; ++t) {
    const int64_t off = sl[t] * row + head_off;
    for (int j = 0; j < NV; ++j) {
      kf[t * NV + j] = load16(kb + off + 16 * j);
      vf[t * NV + j] = load16(vb + off + 16 * j);
    }
  }
  for (int t = cnt; t < kBlock; ++t)
    for (int j = 0; j < NV; ++j) kf[t * NV + j] = vf[t * NV + j] = splat(0.0f);
}

template <int NV>
inline void init_row(RowState<NV>& st) {
  for (int j = 0; j < NV; ++j) st.acc[j] = splat(0.0f);
  st.run_max = -std::numeric_limits<float>::infinity();
  st.run_sum = 0.0f;
}

// The normalised output row; returns the row's log-sum-exp.
template <int NV, typename T>
inline float store_row(const RowState<NV>& st, T* o) {
  const float inv = 1.0f / st.run_sum;
  for (int j = 0; j < NV; ++j) {
    v16f v = st.acc[j] * inv;
    for (int i = 0; i < 16; ++i) o[16 * j + i] = static_cast<T>(v[i]);
  }
  return st.run_max + std::log(st.run_sum);
}

inline v16i lanes_below(int64_t n) {
  return __builtin_convertvector(v16f{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, v16i) < static_cast<int>(n);
}

template <int NV, typename T>
void decode_kernel(const T* q, const T* kb, const T* vb, const int64_t* slots, const int64_t* lens, T* out,
                   float* lse, int64_t B, int64_t H, int64_t KVH, int64_t max_len, float scale) {
  constexpr int64_t D = NV * 16;
  const int64_t G = H / KVH;
  const int64_t row = KVH * D;  // elements between consecutive slots of the pool
  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<v16f> qv(G * NV);
    std::vector<RowState<NV>> st(G);
    // One block of K and V rows converted to fp32 once, then read by every query head of the group.
    std::vector<v16f> kf(kBlock * NV), vf(kBlock * NV);
    v16f partial[kBlock];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / KVH, kh = task % KVH, n = lens[b];
      const int64_t* sl = slots + b * max_len;
      for (int64_t g = 0; g < G; ++g) {
        const T* qg = q + (b * H + kh * G + g) * D;
        for (int j = 0; j < NV; ++j) qv[g * NV + j] = load16(qg + 16 * j) * scale;
        init_row(st[g]);
      }
      for (int64_t t0 = 0; t0 < n; t0 += kBlock) {
        const int cnt = static_cast<int>(n - t0 < kBlock ? n - t0 : kBlock);
        // Rows kPrefetch blocks ahead, while this one computes: the slots are scattered, so the
        // hardware prefetchers cannot guess them.
        const int64_t ahead = t0 + kPrefetch * kBlock;
        const int64_t next = n - ahead < kBlock ? n - ahead : kBlock;
        for (int64_t t = 0; t < next; ++t) {
          const int64_t off = sl[ahead + t] * row + kh * D;
          for (int64_t byte = 0; byte < D * int64_t(sizeof(T)); byte += 64) {
            prefetch_l2(reinterpret_cast<const char*>(kb + off) + byte);
            prefetch_l2(reinterpret_cast<const char*>(vb + off) + byte);
          }
        }
        load_kv_block<NV>(kb, vb, sl + t0, cnt, row, kh * D, kf.data(), vf.data());
        const v16i valid = lanes_below(cnt);
        for (int64_t g = 0; g < G; ++g)
          attend_block<NV>(qv.data() + g * NV, kf.data(), vf.data(), valid, cnt, st[g], partial);
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
                   const int64_t* ext, const int64_t* qstart, int64_t R, T* out, int64_t H, int64_t KVH, float scale) {
  constexpr int64_t D = NV * 16;
  const int64_t G = H / KVH;
  const int64_t row = KVH * D;
  std::vector<int64_t> task_req, task_block;  // (request, first query of a 16-query block)
  for (int64_t r = 0; r < R; ++r)
    for (int64_t i0 = 0; i0 < ext[r]; i0 += kBlock) {
      task_req.push_back(r);
      task_block.push_back(i0);
    }
  const int64_t ntask = static_cast<int64_t>(task_req.size());
  at::parallel_for(0, ntask * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<v16f> qv(kBlock * G * NV), kf(kBlock * NV), vf(kBlock * NV);
    std::vector<RowState<NV>> st(kBlock * G);
    v16f partial[kBlock];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task_req[task / KVH], i0 = task_block[task / KVH], kh = task % KVH;
      const int64_t nq = ext[r] - i0 < kBlock ? ext[r] - i0 : kBlock;
      const int64_t first_pos = prefix[r] + i0, last_pos = first_pos + nq - 1;
      const int64_t* sl = slots + r * L;
      for (int64_t i = 0; i < nq; ++i)
        for (int64_t g = 0; g < G; ++g) {
          const T* qr = q + ((qstart[r] + i0 + i) * H + kh * G + g) * D;
          for (int j = 0; j < NV; ++j) qv[(i * G + g) * NV + j] = load16(qr + 16 * j) * scale;
          init_row(st[i * G + g]);
        }
      for (int64_t t0 = 0; t0 <= last_pos; t0 += kBlock) {
        const int cnt = static_cast<int>(last_pos + 1 - t0 < kBlock ? last_pos + 1 - t0 : kBlock);
        load_kv_block<NV>(kb, vb, sl + t0, cnt, row, kh * D, kf.data(), vf.data());
        // Query i sees keys 0..first_pos + i: the block's first t0 - first_pos queries see none of it.
        for (int64_t i = t0 > first_pos ? t0 - first_pos : 0; i < nq; ++i) {
          const int64_t pos = first_pos + i;
          const int64_t seen = pos + 1 - t0;
          const int upto = static_cast<int>(seen < cnt ? seen : cnt);
          const v16i valid = lanes_below(upto);
          for (int64_t g = 0; g < G; ++g)
            attend_block<NV>(qv.data() + (i * G + g) * NV, kf.data(), vf.data(), valid, upto, st[i * G + g], partial);
        }
      }
      for (int64_t i = 0; i < nq; ++i)
        for (int64_t g = 0; g < G; ++g) store_row<NV>(st[i * G + g], out + ((qstart[r] + i0 + i) * H + kh * G + g) * D);
    }
  });
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// ---- bf16 with AVX512-BF16 dot products (vdpbf16ps) -------------------------------------------
//
// The fp32-FMA kernels above convert every K/V element to fp32 and spend most of their time on
// that conversion and on reducing 16-lane partial dots: at batch 60 x ~360 tokens they read the
// KV cache at ~10 GB/s when DRAM gives ~31. vdpbf16ps multiplies bf16 pairs straight from memory
// (exact products, fp32 sums), and the decode kernel below works in two passes per chunk of keys
// (all scores, then one softmax, then P @ V), so the online-softmax bookkeeping is paid per chunk
// rather than per 16 keys. P is rounded to bf16 for the P @ V dot products, as torch's flash
// attention does for bf16; scores, the max, the sums and the output stay fp32.
#define ASYNCLLM_BF16_DOT 1

constexpr int kChunk = 128;  // keys per two-pass chunk: its K and V rows stay in L2

inline __m512bh as_bh(__m512i v) { return (__m512bh)v; }
inline __m512i load_bf16x32(const c10::BFloat16* p) { return _mm512_loadu_si512(p); }

// Scores of G query heads (bf16 vectors qv[g][DW]) against 16 K rows; lanes >= cnt are -inf.
// rows[t]: the K row of key t (rows past cnt repeat a valid row; their lanes are masked).
template <int DW>
inline void score_block(const __m512i* qv, int G, const c10::BFloat16* const* rows, int cnt, float scale, float* s,
                        int64_t s_stride, v16f* run_max) {
  const v16i valid = lanes_below(cnt);
  for (int g = 0; g < G; ++g) {
    v16f partial[kBlock];
    for (int t = 0; t < kBlock; ++t) {
      __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), as_bh(qv[g * DW]), as_bh(load_bf16x32(rows[t])));
      for (int j = 1; j < DW; ++j)
        a = _mm512_dpbf16_ps(a, as_bh(qv[g * DW + j]), as_bh(load_bf16x32(rows[t] + 32 * j)));
      partial[t] = (v16f)a;
    }
    v16f sc = transpose_sum16(partial) * scale;
    sc = valid ? sc : splat(-std::numeric_limits<float>::infinity());
    std::memcpy(s + g * s_stride, &sc, sizeof(sc));
    run_max[g] = run_max[g] > sc ? run_max[g] : sc;
  }
}

// P @ V for HG heads over n keys: acc[g][2 * DW] (lanes in unpacklo/unpackhi order, see
// store_unpacked) += sum_t p[g][t] * V[t]. p holds bf16 pairs (an even count, zero-padded).
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

// Runs pv_pairs over G heads in groups that keep every accumulator in a register.
template <int DW>
inline void pv_heads(const uint16_t* p, int64_t p_stride, const c10::BFloat16* const* vrows, int n, v16f* acc, int G) {
  constexpr int kMaxGroup = 8 / DW;  // 2 * DW accumulators per head, 16 in all
  int g = 0;
  for (; g + kMaxGroup <= G; g += kMaxGroup)
    pv_pairs<DW, kMaxGroup>(p + g * p_stride, p_stride, vrows, n, acc + g * 2 * DW);
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

template <int NV>
void decode_kernel_bf16dot(const c10::BFloat16* q, const c10::BFloat16* kb, const c10::BFloat16* vb,
                           const int64_t* slots, const int64_t* lens, c10::BFloat16* out, float* lse, int64_t B,
                           int64_t H, int64_t KVH, int64_t max_len, float scale) {
  constexpr int DW = NV / 2;  // 32-element bf16 vectors per row
  constexpr int64_t D = NV * 16;
  const int G = static_cast<int>(H / KVH);
  const int64_t row = KVH * D;
  // A task is one request's KV heads [kh0, kh0 + hpt): all of them when there are enough
  // requests to share out, so a task streams whole slot records (every head's row of a token is
  // adjacent in the pool) rather than one strided head at a time.
  const int64_t hpt = B >= 4 * at::get_num_threads() ? KVH : 1;
  const int64_t tasks_per_req = KVH / hpt;
  at::parallel_for(0, B * tasks_per_req, 1, [&](int64_t begin, int64_t end) {
    const int HG = static_cast<int>(hpt) * G;  // query heads per task
    const int64_t p_stride = kChunk + kBlock;
    std::vector<__m512i> qv(HG * DW);
    std::vector<float> s(HG * kChunk);
    std::vector<uint16_t> p(HG * p_stride);
    std::vector<v16f> acc(HG * 2 * DW), run_max_v(HG);
    std::vector<float> run_max(HG), run_sum(HG);
    std::vector<const c10::BFloat16*> krows(kChunk + kBlock), vrows(kChunk + kBlock);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / tasks_per_req, kh0 = (task % tasks_per_req) * hpt, n = lens[b];
      const int64_t* sl = slots + b * max_len;
      const int64_t h0 = kh0 * G;  // first query head of the task
      for (int g = 0; g < HG; ++g) {
        for (int j = 0; j < DW; ++j) qv[g * DW + j] = load_bf16x32(q + (b * H + h0 + g) * D + 32 * j);
        for (int j = 0; j < 2 * DW; ++j) acc[g * 2 * DW + j] = splat(0.0f);
        run_max[g] = -std::numeric_limits<float>::infinity();
        run_sum[g] = 0.0f;
      }
      const int64_t pf_bytes = hpt * D * 2;  // the task's part of each record
      for (int64_t c0 = 0; c0 < n; c0 += kChunk) {
        const int cn = static_cast<int>(n - c0 < kChunk ? n - c0 : kChunk);
        for (int t = 0; t < cn; ++t) {
          const int64_t off = sl[c0 + t] * row + kh0 * D;
          krows[t] = kb + off;
          vrows[t] = vb + off;
        }
        for (int t = cn; t < kChunk + kBlock; ++t) krows[t] = vrows[t] = krows[0];
        for (int g = 0; g < HG; ++g) run_max_v[g] = splat(-std::numeric_limits<float>::infinity());
        for (int t0 = 0; t0 < cn; t0 += kBlock) {
          // Records kPrefetch blocks ahead (the slots are scattered: the hardware cannot guess
          // them), V too, so the P @ V pass finds this chunk's V rows in cache.
          // (Counted from the task's start, so the next chunk's first rows are on their way
          // during this chunk's P @ V pass.)
          const int64_t first = c0 + t0 == 0 ? 0 : c0 + t0 + kPrefetch * kBlock;
          for (int64_t t = first; t < n && t < c0 + t0 + (kPrefetch + 1) * kBlock; ++t) {
            const char* kr = reinterpret_cast<const char*>(kb + sl[t] * row + kh0 * D);
            const char* vr = reinterpret_cast<const char*>(vb + sl[t] * row + kh0 * D);
            for (int64_t byte = 0; byte < pf_bytes; byte += 64) {
              prefetch_l2(kr + byte);
              prefetch_l2(vr + byte);
            }
          }
          const int cnt = cn - t0 < kBlock ? cn - t0 : kBlock;
          for (int64_t k = 0; k < hpt; ++k) {
            const c10::BFloat16* rows[kBlock];
            for (int t = 0; t < kBlock; ++t) rows[t] = krows[t0 + t] + k * D;
            score_block<DW>(qv.data() + k * G * DW, G, rows, cnt, scale, s.data() + k * G * kChunk + t0, kChunk,
                            run_max_v.data() + k * G);
          }
        }
        const int padded = (cn + 1) & ~1;
        for (int g = 0; g < HG; ++g) {
          uint16_t* pg = p.data() + g * p_stride;
          softmax_chunk<DW>(s.data() + g * kChunk, cn, hmax(run_max_v[g]), run_max[g], run_sum[g],
                            acc.data() + g * 2 * DW, pg);
          if (padded > cn) pg[cn] = 0;
        }
        for (int64_t k = 0; k < hpt; ++k) {
          const c10::BFloat16* const* vr = vrows.data();
          std::vector<const c10::BFloat16*>& shifted = krows;  // reuse: K rows are done with
          for (int t = 0; t < cn; ++t) shifted[t] = vr[t] + k * D;
          pv_heads<DW>(p.data() + k * G * p_stride, p_stride, shifted.data(), cn, acc.data() + k * G * 2 * DW, G);
        }
      }
      for (int g = 0; g < HG; ++g) {
        store_unpacked<DW>(acc.data() + g * 2 * DW, 1.0f / run_sum[g], out + (b * H + h0 + g) * D);
        lse[b * H + h0 + g] = run_max[g] + std::log(run_sum[g]);
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

template <int NV>
void extend_kernel_bf16dot(const c10::BFloat16* q, const c10::BFloat16* kb, const c10::BFloat16* vb,
                           const int64_t* slots, int64_t L, const int64_t* prefix, const int64_t* ext,
                           const int64_t* qstart, int64_t R, c10::BFloat16* out, int64_t H, int64_t KVH,
                           float scale) {
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
  run_dynamic(static_cast<int64_t>(tasks.size()), [&](const auto& claim) {
    std::vector<__m512i> qt(DP * G), pp(kKeys / 2 * G), vi(kKeys / 2 * 2 * DW);
    std::vector<__m512> S(kKeys * G), acc(G * kQueries * 2 * DW), run_max(G), run_sum(G), alpha(G);
    std::vector<const c10::BFloat16*> krows(kKeys + 8), vrows(kKeys + 8);
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
      for (int64_t c0 = 0; c0 <= last_pos; c0 += kKeys) {
        const int cn = static_cast<int>(last_pos + 1 - c0 < kKeys ? last_pos + 1 - c0 : kKeys);
        for (int k = 0; k < cn; ++k) {
          const int64_t off = sl[c0 + k] * row + kh * D;
          krows[k] = kb + off;
          vrows[k] = vb + off;
        }
        for (int k = cn; k < kKeys + 8; ++k) krows[k] = vrows[k] = krows[0];
        // The next chunk's rows, into L2 while this one computes.
        for (int64_t t = c0 + kKeys; t <= last_pos && t < c0 + 2 * kKeys; ++t)
          for (int64_t byte = 0; byte < D * 2; byte += 64) {
            prefetch_l2(reinterpret_cast<const char*>(kb + sl[t] * row + kh * D) + byte);
            prefetch_l2(reinterpret_cast<const char*>(vb + sl[t] * row + kh * D) + byte);
          }
        score_chunk<DP>(qt.data(), G, krows.data(), cn, S.data());
        // Causal mask (key c0 + k is seen by queries i >= c0 + k - first_pos), running max, exp.
        const int npairs = (cn + 1) / 2;
        for (int g = 0; g < G; ++g) {
          __m512 mx = run_max[g];
          for (int k = 0; k < cn; ++k) {
            __m512 sc = S[k * G + g];
            const int64_t hidden = c0 + k - first_pos;  // queries below this lane do not see key k
            if (hidden > 0) {
              const v16i seen = ~lanes_below(hidden);
              sc = (__m512)(seen ? (v16f)sc : splat(neg_inf));
              S[k * G + g] = sc;
            }
            mx = _mm512_max_ps(mx, sc);
          }
          const __m512 neg_m = _mm512_mul_ps(mx, _mm512_set1_ps(-scale));
          alpha[g] = (__m512)exp_nonpos((v16f)_mm512_fmadd_ps(run_max[g], _mm512_set1_ps(scale), neg_m));
          run_max[g] = mx;
          __m512 sum = _mm512_setzero_ps();
          for (int k = 0; k < cn; ++k) {
            const __m512 e = (__m512)exp_nonpos((v16f)_mm512_fmadd_ps(S[k * G + g], _mm512_set1_ps(scale), neg_m));
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
#endif  // AVX512-BF16

template <typename T>
void dispatch_head_dim(int64_t D, const T* q, const T* kb, const T* vb, const int64_t* slots, const int64_t* lens,
                       T* out, float* lse, int64_t B, int64_t H, int64_t KVH, int64_t max_len, float scale) {
  switch (D) {
    case 64:
      return decode_kernel<4, T>(q, kb, vb, slots, lens, out, lse, B, H, KVH, max_len, scale);
    case 128:
      return decode_kernel<8, T>(q, kb, vb, slots, lens, out, lse, B, H, KVH, max_len, scale);
    default:
      TORCH_CHECK(false, "decode_attention: head_dim 64 or 128, got ", D);
  }
}

template <typename T>
void dispatch_extend(int64_t D, const T* q, const T* kb, const T* vb, const int64_t* slots, int64_t L,
                     const int64_t* prefix, const int64_t* ext, const int64_t* qstart, int64_t R, T* out, int64_t H,
                     int64_t KVH, float scale) {
  switch (D) {
    case 64:
      return extend_kernel<4, T>(q, kb, vb, slots, L, prefix, ext, qstart, R, out, H, KVH, scale);
    case 128:
      return extend_kernel<8, T>(q, kb, vb, slots, L, prefix, ext, qstart, R, out, H, KVH, scale);
    default:
      TORCH_CHECK(false, "extend_attention: head_dim 64 or 128, got ", D);
  }
}

}  // namespace

std::vector<torch::Tensor> decode_attention(torch::Tensor q, torch::Tensor k_buf, torch::Tensor v_buf,
                                            torch::Tensor slots, torch::Tensor lens, double scale) {
  TORCH_CHECK(q.device().is_cpu() && k_buf.device().is_cpu() && v_buf.device().is_cpu(), "CPU tensors");
  TORCH_CHECK(q.dim() == 3 && k_buf.dim() == 3 && v_buf.dim() == 3, "q [B, H, D], k/v [S, KVH, D]");
  TORCH_CHECK(q.is_contiguous() && k_buf.is_contiguous() && v_buf.is_contiguous(), "contiguous q, k, v");
  TORCH_CHECK(slots.scalar_type() == torch::kInt64 && slots.dim() == 2 && slots.is_contiguous(), "slots int64 [B, L]");
  TORCH_CHECK(lens.scalar_type() == torch::kInt64 && lens.dim() == 1 && lens.is_contiguous(), "lens int64 [B]");
  TORCH_CHECK(q.scalar_type() == k_buf.scalar_type() && q.scalar_type() == v_buf.scalar_type(), "one dtype");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), KVH = k_buf.size(1), S = k_buf.size(0);
  TORCH_CHECK(KVH > 0 && H % KVH == 0 && k_buf.size(2) == D && v_buf.sizes() == k_buf.sizes(), "head shapes");
  TORCH_CHECK(slots.size(0) == B && lens.size(0) == B, "one slot row and one length per request");
  const int64_t* lp = lens.data_ptr<int64_t>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t L = slots.size(1);
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lp[b] >= 1 && lp[b] <= L, "length out of range");
    for (int64_t t = 0; t < lp[b]; ++t) TORCH_CHECK(sp[b * L + t] >= 0 && sp[b * L + t] < S, "slot out of range");
  }
  auto out = torch::empty_like(q);
  auto lse = torch::empty({B, H}, q.options().dtype(torch::kFloat));
  const float sc = static_cast<float>(scale);
  if (q.scalar_type() == torch::kFloat) {
    dispatch_head_dim<float>(D, q.data_ptr<float>(), k_buf.data_ptr<float>(), v_buf.data_ptr<float>(), sp, lp,
                             out.data_ptr<float>(), lse.data_ptr<float>(), B, H, KVH, L, sc);
  } else if (q.scalar_type() == torch::kBFloat16) {
    using bf = c10::BFloat16;
#ifdef ASYNCLLM_BF16_DOT
    if (D == 64 || D == 128) {
      auto fn = D == 64 ? decode_kernel_bf16dot<4> : decode_kernel_bf16dot<8>;
      fn(q.data_ptr<bf>(), k_buf.data_ptr<bf>(), v_buf.data_ptr<bf>(), sp, lp, out.data_ptr<bf>(),
         lse.data_ptr<float>(), B, H, KVH, L, sc);
      return {out, lse};
    }
#endif
    dispatch_head_dim<bf>(D, q.data_ptr<bf>(), k_buf.data_ptr<bf>(), v_buf.data_ptr<bf>(), sp, lp,
                          out.data_ptr<bf>(), lse.data_ptr<float>(), B, H, KVH, L, sc);
  } else {
    TORCH_CHECK(false, "decode_attention: float32 or bfloat16 only");
  }
  return {out, lse};
}

torch::Tensor extend_attention(torch::Tensor q, torch::Tensor k_buf, torch::Tensor v_buf, torch::Tensor slots,
                               torch::Tensor prefix_lens, torch::Tensor extend_lens, double scale) {
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
  for (int64_t r = 0; r < R; ++r) {
    TORCH_CHECK(pp[r] >= 0 && ep[r] >= 1 && pp[r] + ep[r] <= L, "length out of range");
    for (int64_t t = 0; t < pp[r] + ep[r]; ++t) TORCH_CHECK(sp[r * L + t] >= 0 && sp[r * L + t] < S, "slot out of range");
    qstart[r] = total;
    total += ep[r];
  }
  TORCH_CHECK(total == T, "extend lengths must add up to the query tokens");
  auto out = torch::empty_like(q);
  const float sc = static_cast<float>(scale);
  if (q.scalar_type() == torch::kFloat) {
    dispatch_extend<float>(D, q.data_ptr<float>(), k_buf.data_ptr<float>(), v_buf.data_ptr<float>(), sp, L, pp, ep,
                           qstart.data(), R, out.data_ptr<float>(), H, KVH, sc);
  } else if (q.scalar_type() == torch::kBFloat16) {
    using bf = c10::BFloat16;
#ifdef ASYNCLLM_BF16_DOT
    if (D == 64 || D == 128) {
      auto fn = D == 64 ? extend_kernel_bf16dot<4> : extend_kernel_bf16dot<8>;
      fn(q.data_ptr<bf>(), k_buf.data_ptr<bf>(), v_buf.data_ptr<bf>(), sp, L, pp, ep, qstart.data(), R,
         out.data_ptr<bf>(), H, KVH, sc);
      return out;
    }
#endif
    dispatch_extend<bf>(D, q.data_ptr<bf>(), k_buf.data_ptr<bf>(), v_buf.data_ptr<bf>(), sp, L, pp, ep, qstart.data(),
                        R, out.data_ptr<bf>(), H, KVH, sc);
  } else {
    TORCH_CHECK(false, "extend_attention: float32 or bfloat16 only");
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "paged decode attention (out, lse) on CPU");
  m.def("extend_attention", &extend_attention, "paged causal extend/prefill attention on CPU");
}
