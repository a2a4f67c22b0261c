// Causal-by-position attention of many query rows over one cache layer (CPU): the rows a
// selective recompute chose, or a prefill chunk after a cached prefix. Row i sees cache
// rows [0, limits[i]).
//
// Flash-attention tiles: a work item is one KV head and a tile of query rows whose
// query heads (rows x GQA group, at most kLanes) are the SIMD lanes. Keys and values are
// read in blocks of kKeyRows rows, widened once per block for every lane; scores of a
// block are a [rows, lanes] product (a key element broadcast against 8 query lanes), and
// a running max and sum per lane carry the softmax across blocks, so nothing of size
// rows x cache is ever stored. All arithmetic is float32.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <vector>

#include "attention.h"

namespace ragkv {

constexpr int64_t kLanes = 32;
constexpr int64_t kKeyRows = 32;

// One tile's state: lane l is query head (l % group) of tile row (l / group).
struct LaneTile {
  int64_t lanes;                 // real lanes (rows x group); the rest up to kLanes are padding
  std::vector<float> q;          // [dim][kLanes], transposed queries
  std::vector<float> limit;      // [kLanes] rows each lane may see (padding: all)
  std::vector<float> acc;        // [dim][kLanes] running exp-weighted value sums
  std::vector<float> max, sum;   // [kLanes] running score max and exp-sum
};

// scores[j][lane] = keys[j] . q[:, lane] for `rows` (a multiple of 4) rows and Vectors
// 8-lane groups: each key element is broadcast once and multiplies every lane vector.
template <int Vectors>
inline void tile_scores(const float* keys, const float* q, int64_t rows, int64_t dim, float* scores) {
  constexpr int Rows = Vectors >= 3 ? 2 : 4;  // Rows x Vectors <= 8 accumulators
  for (int64_t j = 0; j < rows; j += Rows) {
    __m256 acc[Rows][Vectors];
    for (int i = 0; i < Rows; ++i)
      for (int v = 0; v < Vectors; ++v) acc[i][v] = _mm256_setzero_ps();
    for (int64_t d = 0; d < dim; ++d) {
      __m256 qv[Vectors];
      for (int v = 0; v < Vectors; ++v) qv[v] = _mm256_loadu_ps(q + d * kLanes + v * 8);
      for (int i = 0; i < Rows; ++i) {
        const __m256 k = _mm256_broadcast_ss(keys + (j + i) * dim + d);
        for (int v = 0; v < Vectors; ++v) acc[i][v] = _mm256_fmadd_ps(k, qv[v], acc[i][v]);
      }
    }
    for (int i = 0; i < Rows; ++i)
      for (int v = 0; v < Vectors; ++v) _mm256_storeu_ps(scores + (j + i) * kLanes + v * 8, acc[i][v]);
  }
}

// acc[d][lane] = acc[d][lane] * alpha[lane] + sum_j p[j][lane] values[j][d] (acc stored
// transposed, lanes innermost): each value element is broadcast once for every lane vector.
template <int Vectors>
inline void tile_values(const float* p, const float* values, const float* alpha, int64_t rows, int64_t dim,
                        float* acc) {
  constexpr int Dims = Vectors >= 3 ? 2 : 4;  // Dims x Vectors <= 8 accumulators
  __m256 scale[Vectors];
  for (int v = 0; v < Vectors; ++v) scale[v] = _mm256_loadu_ps(alpha + v * 8);
  for (int64_t d = 0; d < dim; d += Dims) {
    __m256 a[Dims][Vectors];
    for (int i = 0; i < Dims; ++i)
      for (int v = 0; v < Vectors; ++v) a[i][v] = _mm256_mul_ps(_mm256_loadu_ps(acc + (d + i) * kLanes + v * 8), scale[v]);
    for (int64_t j = 0; j < rows; ++j) {
      __m256 weight[Vectors];
      for (int v = 0; v < Vectors; ++v) weight[v] = _mm256_loadu_ps(p + j * kLanes + v * 8);
      for (int i = 0; i < Dims; ++i) {
        const __m256 x = _mm256_broadcast_ss(values + j * dim + d + i);
        for (int v = 0; v < Vectors; ++v) a[i][v] = _mm256_fmadd_ps(x, weight[v], a[i][v]);
      }
    }
    for (int i = 0; i < Dims; ++i)
      for (int v = 0; v < Vectors; ++v) _mm256_storeu_ps(acc + (d + i) * kLanes + v * 8, a[i][v]);
  }
}

// For the first `vectors` 8-lane groups: masks scores past each lane's limit, turns them into exp(score - running max) in place
// and updates max and sum; alpha[lane] receives the factor that rescales the lane's acc.
inline void tile_softmax(float* scores, int64_t rows, int64_t vectors, int64_t first_row, LaneTile& tile, float* alpha) {
  const __m256 minus_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t v = 0; v < 8 * vectors; v += 8) {
    const __m256 limit = _mm256_loadu_ps(tile.limit.data() + v);
    __m256 block_max = minus_inf;
    for (int64_t j = 0; j < rows; ++j) {
      const __m256 visible = _mm256_cmp_ps(_mm256_set1_ps(static_cast<float>(first_row + j)), limit, _CMP_LT_OQ);
      const __m256 s = _mm256_blendv_ps(minus_inf, _mm256_loadu_ps(scores + j * kLanes + v), visible);
      _mm256_storeu_ps(scores + j * kLanes + v, s);
      block_max = _mm256_max_ps(block_max, s);
    }
    const __m256 old_max = _mm256_loadu_ps(tile.max.data() + v);
    const __m256 new_max = _mm256_max_ps(old_max, block_max);
    // a lane whose rows are all masked in this block keeps max -inf only if it saw nothing
    // yet, which cannot happen: every block starts at or before the lane's limit - 1
    const __m256 scale = exp_nonpositive8(_mm256_sub_ps(old_max, new_max));
    __m256 total = _mm256_mul_ps(_mm256_loadu_ps(tile.sum.data() + v), scale);
    for (int64_t j = 0; j < rows; ++j) {
      const __m256 s = _mm256_loadu_ps(scores + j * kLanes + v);
      const __m256 e = _mm256_and_ps(exp_nonpositive8(_mm256_sub_ps(s, new_max)), _mm256_cmp_ps(s, minus_inf, _CMP_NEQ_OQ));
      _mm256_storeu_ps(scores + j * kLanes + v, e);
      total = _mm256_add_ps(total, e);
    }
    _mm256_storeu_ps(tile.max.data() + v, new_max);
    _mm256_storeu_ps(tile.sum.data() + v, total);
    _mm256_storeu_ps(alpha + v, scale);
  }
}

template <typename T>
inline void widen_rows(const T* rows_begin, int64_t row_stride, int64_t rows, int64_t padded, int64_t dim, float* out) {
  for (int64_t j = 0; j < rows; ++j)
    for (int64_t d = 0; d < dim; d += 8) _mm256_storeu_ps(out + j * dim + d, load8(rows_begin + j * row_stride + d));
  std::fill(out + rows * dim, out + padded * dim, 0.f);
}

template <typename T>
void attend_tile(const T* keys, const T* values, int64_t row_stride, int64_t dim, LaneTile& tile) {
  const int64_t visible = static_cast<int64_t>(*std::max_element(tile.limit.begin(), tile.limit.begin() + tile.lanes));
  std::vector<float> k(kKeyRows * dim), v(kKeyRows * dim), scores(kKeyRows * kLanes), alpha(kLanes);
  const int64_t vectors = (tile.lanes + 7) / 8;
  for (int64_t first = 0; first < visible; first += kKeyRows) {
    const int64_t rows = std::min(kKeyRows, visible - first), padded = (rows + 3) / 4 * 4;
    widen_rows(keys + first * row_stride, row_stride, rows, padded, dim, k.data());
    widen_rows(values + first * row_stride, row_stride, rows, rows, dim, v.data());
    switch (vectors) {
      case 1: tile_scores<1>(k.data(), tile.q.data(), padded, dim, scores.data()); break;
      case 2: tile_scores<2>(k.data(), tile.q.data(), padded, dim, scores.data()); break;
      case 3: tile_scores<3>(k.data(), tile.q.data(), padded, dim, scores.data()); break;
      default: tile_scores<4>(k.data(), tile.q.data(), padded, dim, scores.data()); break;
    }
    tile_softmax(scores.data(), rows, vectors, first, tile, alpha.data());
    switch (vectors) {
      case 1: tile_values<1>(scores.data(), v.data(), alpha.data(), rows, dim, tile.acc.data()); break;
      case 2: tile_values<2>(scores.data(), v.data(), alpha.data(), rows, dim, tile.acc.data()); break;
      case 3: tile_values<3>(scores.data(), v.data(), alpha.data(), rows, dim, tile.acc.data()); break;
      default: tile_values<4>(scores.data(), v.data(), alpha.data(), rows, dim, tile.acc.data()); break;
    }
  }
}

// q [n][heads][dim] float32, pre-scaled by the softmax scale; keys/values one cache layer
// (`head_stride` elements between KV heads, `row_stride` between rows); limits[i] >= 1 the
// cache rows query row i sees. out [n][heads][dim] float32.
template <typename T>
void selective_attention(const float* q, const T* keys, const T* values, int64_t head_stride, int64_t row_stride,
                         const int64_t* limits, int64_t n, int64_t heads, int64_t kv_heads, int64_t dim, float* out) {
  const int64_t group = heads / kv_heads;
  // Rows in order of their limits, so a tile's rows see about as many cache rows.
  std::vector<int64_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return limits[a] < limits[b]; });
  // Tiles as large as the lanes allow (few lanes leave the FMAs waiting on widening and
  // softmax), but two per thread at least.
  const int64_t wanted_tiles = (2 * at::get_num_threads() + kv_heads - 1) / kv_heads;
  const int64_t tile_rows = std::clamp<int64_t>((n + wanted_tiles - 1) / wanted_tiles, 1, kLanes / group);
  const int64_t tiles = (n + tile_rows - 1) / tile_rows;
  at::parallel_for(0, kv_heads * tiles, 1, [&](int64_t begin, int64_t end) {
    LaneTile tile;
    tile.q.resize(dim * kLanes);
    tile.acc.resize(dim * kLanes);
    tile.limit.resize(kLanes);
    tile.max.resize(kLanes);
    tile.sum.resize(kLanes);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item / tiles, first = (item % tiles) * tile_rows;
      const int64_t rows = std::min(tile_rows, n - first);
      tile.lanes = rows * group;
      std::fill(tile.q.begin(), tile.q.end(), 0.f);
      std::fill(tile.acc.begin(), tile.acc.end(), 0.f);
      std::fill(tile.limit.begin(), tile.limit.end(), static_cast<float>(limits[order[first]]));
      std::fill(tile.max.begin(), tile.max.end(), -std::numeric_limits<float>::infinity());
      std::fill(tile.sum.begin(), tile.sum.end(), 0.f);
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t g = 0; g < group; ++g) {
          const int64_t lane = r * group + g, row = order[first + r];
          const float* qv = q + (row * heads + h * group + g) * dim;
          for (int64_t d = 0; d < dim; ++d) tile.q[d * kLanes + lane] = qv[d];
          tile.limit[lane] = static_cast<float>(limits[row]);
        }
      attend_tile<T>(keys + h * head_stride, values + h * head_stride, row_stride, dim, tile);
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t g = 0; g < group; ++g) {
          const int64_t lane = r * group + g;
          const float inverse = 1.f / tile.sum[lane];
          float* o = out + (order[first + r] * heads + h * group + g) * dim;
          for (int64_t d = 0; d < dim; ++d) o[d] = tile.acc[d * kLanes + lane] * inverse;
        }
    }
  });
}

}  // namespace ragkv
