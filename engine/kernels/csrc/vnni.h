// bf16 products on VNNI pairs (AVX512-BF16): the register-blocked kernel that both the dequantized
// tiles (cpu_quant_tiles.cpp) and the resident bf16 weights (cpu_vnni_linear.cpp) run.
//
// Layout: B [K/2][T][2] bf16, pair p of column n at (p T + n) 2, so one 512-bit vdpbf16ps
// multiplies 16 columns' pairs by a broadcast pair of x's row.
//
// Arithmetic: each output is one fp32 chain over every pair of K in order, plus the bias (if any)
// in fp32, rounded to bf16 once. Nothing depends on the row count, the kernel's row group, the
// column block or the thread: a row's result is the same bits whatever the batch around it.
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define ASYNCLLM_VNNI 1

namespace asyncllm::vnni {

using bf16 = c10::BFloat16;

constexpr int kKernelRows = 6;  // 6 x 4 accumulators, 4 weight vectors and a pair: 29 of 32 registers

// y[m, 16 nb + i] for MR rows of x and NB vectors of 16 columns; the last vector's columns masked
// by `last`; bias: NB * 16 values (masked alike) or null.
template <int MR, int NB>
inline void kernel(const bf16* x, int64_t k, const bf16* B, int64_t T, bf16* y, int64_t ldy, __mmask16 last,
                   const bf16* bias) {
  __m512 acc[MR][NB];
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NB; ++n) acc[m][n] = _mm512_setzero_ps();
  const int32_t* xp = reinterpret_cast<const int32_t*>(x);  // x's pairs
  for (int64_t p = 0; p < k / 2; ++p) {
    __m512bh w[NB];
    for (int n = 0; n < NB; ++n) w[n] = (__m512bh)_mm512_loadu_si512(B + (p * T + n * 16) * 2);
    for (int m = 0; m < MR; ++m) {
      const __m512bh pair = (__m512bh)_mm512_set1_epi32(xp[m * k / 2 + p]);
      for (int n = 0; n < NB; ++n) acc[m][n] = _mm512_dpbf16_ps(acc[m][n], pair, w[n]);
    }
  }
  for (int n = 0; n < NB; ++n) {
    const __mmask16 mask = n == NB - 1 ? last : 0xFFFF;
    if (bias != nullptr) {  // bf16 -> fp32 is a 16-bit shift
      const __m512 b = _mm512_castsi512_ps(
          _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, bias + n * 16)), 16));
      for (int m = 0; m < MR; ++m) acc[m][n] = _mm512_add_ps(acc[m][n], b);
    }
    for (int m = 0; m < MR; ++m)
      _mm256_mask_storeu_epi16(y + m * ldy + n * 16, mask, (__m256i)_mm512_cvtneps_pbh(acc[m][n]));
  }
}

// MR rows of x against B's first `cols` columns, 64 at a time
template <int MR>
inline void rows(const bf16* x, int64_t k, const bf16* B, int64_t T, int64_t cols, bf16* y, int64_t ldy,
                 const bf16* bias) {
  for (int64_t n0 = 0; n0 < cols; n0 += 64) {
    const int64_t live = std::min<int64_t>(64, cols - n0), vectors = (live + 15) / 16;
    const __mmask16 last = live % 16 ? static_cast<__mmask16>((1u << (live % 16)) - 1) : 0xFFFF;
    const bf16* b = B + n0 * 2;
    const bf16* bn = bias != nullptr ? bias + n0 : nullptr;
    switch (vectors) {
      case 1: kernel<MR, 1>(x, k, b, T, y + n0, ldy, last, bn); break;
      case 2: kernel<MR, 2>(x, k, b, T, y + n0, ldy, last, bn); break;
      case 3: kernel<MR, 3>(x, k, b, T, y + n0, ldy, last, bn); break;
      default: kernel<MR, 4>(x, k, b, T, y + n0, ldy, last, bn);
    }
  }
}

// 1 .. kKernelRows rows of x (one row group) against B's first `cols` columns
inline void group(const bf16* x, int64_t m_rows, int64_t k, const bf16* B, int64_t T, int64_t cols, bf16* y,
                  int64_t ldy, const bf16* bias) {
  switch (m_rows) {
    case 1: rows<1>(x, k, B, T, cols, y, ldy, bias); break;
    case 2: rows<2>(x, k, B, T, cols, y, ldy, bias); break;
    case 3: rows<3>(x, k, B, T, cols, y, ldy, bias); break;
    case 4: rows<4>(x, k, B, T, cols, y, ldy, bias); break;
    case 5: rows<5>(x, k, B, T, cols, y, ldy, bias); break;
    default: rows<6>(x, k, B, T, cols, y, ldy, bias);
  }
}

// y [M, cols] (row stride ldy) = x [M, K] times B's first `cols` columns (+ bias), kKernelRows
// rows of x at a time
inline void product(const bf16* x, int64_t m_rows, int64_t k, const bf16* B, int64_t T, int64_t cols, bf16* y,
                    int64_t ldy, const bf16* bias = nullptr) {
  for (int64_t m0 = 0; m0 < m_rows; m0 += kKernelRows)
    group(x + m0 * k, std::min<int64_t>(kKernelRows, m_rows - m0), k, B, T, cols, y + m0 * ldy, ldy, bias);
}

}  // namespace asyncllm::vnni

#endif
