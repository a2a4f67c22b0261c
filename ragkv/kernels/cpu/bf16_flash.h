// Causal-by-position attention of bfloat16 rows on AVX512-BF16, the flash way: scores and
// the weighted values are `vdpbf16ps` dot products (two bf16 products per float32 lane),
// softmax statistics and accumulators float32, the probabilities rounded to bfloat16 for
// the second product as GPU flash kernels do. torch's CPU flash kernel, on a CPU with
// AVX512-BF16 but no AMX, runs its bf16 matmuls no faster than float32 ones; these loops
// keep a 6-row tile of scores or outputs in registers instead.
//
// Layout, per call: each KV head's keys are repacked into blocks of kKeys keys as
// [head_dim / 2][kKeys] pairs (lane c of a vector = key c's two dims), its values into
// [key pairs][head_dim] pairs (lane d = dim d of two consecutive keys), so both products
// stream whole vectors and broadcast one 32-bit pair of the other operand. A work item is
// one KV head and kItemRows query positions, all of that head's query heads together (GQA:
// each key block is read once for the group), claimed most expensive first.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include <immintrin.h>

#include "claimed_items.h"
#include "vec.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define RAGKV_HAS_BF16_FLASH 1

namespace ragkv {
namespace bf16_flash_detail {

constexpr int64_t kKeys = 64;      // keys per block: four vectors of scores per query row
constexpr int64_t kTile = 6;       // query rows per register tile (24 accumulators)
constexpr int64_t kItemRows = 16;  // query positions per work item, times the group's heads
constexpr float kLog2e = 1.44269504088896341f;

struct Bf16Flash {};  // owner of the thread buffers below

// 2^x for x <= 0: integer part by scalef, fraction by vec.h's polynomial (its error is far
// below the bf16 rounding the probabilities get next).
inline __m512 exp2_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(kExp2Polynomial[0]);
  for (int i = 1; i < 7; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExp2Polynomial[i]));
  return _mm512_scalef_ps(p, n);
}

inline uint32_t pair_at(const uint16_t* row, int64_t pair) {
  uint32_t bits;
  std::memcpy(&bits, row + 2 * pair, sizeof(bits));
  return bits;
}

inline __m512bh as_bh(__m512i v) { return reinterpret_cast<__m512bh&>(v); }

// scores [R][kKeys] (log2 units) of R query rows against one repacked key block.
template <int R>
inline void score_tile(const uint16_t* const* q, const uint32_t* key_block, int64_t pairs, float scale,
                       float* scores) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    const uint32_t* keys = key_block + p * kKeys;
    const __m512bh k0 = as_bh(_mm512_loadu_si512(keys)), k1 = as_bh(_mm512_loadu_si512(keys + 16)),
                   k2 = as_bh(_mm512_loadu_si512(keys + 32)), k3 = as_bh(_mm512_loadu_si512(keys + 48));
    for (int r = 0; r < R; ++r) {
      const __m512bh qp = as_bh(_mm512_set1_epi32(static_cast<int>(pair_at(q[r], p))));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], qp, k0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], qp, k1);
      acc[r][2] = _mm512_dpbf16_ps(acc[r][2], qp, k2);
      acc[r][3] = _mm512_dpbf16_ps(acc[r][3], qp, k3);
    }
  }
  const __m512 s = _mm512_set1_ps(scale);
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(scores + r * kKeys + 16 * j, _mm512_mul_ps(acc[r][j], s));
}

// out [R][dim] += probabilities [R][kKeys] (bf16) @ one repacked value block [kKeys / 2][dim].
template <int R>
inline void value_tile(const uint16_t* probabilities, const uint32_t* value_block, int64_t dim, float* out) {
  for (int64_t d0 = 0; d0 < dim; d0 += 64) {
    __m512 acc[R][4];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_loadu_ps(out + r * dim + d0 + 16 * j);
    for (int64_t p = 0; p < kKeys / 2; ++p) {
      const uint32_t* values = value_block + p * dim + d0;
      const __m512bh v0 = as_bh(_mm512_loadu_si512(values)), v1 = as_bh(_mm512_loadu_si512(values + 16)),
                     v2 = as_bh(_mm512_loadu_si512(values + 32)), v3 = as_bh(_mm512_loadu_si512(values + 48));
      for (int r = 0; r < R; ++r) {
        const __m512bh pp = as_bh(_mm512_set1_epi32(static_cast<int>(pair_at(probabilities + r * kKeys, p))));
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], pp, v0);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], pp, v1);
        acc[r][2] = _mm512_dpbf16_ps(acc[r][2], pp, v2);
        acc[r][3] = _mm512_dpbf16_ps(acc[r][3], pp, v3);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < 4; ++j) _mm512_storeu_ps(out + r * dim + d0 + 16 * j, acc[r][j]);
  }
}

template <int R>
inline void tiles(const uint16_t* const* q, const uint32_t* key_block, int64_t pairs, float scale,
                  float* scores, const uint16_t* probabilities, const uint32_t* value_block, int64_t dim, float* out,
                  bool values) {
  if (values)
    value_tile<R>(probabilities, value_block, dim, out);
  else
    score_tile<R>(q, key_block, pairs, scale, scores);
}

// The scores (or, with `values`, the outputs) of rows [0, rows) in register tiles (the last
// one shorter).
inline void for_tiles(int64_t rows, bool values, const uint16_t* const* q, const uint32_t* key_block, int64_t pairs,
                      float scale, float* scores, const uint16_t* probabilities, const uint32_t* value_block,
                      int64_t dim, float* out) {
  for (int64_t r = 0; r < rows; r += kTile) {
    const int64_t n = std::min(kTile, rows - r);
    const uint16_t* const* tq = q + r;
    float* ts = scores + r * kKeys;
    const uint16_t* tp = probabilities + r * kKeys;
    float* to = out + r * dim;
    switch (n) {
      case 6: tiles<6>(tq, key_block, pairs, scale, ts, tp, value_block, dim, to, values); break;
      case 5: tiles<5>(tq, key_block, pairs, scale, ts, tp, value_block, dim, to, values); break;
      case 4: tiles<4>(tq, key_block, pairs, scale, ts, tp, value_block, dim, to, values); break;
      case 3: tiles<3>(tq, key_block, pairs, scale, ts, tp, value_block, dim, to, values); break;
      case 2: tiles<2>(tq, key_block, pairs, scale, ts, tp, value_block, dim, to, values); break;
      default: tiles<1>(tq, key_block, pairs, scale, ts, tp, value_block, dim, to, values); break;
    }
  }
}

// Online softmax over one block of scores for one row: rescales its running sum and output,
// writes its probabilities as bf16; columns past `visible` (block-relative) count as -inf.
inline void softmax_row(float* scores, int64_t visible, float& max, float& sum, float* out, int64_t dim,
                        uint16_t* probabilities) {
  __m512 s[4];
  __mmask16 keep[4];
  for (int j = 0; j < 4; ++j) {
    const int64_t lanes = std::clamp<int64_t>(visible - 16 * j, 0, 16);
    keep[j] = lanes == 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << lanes) - 1);
    s[j] = _mm512_mask_mov_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()), keep[j],
                              _mm512_loadu_ps(scores + 16 * j));
  }
  const float block_max = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(s[0], s[1]), _mm512_max_ps(s[2], s[3])));
  const float new_max = std::max(max, block_max);
  const __m512 m = _mm512_set1_ps(new_max);
  __m512 total = _mm512_setzero_ps();
  for (int j = 0; j < 4; ++j) {
    s[j] = _mm512_maskz_mov_ps(keep[j], exp2_nonpositive(_mm512_sub_ps(s[j], m)));
    total = _mm512_add_ps(total, s[j]);
  }
  const float alpha = max == -std::numeric_limits<float>::infinity() ? 0.0f : std::exp2(max - new_max);
  sum = sum * alpha + _mm512_reduce_add_ps(total);
  max = new_max;
  if (alpha != 1.0f) {
    const __m512 a = _mm512_set1_ps(alpha);
    for (int64_t d = 0; d < dim; d += 16) _mm512_storeu_ps(out + d, _mm512_mul_ps(_mm512_loadu_ps(out + d), a));
  }
  for (int j = 0; j < 4; j += 2) {
    const __m512bh pair = _mm512_cvtne2ps_pbh(s[j + 1], s[j]);  // s[j] to the lower half
    _mm512_storeu_si512(probabilities + 16 * j, reinterpret_cast<const __m512i&>(pair));
  }
}

}  // namespace bf16_flash_detail

// q [Hq, N, D] bf16, rows sorted by positions[i] (ascending); keys/values [Hkv, T, D] bf16,
// last dim contiguous, D a multiple of 64. Row i attends to cache rows [0, positions[i]].
// Returns [Hq, N, D] bf16.
inline at::Tensor bf16_flash(const at::Tensor& q_in, const at::Tensor& keys, const at::Tensor& values,
                             const std::vector<int64_t>& positions, double scale) {
  using namespace bf16_flash_detail;
  const at::Tensor q = q_in.contiguous();
  const int64_t heads = q.size(0), n = q.size(1), dim = q.size(2), kv_heads = keys.size(0);
  const int64_t group = heads / kv_heads, pairs = dim / 2;
  at::Tensor out = at::empty({heads, n, dim}, q.options());
  if (n == 0) return out;
  const int64_t used = positions.back() + 1, blocks = (used + kKeys - 1) / kKeys;
  // repacked keys [Hkv][blocks][D/2][kKeys] and values [Hkv][blocks * kKeys / 2][D], as pairs
  std::vector<uint32_t> packed_keys(kv_heads * blocks * pairs * kKeys), packed_values(kv_heads * blocks * kKeys / 2 * dim);
  const auto* key_data = reinterpret_cast<const uint16_t*>(keys.data_ptr());
  const auto* value_data = reinterpret_cast<const uint16_t*>(values.data_ptr());
  const int64_t k_head = keys.stride(0), k_row = keys.stride(1), v_head = values.stride(0), v_row = values.stride(1);
  at::parallel_for(0, kv_heads * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item / blocks, block = item % blocks;
      uint32_t* pk = packed_keys.data() + item * pairs * kKeys;
      uint32_t* pv = packed_values.data() + item * kKeys / 2 * dim;
      for (int64_t c = 0; c < kKeys; ++c) {
        const int64_t row = block * kKeys + c;
        if (row < used) {
          const uint16_t* k = key_data + h * k_head + row * k_row;
          for (int64_t p = 0; p < pairs; ++p) pk[p * kKeys + c] = pair_at(k, p);
        } else {
          for (int64_t p = 0; p < pairs; ++p) pk[p * kKeys + c] = 0;
        }
      }
      for (int64_t c = 0; c < kKeys; c += 2) {
        const int64_t row = block * kKeys + c;
        const uint16_t* even = value_data + h * v_head + row * v_row;
        const uint16_t* odd = even + v_row;
        uint32_t* to = pv + (c / 2) * dim;
        for (int64_t d = 0; d < dim; ++d)
          to[d] = (row < used ? even[d] : 0u) | (row + 1 < used ? static_cast<uint32_t>(odd[d]) << 16 : 0u);
      }
    }
  });
  const auto* q_data = reinterpret_cast<const uint16_t*>(q.data_ptr());
  auto* out_data = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t items = (n + kItemRows - 1) / kItemRows;
  const float log2_scale = static_cast<float>(scale) * kLog2e;
  for_each_claimed(items * kv_heads, [&](int64_t item) {
    const int64_t block_item = items - 1 - item / kv_heads, h = item % kv_heads;  // the longest first
    const int64_t start = block_item * kItemRows, rows = std::min(kItemRows, n - start), m = group * rows;
    float* scores = thread_buffer<Bf16Flash, 0, float>(m * kKeys);
    uint16_t* probabilities = thread_buffer<Bf16Flash, 1, uint16_t>(m * kKeys);
    float* acc = thread_buffer<Bf16Flash, 2, float>(m * dim);
    float* maxima = thread_buffer<Bf16Flash, 3, float>(m);
    float* sums = thread_buffer<Bf16Flash, 4, float>(m);
    const uint16_t** rows_q = thread_buffer<Bf16Flash, 5, const uint16_t*>(m);
    int64_t* bounds = thread_buffer<Bf16Flash, 6, int64_t>(m);
    for (int64_t g = 0; g < group; ++g)
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t i = g * rows + r;
        rows_q[i] = q_data + ((h * group + g) * n + start + r) * dim;
        bounds[i] = positions[start + r];
      }
    std::fill(acc, acc + m * dim, 0.0f);
    std::fill(maxima, maxima + m, -std::numeric_limits<float>::infinity());
    std::fill(sums, sums + m, 0.0f);
    const int64_t last_block = positions[start + rows - 1] / kKeys;
    for (int64_t block = 0; block <= last_block; ++block) {
      const uint32_t* key_block = packed_keys.data() + (h * blocks + block) * pairs * kKeys;
      const uint32_t* value_block = packed_values.data() + (h * blocks + block) * kKeys / 2 * dim;
      for_tiles(m, false, rows_q, key_block, pairs, log2_scale, scores, probabilities, value_block, dim, acc);
      for (int64_t i = 0; i < m; ++i)
        softmax_row(scores + i * kKeys, bounds[i] - block * kKeys + 1, maxima[i], sums[i], acc + i * dim, dim,
                    probabilities + i * kKeys);
      for_tiles(m, true, rows_q, key_block, pairs, log2_scale, scores, probabilities, value_block, dim, acc);
    }
    for (int64_t i = 0; i < m; ++i) {
      const __m512 inverse = _mm512_set1_ps(1.0f / sums[i]);
      const int64_t g = i / rows, r = i % rows;
      uint16_t* to = out_data + ((h * group + g) * n + start + r) * dim;
      for (int64_t d = 0; d < dim; d += 16) {
        const __m256bh v = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(acc + i * dim + d), inverse));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(to + d), reinterpret_cast<const __m256i&>(v));
      }
    }
  });
  return out;
}

}  // namespace ragkv

#endif
