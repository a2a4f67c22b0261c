// The ops on tensors that Python calls one at a time (checks, then the kernels of the headers).
#include "tensor_ops.h"

#include "attention.h"
#include "cache_views.h"
#include "packed_linear.h"
#include "bf16_flash.h"
#include "flash_blocks.h"
#include "selective_attention.h"

namespace ragkv {

// q [B, Hq, D]; keys[b], values[b] [Hkv, capacity_b, D]; request b attends to its first
// lengths[b] rows. Returns [B, Hq, D] float32.
at::Tensor decode_attention_op(const at::Tensor& q, const std::vector<at::Tensor>& keys,
                               const std::vector<at::Tensor>& values, const std::vector<int64_t>& lengths,
                               double scale) {
  TORCH_CHECK(q.dim() == 3, "q must be [B, Hq, D]");
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2), kv_heads = keys.at(0).size(0);
  TORCH_CHECK(heads % kv_heads == 0 && heads / kv_heads <= kMaxGroup, "query heads per KV head must be <= 16");
  TORCH_CHECK(dim % 8 == 0 && dim <= kMaxDim, "head_dim must be a multiple of 8, at most 256");
  check_caches(keys, values, lengths, batch, kv_heads, dim, 3);
  const at::Tensor q_scaled = (q.to(at::kFloat) * scale).contiguous();
  at::Tensor out = at::empty({batch, heads, dim}, q.options().dtype(at::kFloat));
  if (keys[0].scalar_type() == at::kFloat)
    decode_attention<float>(q_scaled.data_ptr<float>(), layer_views<float>(keys, values, lengths, -1), heads,
                            kv_heads, dim, out.data_ptr<float>());
  else
    decode_attention<at::BFloat16>(q_scaled.data_ptr<float>(), layer_views<at::BFloat16>(keys, values, lengths, -1),
                                   heads, kv_heads, dim, out.data_ptr<float>());
  return out;
}

// q [N, Hq, D]; keys/values one cache layer [Hkv, rows, D]; query row i attends to the
// first limits[i] rows. Returns [N, Hq, D] float32.
at::Tensor selective_attention_op(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                                  const std::vector<int64_t>& limits, double scale) {
  TORCH_CHECK(q.dim() == 3, "q must be [N, Hq, D]");
  const int64_t n = q.size(0), heads = q.size(1), dim = q.size(2), kv_heads = keys.size(0);
  TORCH_CHECK(heads % kv_heads == 0 && heads / kv_heads <= kMaxGroup, "query heads per KV head must be <= 16");
  TORCH_CHECK(dim % 16 == 0 && dim <= kMaxDim, "head_dim must be a multiple of 16, at most 256");
  TORCH_CHECK(static_cast<int64_t>(limits.size()) == n, "one limit per query row");
  check_caches({keys}, {values}, {keys.size(1)}, 1, kv_heads, dim, 3);
  for (const int64_t limit : limits) TORCH_CHECK(limit >= 1 && limit <= keys.size(1), "limit out of range");
  const at::Tensor q_scaled = (q.to(at::kFloat) * scale).contiguous();
  at::Tensor out = at::empty({n, heads, dim}, q.options().dtype(at::kFloat));
  if (keys.scalar_type() == at::kFloat)
    selective_attention<float>(q_scaled.data_ptr<float>(), keys.data_ptr<float>(), values.data_ptr<float>(),
                               keys.stride(0), keys.stride(1), limits.data(), n, heads, kv_heads, dim,
                               out.data_ptr<float>());
  else
    selective_attention<at::BFloat16>(q_scaled.data_ptr<float>(), keys.data_ptr<at::BFloat16>(),
                                      values.data_ptr<at::BFloat16>(), keys.stride(0), keys.stride(1), limits.data(),
                                      n, heads, kv_heads, dim, out.data_ptr<float>());
  return out;
}

at::Tensor flash_blocks_op(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                           const std::vector<int64_t>& positions, double scale, int64_t block_rows) {
  TORCH_CHECK(q.dim() == 3 && keys.dim() == 3 && values.sizes() == keys.sizes(), "q [Hq, N, D], keys/values [Hkv, T, D]");
  TORCH_CHECK(q.size(0) % keys.size(0) == 0 && q.size(2) == keys.size(2), "query heads must be a multiple of KV heads");
  TORCH_CHECK(q.scalar_type() == keys.scalar_type() && values.scalar_type() == keys.scalar_type(), "one dtype");
  TORCH_CHECK(keys.stride(2) == 1 && values.stride(2) == 1, "cache rows must be contiguous");
  TORCH_CHECK(static_cast<int64_t>(positions.size()) == q.size(1) && block_rows >= 1, "one position per query row");
  for (size_t i = 0; i < positions.size(); ++i)
    TORCH_CHECK(positions[i] >= 0 && positions[i] < keys.size(1) && (i == 0 || positions[i - 1] <= positions[i]),
                "positions must be ascending and in range");
  return flash_blocks(q, keys, values, positions, scale, block_rows);
}

#ifdef RAGKV_HAS_BF16_FLASH
at::Tensor bf16_flash_op(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                         const std::vector<int64_t>& positions, double scale) {
  TORCH_CHECK(q.dim() == 3 && keys.dim() == 3 && values.sizes() == keys.sizes(), "q [Hq, N, D], keys/values [Hkv, T, D]");
  TORCH_CHECK(q.size(0) % keys.size(0) == 0 && q.size(2) == keys.size(2), "query heads must be a multiple of KV heads");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && keys.scalar_type() == at::kBFloat16 &&
                  values.scalar_type() == at::kBFloat16, "q, keys and values must be bfloat16");
  TORCH_CHECK(q.size(2) % 64 == 0, "head_dim must be a multiple of 64");
  TORCH_CHECK(keys.stride(2) == 1 && values.stride(2) == 1, "cache rows must be contiguous");
  TORCH_CHECK(static_cast<int64_t>(positions.size()) == q.size(1), "one position per query row");
  for (size_t i = 0; i < positions.size(); ++i)
    TORCH_CHECK(positions[i] >= 0 && positions[i] < keys.size(1) && (i == 0 || positions[i - 1] <= positions[i]),
                "positions must be ascending and in range");
  return bf16_flash(q, keys, values, positions, scale);
}
#endif

// q [Hq, D] over one cache layer keys/values [Hkv, capacity, D] of `length` rows with the
// A2ATS state of `layer`. Returns (out [Hq, D] float32, chosen rows [Hkv, k] int64, ascending).
std::tuple<at::Tensor, at::Tensor> a2ats_attention_op(const at::Tensor& q, const at::Tensor& keys,
                                                      const at::Tensor& values, int64_t length, const A2atsPlan& plan,
                                                      int64_t layer, double scale) {
  TORCH_CHECK(q.dim() == 2, "q must be [Hq, D]");
  const int64_t heads = q.size(0), dim = q.size(1), kv_heads = keys.size(0);
  TORCH_CHECK(heads % kv_heads == 0 && heads / kv_heads <= kMaxGroup, "query heads per KV head must be <= 16");
  TORCH_CHECK(dim % 8 == 0 && dim <= kMaxDim, "head_dim must be a multiple of 8, at most 256");
  check_caches({keys}, {values}, {length}, 1, kv_heads, dim, 3);
  TORCH_CHECK(layer >= 0 && layer < plan.layers(), "layer out of range");
  plan.check(plan.layers(), kv_heads, dim, length);
  const at::Tensor q_scaled = (q.to(at::kFloat) * scale).contiguous();
  at::Tensor out = at::empty({heads, dim}, q.options().dtype(at::kFloat));
  at::Tensor chosen = at::empty({kv_heads, plan.k()}, q.options().dtype(at::kLong));
  int64_t* chosen_ptr = plan.selects() ? chosen.data_ptr<int64_t>() : nullptr;
  if (keys.scalar_type() == at::kFloat)
    a2ats_attention<float>(q_scaled.data_ptr<float>(), layer_views<float>({keys}, {values}, {length}, -1)[0],
                           plan.layer(layer), heads, kv_heads, dim, out.data_ptr<float>(), chosen_ptr);
  else
    a2ats_attention<at::BFloat16>(q_scaled.data_ptr<float>(),
                                  layer_views<at::BFloat16>({keys}, {values}, {length}, -1)[0], plan.layer(layer),
                                  heads, kv_heads, dim, out.data_ptr<float>(), chosen_ptr);
  return {out, chosen};
}

namespace {

// x [rows, in] float32 through one packed linear -> [rows, out] float32.
at::Tensor packed_linear_op(const at::Tensor& x, const PackedLinear& linear) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) == linear.in(), "x must be [rows, in] float32");
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({x.size(0), linear.out()}, x.options());
  linear.apply(xc.data_ptr<float>(), x.size(0), y.data_ptr<float>());
  return y;
}

}  // namespace

// x [rows, in] float32 @ (weight [out, in] int8 * scales [out] bf16)^T -> [rows, out] float32.
at::Tensor int8_linear_op(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales) {
  TORCH_CHECK(weight.scalar_type() == at::kChar, "weight must be int8");
  return packed_linear_op(x, PackedLinear(weight, scales, x.size(-1)));
}

// x [rows, in] float32 @ int4 rows weight [out, int4_row_bytes(in)] uint8 (int4_linear.h) -> [rows, out] float32.
at::Tensor int4_linear_op(const at::Tensor& x, const at::Tensor& weight, int64_t in) {
  TORCH_CHECK(weight.scalar_type() == at::kByte, "int4 rows must be uint8");
  return packed_linear_op(x, PackedLinear(weight, weight.new_empty({0}), in));
}

}  // namespace ragkv
