// Many rows of x against a block-quantized weight that has no dense copy: y = x @ W.T, W in the
// small-batch loops' own layouts (cpu_quant_gemv.cpp's 4-bit tiles, cpu_quant_gemv_f32.cpp's
// natural-order 8-bit codes, cpu_quant_lanes.cpp's lane order), x bf16 or fp32 [M, K].
//
// Why: the small-batch loops unpack every weight once per few rows of x, so past a few dozen rows
// a GEMM wins. The projections used to keep a dense copy beside the blocks for those rows: a 1B
// Q4_K_M file of 0.67 GB held 3.0 GB of weights. Here the blocks are the only resident form.
//
// How: W's output rows in tiles of at most kTileBytes of the model's dtype, as many tiles as a
// multiple of the threads. Each thread takes one tile at a time: it writes the tile's exact values
// rounded to x's dtype (the values the dense copy held) into a buffer of its own, which stays in
// the core's L2, and multiplies x by it there. For a bf16 x on AVX512-BF16, our register-blocked
// vdpbf16ps kernels do the multiply (the 4-bit tiles are written straight as VNNI pairs, the other
// forms row by row into a dot-product kernel): at::mm on a plain tile repacks it on every call,
// which cost more than the whole product below ~64 rows of x. Elsewhere (fp32: MKL; bf16 without
// AVX512-BF16, and an AMX build's larger batches: oneDNN) at::mm runs single-threaded inside the
// parallel region. docs/PERFORMANCE.md has the measurements.
//
// Arithmetic: every weight is the file's value exactly (a code times a scale that is an exact
// product of the file's factors, plus an offset: one rounding in fp32, as the Python side's
// dequantize() makes it), then rounded to bf16 to nearest even for a bf16 x; the sums are the
// GEMM library's.
//
// Layouts written:
// - 4-bit tiles: a tile of 16 rows holds, for block b and pair j, rows 0..15's weights 2j, 2j+1
//   (low nibbles) and 2j+16, 2j+17 (high), byte 2i+e for row i; 16 rows of one weight index are
//   one vector, so the tile is written transposed, W.T [K, rows].
// - 8-bit natural order: row by row, W [rows, K].
// - lane order (Q6_K / Q5_K, bf16): row by row in the lanes' order of K (each 256 weights
//   permuted, cpu_quant_lanes.cpp), and x's columns are put in that order once per call.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "q4_scales.h"
#include "vnni.h"
#include "vec.h"

using bf16 = c10::BFloat16;
using fp16 = c10::Half;

namespace {

using asyncllm::v16f;
using asyncllm::v16i;
using asyncllm::v16u;
using asyncllm::v16h;
typedef uint8_t v16b __attribute__((vector_size(16)));
typedef uint8_t v32b __attribute__((vector_size(32)));
typedef int8_t v16c __attribute__((vector_size(16)));

constexpr int64_t kTileBytes = 1 << 20;  // a tile's dequantized bytes at most: ~a core's L2
constexpr int64_t kMinTileRows = 64, kMaxTileRows = 512;
constexpr int64_t kQ4Rows = asyncllm::q4_scales::kRows;  // rows per 4-bit tile
constexpr int64_t kBlock = 32, kGroup = 256;

inline v16f to_float(v16i v) { return __builtin_convertvector(v, v16f); }

// 16 bytes (uint8 or int8) widened to 32-bit lanes: GCC widens a generic byte vector one byte at a
// time (a tenth of the fill's speed where it ran per 16 weights), the intrinsics in one or two
template <typename V>
inline v16i widen(V v) {
  constexpr bool sign = std::is_signed_v<std::remove_cv_t<std::remove_reference_t<decltype(std::declval<V>()[0])>>>;
#if defined(__AVX512F__)
  __m128i b;
  std::memcpy(&b, &v, sizeof(b));
  const __m512i w = sign ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b);
  v16i r;
  std::memcpy(&r, &w, sizeof(r));
  return r;
#elif defined(__AVX2__)
  __m128i b;
  std::memcpy(&b, &v, sizeof(b));
  const __m256i halves[2] = {sign ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b),
                             sign ? _mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)) : _mm256_cvtepu8_epi32(_mm_srli_si128(b, 8))};
  v16i r;
  std::memcpy(&r, halves, sizeof(r));
  return r;
#else
  return __builtin_convertvector(v, v16i);
#endif
}

// 16 floats to where `dst` points, as fp32 or rounded to bf16 (nearest even; weights are finite)
inline void put(float* dst, v16f v) { std::memcpy(dst, &v, sizeof(v)); }
inline void put(bf16* dst, v16f v) {
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), (__m256i)_mm512_cvtneps_pbh((__m512)v));
#else
  v16u u;
  std::memcpy(&u, &v, sizeof(u));
  u = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  const v16h h = __builtin_convertvector(u, v16h);
  std::memcpy(dst, &h, sizeof(h));
#endif
}

// 16 fp16 values as floats (exact)
inline v16f halves(const fp16* p) {
#if defined(__AVX512F__)
  return (v16f)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#else
  float f[16];
  for (int i = 0; i < 16; ++i) f[i] = static_cast<float>(p[i]);
  v16f v;
  std::memcpy(&v, f, sizeof(v));
  return v;
#endif
}

template <typename B>  // 16 small integers (uint8 or int8) as floats
inline v16f small16(const B* p) {
  typedef B v16 __attribute__((vector_size(16)));
  v16 v;
  std::memcpy(&v, p, sizeof(v));
  return to_float(widen(v));
}


// ---- 4-bit tiles -> W.T [K, ld], columns (t - t0) * 16 .. --------------------------------------

// Block b's scale d and offset m of tile t's 16 rows (q4_scales.h's values, 16 at once)
inline v16f scale16(const asyncllm::q4_scales::Half& sc, int64_t t, int64_t b) { return halves(sc.s + sc.at(t, b)); }
inline v16f offset16(const asyncllm::q4_scales::Half& sc, int64_t t, int64_t b) { return halves(sc.o + sc.at(t, b)); }
inline v16f scale16(const asyncllm::q4_scales::Factors& sc, int64_t t, int64_t b) {
  return halves(sc.dd + sc.super(t, b, 0)) * small16(sc.sm + sc.small(t, b, 0));
}
inline v16f offset16(const asyncllm::q4_scales::Factors& sc, int64_t t, int64_t b) {
  return -(halves(sc.dd + sc.super(t, b, 1)) * small16(sc.sm + sc.small(t, b, 1)));
}

template <typename S, typename T>
void fill_q4(const uint8_t* codes, const S& sc, int64_t nb, int64_t t0, int64_t t1, T* wt, int64_t ld) {
  const v16b low = v16b{} + 15;
  for (int64_t t = t0; t < t1; ++t) {
    T* col = wt + (t - t0) * kQ4Rows;
    for (int64_t b = 0; b < nb; ++b) {
      const v16f d = scale16(sc, t, b), m = offset16(sc, t, b);
      const uint8_t* p = codes + (t * nb + b) * kQ4Rows * kBlock / 2;
      for (int64_t j = 0; j < 8; ++j) {
        v32b bytes;
        std::memcpy(&bytes, p + j * 32, sizeof(bytes));
        const v16b even = __builtin_shufflevector(bytes, bytes, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
        const v16b odd = __builtin_shufflevector(bytes, bytes, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
        const v16b codes4[4] = {even & low, odd & low, even >> 4, odd >> 4};
        const int64_t index[4] = {2 * j, 2 * j + 1, 2 * j + 16, 2 * j + 17};
        for (int u = 0; u < 4; ++u) {
          const v16f q = to_float(widen(codes4[u]));
          put(col + (b * kBlock + index[u]) * ld, d * q + m);
        }
      }
    }
  }
}

// ---- 8-bit natural order -> W [rows, K] ------------------------------------------------------

// Q8_0 / Q5_0 (fp16 scale per 32), Q6_K (int8 sc per 16 times a d per 256), Q5_K (uint8 sc and m
// per 32 times d and dmin per 256): scale and offset of row n's block g, as q8.py's Q8Blocks.
struct Q8Scales {
  enum Kind { kHalf, kQ6, kQ5 } kind;
  const void* scales;
  const float* supers;
  int64_t k;
  int64_t block() const { return kind == kQ6 ? 16 : kBlock; }
  void at(int64_t n, int64_t g, float* s, float* o) const {
    const int64_t groups = k >> (kind == kQ6 ? 4 : 5), supers_per_row = k / kGroup;  // no division per block
    if (kind == kHalf) {
      *s = static_cast<float>(static_cast<const fp16*>(scales)[n * groups + g]);
      *o = 0.0f;
    } else if (kind == kQ6) {
      const float d = supers[n * supers_per_row + g * 16 / kGroup];
      *s = d * static_cast<float>(static_cast<const int8_t*>(scales)[n * groups + g]);
      *o = 0.0f;
    } else {
      const auto* sm = static_cast<const uint8_t*>(scales) + n * 2 * groups;  // [2, K/32]: sc, m
      const float* dd = supers + n * 2 * supers_per_row;                     // [2, K/256]: d, dmin
      *s = dd[g * kBlock / kGroup] * static_cast<float>(sm[g]);
      *o = -(dd[supers_per_row + g * kBlock / kGroup] * static_cast<float>(sm[groups + g]));
    }
  }
};

template <typename T>
void fill_q8(const int8_t* codes, const Q8Scales& sc, int64_t n0, int64_t rows, T* w) {
  const int64_t k = sc.k, block = sc.block();
  for (int64_t r = 0; r < rows; ++r) {
    const int8_t* q = codes + (n0 + r) * k;
    T* out = w + r * k;
    for (int64_t g = 0; g < k / block; ++g) {
      float s, o;
      sc.at(n0 + r, g, &s, &o);
      for (int64_t i = g * block; i < (g + 1) * block; i += 16) {
        v16c c;
        std::memcpy(&c, q + i, sizeof(c));
        put(out + i, to_float(widen(c)) * s + o);
      }
    }
  }
}

// ---- lane order (cpu_quant_lanes.cpp) -> W [rows, K] in the lanes' order of K --------------------

struct LaneKind {
  int block, bias, hi_bits;  // as cpu_quant_lanes.cpp's KindInfo
  constexpr int lanes_per_block() const { return 16 / (kGroup / block); }
  constexpr int group_bytes() const { return kGroup / 2 + 32 * hi_bits; }
};
constexpr LaneKind kLaneKinds[2] = {{16, 32, 2}, {32, 0, 1}};  // Q6_K, Q5_K

// The natural index (within its 256) of the weight at lane-order position `at`: vector j holds,
// in fp32 lane b * L + i, pair j * L + i of block b.
int64_t natural_index(const LaneKind& kind, int64_t at) {
  const int64_t L = kind.lanes_per_block(), j = at / 32, lane = at % 32 / 2, e = at % 2;
  return lane / L * kind.block + 2 * (j * L + lane % L) + e;
}

// Each lane-order position's scale and offset in row n's group g: positions 0..15 (s0, o0) and
// 16..31 (s1, o1) of every vector (position i is in block i / 2 / L), offsets with the codes'
// bias folded in (exact: a scale times a small integer).
template <int Kind>
void lane_scales(const Q8Scales& sc, int64_t n, int64_t g, v16f* s0, v16f* s1, v16f* o0, v16f* o1) {
  const int64_t k = sc.k, supers = k / kGroup;
  if constexpr (Kind == 0) {  // Q6_K: 16 blocks of 16, one lane each, bias 32
    const float d = sc.supers[n * supers + g];
    const v16f s = small16(static_cast<const int8_t*>(sc.scales) + n * (k / 16) + g * 16) * d;
    *s0 = __builtin_shufflevector(s, s, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    *s1 = __builtin_shufflevector(s, s, 8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15);
    *o0 = *s0 * -32.0f;
    *o1 = *s1 * -32.0f;
  } else {  // Q5_K: 8 blocks of 32, two lanes each, bias 0, offsets -(dmin m)
    const int64_t groups = k / kBlock;
    const auto* sm = static_cast<const uint8_t*>(sc.scales) + n * 2 * groups + g * 8;
    const float* dd = sc.supers + n * 2 * supers;
    uint8_t both[16];  // sc of the 8 blocks, then their m
    std::memcpy(both, sm, 8);
    std::memcpy(both + 8, sm + groups, 8);
    const v16f f = small16(both);
    const v16f s = f * dd[g], o = -(f * dd[supers + g]);  // lanes 0..7 are s's, 8..15 o's
    *s0 = __builtin_shufflevector(s, s, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    *s1 = __builtin_shufflevector(s, s, 4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6, 7, 7, 7, 7);
    *o0 = __builtin_shufflevector(o, o, 8, 8, 8, 8, 9, 9, 9, 9, 10, 10, 10, 10, 11, 11, 11, 11);
    *o1 = __builtin_shufflevector(o, o, 12, 12, 12, 12, 13, 13, 13, 13, 14, 14, 14, 14, 15, 15, 15, 15);
  }
}

template <int Kind>
void fill_lanes_of(const uint8_t* codes, const Q8Scales& sc, int64_t n0, int64_t rows, bf16* w) {
  constexpr LaneKind kind = kLaneKinds[Kind];
  constexpr int per = 8 / kind.hi_bits;
  constexpr uint8_t mask = (1 << kind.hi_bits) - 1;
  const int64_t k = sc.k, groups = k / kGroup, row_bytes = groups * kind.group_bytes();
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* gp = codes + (n0 + r) * row_bytes + g * kind.group_bytes();
      v16f s0, s1, o0, o1;
      lane_scales<Kind>(sc, n0 + r, g, &s0, &s1, &o0, &o1);
      bf16* out = w + r * k + g * kGroup;
      for (int j = 0; j < 8; ++j) {
        const uint8_t* lo = gp + 32 * (j / 2);
        const uint8_t* hi = gp + kGroup / 2 + 32 * (j / per);
#if defined(__AVX512BW__)
        // in 16-bit lanes: x86 has no byte shifts
        const __m512i l = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo)));
        const __m512i h = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(hi)));
        const __m512i u = _mm512_or_si512(
            _mm512_and_si512(_mm512_srli_epi16(l, 4 * (j % 2)), _mm512_set1_epi16(15)),
            _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(h, (j % per) * kind.hi_bits), _mm512_set1_epi16(mask)), 4));
        const __m512 q0 = _mm512_cvtepi32_ps(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(u)));
        const __m512 q1 = _mm512_cvtepi32_ps(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(u, 1)));
        put(out + 32 * j, (v16f)q0 * s0 + o0);
        put(out + 32 * j + 16, (v16f)q1 * s1 + o1);
#else
        uint8_t u[32];
        for (int i = 0; i < 32; ++i)
          u[i] = static_cast<uint8_t>(((lo[i] >> (4 * (j % 2))) & 15) | (((hi[i] >> ((j % per) * kind.hi_bits)) & mask) << 4));
        put(out + 32 * j, small16(u) * s0 + o0);
        put(out + 32 * j + 16, small16(u + 16) * s1 + o1);
#endif
      }
    }
  }
}

void fill_lanes(const uint8_t* codes, const LaneKind& kind, const Q8Scales& sc, int64_t n0, int64_t rows, bf16* w) {
  if (&kind == &kLaneKinds[0])
    fill_lanes_of<0>(codes, sc, n0, rows, w);
  else
    fill_lanes_of<1>(codes, sc, n0, rows, w);
}

// ---- bf16 dot-product tiles (AVX512-BF16) ------------------------------------------------------
//
// A tile as VNNI pairs, B [K/2][T][2] (pair p of column n at (p T + n) 2): the layout in which one
// 512-bit vdpbf16ps multiplies 16 columns' pairs by a broadcast pair of x. oneDNN repacks a plain
// tile into such a layout on every call (most of at::mm's cost per tile below ~64 rows of x);
// written so directly, a small register-blocked kernel runs the tile from L2.

#if defined(ASYNCLLM_VNNI)
#define ASYNCLLM_VNNI_TILES 1

using asyncllm::vnni::kKernelRows;

// 4-bit tiles [t0, t1) -> B's columns (t - t0) * 16 ..: the 32 bytes of block b, pair index j
// hold every row's pair j (low nibbles: pair b * 16 + j of the row) and j + 8 (high nibbles), byte
// 2i + e for row i's weight e of the pair, which is also where B's vector of that pair holds it:
// each 16 bytes widen to 16 lanes (rows i..i+7's pairs) whose scales are the rows' own, repeated.
template <typename S>
void fill_q4_vnni(const uint8_t* codes, const S& sc, int64_t nb, int64_t t0, int64_t t1, bf16* B, int64_t T) {
  const __m512i nibble = _mm512_set1_epi32(0x0F);
  const __m512i rows0 = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i rows1 = _mm512_add_epi32(rows0, _mm512_set1_epi32(8));
  for (int64_t t = t0; t < t1; ++t) {
    bf16* col = B + (t - t0) * kQ4Rows * 2;
    for (int64_t b = 0; b < nb; ++b) {
      const __m512 d = (__m512)scale16(sc, t, b), m = (__m512)offset16(sc, t, b);
      const __m512 d0 = _mm512_permutexvar_ps(rows0, d), d1 = _mm512_permutexvar_ps(rows1, d);
      const __m512 m0 = _mm512_permutexvar_ps(rows0, m), m1 = _mm512_permutexvar_ps(rows1, m);
      const uint8_t* p = codes + (t * nb + b) * kQ4Rows * kBlock / 2;
      for (int64_t j = 0; j < 8; ++j) {
        const __m512i a = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + j * 32)));
        const __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + j * 32 + 16)));
        const __m512 lo0 = _mm512_fmadd_ps(d0, _mm512_cvtepi32_ps(_mm512_and_si512(a, nibble)), m0);
        const __m512 lo1 = _mm512_fmadd_ps(d1, _mm512_cvtepi32_ps(_mm512_and_si512(c, nibble)), m1);
        _mm512_storeu_si512(col + (b * 16 + j) * T * 2, (__m512i)_mm512_cvtne2ps_pbh(lo1, lo0));
        const __m512 hi0 = _mm512_fmadd_ps(d0, _mm512_cvtepi32_ps(_mm512_srli_epi32(a, 4)), m0);
        const __m512 hi1 = _mm512_fmadd_ps(d1, _mm512_cvtepi32_ps(_mm512_srli_epi32(c, 4)), m1);
        _mm512_storeu_si512(col + (b * 16 + 8 + j) * T * 2, (__m512i)_mm512_cvtne2ps_pbh(hi1, hi0));
      }
    }
  }
}

// A plain bf16 weight's rows [n0, n0 + rows) -> B's columns 0 ..: B's pair p of column n is W's
// pair p of row n0 + n, a 32-bit transpose, done 16 rows x 16 pairs at a time in registers.
inline void transpose16(__m512i* r) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {  // chunk L: rows 2i, 2i+1 at columns 4L, 4L+1 | 4L+2, 4L+3
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // u[4i + c] chunk L: rows 4i .. 4i+3 at column 4L + c
    u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int c = 0; c < 4; ++c) {  // column 4L + c: chunk L of u[c], u[4 + c], u[8 + c], u[12 + c]
    const __m512i x0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44), x1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xEE);
    const __m512i y0 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44), y1 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xEE);
    r[c] = _mm512_shuffle_i32x4(x0, y0, 0x88);
    r[4 + c] = _mm512_shuffle_i32x4(x0, y0, 0xDD);
    r[8 + c] = _mm512_shuffle_i32x4(x1, y1, 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(x1, y1, 0xDD);
  }
}

void fill_bf16_vnni(const bf16* w, int64_t k, int64_t n0, int64_t rows, bf16* B, int64_t T) {
  const int64_t pairs = k / 2;
  const uint32_t* src = reinterpret_cast<const uint32_t*>(w) + n0 * pairs;
  uint32_t* dst = reinterpret_cast<uint32_t*>(B);
  int64_t n = 0;
  for (; n + 16 <= rows; n += 16) {
    int64_t p = 0;
    for (; p + 16 <= pairs; p += 16) {
      __m512i r[16];
      for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(src + (n + i) * pairs + p);
      transpose16(r);
      for (int j = 0; j < 16; ++j) _mm512_storeu_si512(dst + (p + j) * T + n, r[j]);
    }
    for (; p < pairs; ++p)
      for (int i = 0; i < 16; ++i) dst[p * T + n + i] = src[(n + i) * pairs + p];
  }
  for (; n < rows; ++n)
    for (int64_t p = 0; p < pairs; ++p) dst[p * T + n] = src[n * pairs + p];
}

// A tile written row by row (W [cols, K], the 8-bit and lane-order forms): y[m, n] = the dot
// product of x's row m with W's row n, 32 pairs of K per vdpbf16ps into 16 lanes, the lanes summed
// at the end. MR rows of x and NR rows of W at a time: NR loads of W are shared by MR rows.
template <int MR, int NR>
void rows_kernel(const bf16* x, int64_t k, const bf16* w, bf16* y, int64_t ldy, int live) {
  __m512 acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) acc[m][n] = _mm512_setzero_ps();
  for (int64_t i = 0; i < k; i += 32) {
    __m512bh wv[NR];
    for (int n = 0; n < NR; ++n) wv[n] = (__m512bh)_mm512_loadu_si512(w + n * k + i);
    for (int m = 0; m < MR; ++m) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + m * k + i);
      for (int n = 0; n < NR; ++n) acc[m][n] = _mm512_dpbf16_ps(acc[m][n], xv, wv[n]);
    }
  }
  static_assert(NR == 4, "the lane sums below take 4 accumulators at a time");
  for (int m = 0; m < MR; ++m) {
    // the 16 lanes of acc[m][0..3] summed 4 at a time: a few shuffles for all four, in one order
    const __m512 u01 = _mm512_add_ps(_mm512_unpacklo_ps(acc[m][0], acc[m][1]), _mm512_unpackhi_ps(acc[m][0], acc[m][1]));
    const __m512 u23 = _mm512_add_ps(_mm512_unpacklo_ps(acc[m][2], acc[m][3]), _mm512_unpackhi_ps(acc[m][2], acc[m][3]));
    const __m512 r = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(u01), _mm512_castps_pd(u23))),
                                   _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(u01), _mm512_castps_pd(u23))));
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(r), _mm512_extractf32x8_ps(r, 1));
    const __m128 sums = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));  // rows n .. n + 3
    const __m128i packed = (__m128i)_mm_cvtneps_pbh(sums);
    _mm_mask_storeu_epi16(y + m * ldy, static_cast<__mmask8>((1u << live) - 1), packed);
  }
}

template <int MR>
void rows_product_of(const bf16* x, int64_t k, const bf16* w, int64_t cols, bf16* y, int64_t ldy) {
  int64_t n0 = 0;
  for (; n0 + 4 <= cols; n0 += 4) rows_kernel<MR, 4>(x, k, w + n0 * k, y + n0, ldy, 4);
  if (n0 < cols) rows_kernel<MR, 4>(x, k, w + n0 * k, y + n0, ldy, static_cast<int>(cols - n0));  // spare rows unused
}

// y [M, cols] (row stride ldy) = x [M, K] times W [cols, K] (read up to 3 rows past cols)
void rows_product(const bf16* x, int64_t m_rows, int64_t k, const bf16* w, int64_t cols, bf16* y, int64_t ldy) {
  for (int64_t m0 = 0; m0 < m_rows; m0 += kKernelRows) {
    const bf16* xm = x + m0 * k;
    bf16* ym = y + m0 * ldy;
    switch (std::min<int64_t>(kKernelRows, m_rows - m0)) {
      case 1: rows_product_of<1>(xm, k, w, cols, ym, ldy); break;
      case 2: rows_product_of<2>(xm, k, w, cols, ym, ldy); break;
      case 3: rows_product_of<3>(xm, k, w, cols, ym, ldy); break;
      case 4: rows_product_of<4>(xm, k, w, cols, ym, ldy); break;
      case 5: rows_product_of<5>(xm, k, w, cols, ym, ldy); break;
      default: rows_product_of<6>(xm, k, w, cols, ym, ldy);
    }
  }
}
#endif

// ---- the tiled product ------------------------------------------------------------------------

// the row forms' fill_vnni: never called (they are written row by row)
const auto no_vnni = [](int64_t, int64_t, bf16*, int64_t) {};

int64_t tile_rows(int64_t k, int64_t element_size) {
  const int64_t rows = kTileBytes / (k * element_size) / kQ4Rows * kQ4Rows;
  return std::clamp(rows, kMinTileRows, kMaxTileRows);
}

// Whether a bf16 x of `rows` rows takes the dot-product tiles: everywhere they are built, except
// where oneDNN has AMX, whose tiles outrun them by several times once a tile's repacking is spread
// over enough rows (a threshold not measured: no AMX machine at hand when this was written).
bool vnni_tiles(int64_t rows) {
#if defined(ASYNCLLM_VNNI_TILES) && defined(__AMX_BF16__)
  return rows < 64;
#elif defined(ASYNCLLM_VNNI_TILES)
  (void)rows;
  return true;
#else
  (void)rows;
  return false;
#endif
}

// y [M, n_out] = x @ W.T, W's rows [n0, n0 + rows) written per tile by fill(n0, rows, buffer) in
// x's dtype: W.T [K, tile] (`transposed`, the 4-bit tiles) or W [tile, K] (row by row), for at::mm.
// A bf16 x takes our dot-product kernels where they are built (vnni_tiles): the 4-bit tiles written
// as VNNI pairs by fill_vnni(n0, rows, B, T), the row forms as they are (rows_product).
// Tiles start at multiples of 16 (whole 4-bit tiles).
template <typename Fill, typename FillVnni>
torch::Tensor tiled_product(const torch::Tensor& x, int64_t n_out, bool transposed, const Fill& fill,
                            const FillVnni& fill_vnni) {
  const int64_t k = x.size(1), m_rows = x.size(0), threads = at::get_num_threads();
  // tiles of at most tile_rows, as many as a multiple of the threads, so each thread takes an equal
  // share (576 rows in tiles of 512 left one of two threads with 64)
  const int64_t most = tile_rows(k, x.element_size());
  int64_t tiles = (n_out + most - 1) / most;
  tiles = (tiles + threads - 1) / threads * threads;
  const int64_t tile = ((n_out + tiles - 1) / tiles + kQ4Rows - 1) / kQ4Rows * kQ4Rows;
  tiles = (n_out + tile - 1) / tile;
  auto y = torch::empty({m_rows, n_out}, x.options());
  const bool ours = x.scalar_type() == torch::kBFloat16 && vnni_tiles(m_rows);
  const bool inference = c10::InferenceMode::is_enabled();  // y may be an inference tensor
  at::parallel_for(0, tiles, 1, [&](int64_t a, int64_t b) {
    const c10::InferenceMode same_mode(inference);  // OpenMP's workers do not inherit the caller's
    // row forms: 4 spare rows, so the kernel's last group of 4 rows stays inside the buffer
    torch::Tensor buffer = transposed ? torch::empty({k, tile}, x.options()) : torch::zeros({tile + 4, k}, x.options());
    for (int64_t i = a; i < b; ++i) {
      const int64_t n0 = i * tile, rows = std::min(tile, n_out - n0);
#if defined(ASYNCLLM_VNNI_TILES)
      if (ours) {
        bf16* out = y.data_ptr<bf16>() + n0;
        if (transposed) {
          fill_vnni(n0, rows, buffer.data_ptr<bf16>(), tile);
          asyncllm::vnni::product(x.data_ptr<bf16>(), m_rows, k, buffer.data_ptr<bf16>(), tile, rows, out, n_out);
        } else {
          fill(n0, rows, buffer);
          rows_product(x.data_ptr<bf16>(), m_rows, k, buffer.data_ptr<bf16>(), rows, out, n_out);
        }
        continue;
      }
#endif
      fill(n0, rows, buffer);
      const torch::Tensor w = transposed ? buffer.narrow(1, 0, rows) : buffer.narrow(0, 0, rows).t();
      y.narrow(1, n0, rows).copy_(at::mm(x, w));
    }
  });
  return y;
}

void check_x(const torch::Tensor& x, int64_t k, const char* op) {
  TORCH_CHECK(x.device().is_cpu() && (x.scalar_type() == torch::kBFloat16 || x.scalar_type() == torch::kFloat),
              op, ": x must be bf16 or fp32 on the CPU");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) == k && x.size(0) >= 1, op, ": x must be contiguous [M, K]");
}

void check_q4(const torch::Tensor& codes, const torch::Tensor& scales, const torch::Tensor& offsets, int64_t n_out) {
  TORCH_CHECK(codes.scalar_type() == torch::kUInt8 && codes.is_contiguous() && codes.dim() == 4 &&
                  codes.size(2) == 8 && codes.size(3) == 32, "4-bit tiles: codes uint8 [T, K/32, 8, 32]");
  const int64_t tiles = codes.size(0), nb = codes.size(1);
  TORCH_CHECK(n_out > (tiles - 1) * kQ4Rows && n_out <= tiles * kQ4Rows, "4-bit tiles: n_out must fill the last tile");
  TORCH_CHECK(scales.is_contiguous() && offsets.is_contiguous() && offsets.scalar_type() == torch::kHalf,
              "4-bit tiles: contiguous scales, fp16 offsets");
  if (scales.scalar_type() == torch::kByte) {
    TORCH_CHECK(nb % 8 == 0 && scales.numel() == tiles * nb * 2 * kQ4Rows &&
                    offsets.numel() == tiles * nb / 8 * 2 * kQ4Rows,
                "4-bit tiles: K-form sc|m uint8 [T, K/32, 2, 16], d|dmin fp16 [T, K/256, 2, 16]");
  } else {
    TORCH_CHECK(scales.scalar_type() == torch::kHalf && scales.numel() == tiles * nb * kQ4Rows &&
                    offsets.numel() == tiles * nb * kQ4Rows, "4-bit tiles: fp16 scales and offsets [T, K/32, 16]");
  }
}

asyncllm::q4_scales::Factors k_factors(const torch::Tensor& scales, const torch::Tensor& offsets) {
  return {scales.data_ptr<uint8_t>(), offsets.data_ptr<at::Half>(), scales.size(1)};
}

asyncllm::q4_scales::Half half_scales(const torch::Tensor& scales, const torch::Tensor& offsets) {
  return {scales.data_ptr<at::Half>(), offsets.data_ptr<at::Half>(), scales.size(1)};
}

template <typename S>
torch::Tensor q4_product(const torch::Tensor& x, const uint8_t* codes, const S& sc, int64_t nb, int64_t n_out) {
  auto fill = [&](int64_t n0, int64_t rows, torch::Tensor& buffer) {
    const int64_t t0 = n0 / kQ4Rows, t1 = (n0 + rows + kQ4Rows - 1) / kQ4Rows, ld = buffer.size(1);
    if (buffer.scalar_type() == torch::kFloat)
      fill_q4(codes, sc, nb, t0, t1, buffer.data_ptr<float>(), ld);
    else
      fill_q4(codes, sc, nb, t0, t1, buffer.data_ptr<bf16>(), ld);
  };
  auto fill_vnni = [&](int64_t n0, int64_t rows, bf16* B, int64_t T) {
#if defined(ASYNCLLM_VNNI_TILES)
    fill_q4_vnni(codes, sc, nb, n0 / kQ4Rows, (n0 + rows + kQ4Rows - 1) / kQ4Rows, B, T);
#else
    (void)n0, (void)rows, (void)B, (void)T;
#endif
  };
  return tiled_product(x, n_out, true, fill, fill_vnni);
}

Q8Scales q8_scales(const torch::Tensor& codes, const torch::Tensor& scales, const std::optional<torch::Tensor>& supers,
                   int64_t k, const char* op) {
  const int64_t n = codes.size(0);
  TORCH_CHECK(scales.is_contiguous() && scales.size(0) == n, op, ": scales must be contiguous, one row per output row");
  Q8Scales sc{Q8Scales::kHalf, scales.data_ptr(), nullptr, k};
  if (scales.scalar_type() == torch::kHalf) {
    TORCH_CHECK(!supers.has_value() && k % kBlock == 0 && scales.numel() == n * (k / kBlock), op,
                ": Q8_0 scales fp16 [N, K/32], no supers");
    return sc;
  }
  TORCH_CHECK(supers.has_value() && supers->scalar_type() == torch::kFloat && supers->is_contiguous() &&
                  k % kGroup == 0, op, ": K-form blocks take fp32 supers and K a multiple of 256");
  sc.supers = supers->data_ptr<float>();
  if (scales.scalar_type() == torch::kChar) {
    TORCH_CHECK(scales.numel() == n * (k / 16) && supers->numel() == n * (k / kGroup), op,
                ": Q6_K scales int8 [N, K/16], d [N, K/256]");
    sc.kind = Q8Scales::kQ6;
  } else {
    TORCH_CHECK(scales.scalar_type() == torch::kByte && scales.numel() == n * 2 * (k / kBlock) &&
                    supers->numel() == n * 2 * (k / kGroup), op, ": Q5_K scales uint8 [N, 2, K/32], supers [N, 2, K/256]");
    sc.kind = Q8Scales::kQ5;
  }
  return sc;
}

// The lane order's K from its scales (as q8.py's Q8Weight.in_features) and its kind.
int64_t lanes_k(const torch::Tensor& scales) {
  return scales.scalar_type() == torch::kChar ? scales.size(-1) * 16 : scales.size(-1) * kBlock;
}

// x's columns in the lane order of K (or, `inverse`, lane-order columns back in natural order)
torch::Tensor lane_permutation(const LaneKind& kind, int64_t k, bool inverse) {
  std::vector<int64_t> index(k);
  for (int64_t g = 0; g < k / kGroup; ++g)
    for (int64_t at = 0; at < kGroup; ++at) {
      const int64_t natural = g * kGroup + natural_index(kind, at), lane = g * kGroup + at;
      if (inverse)
        index[natural] = lane;
      else
        index[lane] = natural;
    }
  return torch::tensor(index, torch::kLong);
}

// An 8-bit weight as q8_blocks_gemv takes it: int8 codes [N, K] in natural order, or Q6_K's / Q5_K's
// uint8 codes in lane order (`lanes`: their kind).
struct Q8Form {
  Q8Scales scales;
  const LaneKind* lanes;
};

Q8Form q8_form(const torch::Tensor& codes, const torch::Tensor& scales, const std::optional<torch::Tensor>& supers) {
  TORCH_CHECK(codes.dim() == 2 && codes.is_contiguous(), "8-bit blocks: codes must be contiguous [N, ...]");
  if (codes.scalar_type() == torch::kChar) return {q8_scales(codes, scales, supers, codes.size(1), "8-bit blocks"), nullptr};
  TORCH_CHECK(codes.scalar_type() == torch::kByte && scales.scalar_type() != torch::kHalf,
              "8-bit blocks: codes int8 (natural order) or uint8 (Q6_K / Q5_K lane order)");
  const int64_t k = lanes_k(scales);
  const LaneKind* kind = &kLaneKinds[scales.scalar_type() == torch::kChar ? 0 : 1];
  TORCH_CHECK(k % kGroup == 0 && codes.size(1) == k / kGroup * kind->group_bytes(), "8-bit blocks: lane-order codes' width");
  return {q8_scales(codes, scales, supers, k, "8-bit blocks"), kind};
}

}  // namespace

// y [M, n_out] = x @ W.T for x bf16 or fp32 [M, K] (y of x's dtype), W in q4_pack's layout (fp16
// scales and offsets [T, K/32, 16]) or q4k_pack's K form (uint8 sc|m [T, K/32, 2, 16], fp16 d|dmin
// [T, K/256, 2, 16]), through dequantized tiles.
// y [M, N] = x @ W.T for x and a plain W [N, K] both bf16, where the dot-product tiles are built
// (and oneDNN has no AMX for this many rows): W's rows repacked per tile into the VNNI pairs the
// 4-bit tiles are written in. For weights with no prepacked oneDNN form (a MoE layer's experts,
// stacked and sliced per expert), whose `F.linear` repacks the whole weight on every call. Else
// at::linear.
torch::Tensor bf16_tiles_mm(torch::Tensor x, torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kBFloat16 && w.device().is_cpu(), "bf16_tiles_mm: w bf16 [N, K]");
  check_x(x, w.size(1), "bf16_tiles_mm");
#if defined(ASYNCLLM_VNNI_TILES)
  if (x.scalar_type() == torch::kBFloat16 && w.size(1) % 2 == 0 && vnni_tiles(x.size(0))) {
    const torch::Tensor wc = w.contiguous();
    const bf16* wp = wc.data_ptr<bf16>();
    const int64_t k = wc.size(1);
    auto fill_vnni = [&](int64_t n0, int64_t rows, bf16* B, int64_t T) { fill_bf16_vnni(wp, k, n0, rows, B, T); };
    auto unused = [](int64_t, int64_t, torch::Tensor&) {};  // the VNNI path is taken for every tile
    return tiled_product(x, wc.size(0), true, unused, fill_vnni);
  }
#endif
  return at::linear(x, w.to(x.scalar_type()));
}

torch::Tensor q4_tiles_mm(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, torch::Tensor offsets,
                          int64_t n_out) {
  check_q4(codes, scales, offsets, n_out);
  const int64_t nb = codes.size(1);
  check_x(x, nb * kBlock, "q4_tiles_mm");
  if (scales.scalar_type() == torch::kByte)
    return q4_product(x, codes.data_ptr<uint8_t>(), k_factors(scales, offsets), nb, n_out);
  return q4_product(x, codes.data_ptr<uint8_t>(), half_scales(scales, offsets), nb, n_out);
}

// y [M, N] = x @ W.T for 8-bit blocks as q8_blocks_gemv takes them: int8 codes [N, K] in natural
// order (x bf16 or fp32) or Q6_K's / Q5_K's uint8 codes in lane order (x bf16), through
// dequantized tiles.
torch::Tensor q8_tiles_mm(torch::Tensor x, torch::Tensor codes, torch::Tensor scales,
                          std::optional<torch::Tensor> supers) {
  const Q8Form f = q8_form(codes, scales, supers);
  check_x(x, f.scales.k, "q8_tiles_mm");
  const int64_t n = codes.size(0);
  const int64_t k = f.scales.k;
  if (f.lanes == nullptr) {
    auto rows_bf16 = [&](int64_t n0, int64_t rows, bf16* w) { fill_q8(codes.data_ptr<int8_t>(), f.scales, n0, rows, w); };
    auto fill = [&](int64_t n0, int64_t rows, torch::Tensor& buffer) {
      if (buffer.scalar_type() == torch::kFloat)
        fill_q8(codes.data_ptr<int8_t>(), f.scales, n0, rows, buffer.data_ptr<float>());
      else
        rows_bf16(n0, rows, buffer.data_ptr<bf16>());
    };
    return tiled_product(x, n, false, fill, no_vnni);
  }
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16, "q8_tiles_mm: lane-order codes take a bf16 x");
  const torch::Tensor xp = x.index_select(1, lane_permutation(*f.lanes, k, false));
  auto rows_lanes = [&](int64_t n0, int64_t rows, bf16* w) {
    fill_lanes(codes.data_ptr<uint8_t>(), *f.lanes, f.scales, n0, rows, w);
  };
  auto fill = [&](int64_t n0, int64_t rows, torch::Tensor& buffer) { rows_lanes(n0, rows, buffer.data_ptr<bf16>()); };
  return tiled_product(xp, n, false, fill, no_vnni);
}

// W [N, K] itself (bf16 or fp32, `dtype`), for the forms above: their exact values rounded once,
// in natural order (a weight update or a test reads the weight back from its only form).
torch::Tensor quant_dequantize(torch::Tensor codes, torch::Tensor scales, std::optional<torch::Tensor> offsets,
                               int64_t n_out, torch::ScalarType dtype) {
  TORCH_CHECK(dtype == torch::kBFloat16 || dtype == torch::kFloat, "quant_dequantize: bf16 or fp32");
  const auto options = torch::TensorOptions().dtype(dtype);
  if (codes.dim() == 4) {  // 4-bit tiles, written as W.T
    TORCH_CHECK(offsets.has_value(), "quant_dequantize: 4-bit tiles need their offsets");
    check_q4(codes, scales, *offsets, n_out);
    const int64_t tiles = codes.size(0), nb = codes.size(1);
    torch::Tensor wt = torch::empty({nb * kBlock, tiles * kQ4Rows}, options);
    auto fill = [&](const auto& sc) {
      at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
        if (dtype == torch::kFloat)
          fill_q4(codes.data_ptr<uint8_t>(), sc, nb, t0, t1, wt.data_ptr<float>() + t0 * kQ4Rows, wt.size(1));
        else
          fill_q4(codes.data_ptr<uint8_t>(), sc, nb, t0, t1, wt.data_ptr<bf16>() + t0 * kQ4Rows, wt.size(1));
      });
    };
    if (scales.scalar_type() == torch::kByte)
      fill(k_factors(scales, *offsets));
    else
      fill(half_scales(scales, *offsets));
    return wt.narrow(1, 0, n_out).t().contiguous();
  }
  const Q8Form f = q8_form(codes, scales, offsets);
  const Q8Scales& sc = f.scales;
  const int64_t n = codes.size(0), k = sc.k;
  TORCH_CHECK(n_out == n, "quant_dequantize: n_out must be the codes' rows");
  TORCH_CHECK(f.lanes == nullptr || dtype == torch::kBFloat16, "quant_dequantize: lane-order codes are bf16 weights");
  torch::Tensor w = torch::empty({n, k}, options);
  if (f.lanes == nullptr) {
    at::parallel_for(0, n, 16, [&](int64_t n0, int64_t n1) {
      if (dtype == torch::kFloat)
        fill_q8(codes.data_ptr<int8_t>(), sc, n0, n1 - n0, w.data_ptr<float>() + n0 * k);
      else
        fill_q8(codes.data_ptr<int8_t>(), sc, n0, n1 - n0, w.data_ptr<bf16>() + n0 * k);
    });
    return w;
  }
  at::parallel_for(0, n, 16, [&](int64_t n0, int64_t n1) {
    fill_lanes(codes.data_ptr<uint8_t>(), *f.lanes, sc, n0, n1 - n0, w.data_ptr<bf16>() + n0 * k);
  });
  return w.index_select(1, lane_permutation(*f.lanes, k, true));
}
