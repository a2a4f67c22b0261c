// Dense decode attention for a batch of requests, each over its own KV cache (CPU).
//
// Work is split into (request, KV head, block of cache rows) items spread over torch's
// intra-op threads; each item keeps a partial softmax (max, sum, weighted values) and the
// partials of a head are merged at the end (split-K "flash decoding"). Keys and values are
// read once in their stored dtype (float32 or bfloat16) and widened to float32 in
// registers, so a 16-bit cache costs half the memory traffic of a float32 one on CPUs
// without bf16 arithmetic. All arithmetic is float32.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <utility>
#include <vector>

#include "claimed_items.h"
#include "vec.h"

#include <immintrin.h>

namespace ragkv {


constexpr int64_t kBlockRows = 256;
// Rows ahead of a cache stretch read in order fetched into L2: the short fetches into L1
// alone leave DRAM idle between blocks, and these keep the next block's reads in flight
// while this one's arithmetic runs, closer to the machine's streaming bandwidth.
constexpr int64_t kStreamAheadRows = 256;

// exp for x <= 0 (softmax arguments), vectorisable: 2^(x log2 e) split into integer and
// fractional parts, the fraction by a degree-6 polynomial (relative error ~2e-7).
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float y = x * 1.44269504088896341f;
  const float n = std::floor(y);
  const float f = y - n;
  float p = kExp2Polynomial[0];
  for (int i = 1; i < 7; ++i) p = p * f + kExp2Polynomial[i];
  int32_t bits;
  std::memcpy(&bits, &p, sizeof(bits));
  bits += static_cast<int32_t>(n) << 23;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

struct Item {
  int64_t request, head, row_begin, row_end;
};

constexpr int64_t kMaxGroup = 16;
constexpr int64_t kMaxDim = 256;

// Fetch `count` rows starting at `row` into cache (lines past the buffer's end are never
// touched by a prefetch fault: x86 drops prefetches of unmapped addresses); into L2 only
// with `l2_only`, for rows read later, possibly by the other core, that should not evict L1.
template <typename T>
inline void prefetch_rows(const T* base, int64_t row, int64_t count, int64_t row_stride, int64_t dim,
                          bool l2_only = false) {
  const int64_t bytes = dim * static_cast<int64_t>(sizeof(T));
  for (int64_t j = 0; j < count; ++j) {
    const char* line = reinterpret_cast<const char*>(base + (row + j) * row_stride);
    for (int64_t offset = 0; offset < bytes; offset += 64) {
      if (l2_only)
        _mm_prefetch(line + offset, _MM_HINT_T1);
      else
        _mm_prefetch(line + offset, _MM_HINT_T0);
    }
  }
}

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

inline __m256 load8(const at::BFloat16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

// Lanes 0-3 of the result: the sums of the 8 lanes of a[0..3].
inline __m128 sum_lanes4(const __m256* a) {
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

// scores[g][r] = q_g . k_r for Group query heads, 4 rows at a time read straight from the
// cache: 4 x Group independent FMA chains, each key vector widened once for the Group
// heads. Writes 4 scores per group of rows (the buffer has room past the last row).
// `streaming`: the rows are a stretch of a cache read in order, whose rows kStreamAheadRows
// on are fetched into L2 as well.
template <int Group, typename T>
void block_scores_for(const float* q, const T* keys, const T* values, int64_t row_stride, int64_t rows, int64_t dim,
                      float* scores, int64_t scores_stride, bool streaming) {
  for (int64_t r = 0; r < rows; r += 4) {
    const T* k[4];
    for (int j = 0; j < 4; ++j) k[j] = keys + (r + std::min<int64_t>(j, rows - r - 1)) * row_stride;
    // keys 64 rows ahead, and values for block_values, which reads them next
    prefetch_rows(keys, r + 64, 4, row_stride, dim);
    prefetch_rows(values, r + 32, 4, row_stride, dim);
    if (streaming) {
      prefetch_rows(keys, r + kStreamAheadRows, 4, row_stride, dim, /*l2_only=*/true);
      prefetch_rows(values, r + kStreamAheadRows, 4, row_stride, dim, /*l2_only=*/true);
    }
    __m256 acc[Group][4];
    for (int g = 0; g < Group; ++g)
      for (int j = 0; j < 4; ++j) acc[g][j] = _mm256_setzero_ps();
    for (int64_t d = 0; d < dim; d += 8) {
      __m256 key[4];
      for (int j = 0; j < 4; ++j) key[j] = load8(k[j] + d);
      for (int g = 0; g < Group; ++g) {
        const __m256 qv = _mm256_loadu_ps(q + g * dim + d);
        for (int j = 0; j < 4; ++j) acc[g][j] = _mm256_fmadd_ps(qv, key[j], acc[g][j]);
      }
    }
    for (int g = 0; g < Group; ++g) _mm_storeu_ps(scores + g * scores_stride + r, sum_lanes4(acc[g]));
  }
}

template <typename T>
void block_scores(const float* q, const T* keys, const T* values, int64_t row_stride, int64_t rows, int64_t group,
                  int64_t dim, float* scores, int64_t scores_stride, bool streaming = false) {
  // query heads in slices of 3: 12 accumulators and 4 key vectors fill the 16 registers
  for (int64_t g0 = 0; g0 < group; g0 += 3) {
    const float* qg = q + g0 * dim;
    float* out = scores + g0 * scores_stride;
    switch (std::min<int64_t>(3, group - g0)) {
      case 1: block_scores_for<1, T>(qg, keys, values, row_stride, rows, dim, out, scores_stride, streaming); break;
      case 2: block_scores_for<2, T>(qg, keys, values, row_stride, rows, dim, out, scores_stride, streaming); break;
      default: block_scores_for<3, T>(qg, keys, values, row_stride, rows, dim, out, scores_stride, streaming); break;
    }
  }
}

// partial[g][0:dim] = sum_r p[g][r] v_r, two 8-wide column slices at a time so 2 x Group
// FMA chains are in flight; Group is a template argument so the accumulators stay in registers.
template <int Group, typename T>
void block_values_for(const float* p, const T* values, int64_t row_stride, int64_t rows, int64_t dim,
                      int64_t p_stride, float* partial) {
  for (int64_t d = 0; d < dim; d += 16) {
    const bool pair = d + 8 < dim;
    __m256 lo[Group], hi[Group];
    for (int g = 0; g < Group; ++g) lo[g] = hi[g] = _mm256_setzero_ps();
    for (int64_t r = 0; r < rows; ++r) {
      const T* v = values + r * row_stride + d;
      const __m256 v_lo = load8(v), v_hi = pair ? load8(v + 8) : _mm256_setzero_ps();
      for (int g = 0; g < Group; ++g) {
        const __m256 weight = _mm256_broadcast_ss(p + g * p_stride + r);
        lo[g] = _mm256_fmadd_ps(weight, v_lo, lo[g]);
        hi[g] = _mm256_fmadd_ps(weight, v_hi, hi[g]);
      }
    }
    for (int g = 0; g < Group; ++g) {
      _mm256_storeu_ps(partial + g * (dim + 2) + d, lo[g]);
      if (pair) _mm256_storeu_ps(partial + g * (dim + 2) + d + 8, hi[g]);
    }
  }
}

template <typename T>
void block_values(const float* p, const T* values, int64_t row_stride, int64_t rows, int64_t group, int64_t dim,
                  int64_t p_stride, float* partial) {
  // GQA groups above 8 are split into slices of at most 8 query heads
  for (int64_t g0 = 0; g0 < group; g0 += 8) {
    const float* pg = p + g0 * p_stride;
    float* out = partial + g0 * (dim + 2);
    switch (std::min<int64_t>(8, group - g0)) {
      case 1: block_values_for<1, T>(pg, values, row_stride, rows, dim, p_stride, out); break;
      case 2: block_values_for<2, T>(pg, values, row_stride, rows, dim, p_stride, out); break;
      case 3: block_values_for<3, T>(pg, values, row_stride, rows, dim, p_stride, out); break;
      case 4: block_values_for<4, T>(pg, values, row_stride, rows, dim, p_stride, out); break;
      case 5: block_values_for<5, T>(pg, values, row_stride, rows, dim, p_stride, out); break;
      case 6: block_values_for<6, T>(pg, values, row_stride, rows, dim, p_stride, out); break;
      case 7: block_values_for<7, T>(pg, values, row_stride, rows, dim, p_stride, out); break;
      default: block_values_for<8, T>(pg, values, row_stride, rows, dim, p_stride, out); break;
    }
  }
}

inline __m256 exp_nonpositive8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 y = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
  const __m256 n = _mm256_floor_ps(y);
  const __m256 f = _mm256_sub_ps(y, n);
  __m256 p = _mm256_set1_ps(kExp2Polynomial[0]);
  for (int i = 1; i < 7; ++i) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExp2Polynomial[i]));
  const __m256i exponent = _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23);
  return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), exponent));
}

inline float max_lanes(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}

// scores[0:rows] <- exp(scores - max); returns (max, sum).
inline std::pair<float, float> block_softmax(float* scores, int64_t rows) {
  const int64_t full = rows / 8 * 8;
  __m256 vmax = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t r = 0; r < full; r += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(scores + r));
  float m = max_lanes(vmax);
  for (int64_t r = full; r < rows; ++r) m = std::max(m, scores[r]);
  const __m256 shift = _mm256_set1_ps(m);
  __m256 vsum = _mm256_setzero_ps();
  for (int64_t r = 0; r < full; r += 8) {
    const __m256 e = exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(scores + r), shift));
    _mm256_storeu_ps(scores + r, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  float sum = sum_lanes(vsum);
  for (int64_t r = full; r < rows; ++r) {
    scores[r] = exp_nonpositive(scores[r] - m);
    sum += scores[r];
  }
  return {m, sum};
}

// One block of rows of one KV head: for each of its `group` query heads the block's score
// max, exp-sum and exp-weighted value sum, written to `partial` = [group][dim + 2].
// `streaming`: the block is a stretch of a cache read in order (block_scores_for).
template <typename T>
void attend_block(const float* q, const T* keys, const T* values, int64_t row_stride, int64_t row_begin,
                  int64_t row_end, int64_t group, int64_t dim, float* partial, bool streaming = false) {
  const int64_t rows = row_end - row_begin;
  constexpr int64_t stride = kBlockRows + 8;  // room for the last 4-row group's padding lanes
  alignas(32) float scores[kMaxGroup * stride];
  block_scores<T>(q, keys + row_begin * row_stride, values + row_begin * row_stride, row_stride, rows, group, dim,
                  scores, stride, streaming);
  for (int64_t g = 0; g < group; ++g) {
    const auto [m, sum] = block_softmax(scores + g * stride, rows);
    partial[g * (dim + 2) + dim] = m;
    partial[g * (dim + 2) + dim + 1] = sum;
  }
  block_values<T>(scores, values + row_begin * row_stride, row_stride, rows, group, dim, stride, partial);
}


// out[g] (float32 [group][dim]) = the softmax-weighted value sum of `count` partials, partial
// i at first + i * group * (dim + 2), each [group][dim + 2] as attend_block writes them.
inline void merge_partials(const float* first, int64_t count, int64_t group, int64_t dim, float* out) {
  const int64_t stride = group * (dim + 2);
  for (int64_t g = 0; g < group; ++g) {
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t i = 0; i < count; ++i) m = std::max(m, first[i * stride + g * (dim + 2) + dim]);
    float* o = out + g * dim;
    std::fill(o, o + dim, 0.f);
    float total = 0.f;
    for (int64_t i = 0; i < count; ++i) {
      const float* part = first + i * stride + g * (dim + 2);
      const float weight = std::exp(part[dim] - m);
      total += weight * part[dim + 1];
      for (int64_t d = 0; d < dim; ++d) o[d] += weight * part[d];
    }
    const float inverse = 1.f / total;
    for (int64_t d = 0; d < dim; ++d) o[d] *= inverse;
  }
}

// One request's cache layer: rows of `dim` elements, `head_stride` elements between KV heads.
template <typename T>
struct CacheView {
  const T* keys;
  const T* values;
  int64_t head_stride;
  int64_t row_stride;
  int64_t length;
};

// out[r][h] (float32, rows of [heads, dim]) = attention of q[r][h] (float32, pre-scaled by the
// softmax scale) over views[b], r = batch_rows[b] (or b when batch_rows is empty: a batch of
// some dense requests among sparse ones attends in place).
template <typename T>
void decode_attention(const float* q, const std::vector<CacheView<T>>& views, int64_t heads, int64_t kv_heads,
                      int64_t dim, float* out, const std::vector<int64_t>& batch_rows = {}) {
  const int64_t group = heads / kv_heads, batch = static_cast<int64_t>(views.size());
  auto row_of = [&](int64_t b) { return batch_rows.empty() ? b : batch_rows[b]; };
  std::vector<Item> items;
  std::vector<int64_t> first_item{0};
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t h = 0; h < kv_heads; ++h)
      for (int64_t r = 0; r < views[b].length; r += kBlockRows)
        items.push_back({b, h, r, std::min(r + kBlockRows, views[b].length)});
    first_item.push_back(static_cast<int64_t>(items.size()));
  }
  // Rows of one request in a prefill chunk each come as a request over the same cache:
  // schedule the items of one cache block together so the block is read from memory once.
  std::vector<int64_t> schedule(items.size());
  for (size_t i = 0; i < items.size(); ++i) schedule[i] = static_cast<int64_t>(i);
  std::stable_sort(schedule.begin(), schedule.end(), [&](int64_t a, int64_t b) {
    const Item &x = items[a], &y = items[b];
    const T *x_keys = views[x.request].keys, *y_keys = views[y.request].keys;
    if (x_keys != y_keys) return std::less<const T*>()(x_keys, y_keys);
    if (x.head != y.head) return x.head < y.head;
    return x.row_begin < y.row_begin;
  });
  std::vector<float> partials(items.size() * group * (dim + 2));
  // items claimed in schedule order (claimed_items.h)
  for_each_claimed(static_cast<int64_t>(items.size()), [&](int64_t s) {
    const int64_t i = schedule[s];
    const Item& item = items[i];
    const CacheView<T>& view = views[item.request];
    attend_block<T>(q + (row_of(item.request) * heads + item.head * group) * dim, view.keys + item.head * view.head_stride,
                    view.values + item.head * view.head_stride, view.row_stride, item.row_begin, item.row_end,
                    group, dim, partials.data() + i * group * (dim + 2), /*streaming=*/true);
  });
  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / kv_heads, h = bh % kv_heads;
      // a request's items are pushed head by head, the same number for every head
      const int64_t count = (first_item[b + 1] - first_item[b]) / kv_heads, first = first_item[b] + h * count;
      merge_partials(partials.data() + first * group * (dim + 2), count, group, dim, out + (row_of(b) * heads + h * group) * dim);
    }
  });
}

}  // namespace ragkv
