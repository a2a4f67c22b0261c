// Selective attention as blocks of torch's CPU flash-attention kernel (ragkv/kernels/cpu_flash.py
// holds the method): a work item is one block of position-sorted rows and one KV head,
// claimed by the intra-op threads from one counter, most expensive first. Inside a parallel
// region the flash kernel runs on its thread alone, so a layer is one parallel region:
// a call per block from Python opens several, and with more busy threads than cores every
// region waits for a thread the scheduler took away.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "claimed_items.h"

namespace ragkv {

// q [Hq, N, D] with rows sorted by positions[i] (ascending); keys/values [Hkv, T, D], the
// same dtype, last dim contiguous. Returns [Hq, N, D] in q's dtype.
inline at::Tensor flash_blocks(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                               const std::vector<int64_t>& positions, double scale, int64_t block_rows) {
  const int64_t heads = q.size(0), n = q.size(1), dim = q.size(2), kv_heads = keys.size(0);
  const int64_t group = heads / kv_heads, blocks = (n + block_rows - 1) / block_rows;
  const at::Tensor q_contiguous = q.contiguous();
  at::Tensor out = at::empty({heads, n, dim}, q.options());
  const int64_t element = q.element_size();
  char* out_bytes = static_cast<char*>(out.data_ptr());
  for_each_claimed(blocks * kv_heads, [&](int64_t item) {
    c10::InferenceMode inference;  // the caller's mode does not follow it onto this thread
    // the last blocks see the most cache rows: claimed first, they leave no long tail
    const int64_t block = blocks - 1 - item / kv_heads, h = item % kv_heads;
    const int64_t start = block * block_rows, rows = std::min(block_rows, n - start);
    const int64_t first = positions[start], last = positions[start + rows - 1], span = last - first + 1;
    // [1, 1, group * rows, D]: query head h * group + g of row r is row g * rows + r
    const at::Tensor block_q =
        q_contiguous.slice(0, h * group, (h + 1) * group).slice(1, start, start + rows).reshape({1, 1, group * rows, dim});
    const at::Tensor head_keys = keys.select(0, h).unsqueeze(0).unsqueeze(0);
    const at::Tensor head_values = values.select(0, h).unsqueeze(0).unsqueeze(0);
    at::Tensor mask = at::zeros({group * rows, span}, q.options().dtype(at::kFloat));
    float* mask_data = mask.data_ptr<float>();
    for (int64_t g = 0; g < group; ++g)
      for (int64_t r = 0; r < rows; ++r)
        std::fill(mask_data + (g * rows + r) * span + (positions[start + r] - first + 1),
                  mask_data + (g * rows + r) * span + span, -std::numeric_limits<float>::infinity());
    auto [result, result_lse] = at::_scaled_dot_product_flash_attention_for_cpu(
        block_q, head_keys.slice(2, first, last + 1), head_values.slice(2, first, last + 1), 0.0, false,
        mask.to(q.scalar_type()).view({1, 1, group * rows, span}), scale);
    if (first > 0) {
      auto [before, before_lse] = at::_scaled_dot_product_flash_attention_for_cpu(
          block_q, head_keys.slice(2, 0, first), head_values.slice(2, 0, first), 0.0, false, std::nullopt, scale);
      // the share of each part in the softmax over both is sigmoid(lse difference)
      result = at::lerp(result.to(at::kFloat), before.to(at::kFloat), at::sigmoid(before_lse - result_lse).unsqueeze(-1));
    }
    const at::Tensor rows_out = result.to(q.scalar_type()).reshape({group, rows, dim}).contiguous();
    const char* source = static_cast<const char*>(rows_out.data_ptr());
    for (int64_t g = 0; g < group; ++g)
      std::memcpy(out_bytes + ((h * group + g) * n + start) * dim * element, source + g * rows * dim * element,
                  rows * dim * element);
  });
  return out;
}

}  // namespace ragkv
