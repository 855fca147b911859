// Block-quantized products for fp32 activations on CPUs: y = x @ W.T with x fp32 [M, K] (a few
// rows) and W in the same blocks as cpu_quant_gemv.cpp (4-bit tiles of q4_pack; Q8_0 codes and
// scales). The weights are a GGUF file's (or --torchao-config's) exact values, dequantized by an
// exact conversion of each code; only the order of the fp32 sums is this file's own.
//
// Why: an fp32 model on a CPU without oneDNN's bf16 kernels (AVX2 only) streams 4 bytes a weight
// each decode step; the default model's Q4_1 layers and Q8_0 head hold 5/8 and 17/16 of a byte.
// These loops need only AVX2 + FMA + F16C (or AVX-512F), and each weight costs a few vector
// instructions: the read of the blocks, not the arithmetic, is what a step pays.
//
// 4-bit: for a tile (16 rows), block b and pair index j, the 32 bytes of codes hold rows 0..15's
// weights 2j, 2j+1 (low nibbles) and 2j+16, 2j+17 (high nibbles), byte 2i+e for row i. Each row's
// two bytes are widened once to a 32-bit lane; shifts and masks give the four weights' codes of
// every row, converted exactly to fp32 and multiplied by the broadcast x. Per row and block:
//   lo = sum over j of (c[2j] x[2j], then c[2j+1] x[2j+1]), hi likewise over 2j+16, 2j+17;
//   acc = fma(lo + hi, d, acc); acc = fma(m, sum(x over the block), acc)
// which is sum_j (d c_j + m) x_j. The scalar loop (`vectorized` false) computes exactly this in the
// same order, so the two agree to the bit (tests/test_cpu_quant_f32.py).
//
// 4-bit, K form (llama.cpp's Q4_K): the same codes, but each block's scale and offset are two
// factors, a 6-bit integer per block (sc, m) and an fp16 per 256 weights (d, dmin): scale = d * sc,
// offset = -(dmin * m), both exact in fp32, so the sums above run unchanged on the file's exact
// values while the scales cost 2 bytes per row and block instead of 4.
//
// 8-bit: each output row's codes meet x in vectors of the machine's width, one partial sum per
// lane over the block (a product, then fused multiply-adds), scaled into the lane's accumulator by
// the block's d; the lanes are summed in order at the end. The scalar loop keeps the same lanes.
//
// Q5_K, in the 8-bit loops: its 5-bit codes as int8 with Q4_K's factored scale and offset per 32
// weights; the offsets times x's block sums (as the 4-bit loops') added after the lanes' sum.
//
// Q6_K, in the 8-bit loops: codes q - 32 as int8, a scale per 16 weights that is an int8 sc times
// a d per 256 (the file's fp16, held in fp32; the product is exact), so each 16-weight block is
// scaled as a Q8_0 block is.
//
// bf16 models on CPUs without AVX512-BF16 (where the 8-bit blocks have no lane-order form,
// cpu_quant_lanes.cpp): the 8-bit entry points here take a bf16 x too: it widens to fp32 (exact),
// the fp32 loops run, and the result is rounded to bf16 once, as the bf16 loops round theirs. The
// extra conversions touch M x K and M x N values, nothing beside the weights' read.
//
// Every result is a function of its own row of x (no count of rows, position or thread count
// changes it), and every multiply-add is written out (native::fmadd, std::fma): the compiler's
// contraction cannot give two copies of a loop two roundings.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "q4_scales.h"
#include "vec_native.h"

using namespace asyncllm;
using native::vf;
using native::vh;
using fp16 = c10::Half;

namespace {

constexpr int64_t kBlock = 32;      // weights per scale
constexpr int64_t kTile = q4_scales::kRows;  // 4-bit rows per tile
constexpr int64_t kTileBlock = 256;  // bytes of one tile's 32-weight block
constexpr int64_t kW = native::kWidth;
constexpr int kHalves = kTile / kW;  // vectors per tile's 16 rows
// Rows of x per pass over a tile's codes: the accumulators of a pass must stay in registers
// (AVX2 has 16; a pass of G rows holds 2 * 2 * G block sums and 2 * G accumulators).
constexpr int kGroup = kW == 16 ? 4 : 2;
constexpr int64_t kPrefetchBytes = 8192;  // as cpu_quant_gemv.cpp: a cold read's stride ahead

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
constexpr bool kVectorized = true;
#else
constexpr bool kVectorized = false;
#endif

inline vf load_half(const fp16* p) {
#if defined(__AVX512F__)
  return (vf)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(__F16C__)
  return (vf)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  vf v;
  for (int i = 0; i < kW; ++i) v[i] = static_cast<float>(p[i]);
  return v;
#endif
}

// A tile half's 16-bit code pairs (kW rows, 2 bytes each), each widened to a 32-bit lane: then
// every code is one shift and one mask away from an exact int -> fp32 conversion, with no more
// widening per code (one widening per 2 bytes instead of one per byte halved the loop's work).
inline native::vu load_pairs(const uint8_t* p) {
#if defined(__AVX512F__)
  return (native::vu)_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(__AVX2__)
  return (native::vu)_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  vh h;
  std::memcpy(&h, p, sizeof(h));
  return __builtin_convertvector(h, native::vu);
#endif
}

inline vf as_float(native::vu codes) { return __builtin_convertvector((native::vi)codes, vf); }

// kW bytes, each exactly converted to an fp32 lane
inline vf load_u8(const uint8_t* p) {
#if defined(__AVX512F__)
  return (vf)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif defined(__AVX2__)
  return (vf)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
  vf v;
  for (int i = 0; i < kW; ++i) v[i] = static_cast<float>(p[i]);
  return v;
#endif
}

// A 4-bit weight's per-block scales and offsets (q4_scales.h: q4_pack's fp16 ones or q4k_pack's
// factors), for tile t, block b and the tile's rows r*kW .. (vector) or row i (scalar)
struct HalfScales : q4_scales::Half {
  vf scale(int64_t t, int64_t b, int r) const { return load_half(s + at(t, b) + r * kW); }
  vf offset(int64_t t, int64_t b, int r) const { return load_half(o + at(t, b) + r * kW); }
};

struct KScales : q4_scales::Factors {
  vf scale(int64_t t, int64_t b, int r) const {
    return load_half(dd + super(t, b, 0) + r * kW) * load_u8(sm + small(t, b, 0) + r * kW);
  }
  vf offset(int64_t t, int64_t b, int r) const {
    return -(load_half(dd + super(t, b, 1) + r * kW) * load_u8(sm + small(t, b, 1) + r * kW));
  }
};

// sum of x over each 32-wide block, in order: sx[m * nb + b]
void block_sums(const float* x, int64_t m_rows, int64_t k, float* sx) {
  const int64_t nb = k / kBlock;
  for (int64_t m = 0; m < m_rows; ++m)
    for (int64_t b = 0; b < nb; ++b) {
      float s = 0.0f;
      for (int64_t j = 0; j < kBlock; ++j) s += x[m * k + b * kBlock + j];
      sx[m * nb + b] = s;
    }
}

// ---- 4-bit ----------------------------------------------------------------------------------

template <class S>
void q4_tile_scalar(const float* x, const float* sx, int64_t m_rows, int64_t k, const uint8_t* codes, const S& sc,
                    float* y, int64_t n_out, int64_t t) {
  const int64_t nb = k / kBlock;
  for (int64_t i = 0; i < kTile && t * kTile + i < n_out; ++i)
    for (int64_t m = 0; m < m_rows; ++m) {
      float acc = 0.0f;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* block = codes + (t * nb + b) * kTileBlock;
        const float* xb = x + m * k + b * kBlock;
        float lo = 0.0f, hi = 0.0f;
        for (int64_t j = 0; j < 8; ++j) {
          const uint8_t even = block[j * 32 + 2 * i], odd = block[j * 32 + 2 * i + 1];
          lo = std::fma(static_cast<float>(even & 15), xb[2 * j], lo);
          lo = std::fma(static_cast<float>(odd & 15), xb[2 * j + 1], lo);
          hi = std::fma(static_cast<float>(even >> 4), xb[2 * j + 16], hi);
          hi = std::fma(static_cast<float>(odd >> 4), xb[2 * j + 17], hi);
        }
        acc = std::fma(lo + hi, sc.scale1(t, b, i), acc);
        acc = std::fma(sc.offset1(t, b, i), sx[m * nb + b], acc);
      }
      y[m * n_out + t * kTile + i] = acc;
    }
}

// One tile against M rows of x, U blocks in flight (more independent chains for few rows). (Two
// passes of 8 rows each over a tile's codes, to keep every block sum in AVX2's registers, ran
// slower: they broadcast each x twice.)
template <int M, int U, class S>
void q4_tile(const float* x, const float* sx, int64_t k, const uint8_t* codes, const S& sc, float* y, int64_t n_out,
             int64_t t) {
  const int64_t nb = k / kBlock;
  vf acc[M][kHalves];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < kHalves; ++r) acc[m][r] = native::broadcast(0.0f);
  for (int64_t b = 0; b < nb; b += U) {  // nb is even: K is a multiple of 64
    vf lo[U][M][kHalves], hi[U][M][kHalves];
    for (int u = 0; u < U; ++u)
      for (int m = 0; m < M; ++m)
        for (int r = 0; r < kHalves; ++r) lo[u][m][r] = hi[u][m][r] = native::broadcast(0.0f);
    for (int j = 0; j < 8; ++j)
      for (int u = 0; u < U; ++u) {
        const uint8_t* p = codes + ((t * nb + b + u) * 8 + j) * 32;
        __builtin_prefetch(p + kPrefetchBytes);
        for (int r = 0; r < kHalves; ++r) {
          const native::vu h = load_pairs(p + r * 2 * kW);  // bits 0-3: weight 2j, 8-11: 2j+1, 4-7, 12-15: +16
          const vf c0 = as_float(h & 15u), c1 = as_float((h >> 8) & 15u);
          const vf c2 = as_float((h >> 4) & 15u), c3 = as_float(h >> 12);
          for (int m = 0; m < M; ++m) {
            const float* xb = x + m * k + (b + u) * kBlock + 2 * j;
            lo[u][m][r] = native::fmadd(c0, native::broadcast(xb[0]), lo[u][m][r]);
            lo[u][m][r] = native::fmadd(c1, native::broadcast(xb[1]), lo[u][m][r]);
            hi[u][m][r] = native::fmadd(c2, native::broadcast(xb[16]), hi[u][m][r]);
            hi[u][m][r] = native::fmadd(c3, native::broadcast(xb[17]), hi[u][m][r]);
          }
        }
      }
    for (int u = 0; u < U; ++u)
      for (int r = 0; r < kHalves; ++r) {
        const vf d = sc.scale(t, b + u, r), o = sc.offset(t, b + u, r);
        for (int m = 0; m < M; ++m) {
          acc[m][r] = native::fmadd(lo[u][m][r] + hi[u][m][r], d, acc[m][r]);
          acc[m][r] = native::fmadd(o, native::broadcast(sx[m * nb + b + u]), acc[m][r]);
        }
      }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < kHalves; ++r) {
      const int64_t row = t * kTile + r * kW, live = std::min<int64_t>(kW, n_out - row);
      if (live == kW)
        std::memcpy(y + m * n_out + row, &acc[m][r], sizeof(vf));
      else
        for (int64_t i = 0; i < live; ++i) y[m * n_out + row + i] = acc[m][r][i];
    }
}

template <class S>
void q4_group(const float* x, const float* sx, int64_t m_rows, int64_t k, const uint8_t* codes, const S& sc, float* y,
              int64_t n_out, int64_t t) {
  switch (m_rows) {
    case 1: return q4_tile<1, 2>(x, sx, k, codes, sc, y, n_out, t);
    case 2: return q4_tile<2, 1>(x, sx, k, codes, sc, y, n_out, t);
    case 3: return q4_tile<3, 1>(x, sx, k, codes, sc, y, n_out, t);
    default: return q4_tile<kGroup, 1>(x, sx, k, codes, sc, y, n_out, t);
  }
}

// y rows of m_rows rows of x (and their block sums) against tile t, in groups of kGroup rows
template <class S>
void q4_tile_all_rows(const float* x, const float* sx, int64_t m_rows, int64_t k, const uint8_t* codes, const S& sc,
                      float* y, int64_t n_out, int64_t t, bool vectorized) {
  const int64_t nb = k / kBlock;
  for (int64_t m0 = 0; m0 < m_rows; m0 += kGroup) {
    const int64_t rows = std::min<int64_t>(kGroup, m_rows - m0);
    if (vectorized && kVectorized)
      q4_group(x + m0 * k, sx + m0 * nb, rows, k, codes, sc, y + m0 * n_out, n_out, t);
    else
      q4_tile_scalar(x + m0 * k, sx + m0 * nb, rows, k, codes, sc, y + m0 * n_out, n_out, t);
  }
}

// ---- 8-bit ----------------------------------------------------------------------------------

inline vf load_codes(const int8_t* p) {
#if defined(__AVX512F__)
  return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif defined(__AVX2__)
  return (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
  vf v;
  for (int i = 0; i < kW; ++i) v[i] = static_cast<float>(p[i]);
  return v;
#endif
}

// An 8-bit weight's scale for output row n and block b (of kBlk weights): Q8_0's fp16 per 32 weights
// [N, K/32], or Q6_K's int8 per 16 [N, K/16] times its fp16 per 256 [N, K/256].
struct Q8Scales {
  static constexpr int64_t kBlk = 32;
  static constexpr int64_t kRun = 1;  // blocks whose scales `fill` writes at once
  static constexpr bool kOffsets = false;
  const fp16* s;
  int64_t nb;
  float at(int64_t n, int64_t b) const { return static_cast<float>(s[n * nb + b]); }
  void fill(int64_t n, int64_t b0, float* out, float*) const { out[0] = at(n, b0); }
};

// d is kept in fp32 (its exact fp16 value) and a super-block's 16 scales are made by two vector
// products into a buffer the block loop broadcasts from: a scalar conversion and product per 16
// weights and row took ~45% of the loop's time.
struct Q6Scales {
  static constexpr int64_t kBlk = 16;
  static constexpr int64_t kRun = 16;  // blocks per d
  static constexpr bool kOffsets = false;
  const int8_t* sc;
  const float* d;
  int64_t nb;
  float at(int64_t n, int64_t b) const { return d[n * (nb / kRun) + b / kRun] * static_cast<float>(sc[n * nb + b]); }
  void fill(int64_t n, int64_t b0, float* out, float*) const {
    const vf dv = native::broadcast(d[n * (nb / kRun) + b0 / kRun]);
    for (int64_t v = 0; v < kRun; v += kW) {
      const vf prod = dv * load_codes(sc + n * nb + b0 + v);  // exact: an fp16 value times an int8
      std::memcpy(out + v, &prod, sizeof(vf));
    }
  }
};

// Q5_K: codes 0..31 as int8, per 32 weights scale = d * sc and offset = -(dmin * m) (as Q4_K),
// sc and m uint8 [N, 2, K/32], d and dmin fp32 [N, 2, K/256]. The offsets meet x's block sums, one
// scalar product per block and row, added to the row's sum after its lanes.
struct Q5KScales {
  static constexpr int64_t kBlk = 32;
  static constexpr int64_t kRun = 8;  // blocks per d
  static constexpr bool kOffsets = true;
  const uint8_t* sm;
  const float* dd;
  int64_t nb;
  float at(int64_t n, int64_t b) const {
    return dd[n * 2 * (nb / kRun) + b / kRun] * static_cast<float>(sm[n * 2 * nb + b]);
  }
  float off(int64_t n, int64_t b) const {
    return -(dd[n * 2 * (nb / kRun) + nb / kRun + b / kRun] * static_cast<float>(sm[n * 2 * nb + nb + b]));
  }
  void fill(int64_t n, int64_t b0, float* out, float* offs) const {
    for (int64_t i = 0; i < kRun; ++i) {
      out[i] = at(n, b0 + i);
      offs[i] = off(n, b0 + i);
    }
  }
};

// sx: x's block sums (block_sums), read where S has offsets
template <class S>
void q8_row_scalar(const float* x, const float* sx, int64_t m_rows, int64_t k, const int8_t* codes, const S& sc,
                   float* y, int64_t n_total, int64_t n) {
  constexpr int64_t kBlk = S::kBlk, kLanes = kBlk / kW;
  const int64_t nb = k / kBlk;
  for (int64_t m = 0; m < m_rows; ++m) {
    float acc[kW] = {};
    float offset = 0.0f;
    for (int64_t b = 0; b < nb; ++b) {
      const int8_t* c = codes + n * k + b * kBlk;
      const float* xb = x + m * k + b * kBlk;
      const float d = sc.at(n, b);
      for (int64_t l = 0; l < kW; ++l) {
        float s = static_cast<float>(c[l]) * xb[l];
        for (int64_t v = 1; v < kLanes; ++v) s = std::fma(static_cast<float>(c[v * kW + l]), xb[v * kW + l], s);
        acc[l] = std::fma(s, d, acc[l]);
      }
      if constexpr (S::kOffsets) offset = std::fma(sc.off(n, b), sx[m * nb + b], offset);
    }
    float sum = acc[0];
    for (int64_t l = 1; l < kW; ++l) sum += acc[l];
    y[m * n_total + n] = S::kOffsets ? sum + offset : sum;
  }
}

template <int M, int R, class S>
void q8_tile(const float* x, const float* sx, int64_t k, const int8_t* codes, const S& sc, float* y, int64_t n_total,
             int64_t n) {
  constexpr int64_t kBlk = S::kBlk, kLanes = kBlk / kW;
  const int64_t nb = k / kBlk;
  vf acc[M][R];
  float offset[M][R] = {};
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = native::broadcast(0.0f);
  float scales[R][S::kRun], offs[R][S::kRun];
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t run = b % S::kRun;
    if (run == 0)
      for (int r = 0; r < R; ++r) sc.fill(n + r, b, scales[r], offs[r]);
    if constexpr (S::kOffsets)
      for (int m = 0; m < M; ++m)
        for (int r = 0; r < R; ++r) offset[m][r] = std::fma(offs[r][run], sx[m * nb + b], offset[m][r]);
    vf w[R][kLanes], d[R];
    for (int r = 0; r < R; ++r) {
      const int8_t* p = codes + (n + r) * k + b * kBlk;
      __builtin_prefetch(p + kPrefetchBytes);
      for (int v = 0; v < kLanes; ++v) w[r][v] = load_codes(p + v * kW);
      d[r] = native::broadcast(scales[r][run]);
    }
    for (int m = 0; m < M; ++m) {
      vf xv[kLanes];
      for (int v = 0; v < kLanes; ++v) xv[v] = native::load(x + m * k + b * kBlk + v * kW);
      for (int r = 0; r < R; ++r) {
        vf s = w[r][0] * xv[0];
        for (int v = 1; v < kLanes; ++v) s = native::fmadd(w[r][v], xv[v], s);
        acc[m][r] = native::fmadd(s, d[r], acc[m][r]);
      }
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) {
      const float sum = native::hsum(acc[m][r]);
      y[m * n_total + n + r] = S::kOffsets ? sum + offset[m][r] : sum;
    }
}

template <int M, class S>
void q8_rows_m(const float* x, const float* sx, int64_t k, const int8_t* codes, const S& sc, float* y,
               int64_t n_total, int64_t n0, int64_t n1) {
  // Output rows per pass: their codes and M x R accumulators in registers. One row of x with
  // AVX-512 takes one output row at a time, so the codes are one sequential stream: a Q8_0 head
  // (49152 x 576) read 1.3-1.6x faster on one Zen 4 core than four rows' streams at once, 1.25-1.4x
  // on two. AVX2 (8 lanes: a block is 4 dependent multiply-adds) keeps four rows, not measured.
  constexpr int R = M == 1 ? (kW == 16 ? 1 : 4) : 2;
  int64_t n = n0;
  for (; n + R <= n1; n += R) q8_tile<M, R>(x, sx, k, codes, sc, y, n_total, n);
  for (; n < n1; ++n) q8_tile<M, 1>(x, sx, k, codes, sc, y, n_total, n);
}

template <class S>
void q8_group(const float* x, const float* sx, int64_t m_rows, int64_t k, const int8_t* codes, const S& sc, float* y,
              int64_t n_total, int64_t n0, int64_t n1) {
  switch (m_rows) {
    case 1: return q8_rows_m<1>(x, sx, k, codes, sc, y, n_total, n0, n1);
    case 2: return q8_rows_m<2>(x, sx, k, codes, sc, y, n_total, n0, n1);
    case 3: return q8_rows_m<3>(x, sx, k, codes, sc, y, n_total, n0, n1);
    default: return q8_rows_m<kGroup>(x, sx, k, codes, sc, y, n_total, n0, n1);
  }
}

// Work per parallel task: ~64 KB of blocks, so a decode step's projections use every thread (as
// cpu_gemv.cpp's bands; the bf16 loops' 256 KB kept a 576 x 576 projection on one thread).
int64_t grain(int64_t unit_bytes) { return std::max<int64_t>(1, (64 << 10) / std::max<int64_t>(unit_bytes, 1)); }

void check_x(const torch::Tensor& x, int64_t k, const char* op) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32, op, ": x must be float32 on the CPU");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) == k, op, ": x must be contiguous [M, K]");
  TORCH_CHECK(x.size(0) >= 1, op, ": at least one row");
  TORCH_CHECK(k % (2 * kBlock) == 0, op, ": K must be a multiple of 64");
}

// y [M, N] = x [M, K] @ W.T, 8-bit codes [N, K] with `sc`'s scales
template <class S>
torch::Tensor q8_form_gemv(const torch::Tensor& x, const torch::Tensor& codes, const S& sc, bool vectorized) {
  const int64_t n = codes.size(0), k = codes.size(1), rows = x.size(0), nb = k / kBlock;
  auto y = torch::empty({rows, n}, x.options());
  const auto* cp = codes.data_ptr<int8_t>();
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  std::vector<float> sx;
  if constexpr (S::kOffsets) {
    static_assert(S::kBlk == kBlock, "offsets meet 32-wide block sums");
    sx.resize(rows * nb);
    block_sums(xp, rows, k, sx.data());
  }
  auto task = [&](int64_t n0, int64_t n1) {  // a task's rows (~64 KB) stay in L2 across groups
    for (int64_t m0 = 0; m0 < rows; m0 += kGroup) {
      const int64_t m_rows = std::min<int64_t>(kGroup, rows - m0);
      const float* sxm = sx.empty() ? nullptr : sx.data() + m0 * nb;
      if (vectorized && kVectorized)
        q8_group(xp + m0 * k, sxm, m_rows, k, cp, sc, yp + m0 * n, n, n0, n1);
      else
        for (int64_t r = n0; r < n1; ++r) q8_row_scalar(xp + m0 * k, sxm, m_rows, k, cp, sc, yp + m0 * n, n, r);
    }
  };
  at::parallel_for(0, n, grain(k), task);
  return y;
}

// A K form's product for a bf16 x: the fp32 loops on x widened, the result rounded to bf16 once.
template <typename Fn>
torch::Tensor through_fp32(const torch::Tensor& x, Fn&& fp32_product) {
  if (x.scalar_type() != torch::kBFloat16) return fp32_product(x);
  return fp32_product(x.to(torch::kFloat)).to(torch::kBFloat16);
}

void check_codes8(const torch::Tensor& codes, const char* op) {
  TORCH_CHECK(codes.device().is_cpu() && codes.scalar_type() == torch::kChar && codes.is_contiguous() &&
                  codes.dim() == 2,
              op, ": codes int8 [N, K]");
}

}  // namespace

bool quant_gemv_f32_vectorized() { return kVectorized; }

// y [M, n_out] fp32 = x [M, K] @ W.T, W in q4_pack's layout (codes uint8 [T, K/32, 8, 32], fp16
// scales and offsets [T, K/32, 16]) or q4k_pack's (the same codes; `scales` uint8 [T, K/32, 2, 16]
// holding each block's sc and m, `offsets` fp16 [T, K/256, 2, 16] each 256 weights' d and dmin).
torch::Tensor q4_gemv_f32(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, torch::Tensor offsets,
                          int64_t n_out, bool vectorized) {
  TORCH_CHECK(codes.device().is_cpu() && codes.scalar_type() == torch::kUInt8 && codes.is_contiguous() &&
                  codes.dim() == 4 && codes.size(2) == 8 && codes.size(3) == 32,
              "q4_gemv_f32: codes uint8 [T, K/32, 8, 32]");
  const int64_t tiles = codes.size(0), nb = codes.size(1), k = nb * kBlock, rows = x.size(0);
  TORCH_CHECK(n_out > (tiles - 1) * kTile && n_out <= tiles * kTile, "q4_gemv_f32: n_out must fill the last tile");
  const bool k_form = scales.scalar_type() == torch::kByte;
  if (k_form) {
    TORCH_CHECK(nb % KScales::kPerSuper == 0, "q4_gemv_f32: K-form rows must be a multiple of 256 wide");
    TORCH_CHECK(scales.is_contiguous() && scales.sizes() == torch::IntArrayRef({tiles, nb, 2, kTile}),
                "q4_gemv_f32: K-form sc and m uint8 [T, K/32, 2, 16]");
    TORCH_CHECK(offsets.scalar_type() == torch::kHalf && offsets.is_contiguous() &&
                    offsets.sizes() == torch::IntArrayRef({tiles, nb / KScales::kPerSuper, 2, kTile}),
                "q4_gemv_f32: K-form d and dmin fp16 [T, K/256, 2, 16]");
  } else {
    for (const auto* t : {&scales, &offsets})
      TORCH_CHECK(t->scalar_type() == torch::kHalf && t->is_contiguous() && t->dim() == 3 && t->size(0) == tiles &&
                      t->size(1) == nb && t->size(2) == kTile,
                  "q4_gemv_f32: fp16 scales and offsets [T, K/32, 16]");
  }
  check_x(x, k, "q4_gemv_f32");
  auto y = torch::empty({rows, n_out}, x.options());
  const auto* cp = codes.data_ptr<uint8_t>();
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  std::vector<float> sx(rows * nb);
  block_sums(xp, rows, k, sx.data());
  // A task takes each of its tiles through every group of rows of x in turn: the tile's codes
  // (8 K bytes) stay in L1 between groups.
  auto run = [&](const auto& sc) {
    auto task = [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) q4_tile_all_rows(xp, sx.data(), rows, k, cp, sc, yp, n_out, t, vectorized);
    };
    at::parallel_for(0, tiles, grain(kTile * k / 2), task);
  };
  if (k_form)
    run(KScales{{scales.data_ptr<uint8_t>(), offsets.data_ptr<at::Half>(), nb}});
  else
    run(HalfScales{{scales.data_ptr<at::Half>(), offsets.data_ptr<at::Half>(), nb}});
  return y;
}

// y [M, N] fp32 = x [M, K] @ W.T, W = Q8_0 blocks (codes int8 [N, K], fp16 scales [N, K/32]).
torch::Tensor q8_gemv_f32(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, bool vectorized) {
  check_codes8(codes, "q8_gemv_f32");
  const int64_t n = codes.size(0), k = codes.size(1), nb = k / kBlock;
  TORCH_CHECK(scales.scalar_type() == torch::kHalf && scales.is_contiguous() && scales.dim() == 2 &&
                  scales.size(0) == n && scales.size(1) == nb,
              "q8_gemv_f32: fp16 scales [N, K/32]");
  return through_fp32(x, [&](const torch::Tensor& xf) {
    check_x(xf, k, "q8_gemv_f32");
    return q8_form_gemv(xf, codes, Q8Scales{scales.data_ptr<at::Half>(), nb}, vectorized);
  });
}

// y [M, N] fp32 = x [M, K] @ W.T, W = Q6_K's values as codes int8 [N, K] (q - 32), int8 scales
// [N, K/16] and fp32 d [N, K/256]: W[n, k] = d[n, k/256] * scales[n, k/16] * codes[n, k].
torch::Tensor q6_gemv_f32(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, torch::Tensor supers,
                          bool vectorized) {
  check_codes8(codes, "q6_gemv_f32");
  const int64_t n = codes.size(0), k = codes.size(1), nb = k / Q6Scales::kBlk;
  TORCH_CHECK(k % (Q6Scales::kBlk * Q6Scales::kRun) == 0, "q6_gemv_f32: K must be a multiple of 256");
  TORCH_CHECK(scales.scalar_type() == torch::kChar && scales.is_contiguous() &&
                  scales.sizes() == torch::IntArrayRef({n, nb}),
              "q6_gemv_f32: int8 scales [N, K/16]");
  TORCH_CHECK(supers.scalar_type() == torch::kFloat && supers.is_contiguous() &&
                  supers.sizes() == torch::IntArrayRef({n, nb / Q6Scales::kRun}),
              "q6_gemv_f32: fp32 d [N, K/256]");
  return through_fp32(x, [&](const torch::Tensor& xf) {
    check_x(xf, k, "q6_gemv_f32");
    return q8_form_gemv(xf, codes, Q6Scales{scales.data_ptr<int8_t>(), supers.data_ptr<float>(), nb}, vectorized);
  });
}

// y [M, N] fp32 = x [M, K] @ W.T, W = Q5_K's values as codes int8 [N, K] (0..31), sc and m uint8
// [N, 2, K/32], d and dmin fp32 [N, 2, K/256]: W[n, k] = d * sc * codes - dmin * m per 32 weights.
torch::Tensor q5k_gemv_f32(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, torch::Tensor supers,
                           bool vectorized) {
  check_codes8(codes, "q5k_gemv_f32");
  const int64_t n = codes.size(0), k = codes.size(1), nb = k / Q5KScales::kBlk;
  TORCH_CHECK(k % (Q5KScales::kBlk * Q5KScales::kRun) == 0, "q5k_gemv_f32: K must be a multiple of 256");
  TORCH_CHECK(scales.scalar_type() == torch::kByte && scales.is_contiguous() &&
                  scales.sizes() == torch::IntArrayRef({n, 2, nb}),
              "q5k_gemv_f32: uint8 sc and m [N, 2, K/32]");
  TORCH_CHECK(supers.scalar_type() == torch::kFloat && supers.is_contiguous() &&
                  supers.sizes() == torch::IntArrayRef({n, 2, nb / Q5KScales::kRun}),
              "q5k_gemv_f32: fp32 d and dmin [N, 2, K/256]");
  return through_fp32(x, [&](const torch::Tensor& xf) {
    check_x(xf, k, "q5k_gemv_f32");
    return q8_form_gemv(xf, codes, Q5KScales{scales.data_ptr<uint8_t>(), supers.data_ptr<float>(), nb}, vectorized);
  });
}
