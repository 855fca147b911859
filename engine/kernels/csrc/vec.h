// 16-lane fp32 vector helpers shared by the CPU kernels (GCC vector extensions: -march=native
// maps them to the machine's widest registers, AVX-512 here, without intrinsics).
#pragma once

#include <c10/util/BFloat16.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace asyncllm {

typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));

// A float vector F's lanes from p: fp32 values as they are, bf16 ones widened (bf16 is the top half
// of an fp32; U/H: the uint32/uint16 vectors of F's width). 16 lanes here, the machine's own width
// in vec_native.h.
template <typename F>
inline F load_floats(const float* p) {
  F v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

template <typename F, typename U, typename H>
inline F load_floats(const c10::BFloat16* p) {
  H h;
  std::memcpy(&h, p, sizeof(h));
  U u = __builtin_convertvector(h, U) << 16;
  F v;
  std::memcpy(&v, &u, sizeof(v));
  return v;
}

inline v16f load16(const float* p) { return load_floats<v16f>(p); }
inline v16f load16(const c10::BFloat16* p) { return load_floats<v16f, v16u, v16h>(p); }

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

// exp(x) for x <= 0 (scores minus their running max), lane by lane: 2^n * p(r) with x = n ln2 + r,
// |r| <= ln2/2, p a degree-6 Taylor polynomial (relative error < 2e-7). Below -87 it returns 0.
// F/I: a float vector type and the int32 vector of its width (16 lanes here, the machine's own
// width in vec_native.h).
template <typename F, typename I>
inline F exp_nonpos_of(F x) {
  const F lo = F{} - 87.0f;
  I dead = x < lo;
  x = x < lo ? lo : x;
  // n = round(x log2 e): x <= 0, so truncating (x log2 e - 0.5) toward zero rounds to nearest.
  F n = __builtin_convertvector(__builtin_convertvector(x * 1.44269504088896341f - 0.5f, I), F);
  F r = x - n * 0.693359375f + n * 2.12194440e-4f;
  F p = F{} + 1.0f / 720;
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  I bits = (__builtin_convertvector(n, I) + 127) << 23;
  F scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  F out = p * scale;
  return dead ? F{} : out;
}

inline v16f exp_nonpos(v16f x) { return exp_nonpos_of<v16f, v16i>(x); }

// tanh lane by lane: below 0.625 in magnitude an odd polynomial (Cephes' tanhf coefficients, no
// cancellation near 0), above it (1 - e) / (1 + e) with e = exp(-2|x|) <= 0.29 (+-1 from |x| ~ 44
// on, where e underflows); within a few ulp of tanhf.
template <typename F, typename I>
inline F tanh_of(F x) {
  const F ax = x < F{} ? -x : x;
  const F z = x * x;
  F p = F{} - 5.70498872745e-3f;
  p = p * z + 2.06390887954e-2f;
  p = p * z - 5.37397155531e-2f;
  p = p * z + 1.33314422036e-1f;
  p = p * z - 3.33332819422e-1f;
  const F small = x + x * z * p;
  const F e = exp_nonpos_of<F, I>(F{} - 2.0f * ax);
  F big = (1.0f - e) / (1.0f + e);
  big = x < F{} ? -big : big;
  return ax < F{} + 0.625f ? small : big;
}

// Gemma 2's attention-logit soft-cap, cap * tanh(s / cap) (transformers' order: divide, tanh,
// multiply).
template <typename F, typename I>
inline F softcap_of(F s, float cap) {
  return tanh_of<F, I>(s / (F{} + cap)) * cap;
}

inline v16f softcap(v16f s, float cap) { return softcap_of<v16f, v16i>(s, cap); }

// State of one query row (one token, one head) across key blocks: the online softmax.

inline v16i lanes_below(int64_t n) {
  return __builtin_convertvector(v16f{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, v16i) < static_cast<int>(n);
}

// Stores v as 16 values of T (bf16: round to nearest even, as torch rounds).
template <typename T>
inline void store16(const v16f& v, T* o) {
  for (int i = 0; i < 16; ++i) o[i] = static_cast<T>(v[i]);
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
template <>
inline void store16(const v16f& v, c10::BFloat16* o) {
  const __m256bh h = _mm512_cvtneps_pbh((__m512)v);  // round to nearest even, one instruction
  std::memcpy(o, &h, sizeof(h));
}
#else
// c10's round-to-nearest-even (NaN to the quiet NaN 0x7fc0) on all lanes at once: the per-lane
// conversion cost more than the arithmetic in loops that store often (cpu_lora.cpp's expand).
template <>
inline void store16(const v16f& v, c10::BFloat16* o) {
  v16u u;
  std::memcpy(&u, &v, sizeof(u));
  const v16u rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const v16u nan = (u & 0x7fffffffu) > 0x7f800000u;
  const v16h h = __builtin_convertvector(nan ? v16u{} + 0x7fc0u : rounded, v16h);
  std::memcpy(o, &h, sizeof(h));
}
#endif

}  // namespace asyncllm
