// A2ATS sparse decode attention for one request's cache layer (CPU): score the candidate
// rows from their VQ codes, keep the top k per KV head, attend exactly over the kept rows
// plus the always-attended sinks and recent window. The Python selector (ragkv.sparse.a2ats,
// every option: mean key on/off, head_aggregation 'probs'/'logits', rerank) is its reference.
//
// Per KV head and candidate row t of [start, end), for each scored query vector g (each
// query head, or with 'logits' their sum):
//   s[g][t] = table[g][code[t]] + coef[g] . rotary[t]
// table[g] = WRoPE-rotated query . residual centroids (one [C] row per vector, the
// centroids read as int8 tiles of 16 with a float scale per centroid, contiguous, so a step
// streams a quarter of float32's bytes), and the second term the calibration mean key
// scored with its exact RoPE at position t (coef is
// the query folded with the mean key's rotation pairs, rotary the [cos | sin] table of
// positions). 'probs' ranks rows by their estimated attention probabilities, normalised
// together with the exact logits of the always-attended rows and summed over the group;
// 'logits' by s itself. The top rows are found by a radix select on their float bits (over
// the rows at or above a bound from a strided sample of the scores, when k is a small share)
// and come out ascending; with rerank the codes pick `candidates` rows and the k with the most
// exact mass among them (their keys read) are kept, and their logits serve the attention,
// which then reads only their values. Work is split into (head, block) items that torch's
// intra-op threads take in order (see a2ats_attention); nothing per row is stored beyond
// one float per (scored vector, row), in scratch buffers kept per thread across calls.
//
// The mean-key term of a tile of 64 rows from position p0 is evaluated with the coefficients
// rotated to the tile's middle p0 + 31.5 (angle addition: q . R(p0 + j) m = q' . R(j - 31.5) m
// with q' = q rotated by p0 + 31.5). Offsets +-(u + 1/2) share cos((u + 1/2) w) (even) and
// sin((u + 1/2) w) (odd), so the 64 rows cost 32 sums of each half of the coefficients, against
// a [cos | sin] table of the 32 half offsets that stays in L1; only one row of the rotary
// table is read per tile.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <thread>
#include <vector>

#include "attention.h"

namespace ragkv {

// Most rows per scoring item (a multiple of kWarmEvery). Each item pays a claim and restarts
// the stream of its codes, which waits on DRAM latency, so items are large; larger still
// would leave too few later items for the candidate warming to hide in.
constexpr int64_t kScoreRows = 2048;
constexpr int64_t kWarmEvery = 128;  // rows scored between two batches of warmed candidate rows (two 64-row tiles)
constexpr int64_t kWarmRows = 16;    // candidate rows (key and value) warmed per batch
// Centroids per table item (a multiple of kTileCentroids): an item restarts the stream of
// its tiles, so a 1024-centroid codebook is one item per head, one uninterrupted stream.
constexpr int64_t kTableColumns = 1024;
constexpr int64_t kTileCentroids = 16;
constexpr int64_t kRerankRows = 512;  // a multiple of the 4-row score tiles; each chunk restarts its reads ahead, so chunks are large
constexpr int kRadixBits = 11;
constexpr int kNarrowRadixBits = 8;
constexpr int64_t kWideRadixKeys = 4096;  // keys from which a radix level takes kRadixBits

// One layer of a request's A2ATS state, as the Python selector holds it.
struct A2atsLayer {
  const int16_t* codes;         // codes[h * codes_head_stride + t]
  int64_t codes_head_stride;
  const int8_t* centroid_tiles;  // [Hkv, C / kTileCentroids, D, kTileCentroids] residual centroids, int8
  const float* centroid_scales;  // [Hkv, C]: centroid c is centroid_scales[c] times its int8 row
  const int8_t* next_centroid_tiles;  // the next layer's, warmed while this layer's values are read; or nullptr
  int64_t next_tiles_bytes;
  int64_t centroids;            // C, a multiple of kTileCentroids (the codebook's, padded)
  const float* key_mean;        // [Hkv, D]; nullptr = no mean-key term
  const float* rotary;          // [positions, D]: cos | sin of every rotation pair at each position
  const float* middle_offsets;  // [D][32]: cos (i < D / 2), then sin, of rotation pair i at offsets u + 1/2, u < 32
  const float* half_turn;       // [D]: cos | sin of half a position, divided by the rotary table's scaling
  const float* wrope_cos;       // [D] at relative position (offset - current position)
  const float* wrope_sin;
  int64_t start, end, k;        // rows [start, end) are scored; k kept
  int64_t candidates;           // the codes pick this many (>= k); more than k: the k with the most exact mass among them
  bool logits;                  // rank by the group's summed logits instead of its summed probabilities
};

namespace a2ats_detail {

struct Scratch;
template <int Slot, typename T>
T* scratch(int64_t size) {
  return thread_buffer<Scratch, Slot, T>(size);
}

constexpr int64_t kTileRows = 64;  // rows per scoring tile (mean_key_tiles, lookup64)
constexpr int64_t kHalfTile = kTileRows / 2;

// coef[g] rotated to position p0: the pair (a, b) of rotation i becomes
// (a cos + b sin, b cos - a sin) at angle p0 w_i, so that coef' . R(j) m = coef . R(p0 + j) m.
inline void rotate_coefficients(const float* coef, const float* rotary_row, int64_t dim, float* out) {
  const int64_t half = dim / 2;
  int64_t i = 0;
  for (; i + 8 <= half; i += 8) {
    const __m256 a = _mm256_loadu_ps(coef + i), b = _mm256_loadu_ps(coef + half + i);
    const __m256 c = _mm256_loadu_ps(rotary_row + i), s = _mm256_loadu_ps(rotary_row + half + i);
    _mm256_storeu_ps(out + i, _mm256_fmadd_ps(a, c, _mm256_mul_ps(b, s)));
    _mm256_storeu_ps(out + half + i, _mm256_fmsub_ps(b, c, _mm256_mul_ps(a, s)));
  }
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

// table[g][16 t + j] = rotated[g] . centroid 16 t + j, for Group query vectors and Tiles
// consecutive tiles of 16 centroids ([D][16] int8 each, times scales[16 t + j]).
template <int Group, int Tiles>
inline void table_tiles(const float* rotated, const int8_t* tiles, const float* scales, int64_t dim, float* table,
                        int64_t table_stride) {
  __m256 acc[Group][2 * Tiles];
  for (int g = 0; g < Group; ++g)
    for (int v = 0; v < 2 * Tiles; ++v) acc[g][v] = _mm256_setzero_ps();
  // the next Tiles tiles (contiguous, read next): Tiles interleaved streams are followed
  // poorly by the hardware prefetcher
  const char* next = reinterpret_cast<const char*>(tiles + Tiles * dim * kTileCentroids);
  constexpr int64_t bytes_per_d = Tiles * kTileCentroids;
  for (int64_t d = 0; d < dim; ++d) {
    if (d * bytes_per_d % 64 < bytes_per_d) _mm_prefetch(next + d * bytes_per_d / 64 * 64, _MM_HINT_T0);
    if (bytes_per_d > 64) _mm_prefetch(next + d * bytes_per_d + 64, _MM_HINT_T0);
    __m256 c[2 * Tiles];
    for (int t = 0; t < Tiles; ++t) {
      const int8_t* row = tiles + (t * dim + d) * kTileCentroids;
      c[2 * t] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row))));
      c[2 * t + 1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + 8))));
    }
    for (int g = 0; g < Group; ++g) {
      const __m256 r = _mm256_broadcast_ss(rotated + g * dim + d);
      for (int v = 0; v < 2 * Tiles; ++v) acc[g][v] = _mm256_fmadd_ps(r, c[v], acc[g][v]);
    }
  }
  for (int g = 0; g < Group; ++g)
    for (int v = 0; v < 2 * Tiles; ++v)
      _mm256_storeu_ps(table + g * table_stride + 8 * v, _mm256_mul_ps(acc[g][v], _mm256_loadu_ps(scales + 8 * v)));
}

// out[64 t : 64 t + 64] = the mean-key terms of Tiles tiles from their coefficients middle[t]
// (rotated to the tile's middle): row 32 + u gets A(u) + B(u) and row 31 - u gets A(u) - B(u),
// with A(u) = sum_i a_i cos((u + 1/2) w_i) over the cos half of the coefficients and B(u) the
// same over the sin half. Two tiles share every table load (two FMAs per load); the A sums
// wait in memory while the B sums take the registers.
template <int Tiles>
inline void mean_key_tiles(const float* const* middle, const float* offsets, int64_t dim, float* out) {
  const int64_t half = dim / 2;
  alignas(32) float even[Tiles][kHalfTile];
  for (int part = 0; part < 2; ++part) {
    __m256 acc[Tiles][4];
    for (int t = 0; t < Tiles; ++t)
      for (int v = 0; v < 4; ++v) acc[t][v] = _mm256_setzero_ps();
    for (int64_t i = part * half; i < (part + 1) * half; ++i) {
      const float* row = offsets + i * kHalfTile;
      const __m256 c0 = _mm256_loadu_ps(row), c1 = _mm256_loadu_ps(row + 8);
      const __m256 c2 = _mm256_loadu_ps(row + 16), c3 = _mm256_loadu_ps(row + 24);
      for (int t = 0; t < Tiles; ++t) {
        const __m256 a = _mm256_broadcast_ss(middle[t] + i);
        acc[t][0] = _mm256_fmadd_ps(a, c0, acc[t][0]);
        acc[t][1] = _mm256_fmadd_ps(a, c1, acc[t][1]);
        acc[t][2] = _mm256_fmadd_ps(a, c2, acc[t][2]);
        acc[t][3] = _mm256_fmadd_ps(a, c3, acc[t][3]);
      }
    }
    for (int t = 0; t < Tiles; ++t)
      for (int v = 0; v < 4; ++v) {
        if (part == 0) {
          _mm256_store_ps(even[t] + 8 * v, acc[t][v]);
          continue;
        }
        const __m256 a = _mm256_load_ps(even[t] + 8 * v);
        const __m256i reversed = _mm256_setr_epi32(7, 6, 5, 4, 3, 2, 1, 0);
        float* tile = out + t * kTileRows;
        _mm256_storeu_ps(tile + kHalfTile + 8 * v, _mm256_add_ps(a, acc[t][v]));
        _mm256_storeu_ps(tile + kHalfTile - 8 - 8 * v, _mm256_permutevar8x32_ps(_mm256_sub_ps(a, acc[t][v]), reversed));
      }
  }
}

// out[0:64] = table[codes[0:64]], added to out when `accumulate`.
inline void lookup64(const float* table, const int16_t* codes, float* out, bool accumulate) {
  for (int v = 0; v < 8; ++v) {
    const __m256i index = _mm256_cvtepi16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 8 * v)));
    const __m256 looked = _mm256_i32gather_ps(table, index, 4);
    _mm256_storeu_ps(out + 8 * v, accumulate ? _mm256_add_ps(_mm256_loadu_ps(out + 8 * v), looked) : looked);
  }
}

// table[g][c] for the `group` query vectors of one KV head and centroids [c0, c1), both
// multiples of kTileCentroids; tiles [C / kTileCentroids][D][kTileCentroids] int8, scales [C].
inline void table_block(const float* rotated, const int8_t* tiles, const float* scales, int64_t C, int64_t c0,
                        int64_t c1, int64_t group, int64_t dim, float* table) {
  int64_t tile = c0 / kTileCentroids;
  const int64_t last = c1 / kTileCentroids, tile_size = dim * kTileCentroids;
  // tiles per pass so that group x 2 x tiles FMA chains hide the FMA latency
  for (int64_t g0 = 0; g0 < group; g0 += 3) {
    const float* r = rotated + g0 * dim;
    float* out = table + g0 * C;
    const int64_t slice = std::min<int64_t>(3, group - g0);
    int64_t t = tile;
    // tiles from tile t through one table_tiles instantiation
    auto at_tile = [&](auto tiles_fn) {
      tiles_fn(r, tiles + t * tile_size, scales + t * kTileCentroids, dim, out + t * kTileCentroids, C);
    };
    for (; slice == 1 && t + 4 <= last; t += 4) at_tile(table_tiles<1, 4>);
    for (; slice == 2 && t + 2 <= last; t += 2) at_tile(table_tiles<2, 2>);
    for (; t < last; ++t) switch (slice) {
        case 1: at_tile(table_tiles<1, 1>); break;
        case 2: at_tile(table_tiles<2, 1>); break;
        default: at_tile(table_tiles<3, 1>); break;
      }
  }
  tile = last;
  for (; tile < last; ++tile)
    for (int64_t j = 0; j < kTileCentroids; ++j)
      for (int64_t g = 0; g < group; ++g) {
        float sum = 0.f;
        for (int64_t d = 0; d < dim; ++d)
          sum += rotated[g * dim + d] * static_cast<float>(tiles[(tile * dim + d) * kTileCentroids + j]);
        table[g * C + tile * kTileCentroids + j] = sum * scales[tile * kTileCentroids + j];
      }
}

// s[g][i] = table[g][codes[i]] + coef[g] . rotary[position + i] for `rows` rows from
// `position`; tiles of 64 rows take the mean-key term from their middle (see the top).
inline void score_block(const float* table, const float* coef, int64_t C, const int16_t* codes, const float* rotary,
                        const float* offsets, const float* half_turn, int64_t position, int64_t rows, int64_t group,
                        int64_t dim, float* scores, int64_t scores_stride, bool mean_key) {
  int64_t t = 0;
  alignas(32) float at_row[kMaxDim], middle[2][kMaxDim];
  const float* middles[2] = {middle[0], middle[1]};
  for (int64_t g = 0; g < group; ++g)
    for (t = 0; t + kTileRows <= rows;) {
      const int tiles = t + 2 * kTileRows <= rows ? 2 : 1;
      float* out = scores + g * scores_stride + t;
      if (mean_key) {
        for (int i = 0; i < tiles; ++i) {
          // by the table row at p0 + 31 (which carries the rotary scaling), then half a position
          rotate_coefficients(coef + g * dim, rotary + (position + t + i * kTileRows + kHalfTile - 1) * dim, dim, at_row);
          rotate_coefficients(at_row, half_turn, dim, middle[i]);
        }
        if (tiles == 2)
          mean_key_tiles<2>(middles, offsets, dim, out);
        else
          mean_key_tiles<1>(middles, offsets, dim, out);
      }
      for (int i = 0; i < tiles; ++i) lookup64(table + g * C, codes + t + i * kTileRows, out + i * kTileRows, mean_key);
      t += tiles * kTileRows;
    }
  for (; t < rows; ++t)
    for (int64_t g = 0; g < group; ++g) {
      float s = table[g * C + codes[t]];
      if (mean_key)
        for (int64_t d = 0; d < dim; ++d) s += coef[g * dim + d] * rotary[(position + t) * dim + d];
      scores[g * scores_stride + t] = s;
    }
}

// A float's bits as a signed integer that orders like the float (a negative float has its
// magnitude bits flipped).
inline int32_t order_key(float value) {
  int32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits ^ ((bits >> 31) & 0x7FFFFFFF);
}

// The radix digit of an order key: its unsigned bits (sign flipped) above `shift`, masked.
inline uint32_t digit(int32_t key, int shift, uint32_t mask) {
  return (static_cast<uint32_t>(key) ^ 0x80000000u) >> shift & mask;
}

inline __m256i order_keys8(const float* values) {
  const __m256i bits = _mm256_castps_si256(_mm256_loadu_ps(values));
  return _mm256_xor_si256(bits, _mm256_and_si256(_mm256_srai_epi32(bits, 31), _mm256_set1_epi32(0x7FFFFFFF)));
}

// Lane orders that move the lanes set in an 8-bit mask to the front, in order.
inline const std::array<std::array<int32_t, 8>, 256>& compress_lanes() {
  static const auto table = [] {
    std::array<std::array<int32_t, 8>, 256> lanes{};
    for (int mask = 0; mask < 256; ++mask)
      for (int lane = 0, kept = 0; lane < 8; ++lane)
        if (mask >> lane & 1) lanes[mask][kept++] = lane;
    return lanes;
  }();
  return table;
}

// Writes the lanes of `items` selected by `mask` at out[count] (all 8 lanes are stored: out
// needs 7 spare) and returns the new count.
inline int64_t append_selected(__m256i items, int mask, int32_t* out, int64_t count) {
  const __m256i order = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(compress_lanes()[mask].data()));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + count), _mm256_permutevar8x32_epi32(items, order));
  return count + __builtin_popcount(mask);
}

// The k-th largest of n order keys, how many keys equal to it are among the k largest, and
// how many keys equal it. Radix select, kRadixBits (kNarrowRadixBits when few keys are left)
// at a time, each level histogramming only the keys in the boundary bin of the level above.
struct Threshold {
  int32_t key;
  int64_t taken_ties, ties;
};

inline Threshold radix_threshold(const int32_t* keys, int64_t n, int64_t k) {
  int32_t* narrowed = scratch<30, int32_t>(n + 8);
  uint32_t prefix = 0;  // the threshold's unsigned bits found so far
  int64_t count = n, need = k;
  const int32_t* level_keys = keys;
  for (int low = 32;;) {
    // few keys: narrower digits, whose histograms cost less to clear and to scan
    const int width = std::min(count >= kWideRadixKeys ? kRadixBits : kNarrowRadixBits, low), shift = low - width;
    const uint32_t mask = (1u << width) - 1, bins = 1u << width;
    // two interleaved histograms: consecutive equal bins do not wait on each other's stores
    std::array<int32_t, 2 << kRadixBits> counts;
    std::fill(counts.begin(), counts.begin() + 2 * bins, 0);
    int64_t j = 0;
    for (; j + 2 <= count; j += 2) {
      ++counts[digit(level_keys[j], shift, mask)];
      ++counts[bins + digit(level_keys[j + 1], shift, mask)];
    }
    for (; j < count; ++j) ++counts[digit(level_keys[j], shift, mask)];
    uint32_t bin = mask;
    for (int64_t above = counts[bin] + counts[bins + bin]; need > above; above = counts[bin] + counts[bins + bin]) {
      need -= above;
      --bin;
    }
    prefix |= bin << shift;
    if (shift == 0) return {static_cast<int32_t>(prefix ^ 0x80000000u), need, counts[bin] + counts[bins + bin]};
    // keep the keys of the boundary bin, [lowest, highest] as signed keys
    const int32_t lowest = static_cast<int32_t>(prefix ^ 0x80000000u), highest = lowest + ((1 << shift) - 1);
    int64_t kept = 0, t = 0;
    const __m256i below = _mm256_set1_epi32(lowest - 1), above = _mm256_set1_epi32(highest);
    for (; t + 8 <= count; t += 8) {
      const __m256i key = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(level_keys + t));
      const __m256i inside = _mm256_andnot_si256(_mm256_cmpgt_epi32(key, above), _mm256_cmpgt_epi32(key, below));
      kept = append_selected(key, _mm256_movemask_ps(_mm256_castsi256_ps(inside)), narrowed, kept);
    }
    for (; t < count; ++t) {
      narrowed[kept] = level_keys[t];
      kept += level_keys[t] >= lowest && level_keys[t] <= highest;
    }
    count = kept;
    level_keys = narrowed;
    low = shift;
  }
}

// The order keys of values[0:n) that are >= `bound`, and their positions, in position order
// (both buffers need 7 spare entries); returns how many.
inline int64_t keys_at_least(const float* values, int64_t n, int32_t bound, int32_t* keys, int32_t* positions) {
  int64_t count = 0, j = 0;
  const __m256i floor = _mm256_set1_epi32(bound), step = _mm256_set1_epi32(8);
  __m256i position = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (; j + 8 <= n; j += 8, position = _mm256_add_epi32(position, step)) {
    const __m256i key = order_keys8(values + j);
    const int below = _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(floor, key)));
    append_selected(key, below ^ 0xFF, keys, count);
    count = append_selected(position, below ^ 0xFF, positions, count);
  }
  for (; j < n; ++j) {
    keys[count] = order_key(values[j]);
    positions[count] = static_cast<int32_t>(j);
    count += keys[count] >= bound;
  }
  return count;
}

constexpr int64_t kSampleStride = 8;

// An order key at most the k-th largest of values[0:n) when the share k / n is small enough
// for it to pay: the values at every kSampleStride-th position put a quarter more than k
// (and a few for the sample's spread) at or above it. The lowest key when not worth it.
inline int32_t sampled_bound(const float* values, int64_t n, int64_t k) {
  const int64_t samples = n / kSampleStride;
  if (samples < 64 || 4 * k > n) return std::numeric_limits<int32_t>::min();
  int32_t* sample = scratch<34, int32_t>(samples);
  for (int64_t i = 0; i < samples; ++i) sample[i] = order_key(values[i * kSampleStride]);
  return radix_threshold(sample, samples, std::min(samples, (k + k / 4) / kSampleStride + 16)).key;
}

// The positions of the k largest of values[0:n), offset by `offset`, ascending (the rows
// are then read in address order); of values tied at the k-th largest, the lowest positions.
// When k is a small share of n, the radix select runs on the values at or above a sampled
// bound only (all of them again if fewer than k pass), which chooses the same rows.
inline void top_k(const float* values, int64_t n, int64_t k, int64_t offset, int64_t* chosen) {
  if (k <= 0) return;
  if (k >= n) {
    for (int64_t i = 0; i < n; ++i) chosen[i] = offset + i;
    return;
  }
  int32_t* keys = scratch<32, int32_t>(n + 8);
  int32_t* positions = scratch<33, int32_t>(n + 8);
  int64_t count = keys_at_least(values, n, sampled_bound(values, n, k), keys, positions);
  if (count < k) count = keys_at_least(values, n, std::numeric_limits<int32_t>::min(), keys, positions);
  const Threshold threshold = radix_threshold(keys, count, k);
  int64_t taken = 0, j = 0;
  if (threshold.taken_ties < threshold.ties) {
    // some values equal to the k-th are left out: the first ones are kept
    for (int64_t tied = 0; j < count && taken < k; ++j) {
      const bool same = keys[j] == threshold.key;
      chosen[taken] = offset + positions[j];
      taken += (keys[j] > threshold.key) | (same & (tied < threshold.taken_ties));
      tied += same;
    }
    return;
  }
  // every value >= the k-th is kept: exactly k of them
  int32_t* kept = scratch<31, int32_t>(k + 8);
  const __m256i floor = _mm256_set1_epi32(threshold.key);
  for (; j + 8 <= count; j += 8) {
    const __m256i key = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(keys + j));
    const int below = _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(floor, key)));
    taken = append_selected(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(positions + j)), below ^ 0xFF, kept,
                            taken);
  }
  for (; j < count; ++j) {
    kept[taken] = positions[j];
    taken += keys[j] >= threshold.key;
  }
  for (int64_t i = 0; i < k; ++i) chosen[i] = offset + kept[i];
}

// One row copied inline (a libc memcpy call per 128-byte row costs more than the copy).
template <typename T>
inline void copy_row(const T* row, int64_t dim, T* out) {
  const int64_t bytes = dim * static_cast<int64_t>(sizeof(T));
  int64_t offset = 0;
  for (; offset + 32 <= bytes; offset += 32)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(reinterpret_cast<char*>(out) + offset),
                        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(reinterpret_cast<const char*>(row) + offset)));
  if (offset < bytes)  // only for a tail: a memcpy call per row costs a visible share of a scattered row's read
    std::memcpy(reinterpret_cast<char*>(out) + offset, reinterpret_cast<const char*>(row) + offset, bytes - offset);
}

}  // namespace a2ats_detail

// Cache rows row_of(0 .. count - 1) of one KV head into contiguous buffers (values too when
// values_out is not null), prefetching a few rows ahead: chosen rows are scattered.
template <typename T, typename RowOf>
void gather_rows(const T* keys, const T* values, int64_t row_stride, int64_t count, int64_t dim, RowOf row_of,
                 T* keys_out, T* values_out) {
  constexpr int64_t ahead = 32;  // rows in flight: scattered rows wait on DRAM latency, so keep many misses outstanding
  auto prefetch = [&](int64_t i) {
    prefetch_rows(keys, row_of(i), 1, row_stride, dim);
    if (values_out != nullptr) prefetch_rows(values, row_of(i), 1, row_stride, dim);
  };
  for (int64_t i = 0; i < std::min(ahead, count); ++i) prefetch(i);
  for (int64_t i = 0; i < count; ++i) {
    if (i + ahead < count) prefetch(i + ahead);
    const int64_t row = row_of(i);
    a2ats_detail::copy_row(keys + row * row_stride, dim, keys_out + i * dim);
    if (values_out != nullptr) a2ats_detail::copy_row(values + row * row_stride, dim, values_out + i * dim);
  }
}

namespace a2ats_detail {

// The partial softmax ([group][dim + 2], as attend_block writes it) of one KV head's query
// heads over rows row_of(0 .. count - 1), gathered from the cache in blocks of kBlockRows;
// one partial per block at partials + block * group * (dim + 2).
template <typename T, typename RowOf>
void attend_rows(const float* q, const T* keys, const T* values, int64_t row_stride, int64_t count, int64_t group,
                 int64_t dim, RowOf row_of, float* partials) {
  T* gathered_keys = scratch<13, T>(kBlockRows * dim);
  T* gathered_values = scratch<14, T>(kBlockRows * dim);
  for (int64_t first = 0, block = 0; first < count; first += kBlockRows, ++block) {
    const int64_t rows = std::min(kBlockRows, count - first);
    gather_rows<T>(keys, values, row_stride, rows, dim, [&](int64_t i) { return row_of(first + i); }, gathered_keys,
                   gathered_values);
    attend_block<T>(q, gathered_keys, gathered_values, dim, 0, rows, group, dim, partials + block * group * (dim + 2));
  }
}

// log-sum-exp of query head g over `count` partials (each [group][dim + 2]).
inline float partials_logsumexp(const float* partials, int64_t count, int64_t group, int64_t dim, int64_t g) {
  const int64_t stride = group * (dim + 2);
  float m = -std::numeric_limits<float>::infinity(), sum = 0.f;
  for (int64_t i = 0; i < count; ++i) m = std::max(m, partials[i * stride + g * (dim + 2) + dim]);
  if (std::isinf(m)) return m;
  for (int64_t i = 0; i < count; ++i) {
    const float* part = partials + i * stride + g * (dim + 2);
    sum += part[dim + 1] * std::exp(part[dim] - m);
  }
  return m + std::log(sum);
}

}  // namespace a2ats_detail

// out [Hq, dim] float32 = attention of q (float32 [Hq, dim], pre-scaled by the softmax
// scale, post-RoPE) over rows [0, start), the k chosen rows of [start, end) and
// [end, view.length) of each KV head; the chosen rows (ascending) go to chosen [Hkv, k] when
// it is not null. k >= end - start attends every row.
//
// One parallel region whose threads take work items in order from a shared counter, stage
// by stage: (1) per KV head, the tables, and the exact partial softmax of the always-
// attended rows (its log-sum-exp normalises the estimated and reranked masses, its values
// join the output); (2) the row scores; (3) with rerank, the candidates' exact logits;
// (4) the attention over the kept rows, which with rerank reuses the logits of (3) and
// reads only the values. The thread that finishes a head's last item of a stage finishes
// the head's stage (ranks and picks its rows, keeps the reranked ones, merges its output);
// an item whose head is not ready waits for it, which happens only near a stage's end.
// With 3 KV heads on 2 cores, barriers between stages would idle one core at each.
template <typename T>
void a2ats_attention(const float* q, const CacheView<T>& view, const A2atsLayer& plan, int64_t heads,
                     int64_t kv_heads, int64_t dim, float* out, int64_t* chosen_out) {
  using namespace a2ats_detail;
  const int64_t group = heads / kv_heads, rows = view.length, C = plan.centroids;
  const int64_t start = plan.start, end = plan.end, n = end - start, half = dim / 2;
  const int64_t k = std::min(plan.k, n), candidates = std::min(std::max(plan.candidates, k), n);
  const bool selecting = k > 0 && k < n, mean_key = plan.key_mean != nullptr;
  const bool rerank = selecting && candidates > k;
  const int64_t partial_size = group * (dim + 2);
  // query vectors the codes score per KV head: each query head, or their sum
  const int64_t scored = plan.logits ? 1 : group;
  // about four scoring items per thread, for the threads to share the heads evenly
  const int64_t items = 4 * at::get_num_threads();
  const int64_t item_rows = (n * kv_heads + items - 1) / items;
  const int64_t score_rows = std::min(kScoreRows, (item_rows + kWarmEvery - 1) / kWarmEvery * kWarmEvery);
  const int64_t blocks = selecting ? (n + score_rows - 1) / score_rows : 0;
  auto block_begin = [&](int64_t b) { return std::min(end, start + b * score_rows); };
  const int64_t table_blocks = selecting ? (C + kTableColumns - 1) / kTableColumns : 0;
  const int64_t fixed = start + rows - end;  // always attended: sinks and window
  const int64_t fixed_blocks = (fixed + kBlockRows - 1) / kBlockRows;
  const int64_t kept = k;                     // rows of [start, end) attended (all when k == n)
  const int64_t kept_blocks = (kept + kBlockRows - 1) / kBlockRows;
  const int64_t head_partials = fixed_blocks + kept_blocks;
  const int64_t rerank_stride = candidates + 8;
  const int64_t rerank_chunks = rerank ? (candidates + kRerankRows - 1) / kRerankRows : 0;

  // shared by every thread (this thread's buffers, handed to the items by pointer)
  float* table = scratch<0, float>(kv_heads * scored * C);
  float* coef = scratch<1, float>(kv_heads * scored * dim);
  float* fixed_lse = scratch<3, float>(heads);
  float* scores = scratch<4, float>(kv_heads * scored * std::max<int64_t>(n, 1));
  float* block_max = scratch<5, float>(kv_heads * scored * blocks);
  float* block_sum = scratch<6, float>(kv_heads * scored * blocks);
  int64_t* picked = scratch<7, int64_t>(kv_heads * std::max<int64_t>(candidates, 1));
  int64_t* chosen = scratch<8, int64_t>(kv_heads * std::max<int64_t>(k, 1));
  int64_t* best = scratch<10, int64_t>(kv_heads * std::max<int64_t>(k, 1));
  float* rank = scratch<9, float>(kv_heads * std::max<int64_t>(n, 1));
  float* weights = scratch<11, float>(heads * blocks);
  float* partials = scratch<12, float>(kv_heads * head_partials * partial_size);
  float* logits = scratch<15, float>(rerank ? heads * rerank_stride : 0);

  // Each scored query vector (a query head, or with 'logits' the group's sum), WRoPE-rotated
  // for the tables and folded with the key mean's rotation pairs for the mean-key term.
  float* rotated = scratch<20, float>(kv_heads * scored * dim);
  float* summed = scratch<22, float>(dim);
  for (int64_t h = 0; selecting && h < kv_heads; ++h)
    for (int64_t s = 0; s < scored; ++s) {
      const float* query = q + (h * group + s) * dim;
      if (plan.logits) {
        std::fill(summed, summed + dim, 0.f);
        for (int64_t g = 0; g < group; ++g)
          for (int64_t d = 0; d < dim; ++d) summed[d] += q[(h * group + g) * dim + d];
        query = summed;
      }
      rotate(query, plan.wrope_cos, plan.wrope_sin, dim, rotated + (h * scored + s) * dim);
      if (!mean_key) continue;
      const float* mean = plan.key_mean + h * dim;
      float* c = coef + (h * scored + s) * dim;
      for (int64_t i = 0; i < half; ++i) {
        const float q1 = query[i], q2 = query[i + half], x = mean[i], y = mean[i + half];
        c[i] = q1 * x + q2 * y;
        c[half + i] = q2 * x - q1 * y;
      }
    }

  // (1) one table block of head h, or (j == table_blocks) the head's always-attended rows
  auto prepare = [&](int64_t h, int64_t j) {
    if (j < table_blocks) {
      const int64_t c0 = j * kTableColumns;
      table_block(rotated + h * scored * dim, plan.centroid_tiles + h * dim * C, plan.centroid_scales + h * C, C, c0,
                  std::min(C, c0 + kTableColumns), scored, dim, table + h * scored * C);
      return;
    }
    float* head_fixed = partials + h * head_partials * partial_size;
    attend_rows<T>(q + h * group * dim, view.keys + h * view.head_stride, view.values + h * view.head_stride,
                   view.row_stride, fixed, group, dim, [&](int64_t i) { return i < start ? i : end + (i - start); },
                   head_fixed);
    for (int64_t g = 0; g < group; ++g)
      fixed_lse[h * group + g] = partials_logsumexp(head_fixed, fixed_blocks, group, dim, g);
  };

  // finished[s][h]: head h's items of stage s done; ready[s][h]: and the head's stage
  // finished (pick, keep) by the thread that did its last item
  std::unique_ptr<std::atomic<int64_t>[]> finished(new std::atomic<int64_t>[4 * kv_heads]);
  std::unique_ptr<std::atomic<bool>[]> ready(new std::atomic<bool>[4 * kv_heads]);
  for (int64_t i = 0; i < 4 * kv_heads; ++i) {
    finished[i].store(0, std::memory_order_relaxed);
    ready[i].store(false, std::memory_order_relaxed);
  }

  // The rerank reads its candidates' keys at DRAM latency, and the kept rows' values after
  // it, while the scores are bound by arithmetic: scoring a later head fetches an earlier
  // head's candidate keys and values into L2 a few rows at a time, so that most of those
  // reads hit cache (the values of the candidates not kept are fetched for nothing, but
  // the kept rows' value reads save more than the scores lose).
  std::unique_ptr<std::atomic<int64_t>[]> warmed(new std::atomic<int64_t>[kv_heads]);
  for (int64_t h = 0; h < kv_heads; ++h) warmed[h].store(0, std::memory_order_relaxed);
  auto warm_candidates = [&](int64_t scoring) {
    for (int64_t h = 0; rerank && h < scoring; ++h) {
      if (!ready[kv_heads + h].load(std::memory_order_acquire)) continue;
      const int64_t first = warmed[h].fetch_add(kWarmRows, std::memory_order_relaxed);
      if (first >= candidates) continue;
      const T* head_keys = view.keys + h * view.head_stride;
      const T* head_values = view.values + h * view.head_stride;
      for (int64_t i = first; i < std::min(candidates, first + kWarmRows); ++i) {
        prefetch_rows(head_keys, picked[h * candidates + i], 1, view.row_stride, dim, /*l2_only=*/true);
        prefetch_rows(head_values, picked[h * candidates + i], 1, view.row_stride, dim, /*l2_only=*/true);
      }
      return;
    }
  };

  // (2) one block of row scores of head h
  auto score = [&](int64_t h, int64_t b) {
    const int64_t first = block_begin(b) - start, count = block_begin(b + 1) - start - first;
    float* block = scores + h * scored * n + first;
    for (int64_t part = 0; part < count; part += kWarmEvery) {
      score_block(table + h * scored * C, coef + h * scored * dim, C,
                  plan.codes + h * plan.codes_head_stride + start + first + part, plan.rotary, plan.middle_offsets,
                  plan.half_turn, start + first + part, std::min(kWarmEvery, count - part), scored, dim, block + part, n,
                  mean_key);
      warm_candidates(h);
    }
    if (!plan.logits)
      for (int64_t g = 0; g < group; ++g) {
        const auto [m, sum] = block_softmax(block + g * n, count);
        block_max[(h * group + g) * blocks + b] = m;
        block_sum[(h * group + g) * blocks + b] = sum;
      }
  };
  // head h's ranking ('probs': each query head's estimated probabilities, exps of a block
  // times exp(block max - lse), summed over the group) and its top candidates
  auto pick = [&](int64_t h) {
    const float* ranked = scores + h * n;
    if (!plan.logits) {
      for (int64_t g = 0; g < group; ++g) {
        const int64_t hg = h * group + g;
        const float* maxima = block_max + hg * blocks;
        const float* sums = block_sum + hg * blocks;
        const float peak = *std::max_element(maxima, maxima + blocks);
        float total = 0.f;
        for (int64_t b = 0; b < blocks; ++b) total += sums[b] * std::exp(maxima[b] - peak);
        const float estimated = peak + std::log(total), fixed_part = fixed_lse[hg];
        const float top = std::max(estimated, fixed_part);
        const float lse = top + std::log(std::exp(estimated - top) + std::exp(fixed_part - top));
        for (int64_t b = 0; b < blocks; ++b) weights[hg * blocks + b] = std::exp(maxima[b] - lse);
      }
      float* mass = rank + h * n;
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t first = block_begin(b) - start, last_row = block_begin(b + 1) - start;
        for (int64_t g = 0; g < group; ++g) {
          const float weight = weights[(h * group + g) * blocks + b];
          const float* e = scores + (h * group + g) * n;
          if (g == 0)
            for (int64_t t = first; t < last_row; ++t) mass[t] = weight * e[t];
          else
            for (int64_t t = first; t < last_row; ++t) mass[t] += weight * e[t];
        }
      }
      ranked = mass;
    }
    top_k(ranked, n, candidates, start, (rerank ? picked : chosen) + h * candidates);
  };

  // (3) the exact logits of one chunk of head h's candidates
  auto rerank_chunk = [&](int64_t h, int64_t c) {
    T* keys = scratch<21, T>(kRerankRows * dim);
    const int64_t first = c * kRerankRows, count = std::min(kRerankRows, candidates - first);
    const int64_t* rows_of = picked + h * candidates + first;
    gather_rows<T>(view.keys + h * view.head_stride, nullptr, view.row_stride, count, dim,
                   [&](int64_t i) { return rows_of[i]; }, keys, nullptr);
    block_scores<T>(q + h * group * dim, keys, keys, dim, count, group, dim, logits + h * group * rerank_stride + first,
                    rerank_stride);
  };
  // head h's k candidates with the most exact attention mass, normalised with the fixed rows
  auto keep = [&](int64_t h) {
    float* mass = scratch<23, float>(candidates);
    float* exps = scratch<24, float>(candidates);
    int64_t* order = best + h * k;
    std::fill(mass, mass + candidates, 0.f);
    for (int64_t g = 0; g < group; ++g) {
      const float* l = logits + (h * group + g) * rerank_stride;
      std::copy(l, l + candidates, exps);  // the logits stay for the attention
      const auto [m, sum] = block_softmax(exps, candidates);
      const float fixed_part = fixed_lse[h * group + g], exact = m + std::log(sum);
      const float top = std::max(exact, fixed_part);
      const float weight = std::exp(m - (top + std::log(std::exp(exact - top) + std::exp(fixed_part - top))));
      for (int64_t i = 0; i < candidates; ++i) mass[i] += weight * exps[i];
    }
    top_k(mass, candidates, k, 0, order);
    for (int64_t i = 0; i < k; ++i) chosen[h * k + i] = picked[h * candidates + order[i]];
  };

  // The next layer's centroid tiles, a share per kept-row item: this layer's value reads wait
  // on DRAM latency with bandwidth to spare, and the next layer's tables would otherwise
  // stream the tiles from DRAM (its linears' weights pass through L2 in between; the
  // tiles then wait in L3).
  auto warm_next_tiles = [&](int64_t h, int64_t block) {
    if (plan.next_centroid_tiles == nullptr) return;
    const int64_t items = kv_heads * kept_blocks, item = h * kept_blocks + block;
    const int64_t lines = (plan.next_tiles_bytes + 63) / 64;
    const char* tiles = reinterpret_cast<const char*>(plan.next_centroid_tiles);
    for (int64_t line = lines * item / items; line < lines * (item + 1) / items; ++line)
      _mm_prefetch(tiles + 64 * line, _MM_HINT_T1);
  };

  // (4) one block of head h's kept rows
  auto attend = [&](int64_t h, int64_t block) {
    warm_next_tiles(h, block);
    const int64_t first = block * kBlockRows, count = std::min(kBlockRows, kept - first);
    float* partial = partials + (h * head_partials + fixed_blocks + block) * partial_size;
    const T* head_keys = view.keys + h * view.head_stride;
    const T* head_values = view.values + h * view.head_stride;
    if (!rerank) {
      attend_rows<T>(q + h * group * dim, head_keys, head_values, view.row_stride, count, group, dim,
                     [&](int64_t i) { return selecting ? chosen[h * k + first + i] : start + first + i; }, partial);
      return;
    }
    // the reranked rows' logits are already known: only their values are read
    constexpr int64_t stride = kBlockRows + 8;
    alignas(32) float p[kMaxGroup * stride];
    const int64_t* order = best + h * k + first;
    for (int64_t g = 0; g < group; ++g) {
      const float* l = logits + (h * group + g) * rerank_stride;
      for (int64_t i = 0; i < count; ++i) p[g * stride + i] = l[order[i]];
      const auto [m, sum] = block_softmax(p + g * stride, count);
      partial[g * (dim + 2) + dim] = m;
      partial[g * (dim + 2) + dim + 1] = sum;
    }
    T* values = scratch<14, T>(kBlockRows * dim);
    gather_rows<T>(head_values, nullptr, view.row_stride, count, dim, [&](int64_t i) { return chosen[h * k + first + i]; },
                   values, nullptr);
    block_values<T>(p, values, dim, count, group, dim, stride, partial);
  };
  auto merge = [&](int64_t h) {
    merge_partials(partials + h * head_partials * partial_size, head_partials, group, dim, out + h * group * dim);
  };

  const std::array<int64_t, 4> per_head = {table_blocks + 1, blocks, rerank_chunks, kept_blocks};
  std::array<int64_t, 5> stage_begin{};
  for (int s = 0; s < 4; ++s) stage_begin[s + 1] = stage_begin[s] + kv_heads * per_head[s];
  auto wait_for = [&](int s, int64_t h) {
    while (!ready[s * kv_heads + h].load(std::memory_order_acquire)) std::this_thread::yield();
  };
  // the stage an item of stage s needs finished, or -1
  auto needs = [&](int s) { return s == 1 ? 0 : s == 2 ? 1 : s == 3 && rerank ? 2 : s == 3 && selecting ? 1 : -1; };
  for_each_claimed(stage_begin[4], [&](int64_t item) {
    int s = 0;
    while (item >= stage_begin[s + 1]) ++s;
    const int64_t h = (item - stage_begin[s]) / per_head[s], j = (item - stage_begin[s]) % per_head[s];
    if (needs(s) >= 0) wait_for(needs(s), h);
    switch (s) {
      case 0: prepare(h, j); break;
      case 1: score(h, j); break;
      case 2: rerank_chunk(h, j); break;
      default: attend(h, j); break;
    }
    if (finished[s * kv_heads + h].fetch_add(1, std::memory_order_acq_rel) + 1 < per_head[s]) return;
    if (s == 1) pick(h);
    if (s == 2) keep(h);
    if (s == 3) {
      wait_for(0, h);
      merge(h);
    }
    ready[s * kv_heads + h].store(true, std::memory_order_release);
  });
  if (kept_blocks == 0)  // no kept rows: the always-attended rows alone
    for (int64_t h = 0; h < kv_heads; ++h) merge(h);
  if (chosen_out != nullptr && selecting) std::copy(chosen, chosen + kv_heads * k, chosen_out);
}

}  // namespace ragkv
