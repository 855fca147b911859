// Where the 4-bit tiles' per-block scale d and offset m come from, for row i of tile t, block b:
// q4_pack's fp16 arrays [T, K/32, 16] as stored, or q4k_pack's factors (llama.cpp's Q4_K: sc and
// m uint8 [T, K/32, 2, 16], d and dmin fp16 [T, K/256, 2, 16]; d = d256 * sc, m = -(dmin256 * m),
// both exact in fp32: an fp16 times a 6-bit integer). The bf16 loops (cpu_quant_gemv.cpp) and the
// fp32 ones (cpu_quant_gemv_f32.cpp) share these indices and plain-loop values and add their own
// vector loads on top, so both read one layout the same way.
#pragma once

#include <c10/util/Half.h>

#include <cstdint>

namespace asyncllm::q4_scales {

constexpr int64_t kRows = 16;  // rows per tile

struct Half {
  const c10::Half* s;
  const c10::Half* o;
  int64_t nb;
  int64_t at(int64_t t, int64_t b) const { return (t * nb + b) * kRows; }
  float scale1(int64_t t, int64_t b, int64_t i) const { return static_cast<float>(s[at(t, b) + i]); }
  float offset1(int64_t t, int64_t b, int64_t i) const { return static_cast<float>(o[at(t, b) + i]); }
};

struct Factors {
  static constexpr int64_t kPerSuper = 8;  // 32-weight blocks per d
  const uint8_t* sm;
  const c10::Half* dd;
  int64_t nb;
  // which: 0 the scale's factors (sc, d), 1 the offset's (m, dmin)
  int64_t small(int64_t t, int64_t b, int which) const { return ((t * nb + b) * 2 + which) * kRows; }
  int64_t super(int64_t t, int64_t b, int which) const {
    return ((t * (nb / kPerSuper) + b / kPerSuper) * 2 + which) * kRows;
  }
  float scale1(int64_t t, int64_t b, int64_t i) const {
    return static_cast<float>(dd[super(t, b, 0) + i]) * static_cast<float>(sm[small(t, b, 0) + i]);
  }
  float offset1(int64_t t, int64_t b, int64_t i) const {
    return -(static_cast<float>(dd[super(t, b, 1) + i]) * static_cast<float>(sm[small(t, b, 1) + i]));
  }
};

}  // namespace asyncllm::q4_scales
