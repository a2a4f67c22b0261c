// The ops on tensors that Python calls one at a time: dense and selective attention,
// A2ATS sparse attention over one cache layer, and the few-row int8 and int4 linears.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <tuple>
#include <vector>

#include "a2ats_plan.h"

namespace ragkv {

// q [B, Hq, D]; keys[b], values[b] [Hkv, capacity_b, D]; request b attends to its first
// lengths[b] rows. Returns [B, Hq, D] float32.
at::Tensor decode_attention_op(const at::Tensor& q, const std::vector<at::Tensor>& keys,
                               const std::vector<at::Tensor>& values, const std::vector<int64_t>& lengths,
                               double scale);

// q [N, Hq, D]; keys/values one cache layer [Hkv, rows, D]; query row i attends to the
// first limits[i] rows. Returns [N, Hq, D] float32.
at::Tensor selective_attention_op(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                                  const std::vector<int64_t>& limits, double scale);

// q [Hq, N, D] rows sorted by `positions`; keys/values one cache layer [Hkv, rows, D]; row
// i attends to cache rows [0, positions[i]], in blocks of torch's flash kernel. Returns
// [Hq, N, D] in q's dtype.
at::Tensor flash_blocks_op(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                           const std::vector<int64_t>& positions, double scale, int64_t block_rows);

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
// The same in bfloat16 dot products (bf16_flash.h): q, keys, values bfloat16, head_dim a
// multiple of 64. Only where the compiler targets AVX512-BF16.
at::Tensor bf16_flash_op(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                         const std::vector<int64_t>& positions, double scale);
#endif

// q [Hq, D] over one cache layer keys/values [Hkv, capacity, D] of `length` rows with the
// A2ATS state of `layer`. Returns (out [Hq, D] float32, chosen rows [Hkv, k] int64, ascending).
std::tuple<at::Tensor, at::Tensor> a2ats_attention_op(const at::Tensor& q, const at::Tensor& keys,
                                                      const at::Tensor& values, int64_t length, const A2atsPlan& plan,
                                                      int64_t layer, double scale);

// x [rows, in] float32 @ (weight [out, in] int8 * scales [out] bf16)^T -> [rows, out] float32.
at::Tensor int8_linear_op(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales);

// x [rows, in] float32 @ int4 rows weight [out, int4_row_bytes(in)] uint8 (int4_linear.h) -> [rows, out] float32.
at::Tensor int4_linear_op(const at::Tensor& x, const at::Tensor& weight, int64_t in);

}  // namespace ragkv
