// Block-quantized matrix-vector products for small batches on CPUs: y = x @ W.T with W kept in a
// GGUF file's own 4-bit blocks (Q4_0/Q4_1, Q4_K), x bf16 [M, K] with M up to a few dozen rows. (The
// 8-bit blocks' bf16 loops are in cpu_quant_lanes.cpp.)
//
// Why: a decode step of a small model reads every weight once per step, so it is bound by memory
// bandwidth; torch's int4pack CPU kernel unpacks each weight to fp32 and reaches ~16 GB/s on one
// core of the development machine (its read bandwidth is ~40 GB/s). These loops unpack with few
// instructions per weight so the read of the blocks is the bound at one row, and at more rows
// (a batched decode step) the dot products' rate is the bound.
//
// 4-bit layout (cpu_quant.q4_pack): rows in tiles of 16, one row per 32-bit lane, so a tile's 16
// outputs accumulate in one vector and need no horizontal sums. For tile t, 32-weight block b and
// pair index j (weights 2j, 2j+1 of the block), the 16 rows' pairs are 32 codes; pairs j and j+8
// share 32 bytes (low and high nibbles), stored at codes[t][b][j][0..31] (byte 2i+e: row i, weight
// 2j+e). 64 bytes (pairs j, j+1) give, after a mask (or a shift and a mask) and one word permute,
// row i's four consecutive codes in lane i.
//
// x is read exactly by default (AVX512-BF16 dot products on the codes as bf16 numbers, below), or
// with --q4-int8-activations in int8 blocks (quantize_rows, as llama.cpp's Q8_1): the codes are
// unsigned integers, so AVX512-VNNI's u8 x s8 dot product sums each block's code x q products
// exactly in int32, and
//   sum_j (d c_j + m) x_j ~= d * dx * sum_j c_j q_j + m * sum_j x_j
// costs one conversion and two FMAs a row and block; the offsets meet x's exact fp32 block sum.
// Twice the products per instruction, ~1.3-1.6x faster from 8 rows up on a Zen 4 core, but the
// int8 steps (~1/254 of a block's largest value) are ~5x bf16's rounding of x: the default model's
// greedy tokens agree with transformers bf16's argmax 97% of the time against 99% exact
// (docs/PERFORMANCE.md), so it is the user's choice, not the default. Scales d and offsets m stay
// fp16, exactly as the file stores them (Q4_0's m = -8 d is exact too), laid out [t][b][16 rows].
//
// 4-bit K form (llama.cpp's Q4_K, q4k_pack): the same codes, each block's d and m made from two
// factors (a 6-bit integer per block, an fp16 per 256 weights; exact in fp32) where the loop reads
// them, so Q4_K runs at the fp16 form's speed on 2 fewer scale bytes per row and block.
//
// Both accumulate in fp32 and round the result to bf16 once; every row's result depends on its own
// x row only (deterministic inference relies on it). Without AVX512-BF16 and VNNI the same
// arithmetic runs as plain loops: correct everywhere, fast where the engine uses it
// (`quant_gemv_vectorized()` tells the Python side which).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <atomic>
#include <cstring>
#include <type_traits>
#include <vector>

#include "q4_scales.h"
#include "vec.h"

using bf16 = c10::BFloat16;
using fp16 = c10::Half;

namespace {

constexpr int64_t kBlock = 32;    // weights per scale
constexpr int64_t kChunk = 64;    // weights per 32 packed bytes (two blocks)
constexpr int kMaxRows = 8;       // rows of x per pass over a task's weights (more rows: more passes)
constexpr int64_t kMaxBlocks = 1024;  // K / 32 bound (K <= 32768): the block-sum and scale tables
// Software prefetch distance along the weights: without it a cold (DRAM) read of the Q8_0 LM head
// ran at ~20 GB/s on one core, with 8 KB ahead at ~38 GB/s (4 KB: 34, 16 KB: 37).
constexpr int64_t kPrefetchBytes = 8192;

// x in int8 blocks (llama.cpp's Q8_1 for its 4-bit dot products): each row's 32-wide blocks scaled
// symmetrically, q = round(x * 127 / amax) with the scale dx = amax / 127, beside the block's exact
// fp32 sum sx (the weights' offsets multiply it). The weight codes are unsigned 4-bit integers, so
// AVX512-VNNI's u8 x s8 dot product sums 4 of them a lane exactly in int32: 64 products an
// instruction, where AVX512-BF16's dot product makes 32 at the same rate on the CPUs that have both.
struct Int8Rows {
  std::vector<int8_t> q;  // [M, K]
  std::vector<float> d;   // [M, K / 32] dx
  std::vector<float> s;   // [M, K / 32] sx
};

#if defined(__AVX512F__)
inline __m512 widen16(const bf16* p) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
#endif

void quantize_block(const bf16* x, int8_t* q, float* d, float* s) {
#if defined(__AVX512F__)
  const __m512 lo = widen16(x), hi = widen16(x + 16);
  *s = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
  if (amax == 0.0f) {
    std::memset(q, 0, kBlock);
    *d = 0.0f;
    return;
  }
  const __m512 inv = _mm512_set1_ps(127.0f / amax);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(lo, inv))));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16),
                   _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(hi, inv))));
  *d = amax / 127.0f;
#else
  float sum = 0.0f, amax = 0.0f;
  for (int64_t j = 0; j < kBlock; ++j) {
    const float v = static_cast<float>(x[j]);
    sum += v;
    amax = std::max(amax, std::fabs(v));
  }
  *s = sum;
  *d = amax / 127.0f;
  const float inv = amax == 0.0f ? 0.0f : 127.0f / amax;
  for (int64_t j = 0; j < kBlock; ++j) q[j] = static_cast<int8_t>(std::nearbyint(static_cast<float>(x[j]) * inv));
#endif
}

Int8Rows quantize_rows(const bf16* x, int64_t m_rows, int64_t k) {
  const int64_t nb = k / kBlock;
  Int8Rows r{std::vector<int8_t>(m_rows * k), std::vector<float>(m_rows * nb), std::vector<float>(m_rows * nb)};
  // Many rows (a large decode batch) split across threads; one row is ~1 us of work.
  at::parallel_for(0, m_rows * nb, 512, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) quantize_block(x + i * kBlock, r.q.data() + i * kBlock, &r.d[i], &r.s[i]);
  });
  return r;
}

// fn(std::integral_constant<int, M>) for M = m_rows (1..kMaxRows): the row count as a template
// argument, so each loop keeps its M rows' accumulators in registers.
template <typename F>
void with_rows(int64_t m_rows, F&& fn) {
  switch (m_rows) {
#define Q4_CASE(M) \
  case M: return fn(std::integral_constant<int, M>{});
    Q4_CASE(1) Q4_CASE(2) Q4_CASE(3) Q4_CASE(4) Q4_CASE(5) Q4_CASE(6) Q4_CASE(7) Q4_CASE(8)
#undef Q4_CASE
  }
}

void check_x(const torch::Tensor& x, int64_t k, const char* op) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kBFloat16, op, ": x must be bf16 on the CPU");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) == k, op, ": x must be contiguous [M, K]");
  TORCH_CHECK(x.size(0) >= 1, op, ": at least one row");
  TORCH_CHECK(k % kChunk == 0 && k / kBlock <= kMaxBlocks, op, ": K must be a multiple of 64, at most 32768");
}

// ---- 4-bit ----------------------------------------------------------------------------------

constexpr int64_t kTile = asyncllm::q4_scales::kRows;  // rows per tile (one per fp32 lane)
constexpr int64_t kTileBlock = 256;  // bytes of one tile's 32-weight block (16 rows x 32 codes / 2)

// Weight w (0..31) of row i in one tile block of the layout above: pair j = w / 2 sits in chunk
// j % 8 at byte 2i + w % 2, in the low nibble for j < 8 and the high one for j >= 8.
inline int code_at(const uint8_t* block, int64_t i, int64_t w) {
  const int64_t j = w / 2;
  const uint8_t byte = block[(j % 8) * 32 + 2 * i + w % 2];
  return j >= 8 ? byte >> 4 : byte & 15;
}

#if defined(__AVX512F__)
inline __m512 half16(const fp16* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
#endif

// Each block's scale d and offset m (q4_scales.h), 16 rows at once for the vector loops.
struct HalfScales : asyncllm::q4_scales::Half {
#if defined(__AVX512F__)
  __m512 scale(int64_t t, int64_t b) const { return half16(s + at(t, b)); }
  __m512 offset(int64_t t, int64_t b) const { return half16(o + at(t, b)); }
#endif
};

struct KScales : asyncllm::q4_scales::Factors {
#if defined(__AVX512F__)
  __m512 factor(int64_t t, int64_t b, int which) const {
    const auto* small_factors = reinterpret_cast<const __m128i*>(sm + small(t, b, which));
    const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(small_factors)));
    return _mm512_mul_ps(half16(dd + super(t, b, which)), sc);
  }
  __m512 scale(int64_t t, int64_t b) const { return factor(t, b, 0); }
  __m512 offset(int64_t t, int64_t b) const { return _mm512_sub_ps(_mm512_setzero_ps(), factor(t, b, 1)); }
#endif
};

// Plain loops over the same layout: the reference arithmetic (also the fallback without
// AVX512-BF16 and VNNI). Each block's integer sum is exact; the fp32 steps are the vector loop's,
// in its order: acc += S * (d * dx), then acc += m * sx.
template <typename S>
void q4_rows_scalar(const Int8Rows& xr, int64_t m0, int64_t m_rows, int64_t k, const uint8_t* codes, const S& sc,
                    bf16* y, int64_t n_out, int64_t t0, int64_t t1) {
  const int64_t nb = k / kBlock;
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t i = 0; i < kTile && t * kTile + i < n_out; ++i)
      for (int64_t m = m0; m < m0 + m_rows; ++m) {
        float acc = 0.0f;
        for (int64_t b = 0; b < nb; ++b) {
          const uint8_t* block = codes + (t * nb + b) * kTileBlock;
          int32_t s = 0;
          for (int64_t w = 0; w < kBlock; ++w) s += code_at(block, i, w) * xr.q[m * k + b * kBlock + w];
          acc = std::fma(static_cast<float>(s), sc.scale1(t, b, i) * xr.d[m * nb + b], acc);
          acc = std::fma(sc.offset1(t, b, i), xr.s[m * nb + b], acc);
        }
        y[m * n_out + t * kTile + i] = static_cast<bf16>(acc);
      }
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
constexpr bool kQ4Vectorized = true;

inline __m512i quad_of(const int8_t* p) {  // x[p .. p + 3] in every 32-bit lane
  int32_t four;
  std::memcpy(&four, p, sizeof(four));
  return _mm512_set1_epi32(four);
}

// 64 bytes of codes hold pairs j and j + 1 of 16 rows (byte 2i + e of each 32: row i): this puts
// row i's four weights in 32-bit lane i, as the dot product multiplies them with a broadcast quad.
inline __m512i rows_in_lanes() {
  alignas(64) int16_t idx[32];
  for (int i = 0; i < 16; ++i) idx[2 * i] = static_cast<int16_t>(i), idx[2 * i + 1] = static_cast<int16_t>(16 + i);
  return _mm512_load_si512(idx);
}

// One tile (16 rows) against M rows of x, B blocks per step. A block's 512 codes become 8 vectors
// of 16 rows x 4 weights once, for all M rows; each (row, block) then takes 8 dot products in two
// independent chains and one conversion to fp32 with its two scales.
template <int M, int B, typename S>
void q4_tile(const int8_t* xq, const float* dx, const float* sx, int64_t k, const uint8_t* codes, const S& sc,
             bf16* y, int64_t n_out, int64_t t) {
  const int64_t nb = k / kBlock;
  const __m512i low = _mm512_set1_epi8(0x0F), order = rows_in_lanes();
  __m512 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; b += B) {  // nb is even: K is a multiple of 64
    __m512i w[B][8];
    for (int u = 0; u < B; ++u)
      for (int p = 0; p < 4; ++p) {
        const uint8_t* ptr = codes + ((t * nb + b + u) * 8 + 2 * p) * 32;
        _mm_prefetch(reinterpret_cast<const char*>(ptr + kPrefetchBytes), _MM_HINT_T0);
        const __m512i v = _mm512_loadu_si512(ptr);
        w[u][p] = _mm512_permutexvar_epi16(order, _mm512_and_si512(v, low));  // weights 4p .. 4p + 3
        w[u][4 + p] = _mm512_permutexvar_epi16(order, _mm512_and_si512(_mm512_srli_epi16(v, 4), low));  // 16 + 4p ..
      }
    for (int u = 0; u < B; ++u) {
      const __m512 d = sc.scale(t, b + u), off = sc.offset(t, b + u);
      for (int m = 0; m < M; ++m) {
        const int8_t* xb = xq + m * k + (b + u) * kBlock;
        __m512i lo_sum = _mm512_setzero_si512(), hi_sum = _mm512_setzero_si512();
        for (int p = 0; p < 4; ++p) {
          lo_sum = _mm512_dpbusd_epi32(lo_sum, w[u][p], quad_of(xb + 4 * p));
          hi_sum = _mm512_dpbusd_epi32(hi_sum, w[u][4 + p], quad_of(xb + 16 + 4 * p));
        }
        const __m512 s = _mm512_cvtepi32_ps(_mm512_add_epi32(lo_sum, hi_sum));
        acc[m] = _mm512_fmadd_ps(s, _mm512_mul_ps(d, _mm512_set1_ps(dx[m * nb + b + u])), acc[m]);
        acc[m] = _mm512_fmadd_ps(off, _mm512_set1_ps(sx[m * nb + b + u]), acc[m]);
      }
    }
  }
  const int64_t live = std::min<int64_t>(kTile, n_out - t * kTile);
  const __mmask16 mask = live == kTile ? 0xFFFF : static_cast<__mmask16>((1u << live) - 1);
  for (int m = 0; m < M; ++m)  // round to nearest even, 16 rows per instruction
    _mm256_mask_storeu_epi16(y + m * n_out + t * kTile, mask, (__m256i)_mm512_cvtneps_pbh(acc[m]));
}

template <int M, typename S>
void q4_tiles(const Int8Rows& xr, int64_t m0, int64_t k, const uint8_t* codes, const S& sc, bf16* y, int64_t n_out,
              int64_t t0, int64_t t1) {
  constexpr int B = M <= 2 ? 2 : 1;  // keep 8*B code vectors, 2*M chains and M accumulators in registers
  const int64_t nb = k / kBlock;
  for (int64_t t = t0; t < t1; ++t)
    q4_tile<M, B>(xr.q.data() + m0 * k, xr.d.data() + m0 * nb, xr.s.data() + m0 * nb, k, codes, sc,
                  y + m0 * n_out, n_out, t);
}

template <typename S>
void q4_rows(const Int8Rows& xr, int64_t m0, int64_t m_rows, int64_t k, const uint8_t* codes, const S& sc, bf16* y,
             int64_t n_out, int64_t t0, int64_t t1) {
  with_rows(m_rows, [&](auto m) { q4_tiles<decltype(m)::value>(xr, m0, k, codes, sc, y, n_out, t0, t1); });
}
#else
constexpr bool kQ4Vectorized = false;

template <typename S>
void q4_rows(const Int8Rows& xr, int64_t m0, int64_t m_rows, int64_t k, const uint8_t* codes, const S& sc, bf16* y,
             int64_t n_out, int64_t t0, int64_t t1) {
  q4_rows_scalar(xr, m0, m_rows, k, codes, sc, y, n_out, t0, t1);
}
#endif

// ---- x exact (the default): AVX512-BF16 dot products on the codes as bf16 numbers ----------------
//
// A code c becomes the bf16 number 128 + c by OR-ing in 0x4300 (bf16 has 8 significant bits, so
// 128..255 are exact), and AVX512-BF16's dot product multiplies it exactly by the broadcast pair of
// x and sums in fp32: 16 dot products give each row's block sum S_b = sum_j (128 + q_j) x_j, and
//   sum_j (d q_j + m) x_j = d * S_b + (m - 128 d) * sum_j x_j
// costs two FMAs per block for all 16 rows. One 32-byte load widened to 16-bit lanes gives pairs j
// and j + 8 after one mask and one shift.

// sum of x over each 32-wide block, fp32: sx[m * nb + b]
void block_sums(const bf16* x, int64_t m_rows, int64_t k, float* sx) {
  const int64_t nb = k / kBlock;
  for (int64_t m = 0; m < m_rows; ++m)
    for (int64_t b = 0; b < nb; ++b) {
      float s = 0.0f;
      for (int64_t j = 0; j < kBlock; ++j) s += static_cast<float>(x[m * k + b * kBlock + j]);
      sx[m * nb + b] = s;
    }
}

// Plain loops over the same layout: the exact-x reference arithmetic (also the fallback).
template <typename S>
void q4_rows_scalar_exact(const bf16* x, const float* sx, int64_t m_rows, int64_t k, const uint8_t* codes,
                          const S& sc, bf16* y, int64_t n_out, int64_t t0, int64_t t1) {
  const int64_t nb = k / kBlock;
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t i = 0; i < kTile && t * kTile + i < n_out; ++i)
      for (int64_t m = 0; m < m_rows; ++m) {
        float acc = 0.0f;
        for (int64_t b = 0; b < nb; ++b) {
          const uint8_t* block = codes + (t * nb + b) * kTileBlock;
          float s = 0.0f;
          for (int64_t w = 0; w < kBlock; ++w)
            s += static_cast<float>(x[m * k + b * kBlock + w]) * static_cast<float>(code_at(block, i, w));
          acc += sc.scale1(t, b, i) * s + sc.offset1(t, b, i) * sx[m * nb + b];
        }
        y[m * n_out + t * kTile + i] = static_cast<bf16>(acc);
      }
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
inline __m512bh pair_of(const bf16* p) {  // x[p], x[p + 1] in every 32-bit lane
  int32_t both;
  std::memcpy(&both, p, sizeof(both));
  return (__m512bh)_mm512_set1_epi32(both);
}

// One tile (16 rows) against M rows of x, B blocks per step: every (m, block) pair has two
// independent dot-product chains (low and high nibbles), enough to hide the dot product's latency.
template <int M, int B, typename S>
void q4_tile_exact(const bf16* x, const float* sx, int64_t k, const uint8_t* codes, const S& sc, bf16* y, int64_t n_out,
             int64_t t) {
  const int64_t nb = k / kBlock;
  const __m512i low = _mm512_set1_epi16(0x000F), magic = _mm512_set1_epi16(0x4300);
  __m512 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  auto finish_block = [&](int64_t b, __m512 (&s)[M]) {
    const __m512 d = sc.scale(t, b);
    const __m512 off = _mm512_fnmadd_ps(d, _mm512_set1_ps(128.0f), sc.offset(t, b));
    for (int m = 0; m < M; ++m) {
      acc[m] = _mm512_fmadd_ps(s[m], d, acc[m]);
      acc[m] = _mm512_fmadd_ps(off, _mm512_set1_ps(sx[m * nb + b]), acc[m]);
    }
  };
  for (int64_t b = 0; b < nb; b += B) {  // nb is even: K is a multiple of 64
    __m512 lo_sum[B][M], hi_sum[B][M];
    for (int u = 0; u < B; ++u)
      for (int m = 0; m < M; ++m) lo_sum[u][m] = hi_sum[u][m] = _mm512_setzero_ps();
    for (int j = 0; j < 8; ++j)
      for (int u = 0; u < B; ++u) {
        const uint8_t* p = codes + ((t * nb + b + u) * 8 + j) * 32;
        _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetchBytes), _MM_HINT_T0);
        const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
        const __m512bh lo = (__m512bh)_mm512_ternarylogic_epi32(w, low, magic, 0xEA);  // (w & 0xF) | 0x4300
        const __m512bh hi = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(w, 4), magic);
        for (int m = 0; m < M; ++m) {
          const bf16* xb = x + m * k + (b + u) * kBlock;
          lo_sum[u][m] = _mm512_dpbf16_ps(lo_sum[u][m], pair_of(xb + 2 * j), lo);
          hi_sum[u][m] = _mm512_dpbf16_ps(hi_sum[u][m], pair_of(xb + 2 * j + 16), hi);
        }
      }
    for (int u = 0; u < B; ++u) {
      __m512 s[M];
      for (int m = 0; m < M; ++m) s[m] = _mm512_add_ps(lo_sum[u][m], hi_sum[u][m]);
      finish_block(b + u, s);
    }
  }
  const int64_t live = std::min<int64_t>(kTile, n_out - t * kTile);
  const __mmask16 mask = live == kTile ? 0xFFFF : static_cast<__mmask16>((1u << live) - 1);
  for (int m = 0; m < M; ++m)  // round to nearest even, 16 rows per instruction
    _mm256_mask_storeu_epi16(y + m * n_out + t * kTile, mask, (__m256i)_mm512_cvtneps_pbh(acc[m]));
}

template <int M, typename S>
void q4_tiles_exact(const bf16* x, const float* sx, int64_t k, const uint8_t* codes, const S& sc, bf16* y,
                    int64_t n_out, int64_t t0, int64_t t1) {
  constexpr int B = M <= 2 ? 2 : 1;  // keep 2*B*M chains and M accumulators in registers
  for (int64_t t = t0; t < t1; ++t) q4_tile_exact<M, B>(x, sx, k, codes, sc, y, n_out, t);
}

template <typename S>
void q4_rows_exact(const bf16* x, const float* sx, int64_t m_rows, int64_t k, const uint8_t* codes, const S& sc,
                   bf16* y, int64_t n_out, int64_t t0, int64_t t1) {
  with_rows(m_rows, [&](auto m) { q4_tiles_exact<decltype(m)::value>(x, sx, k, codes, sc, y, n_out, t0, t1); });
}
#else

template <typename S>
void q4_rows_exact(const bf16* x, const float* sx, int64_t m_rows, int64_t k, const uint8_t* codes, const S& sc,
                   bf16* y, int64_t n_out, int64_t t0, int64_t t1) {
  q4_rows_scalar_exact(x, sx, m_rows, k, codes, sc, y, n_out, t0, t1);
}
#endif

// Tiles per parallel task: ~256 KB of weights, so a decode step's
// projections split across threads while a single-threaded forward runs them inline.
int64_t grain(int64_t row_bytes) { return std::max<int64_t>(1, (256 << 10) / std::max<int64_t>(row_bytes, 1)); }

void check_q4(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scales,
              const torch::Tensor& offsets, int64_t n_out, const char* op) {
  TORCH_CHECK(codes.device().is_cpu() && codes.scalar_type() == torch::kUInt8 && codes.is_contiguous() &&
                  codes.dim() == 4 && codes.size(2) == 8 && codes.size(3) == 32,
              op, ": codes uint8 [T, K/32, 8, 32]");
  const int64_t tiles = codes.size(0), nb = codes.size(1);
  TORCH_CHECK(n_out > (tiles - 1) * kTile && n_out <= tiles * kTile, op, ": n_out must fill the last tile");
  if (scales.scalar_type() == torch::kByte) {  // the K form
    TORCH_CHECK(nb % KScales::kPerSuper == 0, op, ": K-form rows must be a multiple of 256 wide");
    TORCH_CHECK(scales.is_contiguous() && scales.sizes() == torch::IntArrayRef({tiles, nb, 2, kTile}),
                op, ": K-form sc and m uint8 [T, K/32, 2, 16]");
    TORCH_CHECK(offsets.scalar_type() == torch::kHalf && offsets.is_contiguous() &&
                    offsets.sizes() == torch::IntArrayRef({tiles, nb / KScales::kPerSuper, 2, kTile}),
                op, ": K-form d and dmin fp16 [T, K/256, 2, 16]");
  } else {
    for (const auto* t : {&scales, &offsets})
      TORCH_CHECK(t->scalar_type() == torch::kHalf && t->is_contiguous() && t->dim() == 3 && t->size(0) == tiles &&
                      t->size(1) == nb && t->size(2) == kTile,
                  op, ": fp16 scales and offsets [T, K/32, 16]");
  }
  check_x(x, nb * kBlock, op);
}

}  // namespace

// --q4-int8-activations: process-wide, set when a model loads (engine/kernels/cpu_quant.py).
static std::atomic<bool> g_q4_int8_activations{false};
void set_q4_int8_activations(bool on) { g_q4_int8_activations.store(on); }
bool q4_int8_activations() { return g_q4_int8_activations.load(); }

bool q8_lanes_vectorized();

// The bf16 block loops, 4-bit here and 8-bit in lane order, both run vectorized here.
bool quant_gemv_vectorized() { return kQ4Vectorized && q8_lanes_vectorized(); }

// y [M, n_out] bf16 = x [M, K] @ W.T, W in q4_pack's layout: codes uint8 [T, K/32, 8, 32], fp16
// scales and offsets [T, K/32, 16] (T = ceil(n_out / 16) tiles; rows past n_out are padding); or
// q4k_pack's K form (the same codes; `scales` uint8 [T, K/32, 2, 16] each block's sc and m,
// `offsets` fp16 [T, K/256, 2, 16] each 256 weights' d and dmin).
torch::Tensor q4_gemv(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, torch::Tensor offsets,
                      int64_t n_out, bool vectorized) {
  check_q4(x, codes, scales, offsets, n_out, "q4_gemv");
  const int64_t tiles = codes.size(0), k = codes.size(1) * kBlock, rows = x.size(0), nb = k / kBlock;
  auto y = torch::empty({rows, n_out}, x.options());
  const auto* cp = codes.data_ptr<uint8_t>();
  const bf16* xp = x.data_ptr<bf16>();
  bf16* yp = y.data_ptr<bf16>();
  const bool int8_x = q4_int8_activations();
  Int8Rows xr;
  std::vector<float> sx;
  if (int8_x) {
    xr = quantize_rows(xp, rows, k);
  } else {
    sx.resize(rows * nb);
    block_sums(xp, rows, k, sx.data());
  }
  // Each task takes its tiles through every group of kMaxRows rows of x in turn: a group's pass
  // finds the task's weights (~256 KB) still in L2, so more rows cost compute, not DRAM reads.
  auto run = [&](const auto& sc) {
    auto groups = [&](int64_t t0, int64_t t1) {
      for (int64_t m0 = 0; m0 < rows; m0 += kMaxRows) {
        const int64_t m_rows = std::min<int64_t>(kMaxRows, rows - m0);
        if (int8_x && vectorized)
          q4_rows(xr, m0, m_rows, k, cp, sc, yp, n_out, t0, t1);
        else if (int8_x)
          q4_rows_scalar(xr, m0, m_rows, k, cp, sc, yp, n_out, t0, t1);
        else if (vectorized)
          q4_rows_exact(xp + m0 * k, sx.data() + m0 * nb, m_rows, k, cp, sc, yp + m0 * n_out, n_out, t0, t1);
        else
          q4_rows_scalar_exact(xp + m0 * k, sx.data() + m0 * nb, m_rows, k, cp, sc, yp + m0 * n_out, n_out, t0, t1);
      }
    };
    if (vectorized)
      at::parallel_for(0, tiles, grain(kTile * k / 2), groups);
    else
      groups(0, tiles);
  };
  if (scales.scalar_type() == torch::kByte)
    run(KScales{{scales.data_ptr<uint8_t>(), offsets.data_ptr<at::Half>(), nb}});
  else
    run(HalfScales{{scales.data_ptr<at::Half>(), offsets.data_ptr<at::Half>(), nb}});
  return y;
}
