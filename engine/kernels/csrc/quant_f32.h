// The 4-bit fp32 loops of cpu_quant_gemv_f32.cpp, for kernels that run many small products in one
// parallel region of their own (cpu_moe.cpp's 4-bit experts): the same sums, in the same order, as
// q4_gemv_f32, so a row's result does not depend on which kernel computed it.
#pragma once

#include <c10/util/Half.h>

#include <cstdint>

namespace asyncllm {

// sx[m * (k / 32) + b] = the sum of x's row m over its block b of 32 values, in order
void q4_block_sums_f32(const float* x, int64_t m_rows, int64_t k, float* sx);

// Tile t (output rows 16t .. 16t + 15, those below n_out) of a 4-bit weight in q4_pack's layout
// (codes, scales, offsets: the weight's whole arrays) against m_rows rows of x [m_rows, k] with
// their block sums: y[m * n_out + row] for those rows.
void q4_tile_rows_f32(const float* x, const float* sx, int64_t m_rows, int64_t k, const uint8_t* codes,
                      const c10::Half* scales, const c10::Half* offsets, float* y, int64_t n_out, int64_t t);

}  // namespace asyncllm
