// Per-request views of KV caches as the attention kernels read them, and the checks every
// op that takes caches makes on them.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

#include "attention.h"

namespace ragkv {

// Views of one layer of each request's cache: [layers, Hkv, rows, D] caches with `layer`,
// or [Hkv, rows, D] cache layers with layer = -1.
template <typename T>
std::vector<CacheView<T>> layer_views(const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values,
                                      const std::vector<int64_t>& lengths, int64_t layer) {
  std::vector<CacheView<T>> views;
  for (size_t b = 0; b < keys.size(); ++b) {
    const at::Tensor &k = keys[b], &v = values[b];
    const int64_t heads_axis = k.dim() - 3, offset = layer < 0 ? 0 : layer * k.stride(0);
    views.push_back({k.data_ptr<T>() + offset, v.data_ptr<T>() + offset, k.stride(heads_axis), k.stride(heads_axis + 1),
                     lengths[b]});
  }
  return views;
}

inline void check_caches(const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values,
                         const std::vector<int64_t>& lengths, int64_t batch, int64_t kv_heads, int64_t dim,
                         int64_t rank) {
  TORCH_CHECK(static_cast<int64_t>(keys.size()) == batch && static_cast<int64_t>(values.size()) == batch &&
                  static_cast<int64_t>(lengths.size()) == batch,
              "one key, value and length per request");
  const auto dtype = keys[0].scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "caches must be float32 or bfloat16");
  for (int64_t b = 0; b < batch; ++b) {
    const at::Tensor &k = keys[b], &v = values[b];
    TORCH_CHECK(k.dim() == rank && v.sizes() == k.sizes() && v.strides() == k.strides(),
                "keys and values of a request must share shape and layout");
    TORCH_CHECK(k.scalar_type() == dtype && v.scalar_type() == dtype, "every cache must share one dtype");
    TORCH_CHECK(k.size(rank - 3) == kv_heads && k.size(rank - 1) == dim && k.stride(rank - 1) == 1,
                "cache layers must be [Hkv, rows, D] with contiguous rows");
    TORCH_CHECK(lengths[b] >= 1 && lengths[b] <= k.size(rank - 2), "length out of range");
  }
}

}  // namespace ragkv
