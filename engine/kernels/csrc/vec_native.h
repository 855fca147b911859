// fp32 vectors of the machine's own width (GCC vector extensions): 16 lanes with AVX-512, 8 with
// AVX2. vec.h's 16-lane vectors are two registers each on AVX2, and GCC kept arrays of them in
// memory between operations there (the attention kernels' inner loops were mostly stack loads and
// stores); kernels whose inner loops hold several vectors at once use these instead.
#pragma once

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>
#include <utility>

#include "vec.h"

namespace asyncllm::native {

#if defined(__AVX512F__)
constexpr int kWidth = 16;
#else
constexpr int kWidth = 8;
#endif
typedef float vf __attribute__((vector_size(4 * kWidth)));
typedef int32_t vi __attribute__((vector_size(4 * kWidth)));
typedef uint32_t vu __attribute__((vector_size(4 * kWidth)));
typedef uint16_t vh __attribute__((vector_size(2 * kWidth)));

inline vf load(const float* p) { return load_floats<vf>(p); }
inline vf load(const c10::BFloat16* p) { return load_floats<vf, vu, vh>(p); }

inline vf broadcast(float x) {
#if defined(__AVX512F__)
  return (vf)_mm512_set1_ps(x);
#elif defined(__AVX__)
  return (vf)_mm256_set1_ps(x);
#else
  vf v;
  for (int i = 0; i < kWidth; ++i) v[i] = x;
  return v;
#endif
}

// a * b + c rounded once, written out: a file compiled without implicit contraction (its sums
// must not depend on which copy of a loop the compiler ran) still gets its fused multiply-adds.
inline vf fmadd(vf a, vf b, vf c) {
#if defined(__AVX512F__)
  return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__)
  return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
  return a * b + c;
#endif
}

template <size_t... I>
inline vf pair_sums_of(vf a, vf b, std::index_sequence<I...>) {
  return __builtin_shufflevector(a, b, (2 * I)...) + __builtin_shufflevector(a, b, (2 * I + 1)...);
}

// Lanes 0 .. kWidth/2 get a's adjacent pair sums, the rest b's: log2(kWidth) rounds of it over
// kWidth vectors leave vector t's lane sum in lane t.
inline vf pair_sums(vf a, vf b) { return pair_sums_of(a, b, std::make_index_sequence<kWidth>{}); }

// Horizontal sum and max, lane 0 first (a fixed order).
inline float hsum(vf v) {
  float s = v[0];
  for (int i = 1; i < kWidth; ++i) s += v[i];
  return s;
}

inline float hmax(vf v) {
  float m = v[0];
  for (int i = 1; i < kWidth; ++i) m = v[i] > m ? v[i] : m;
  return m;
}

inline vi lanes_below(int n) {
  vi idx;
  for (int i = 0; i < kWidth; ++i) idx[i] = i;
  return idx < n;
}

inline vf exp_nonpos(vf x) { return exp_nonpos_of<vf, vi>(x); }
inline vf softcap(vf s, float cap) { return softcap_of<vf, vi>(s, cap); }

}  // namespace asyncllm::native
