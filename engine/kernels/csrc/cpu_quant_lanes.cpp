// Q6_K and Q5_K blocks for bf16 activations: y = x @ W.T with AVX512-BF16 dot products, x bf16
// [M, K] with M a handful of rows, W's codes in "lane order" at the file's 6 or 5 bits a weight.
//
// Why: the fp32 loops (cpu_quant_gemv_f32.cpp) widen every code to fp32 and spend two conversions,
// a multiply and two FMAs on each 32 weights, so a bf16 decode step of a Q4_K_M file (Q6_K head,
// half the v and down projections) was compute-bound in them: ~13 GB/s on a core with one row of
// x, 3.5 GB/s with eight. Here a code becomes a bf16 number by an OR (as the 4-bit loops do:
// 0x4300 | u is the bf16 128 + u, exact for u < 128) and one vdpbf16ps multiplies 32 of them by
// 32 consecutive x values. (Q8_0's 8-bit codes do not fit: as two nibbles they took two dot
// products per 32 weights, which on a Zen 4 core, where a 512-bit vdpbf16ps issues every other
// cycle, was no faster than the fp32 loop with one row of x and slower with eight. Q8_0 keeps the
// fp32 loop, a bf16 x widened.)
//
// Lane order: a dot product sums pairs into 16 fp32 lanes, and each block of weights has its own
// scale. So each 256 weights (16 of Q6_K's 16-weight blocks, 8 of Q5_K's 32) give each block
// 16 / B lanes (L): vector j (of 8) holds, in lane b * L + i, pair j * L + i of block b. Every lane
// then sums weights of one block only, through the 8 vectors in one chain, and one FMA applies
// the 16 lanes' scales. x is put in the same order once per call.
//
// Codes are stored unsigned (`group_bytes`: low nibbles, then the high bits), u = q + bias with
// bias 32 (Q6_K, 0..63) or 0 (Q5_K, 0..31); a few shifts and two ternary-logic ops per vector put
// u | 0x4300 in 16-bit lanes. (Held at 8 bits, the fp32 loops' int8, Q6_K read 31% more bytes than
// the file holds, which a single stream pays in full.) sum((128 + u) x) over a lane is its dot
// product plus (128 + bias) times its sum of x, S: each chain starts from -(128 + bias) * S (summed
// with x's reordering) and ends as sum(q x). Q5_K's offsets (-dmin m per 32 weights) meet S in a
// second FMA.
//
// Arithmetic: products exact, sums in fp32 in the chain's order, the result rounded to bf16
// once. The chain starts at -(128 + bias) * S, so its fp32 steps round at a few times the result's scale:
// units of 2^-22 of it, far below the output's bf16 step (2^-8). Every row's result is a function
// of its own x row (no row count, position or thread split changes it), which deterministic
// inference relies on.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define ASYNCLLM_LANES 1
#endif

using bf16 = c10::BFloat16;

namespace {

constexpr int kLanes = 16;     // fp32 lanes of a dot product; each sums one block's pairs
constexpr int kVec = 32;       // bf16 weights per vector
constexpr int kGroup = 256;    // weights per group: one superblock (its d, and dmin)
constexpr int kVectors = kGroup / kVec;
constexpr int kMaxRows = 8;    // rows of x per pass over a task's weights
constexpr int64_t kPrefetchBytes = 8192;  // as cpu_quant_gemv.cpp: a cold read's stride ahead

enum Kind { kQ6 = 0, kQ5 = 1 };

struct KindInfo {
  int block;    // weights per scale
  int bias;     // u - q
  int hi_bits;  // u's bits above its low nibble
};
constexpr KindInfo kInfo[2] = {{16, 32, 2}, {32, 0, 1}};

// Bytes of a group's codes: its 256 low nibbles (128 bytes: vector j's lane pair i in byte
// 32 (j / 2) + i, low half for even j), then the high bits (32 bytes per 8 / hi_bits vectors:
// vector j's in byte 32 (j / per) + i at bit (j % per) * hi_bits), so 6 (Q6_K) or 5 (Q5_K) bits a
// weight as in the file, and a vector's codes come from two 32-byte loads shared with its neighbours.
constexpr int group_bytes(int kind) { return kGroup / 2 + kVec * kInfo[kind].hi_bits; }

// Code u at lane-order position `at` of the group at gp.
inline int code_at(const uint8_t* gp, int hi_bits, int at) {
  const int j = at / kVec, i = at % kVec, per = 8 / hi_bits;
  const int lo = (gp[kVec * (j / 2) + i] >> (4 * (j % 2))) & 0xF;
  const int hi = (gp[kGroup / 2 + kVec * (j / per) + i] >> ((j % per) * hi_bits)) & ((1 << hi_bits) - 1);
  return lo | hi << 4;
}

// f(position in lane order, natural position) for each weight of a group, both from its start.
template <class F>
void for_each_lane(int block, F&& f) {
  const int per = kLanes / (kGroup / block);
  for (int j = 0; j < kVectors; ++j)
    for (int l = 0; l < kLanes; ++l)
      for (int e = 0; e < 2; ++e) f(kVec * j + 2 * l + e, (l / per) * block + 2 * (j * per + l % per) + e);
}

// x in lane order and each group's lane sums S, per row.
struct LaneX {
  std::vector<bf16> x;
  std::vector<float> sums;  // [rows, groups, 16]
};

LaneX lane_x(const bf16* x, int64_t rows, int64_t k, int block) {
  const int64_t groups = k / kGroup;
  LaneX lx;
  lx.x.resize(rows * k);
  lx.sums.assign(rows * groups * kLanes, 0.0f);
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t g = 0; g < groups; ++g) {
      float* s = lx.sums.data() + (m * groups + g) * kLanes;
      const int64_t w0 = m * k + g * kGroup;
      for_each_lane(block, [&](int at, int from) {
        lx.x[w0 + at] = x[w0 + from];
        s[(at % kVec) / 2] += static_cast<float>(x[w0 + from]);
      });
    }
  return lx;
}

// The two-level scales of output row n: Q6_K's int8 sc [N, K/16] and d [N, K/256]; Q5_K's uint8
// sc and m [N, 2, K/32] and d, dmin [N, 2, K/256].
struct RowScales {
  const void* scales;
  const float* supers;
  int64_t nb;  // blocks per row
};

// Lane l's scale (and Q5_K's offset) in output row n's group g.
template <int KIND>
void scalar_scales(const RowScales& rs, int64_t n, int64_t g, float* s, float* off) {
  constexpr int per = kLanes * kInfo[KIND].block / kGroup;
  const int64_t groups = rs.nb * kInfo[KIND].block / kGroup;
  for (int l = 0; l < kLanes; ++l) {
    const int64_t b = g * (kLanes / per) + l / per;
    if constexpr (KIND == kQ6) {
      s[l] = rs.supers[n * groups + g] * static_cast<const int8_t*>(rs.scales)[n * rs.nb + b];
    } else {
      const auto* sm = static_cast<const uint8_t*>(rs.scales) + n * 2 * rs.nb;
      const float* dd = rs.supers + n * 2 * groups;
      s[l] = dd[g] * sm[b];
      off[l] = -(dd[groups + g] * sm[rs.nb + b]);
    }
  }
}

// The tests' reference: each lane's sum of q x in plain fp32, scaled (and offset) per group, the
// lanes summed in order.
template <int KIND>
void rows_scalar(const LaneX& lx, int64_t m_rows, int64_t m0, int64_t k, const uint8_t* codes, const RowScales& rs,
                 bf16* y, int64_t n_total, int64_t n0, int64_t n1) {
  const int64_t groups = k / kGroup, gb = group_bytes(KIND);
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t m = 0; m < m_rows; ++m) {
      float acc[kLanes] = {};
      for (int64_t g = 0; g < groups; ++g) {
        float s[kLanes], off[kLanes], t[kLanes] = {};
        scalar_scales<KIND>(rs, n, g, s, off);
        for (int i = 0; i < kGroup; ++i) {
          const int u = code_at(codes + (n * groups + g) * gb, kInfo[KIND].hi_bits, i);
          const float q = static_cast<float>(u - kInfo[KIND].bias);
          t[(i % kVec) / 2] += q * static_cast<float>(lx.x[(m0 + m) * k + g * kGroup + i]);
        }
        const float* sum = lx.sums.data() + ((m0 + m) * groups + g) * kLanes;
        for (int l = 0; l < kLanes; ++l) {
          acc[l] += t[l] * s[l];
          if constexpr (KIND == kQ5) acc[l] += sum[l] * off[l];
        }
      }
      float total = 0.0f;
      for (int l = 0; l < kLanes; ++l) total += acc[l];
      y[m * n_total + n] = static_cast<bf16>(total);
    }
}

#ifdef ASYNCLLM_LANES
constexpr bool kVectorized = true;

inline __m512bh as_bh(__m512i v) { return (__m512bh)v; }

// The 16 lanes' scales (and Q5_K's offsets) of output row n's group g.
template <int KIND>
inline void vector_scales(const RowScales& rs, int64_t n, int64_t g, __m512* s, __m512* off) {
  const int64_t groups = rs.nb * kInfo[KIND].block / kGroup;
  if constexpr (KIND == kQ6) {  // 16 blocks: one lane each
    const int8_t* p = static_cast<const int8_t*>(rs.scales) + n * rs.nb + g * kLanes;
    const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
    *s = _mm512_mul_ps(sc, _mm512_set1_ps(rs.supers[n * groups + g]));
  } else {  // 8 blocks: two lanes each
    const uint8_t* sm = static_cast<const uint8_t*>(rs.scales) + n * 2 * rs.nb + g * 8;
    const float* dd = rs.supers + n * 2 * groups + g;
    const __m512i pairs = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    const auto widen = [&](const uint8_t* p) {
      const __m512i v = _mm512_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
      return _mm512_cvtepi32_ps(_mm512_permutexvar_epi32(pairs, v));
    };
    *s = _mm512_mul_ps(widen(sm), _mm512_set1_ps(dd[0]));
    *off = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(widen(sm + rs.nb), _mm512_set1_ps(dd[groups])));
  }
}

// Output row n against x rows m0 .. m0 + M: each x row sums a group in one chain of dot products,
// the same in any batch. One output row at a time streams the codes in order (one row of x: ~15
// GB/s on a core, against ~11 GB/s from four rows' streams at once; two or four rows of x were no
// faster with two output rows sharing each x load).
template <int KIND, int M>
void lanes_row(const LaneX& lx, int64_t m0, int64_t k, const uint8_t* codes, const RowScales& rs, bf16* y,
               int64_t n_total, int64_t n) {
  constexpr int hb = kInfo[KIND].hi_bits, per = 8 / hb;
  const int64_t groups = k / kGroup;
  const __m512 chain = _mm512_set1_ps(-(128.0f + kInfo[KIND].bias));  // 0x4300 | u is 128 + u
  const __m512i ored = _mm512_set1_epi16(0x4300), lomask = _mm512_set1_epi16(0x000F);
  const __m512i himask = _mm512_set1_epi16(((1 << hb) - 1) << 4);
  __m512 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* gp = codes + (n * groups + g) * group_bytes(KIND);
    __m512 s, off, t[M], sum[M];
    vector_scales<KIND>(rs, n, g, &s, &off);
    for (int m = 0; m < M; ++m) {
      sum[m] = _mm512_loadu_ps(lx.sums.data() + ((m0 + m) * groups + g) * kLanes);
      t[m] = _mm512_mul_ps(chain, sum[m]);
    }
    __m512i lo_pair, hi_run;
#pragma GCC unroll 8
    for (int j = 0; j < kVectors; ++j) {
      if (j % 2 == 0) {
        if (j < 6) _mm_prefetch(reinterpret_cast<const char*>(gp + kVec * j + kPrefetchBytes), _MM_HINT_T0);
        lo_pair = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(gp + kVec * (j / 2))));
      }
      if (j % per == 0)
        hi_run = _mm512_cvtepu8_epi16(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(gp + kGroup / 2 + kVec * (j / per))));
      // 0x4300 | the low nibble, then the high bits moved to bit 4 OR-ed in (ternary logic (a & b) | c)
      const __m512i lo = j % 2 == 0 ? _mm512_ternarylogic_epi32(lo_pair, lomask, ored, 0xEA)
                                    : _mm512_or_si512(_mm512_srli_epi16(lo_pair, 4), ored);
      const int bit = (j % per) * hb;
      const __m512i hi = bit <= 4 ? _mm512_slli_epi16(hi_run, 4 - bit) : _mm512_srli_epi16(hi_run, bit - 4);
      const __m512i w = _mm512_ternarylogic_epi32(hi, himask, lo, 0xEA);
      for (int m = 0; m < M; ++m) {
        const __m512i xv = _mm512_loadu_si512(lx.x.data() + (m0 + m) * k + g * kGroup + kVec * j);
        t[m] = _mm512_dpbf16_ps(t[m], as_bh(xv), as_bh(w));
      }
    }
    for (int m = 0; m < M; ++m) {
      acc[m] = _mm512_fmadd_ps(t[m], s, acc[m]);
      if constexpr (KIND == kQ5) acc[m] = _mm512_fmadd_ps(sum[m], off, acc[m]);
    }
  }
  for (int m = 0; m < M; ++m) y[m * n_total + n] = static_cast<bf16>(_mm512_reduce_add_ps(acc[m]));
}

template <int KIND>
void lanes_rows(const LaneX& lx, int64_t m0, int64_t m_rows, int64_t k, const uint8_t* codes, const RowScales& rs,
                bf16* y, int64_t n_total, int64_t n0, int64_t n1) {
  switch (m_rows) {
#define LANES_CASE(M)                                                                   \
  case M:                                                                               \
    for (int64_t n = n0; n < n1; ++n) lanes_row<KIND, M>(lx, m0, k, codes, rs, y, n_total, n); \
    return;
    LANES_CASE(1) LANES_CASE(2) LANES_CASE(3) LANES_CASE(4) LANES_CASE(5) LANES_CASE(6) LANES_CASE(7) LANES_CASE(8)
#undef LANES_CASE
  }
}
#else
constexpr bool kVectorized = false;

template <int KIND>
void lanes_rows(const LaneX& lx, int64_t m0, int64_t m_rows, int64_t k, const uint8_t* codes, const RowScales& rs,
                bf16* y, int64_t n_total, int64_t n0, int64_t n1) {
  rows_scalar<KIND>(lx, m_rows, m0, k, codes, rs, y, n_total, n0, n1);
}
#endif

// The kind a form's scales name, after checking every tensor's dtype and shape; `k` its row width.
Kind check_form(const torch::Tensor& codes, const torch::Tensor& scales, const torch::Tensor& supers, int64_t* k) {
  TORCH_CHECK(codes.device().is_cpu() && codes.scalar_type() == torch::kByte && codes.is_contiguous() &&
                  codes.dim() == 2,
              "q8_lanes_gemv: codes uint8 [N, K / 256 groups' bytes] (q8_lanes_pack)");
  TORCH_CHECK(scales.is_contiguous() && supers.scalar_type() == torch::kFloat && supers.is_contiguous(),
              "q8_lanes_gemv: contiguous scales and fp32 d's");
  const int64_t n = codes.size(0);
  const Kind kind = scales.scalar_type() == torch::kChar ? kQ6 : kQ5;
  if (kind == kQ6) {
    *k = scales.dim() == 2 ? scales.size(1) * 16 : 0;
    TORCH_CHECK(*k % kGroup == 0 && scales.sizes() == torch::IntArrayRef({n, *k / 16}) &&
                    supers.sizes() == torch::IntArrayRef({n, *k / 256}),
                "q8_lanes_gemv: Q6_K takes int8 scales [N, K/16] and fp32 d [N, K/256], K a multiple of 256");
  } else {
    *k = scales.dim() == 3 ? scales.size(2) * 32 : 0;
    TORCH_CHECK(scales.scalar_type() == torch::kByte && *k % kGroup == 0 &&
                    scales.sizes() == torch::IntArrayRef({n, 2, *k / 32}) &&
                    supers.sizes() == torch::IntArrayRef({n, 2, *k / 256}),
                "q8_lanes_gemv: Q5_K takes uint8 sc and m [N, 2, K/32] and fp32 d and dmin [N, 2, K/256], K a "
                "multiple of 256");
  }
  TORCH_CHECK(*k > 0 && codes.size(1) == *k / kGroup * group_bytes(kind),
              "q8_lanes_gemv: codes of another width than the scales' K");
  return kind;
}

template <int KIND>
torch::Tensor lanes_gemv(const torch::Tensor& x, const torch::Tensor& codes, const RowScales& rs, int64_t k,
                         bool vectorized) {
  const int64_t n = codes.size(0), rows = x.size(0);
  const LaneX lx = lane_x(x.data_ptr<bf16>(), rows, k, kInfo[KIND].block);
  auto y = torch::empty({rows, n}, x.options());
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  bf16* yp = y.data_ptr<bf16>();
  // A task's output rows (~256 KB of codes) stay in L2 while each group of x rows passes over them.
  auto task = [&](int64_t n0, int64_t n1) {
    for (int64_t m0 = 0; m0 < rows; m0 += kMaxRows) {
      const int64_t m_rows = std::min<int64_t>(kMaxRows, rows - m0);
      if (vectorized && kVectorized)
        lanes_rows<KIND>(lx, m0, m_rows, k, cp, rs, yp + m0 * n, n, n0, n1);
      else
        rows_scalar<KIND>(lx, m_rows, m0, k, cp, rs, yp + m0 * n, n, n0, n1);
    }
  };
  at::parallel_for(0, n, std::max<int64_t>(1, (256 << 10) / codes.size(1)), task);
  return y;
}

torch::Tensor q8_lanes_gemv(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scales,
                            const torch::Tensor& supers, bool vectorized) {
  int64_t k = 0;
  const Kind kind = check_form(codes, scales, supers, &k);
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kBFloat16 && x.dim() == 2 && x.is_contiguous() &&
                  x.size(1) == k && x.size(0) >= 1,
              "q8_lanes_gemv: x must be contiguous bf16 [M, K] on the CPU, at least one row");
  if (kind == kQ6)
    return lanes_gemv<kQ6>(x, codes, RowScales{scales.data_ptr<int8_t>(), supers.data_ptr<float>(), k / 16}, k,
                           vectorized);
  return lanes_gemv<kQ5>(x, codes, RowScales{scales.data_ptr<uint8_t>(), supers.data_ptr<float>(), k / 32}, k,
                         vectorized);
}

}  // namespace

bool q8_lanes_vectorized() { return kVectorized; }

// int8 codes [N, K] of a kind (0 Q6_K: q - 32; 1 Q5_K: 0..31) -> the form the bf16 loops read:
// u = q + bias (0..63, 0..31) in lane order, each 256 at 6 or 5 bits (group_bytes) [N, K / 256 * bytes].
torch::Tensor q8_lanes_pack(torch::Tensor codes, int64_t kind) {
  TORCH_CHECK(kind == kQ6 || kind == kQ5, "q8_lanes_pack: kind 0 (Q6_K) or 1 (Q5_K)");
  const KindInfo& info = kInfo[kind];
  TORCH_CHECK(codes.scalar_type() == torch::kChar && codes.dim() == 2, "q8_lanes_pack: codes int8 [N, K]");
  const int64_t n = codes.size(0), k = codes.size(1);
  TORCH_CHECK(k % kGroup == 0, "q8_lanes_pack: K must be a multiple of 256");
  const torch::Tensor src = codes.contiguous();
  // u must stay below 128 for 0x4300 | u to be the bf16 128 + u
  const int64_t lo = src.min().item<int64_t>() + info.bias, hi = src.max().item<int64_t>() + info.bias;
  TORCH_CHECK(lo >= 0 && hi < (kind == kQ6 ? 64 : 32), "q8_lanes_pack: codes out of the kind's range");
  const int gb = group_bytes(kind), hb = info.hi_bits, per = 8 / hb;
  auto out = torch::zeros({n, k / kGroup * gb}, codes.options().dtype(torch::kByte));
  const int8_t* sp = src.data_ptr<int8_t>();
  uint8_t* op = out.data_ptr<uint8_t>();
  at::parallel_for(0, n, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t r = n0; r < n1; ++r)
      for (int64_t g = 0; g < k / kGroup; ++g) {
        uint8_t* gp = op + (r * (k / kGroup) + g) * gb;
        for_each_lane(info.block, [&](int at, int from) {
          const int u = sp[r * k + g * kGroup + from] + info.bias, j = at / kVec, i = at % kVec;
          gp[kVec * (j / 2) + i] |= static_cast<uint8_t>((u & 0xF) << (4 * (j % 2)));
          gp[kGroup / 2 + kVec * (j / per) + i] |= static_cast<uint8_t>((u >> 4) << ((j % per) * hb));
        });
      }
  });
  return out;
}

torch::Tensor q8_gemv_f32(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, bool vectorized);
torch::Tensor q6_gemv_f32(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, torch::Tensor supers,
                          bool vectorized);
torch::Tensor q5k_gemv_f32(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, torch::Tensor supers,
                           bool vectorized);

// Any 8-bit form, its kind named by the scales (fp16: Q8_0; int8: Q6_K; uint8: Q5_K): Q6_K and
// Q5_K codes in lane order (uint8; a bf16 x) here; natural order (int8 codes) through the fp32
// loops (a bf16 x widened, the result rounded to bf16 once).
torch::Tensor q8_blocks_gemv(torch::Tensor x, torch::Tensor codes, torch::Tensor scales,
                             std::optional<torch::Tensor> supers, bool vectorized) {
  if (codes.scalar_type() == torch::kByte) {
    TORCH_CHECK(supers.has_value(), "q8_blocks_gemv: lane-order codes are Q6_K's or Q5_K's, with their d's");
    return q8_lanes_gemv(x, codes, scales, *supers, vectorized);
  }
  if (!supers.has_value()) return q8_gemv_f32(x, codes, scales, vectorized);
  return scales.scalar_type() == torch::kByte ? q5k_gemv_f32(x, codes, scales, *supers, vectorized)
                                              : q6_gemv_f32(x, codes, scales, *supers, vectorized);
}
