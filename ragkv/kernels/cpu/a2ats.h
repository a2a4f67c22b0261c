// A2ATS sparse decode attention for one request's cache layer (CPU): score the candidate
// rows from their VQ codes, keep the top k per KV head, attend exactly over the kept rows
// plus the always-attended sinks and recent window. The Python selector (ragkv.sparse.a2ats,
// every option: mean key on/off, head_aggregation 'probs'/'logits', rerank) is its reference.
//
// Per KV head and candidate row t of [start, end), for each scored query vector g (each
// query head, or with 'logits' their sum):
//   s[g][t] = table[g][code[t]] + coef[g] . rotary[t]
// table[g] = WRoPE-rotated query . residual centroids (one [C] row per vector), and the
// second term the calibration mean key scored with its exact RoPE at position t (coef is
// the query folded with the mean key's rotation pairs, rotary the [cos | sin] table of
// positions). 'probs' ranks rows by their estimated attention probabilities, normalised
// together with the exact logits of the always-attended rows and summed over the group;
// 'logits' by s itself. The top rows are found by a radix select on their float bits; with
// rerank the codes pick `candidates` rows and the k with the most exact mass among them
// (their keys read) are kept. Work is split into (head, block of rows) items over torch's
// intra-op threads; nothing per row is stored beyond one float per (scored vector, row),
// in scratch buffers kept per thread across calls.
//
// The mean-key term of a tile of rows from position p0 is evaluated with the coefficients
// rotated to p0 (angle addition: q . R(p0 + j) m = q' . R(j) m with q' = q rotated by p0)
// against the [cos | sin] of positions 0..kTileRows - 1, which stay in L1: only one row of
// the rotary table is read per tile.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "attention.h"

namespace ragkv {

constexpr int64_t kScoreRows = 576;  // a multiple of every scoring tile (24, 32 and 64 rows)
constexpr int64_t kTableColumns = 256;
constexpr int64_t kRerankRows = 128;  // a multiple of the 4-row score tiles
constexpr int kRadixBits = 11;

// One layer of a request's A2ATS state, as the Python selector holds it.
struct A2atsLayer {
  const int16_t* codes;         // codes[h * codes_head_stride + t]
  int64_t codes_head_stride;
  const float* centroids_t;     // [Hkv, D, C] residual centroids, transposed
  int64_t centroids;            // C
  const float* key_mean;        // [Hkv, D]; nullptr = no mean-key term
  const float* rotary;          // [positions, D]: cos | sin of every rotation pair at each position
  const float* rotary_tile;     // [kTileRows / 8][D][8]: the same for positions 0..kTileRows - 1, in score_rows' layout
  const float* wrope_cos;       // [D] at relative position (offset - current position)
  const float* wrope_sin;
  int64_t start, end, k;        // rows [start, end) are scored; k kept
  int64_t candidates;           // the codes pick this many (>= k); more than k: the k with the most exact mass among them
  bool logits;                  // rank by the group's summed logits instead of its summed probabilities
};

namespace a2ats_detail {

// A buffer of the calling thread, kept across calls (resized, never shrunk or cleared).
template <int Slot, typename T>
T* scratch(int64_t size) {
  thread_local std::vector<T> buffer;
  if (static_cast<int64_t>(buffer.size()) < size) buffer.resize(size);
  return buffer.data();
}

constexpr int64_t kTileRows = 64;  // the longest scoring tile

// coef[g] rotated to position p0: the pair (a, b) of rotation i becomes
// (a cos + b sin, b cos - a sin) at angle p0 w_i, so that coef' . R(j) m = coef . R(p0 + j) m.
inline void rotate_coefficients(const float* coef, const float* rotary_row, int64_t dim, float* out) {
  const int64_t half = dim / 2;
  int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
  for (; i + 8 <= half; i += 8) {
    const __m256 a = _mm256_loadu_ps(coef + i), b = _mm256_loadu_ps(coef + half + i);
    const __m256 c = _mm256_loadu_ps(rotary_row + i), s = _mm256_loadu_ps(rotary_row + half + i);
    _mm256_storeu_ps(out + i, _mm256_fmadd_ps(a, c, _mm256_mul_ps(b, s)));
    _mm256_storeu_ps(out + half + i, _mm256_fmsub_ps(b, c, _mm256_mul_ps(a, s)));
  }
#endif
  for (; i < half; ++i) {
    const float a = coef[i], b = coef[half + i], c = rotary_row[i], s = rotary_row[half + i];
    out[i] = a * c + b * s;
    out[half + i] = b * c - a * s;
  }
}

// x * cos + rotate_half(x) * sin
inline void rotate(const float* x, const float* cos, const float* sin, int64_t dim, float* out) {
  const int64_t half = dim / 2;
  for (int64_t d = 0; d < half; ++d) {
    out[d] = x[d] * cos[d] - x[d + half] * sin[d];
    out[d + half] = x[d + half] * cos[d + half] + x[d] * sin[d + half];
  }
}

// (max, exp-sum) of the exact logits q . k_r over rows [begin, end) of one KV head.
template <typename T>
std::pair<float, float> exact_logsumexp_parts(const float* q, const T* keys, int64_t row_stride, int64_t begin,
                                              int64_t end, int64_t dim) {
  constexpr int64_t stride = kBlockRows + 8;
  alignas(32) float scores[stride];
  float m = -std::numeric_limits<float>::infinity(), sum = 0.f;
  for (int64_t r = begin; r < end; r += kBlockRows) {
    const int64_t rows = std::min(kBlockRows, end - r);
    block_scores<T>(q, keys + r * row_stride, keys + r * row_stride, row_stride, rows, 1, dim, scores, stride);
    const auto [block_max, block_sum] = block_softmax(scores, rows);
    const float merged = std::max(m, block_max);
    sum = sum * std::exp(m - merged) + block_sum * std::exp(block_max - merged);
    m = merged;
  }
  return {m, sum};
}

#if defined(__AVX2__) && defined(__FMA__)
// table[g][c] = rotated[g] . centroids[:, c] for Group query heads and 16 centroids from c.
template <int Group>
inline void table_columns16(const float* rotated, const float* centroids, int64_t C, int64_t dim, float* table) {
  __m256 acc[Group][2];
  for (int g = 0; g < Group; ++g) acc[g][0] = acc[g][1] = _mm256_setzero_ps();
  for (int64_t d = 0; d < dim; ++d) {
    const __m256 c0 = _mm256_loadu_ps(centroids + d * C), c1 = _mm256_loadu_ps(centroids + d * C + 8);
    for (int g = 0; g < Group; ++g) {
      const __m256 r = _mm256_broadcast_ss(rotated + g * dim + d);
      acc[g][0] = _mm256_fmadd_ps(r, c0, acc[g][0]);
      acc[g][1] = _mm256_fmadd_ps(r, c1, acc[g][1]);
    }
  }
  for (int g = 0; g < Group; ++g) {
    _mm256_storeu_ps(table + g * C, acc[g][0]);
    _mm256_storeu_ps(table + g * C + 8, acc[g][1]);
  }
}

// s[g][i] for Group query heads and 8 x Vectors rows: the table lookups through the codes,
// plus the mean-key term (coefficients already rotated to the tile's first position) as
// Vectors x Group independent FMA chains against `local` = [tiles][D][8], the [cos | sin]
// of positions 0, 1, ...
template <int Group, int Vectors>
inline void score_rows(const float* const* table, const float* const* coef, const int16_t* codes,
                       const float* local, int64_t dim, float* const* out) {
  __m256 acc[Group][Vectors];
  for (int v = 0; v < Vectors; ++v) {
    const __m256i index = _mm256_cvtepi16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 8 * v)));
    for (int g = 0; g < Group; ++g) acc[g][v] = _mm256_i32gather_ps(table[g], index, 4);
  }
  if (coef[0] != nullptr) {
    const int64_t tile = dim * 8;
    for (int64_t d = 0; d < dim; ++d) {
      __m256 c[Group];
      for (int g = 0; g < Group; ++g) c[g] = _mm256_broadcast_ss(coef[g] + d);
      for (int v = 0; v < Vectors; ++v) {
        const __m256 r = _mm256_loadu_ps(local + v * tile + d * 8);
        for (int g = 0; g < Group; ++g) acc[g][v] = _mm256_fmadd_ps(c[g], r, acc[g][v]);
      }
    }
  }
  for (int g = 0; g < Group; ++g)
    for (int v = 0; v < Vectors; ++v) _mm256_storeu_ps(out[g] + 8 * v, acc[g][v]);
}
#endif

// table[g][c] for every query head g of one KV head and centroids [c0, c1).
inline void table_block(const float* rotated, const float* centroids, int64_t C, int64_t c0, int64_t c1,
                        int64_t group, int64_t dim, float* table) {
  int64_t c = c0;
#if defined(__AVX2__) && defined(__FMA__)
  for (; c + 16 <= c1; c += 16)
    for (int64_t g0 = 0; g0 < group; g0 += 3) {
      const float* r = rotated + g0 * dim;
      float* out = table + g0 * C + c;
      switch (std::min<int64_t>(3, group - g0)) {
        case 1: table_columns16<1>(r, centroids + c, C, dim, out); break;
        case 2: table_columns16<2>(r, centroids + c, C, dim, out); break;
        default: table_columns16<3>(r, centroids + c, C, dim, out); break;
      }
    }
#endif
  for (; c < c1; ++c)
    for (int64_t g = 0; g < group; ++g) {
      float s = 0.f;
      for (int64_t d = 0; d < dim; ++d) s += rotated[g * dim + d] * centroids[d * C + c];
      table[g * C + c] = s;
    }
}

// s[g][i] = table[g][codes[i]] + coef[g] . rotary[position + i] for `rows` rows from
// `position`; local is [tiles][D][8], the [cos | sin] of positions 0..kTileRows - 1.
inline void score_block(const float* table, const float* coef, int64_t C, const int16_t* codes, const float* rotary,
                        const float* local, int64_t position, int64_t rows, int64_t group, int64_t dim, float* scores,
                        int64_t scores_stride, bool mean_key) {
  for (int64_t g0 = 0; g0 < group; g0 += 3) {
    const int slice = static_cast<int>(std::min<int64_t>(3, group - g0));
    int64_t t = 0;
#if defined(__AVX2__) && defined(__FMA__)
    // rows per tile so that slice x vectors FMA chains hide the FMA latency in 16 registers
    const int64_t tile_rows = slice == 1 ? 64 : slice == 2 ? 32 : 24;
    alignas(32) float rotated[3 * kMaxDim];
    const float* tables[3];
    const float* coefs[3];
    for (int g = 0; g < slice; ++g) {
      tables[g] = table + (g0 + g) * C;
      coefs[g] = mean_key ? rotated + g * dim : nullptr;
    }
    for (; t + tile_rows <= rows; t += tile_rows) {
      if (mean_key)
        for (int g = 0; g < slice; ++g)
          rotate_coefficients(coef + (g0 + g) * dim, rotary + (position + t) * dim, dim, rotated + g * dim);
      float* outs[3];
      for (int g = 0; g < slice; ++g) outs[g] = scores + (g0 + g) * scores_stride + t;
      switch (slice) {
        case 1: score_rows<1, 8>(tables, coefs, codes + t, local, dim, outs); break;
        case 2: score_rows<2, 4>(tables, coefs, codes + t, local, dim, outs); break;
        default: score_rows<3, 3>(tables, coefs, codes + t, local, dim, outs); break;
      }
    }
#endif
    for (; t < rows; ++t)
      for (int64_t g = g0; g < g0 + slice; ++g) {
        float s = table[g * C + codes[t]];
        if (mean_key)
          for (int64_t d = 0; d < dim; ++d) s += coef[g * dim + d] * rotary[(position + t) * dim + d];
        scores[g * scores_stride + t] = s;
      }
  }
}

// Bits of a float that order like the float, as unsigned integers.
inline uint32_t order_bits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits & 0x80000000u ? ~bits : bits | 0x80000000u;
}

// The positions of the k largest of values[0:n), offset by `offset`, in no order: a
// histogram of the top kRadixBits bits finds the bin holding the k-th largest, every
// value above it is kept and the bin itself is resolved by nth_element.
inline void top_k(const float* values, int64_t n, int64_t k, int64_t offset, int64_t* chosen) {
  constexpr int shift = 32 - kRadixBits, bins = 1 << kRadixBits;
  thread_local std::vector<uint32_t> keys;
  keys.resize(n);
  for (int64_t i = 0; i < n; ++i) keys[i] = order_bits(values[i]);
  // two interleaved histograms: consecutive equal bins do not wait on each other's stores
  std::array<int32_t, 2 * bins> counts{};
  int64_t i = 0;
  for (; i + 2 <= n; i += 2) {
    ++counts[keys[i] >> shift];
    ++counts[bins + (keys[i + 1] >> shift)];
  }
  for (; i < n; ++i) ++counts[keys[i] >> shift];
  int64_t above = 0;
  uint32_t bin = bins - 1;
  while (above + counts[bin] + counts[bins + bin] < k) {
    above += counts[bin] + counts[bins + bin];
    --bin;
  }
  const uint32_t floor = bin << shift, ceiling = floor + (1u << shift);
  // branch-free: every row is written, the counts advance only for the rows that qualify
  // (fewer than k rows lie above the boundary bin, so chosen[taken] stays inside chosen)
  const uint32_t* key = keys.data();
  thread_local std::vector<uint32_t> boundary_keys;
  thread_local std::vector<int64_t> boundary_rows;
  boundary_keys.resize(n + 1);
  boundary_rows.resize(n + 1);
  uint32_t* b_keys = boundary_keys.data();
  int64_t* b_rows = boundary_rows.data();
  int64_t taken = 0, on_boundary = 0;
  for (int64_t j = 0; j < n; ++j) {
    const uint32_t value = key[j];
    chosen[taken] = offset + j;
    taken += value >= ceiling;
    b_keys[on_boundary] = value;
    b_rows[on_boundary] = j;
    on_boundary += (value >= floor) & (value < ceiling);
  }
  const int64_t need = k - taken;
  thread_local std::vector<int64_t> order;
  order.resize(on_boundary);
  for (int64_t j = 0; j < on_boundary; ++j) order[j] = j;
  std::nth_element(order.begin(), order.begin() + need, order.end(),
                   [&](int64_t x, int64_t y) { return b_keys[x] > b_keys[y]; });
  for (int64_t j = 0; j < need; ++j) chosen[taken++] = offset + b_rows[order[j]];
}

// Fetch the cache lines of one row.
template <typename T>
inline void prefetch_row(const T* row, int64_t dim) {
#if defined(__AVX2__) && defined(__FMA__)
  for (int64_t offset = 0; offset < dim * static_cast<int64_t>(sizeof(T)); offset += 64)
    _mm_prefetch(reinterpret_cast<const char*>(row) + offset, _MM_HINT_T0);
#endif
}

}  // namespace a2ats_detail

// Cache rows row_of(0 .. count - 1) of one KV head into contiguous buffers (values too when
// values_out is not null), prefetching a few rows ahead: chosen rows are scattered.
template <typename T, typename RowOf>
void gather_rows(const T* keys, const T* values, int64_t row_stride, int64_t count, int64_t dim, RowOf row_of,
                 T* keys_out, T* values_out) {
  constexpr int64_t ahead = 8;
  auto prefetch = [&](int64_t i) {
    a2ats_detail::prefetch_row(keys + row_of(i) * row_stride, dim);
    if (values_out != nullptr) a2ats_detail::prefetch_row(values + row_of(i) * row_stride, dim);
  };
  for (int64_t i = 0; i < std::min(ahead, count); ++i) prefetch(i);
  for (int64_t i = 0; i < count; ++i) {
    if (i + ahead < count) prefetch(i + ahead);
    const int64_t row = row_of(i);
    std::memcpy(keys_out + i * dim, keys + row * row_stride, dim * sizeof(T));
    if (values_out != nullptr) std::memcpy(values_out + i * dim, values + row * row_stride, dim * sizeof(T));
  }
}

// out [Hq, dim] float32 = attention of q (float32 [Hq, dim], pre-scaled by the softmax
// scale, post-RoPE) over rows [0, start), the k chosen rows of [start, end) and
// [end, view.length) of each KV head; the chosen rows go to chosen [Hkv, k] when it is
// not null. k >= end - start attends every row.
template <typename T>
void a2ats_attention(const float* q, const CacheView<T>& view, const A2atsLayer& plan, int64_t heads,
                     int64_t kv_heads, int64_t dim, float* out, int64_t* chosen_out) {
  using namespace a2ats_detail;
  const int64_t group = heads / kv_heads, rows = view.length, C = plan.centroids;
  const int64_t start = plan.start, end = plan.end, n = end - start, half = dim / 2;
  const int64_t k = std::min(plan.k, n), candidates = std::min(std::max(plan.candidates, k), n);
  const bool mean_key = plan.key_mean != nullptr, rerank = candidates > k;
  // query vectors the codes score per KV head: each query head, or their sum
  const int64_t scored = plan.logits ? 1 : group;
  const int64_t blocks = (n + kScoreRows - 1) / kScoreRows;
  auto block_begin = [&](int64_t b) { return std::min(end, start + b * kScoreRows); };
  const int64_t table_blocks = (C + kTableColumns - 1) / kTableColumns;

  float* table = scratch<0, float>(kv_heads * scored * C);
  float* coef = scratch<1, float>(kv_heads * scored * dim);
  float* rotated = scratch<2, float>(kv_heads * scored * dim);
  float* fixed_lse = scratch<3, float>(heads);
  float* scores = scratch<4, float>(kv_heads * scored * std::max<int64_t>(n, 1));
  float* block_max = scratch<5, float>(kv_heads * scored * blocks);
  float* block_sum = scratch<6, float>(kv_heads * scored * blocks);
  int64_t* picked = scratch<7, int64_t>(kv_heads * std::max<int64_t>(candidates, 1));
  int64_t* chosen = scratch<8, int64_t>(kv_heads * std::max<int64_t>(k, 1));
  float* rank = scratch<9, float>(kv_heads * std::max<int64_t>(n, 1));
  if (k > 0 && k < n) {
    at::parallel_for(0, kv_heads, 1, [&](int64_t begin, int64_t last) {
      float* summed = scratch<20, float>(dim);
      for (int64_t h = begin; h < last; ++h) {
        for (int64_t s = 0; s < scored; ++s) {
          const float* query = q + (h * group + s) * dim;
          if (plan.logits) {
            std::fill(summed, summed + dim, 0.f);
            for (int64_t g = 0; g < group; ++g)
              for (int64_t d = 0; d < dim; ++d) summed[d] += q[(h * group + g) * dim + d];
            query = summed;
          }
          const int64_t hs = h * scored + s;
          rotate(query, plan.wrope_cos, plan.wrope_sin, dim, rotated + hs * dim);
          if (mean_key) {
            const float* mean = plan.key_mean + h * dim;
            for (int64_t i = 0; i < half; ++i) {
              const float q1 = query[i], q2 = query[i + half], x = mean[i], y = mean[i + half];
              coef[hs * dim + i] = q1 * x + q2 * y;
              coef[hs * dim + half + i] = q2 * x - q1 * y;
            }
          }
        }
        if (plan.logits && !rerank) continue;
        const T* keys = view.keys + h * view.head_stride;
        for (int64_t g = 0; g < group; ++g) {
          const float* query = q + (h * group + g) * dim;
          const auto [m0, s0] = exact_logsumexp_parts<T>(query, keys, view.row_stride, 0, start, dim);
          const auto [m1, s1] = exact_logsumexp_parts<T>(query, keys, view.row_stride, end, rows, dim);
          const float m = std::max(m0, m1);
          fixed_lse[h * group + g] = std::isinf(m) ? m : m + std::log(s0 * std::exp(m0 - m) + s1 * std::exp(m1 - m));
        }
      }
    });
    at::parallel_for(0, kv_heads * table_blocks, 1, [&](int64_t begin, int64_t last) {
      for (int64_t item = begin; item < last; ++item) {
        const int64_t h = item / table_blocks, c0 = item % table_blocks * kTableColumns;
        table_block(rotated + h * scored * dim, plan.centroids_t + h * dim * C, C, c0,
                    std::min(C, c0 + kTableColumns), scored, dim, table + h * scored * C);
      }
    });
    at::parallel_for(0, kv_heads * blocks, 1, [&](int64_t begin, int64_t last) {
      for (int64_t item = begin; item < last; ++item) {
        const int64_t h = item / blocks, b = item % blocks, first = block_begin(b) - start;
        const int64_t count = block_begin(b + 1) - start - first;
        float* block = scores + h * scored * n + first;
        score_block(table + h * scored * C, coef + h * scored * dim, C,
                    plan.codes + h * plan.codes_head_stride + start + first, plan.rotary, plan.rotary_tile, start + first, count,
                    scored, dim, block, n, mean_key);
        if (plan.logits) continue;
        for (int64_t g = 0; g < group; ++g) {
          const auto [m, sum] = block_softmax(block + g * n, count);
          block_max[(h * group + g) * blocks + b] = m;
          block_sum[(h * group + g) * blocks + b] = sum;
        }
      }
    });
    const float* ranked = plan.logits ? scores : rank;  // [Hkv, n]
    if (!plan.logits) {
      // each query head's estimated probabilities: exps of a block times exp(block max - lse)
      float* weights = scratch<11, float>(heads * blocks);
      for (int64_t hg = 0; hg < heads; ++hg) {
        const float* maxima = block_max + hg * blocks;
        const float* sums = block_sum + hg * blocks;
        const float peak = *std::max_element(maxima, maxima + blocks);
        float total = 0.f;
        for (int64_t b = 0; b < blocks; ++b) total += sums[b] * std::exp(maxima[b] - peak);
        const float estimated = peak + std::log(total), fixed = fixed_lse[hg];
        const float top = std::max(estimated, fixed);
        const float lse = top + std::log(std::exp(estimated - top) + std::exp(fixed - top));
        for (int64_t b = 0; b < blocks; ++b) weights[hg * blocks + b] = std::exp(maxima[b] - lse);
      }
      at::parallel_for(0, kv_heads * blocks, 1, [&](int64_t begin, int64_t last) {
        for (int64_t item = begin; item < last; ++item) {
          const int64_t h = item / blocks, b = item % blocks;
          const int64_t first = block_begin(b) - start, last_row = block_begin(b + 1) - start;
          float* mass = rank + h * n;
          for (int64_t g = 0; g < group; ++g) {
            const float weight = weights[(h * group + g) * blocks + b];
            const float* e = scores + (h * group + g) * n;
            if (g == 0)
              for (int64_t t = first; t < last_row; ++t) mass[t] = weight * e[t];
            else
              for (int64_t t = first; t < last_row; ++t) mass[t] += weight * e[t];
          }
        }
      });
    }
    at::parallel_for(0, kv_heads, 1, [&](int64_t begin, int64_t last) {
      for (int64_t h = begin; h < last; ++h)
        top_k(ranked + h * n, n, candidates, start, (rerank ? picked : chosen) + h * candidates);
    });
    if (rerank) {
      // the k candidates with the most exact attention mass, normalised with the fixed rows:
      // their exact logits in (head, chunk of candidates) items, so both cores share the reads
      const int64_t stride = candidates + 8, chunks = (candidates + kRerankRows - 1) / kRerankRows;
      float* logits = scratch<15, float>(heads * stride);
      at::parallel_for(0, kv_heads * chunks, 1, [&](int64_t begin, int64_t last) {
        T* keys = scratch<21, T>(kRerankRows * dim);
        for (int64_t item = begin; item < last; ++item) {
          const int64_t h = item / chunks, first = item % chunks * kRerankRows;
          const int64_t count = std::min(kRerankRows, candidates - first);
          const int64_t* rows_of = picked + h * candidates + first;
          gather_rows<T>(view.keys + h * view.head_stride, nullptr, view.row_stride, count, dim,
                         [&](int64_t i) { return rows_of[i]; }, keys, nullptr);
          block_scores<T>(q + h * group * dim, keys, keys, dim, count, group, dim, logits + h * group * stride + first,
                          stride);
        }
      });
      at::parallel_for(0, kv_heads, 1, [&](int64_t begin, int64_t last) {
        float* mass = scratch<23, float>(candidates);
        int64_t* best = scratch<24, int64_t>(k);
        for (int64_t h = begin; h < last; ++h) {
          std::fill(mass, mass + candidates, 0.f);
          for (int64_t g = 0; g < group; ++g) {
            float* l = logits + (h * group + g) * stride;
            const auto [m, sum] = block_softmax(l, candidates);
            const float fixed = fixed_lse[h * group + g], exact = m + std::log(sum);
            const float top = std::max(exact, fixed);
            const float weight = std::exp(m - (top + std::log(std::exp(exact - top) + std::exp(fixed - top))));
            for (int64_t i = 0; i < candidates; ++i) mass[i] += weight * l[i];
          }
          top_k(mass, candidates, k, 0, best);
          for (int64_t i = 0; i < k; ++i) chosen[h * k + i] = picked[h * candidates + best[i]];
        }
      });
    }
  }

  // exact attention over sinks + kept rows + window, gathered per head into chunks
  const int64_t attended = start + k + (rows - end);
  const int64_t chunks = (attended + kBlockRows - 1) / kBlockRows;
  float* partials = scratch<12, float>(kv_heads * chunks * group * (dim + 2));
  at::parallel_for(0, kv_heads * chunks, 1, [&](int64_t begin, int64_t last) {
    T* keys = scratch<13, T>(kBlockRows * dim);
    T* values = scratch<14, T>(kBlockRows * dim);
    for (int64_t item = begin; item < last; ++item) {
      const int64_t h = item / chunks, c = item % chunks, first = c * kBlockRows;
      const int64_t count = std::min(kBlockRows, attended - first);
      const T* head_keys = view.keys + h * view.head_stride;
      const T* head_values = view.values + h * view.head_stride;
      auto row_of = [&](int64_t j) {
        if (j < start) return j;
        if (j < start + k) return k < n ? chosen[h * k + (j - start)] : j;
        return end + (j - start - k);
      };
      gather_rows<T>(head_keys, head_values, view.row_stride, count, dim, [&](int64_t i) { return row_of(first + i); },
                     keys, values);
      attend_block<T>(q + h * group * dim, keys, values, dim, 0, count, group, dim,
                      partials + item * group * (dim + 2));
    }
  });
  for (int64_t h = 0; h < kv_heads; ++h)
    merge_partials(partials + h * chunks * group * (dim + 2), chunks, group, dim, out + h * group * dim);
  if (chosen_out != nullptr && k < n) std::copy(chosen, chosen + kv_heads * k, chosen_out);
}

}  // namespace ragkv
