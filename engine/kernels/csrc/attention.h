// Shared by the CPU attention kernels: block sizes, prefetch, and the AVX512-BF16 kernels' entry
// points (cpu_attention_bf16.cpp), which the generic entry points (cpu_attention.cpp) try first.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>

#include "vec.h"

namespace asyncllm {

constexpr int kBlock = 16;  // tokens scored together: one vector of scores per query head
constexpr int kPrefetch = 4;  // blocks of rows requested ahead of use

// Software prefetch into L2 (prefetcht2), not L1: the rows are scattered (decoded tokens of a
// request sit a batch apart in the pool), and with L1 prefetches the bf16 decode kernel ran 15%
// slower than with none on this 2-core EPYC, while L2 prefetches 4 blocks ahead made it 17% faster.
inline void prefetch_l2(const void* p) { __builtin_prefetch(p, 0, 1); }

// Decode/extend in bf16 with vdpbf16ps; false when this build has no AVX512-BF16 or D is not
// 64/128/256 (the caller then runs the fp32-FMA kernels). Arguments are already validated. Decode:
// R slot rows, qstart [R + 1] (row r's queries qstart[r] .. qstart[r + 1]; 0, 1, .., R for one
// each). cap > 0: every scaled score soft-capped (Gemma 2), cap * tanh(score / cap). Extend,
// window > 0: a query at position p sees keys p - window + 1 .. p only (a sliding-window layer).
bool decode_attention_bf16dot(int64_t D, const c10::BFloat16* q, const c10::BFloat16* kb, const c10::BFloat16* vb,
                              const int64_t* slots, const int64_t* lens, const int64_t* qstart, c10::BFloat16* out,
                              float* lse, int64_t R, int64_t H, int64_t KVH, int64_t max_len, float scale, float cap);
bool extend_attention_bf16dot(int64_t D, const c10::BFloat16* q, const c10::BFloat16* kb, const c10::BFloat16* vb,
                              const int64_t* slots, int64_t L, const int64_t* prefix, const int64_t* ext,
                              const int64_t* qstart, int64_t R, c10::BFloat16* out, int64_t H, int64_t KVH,
                              float scale, float cap, int64_t window);
// Whether this build has the vdpbf16ps kernels: a bf16 decode with several queries per slot row
// then reads the row's K/V once for all of them (the fp32-FMA kernels repeat the row per query).
bool attention_bf16dot_built();

}  // namespace asyncllm
