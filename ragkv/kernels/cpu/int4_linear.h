// y[r][o] = sum_i x[r][i] * w[o][i] for a few activation rows (decode steps), with int4
// weights in groups of 32 input columns, each with a float16 scale d and minimum m
// (w = q * d + m, q in 0..15: the GGUF's Q4_1 blocks exactly), and the activations
// quantized to int8 in the same groups of 32 (one float scale each), so each group's dot
// product is integer arithmetic (vpmaddubsw: unsigned codes times signed activations).
//
// On a 2-core AVX2 CPU a float32 x int8 multiply-add per weight left the decode step's
// linears bound by vector instructions as much as by memory; this reads 0.625 bytes per
// weight instead of 1 and takes about half the instructions (BENCHMARKS.md). Where the CPU
// has AVX512-VNNI (int4_tile_vnni) a block pair is one 512-bit vpdpbusd per row.
//
// Layout of an output channel's row (`int4_row_bytes`): the codes of block pairs, 32 bytes
// per pair (byte j: block 2p's code j in the low nibble, block 2p + 1's in the high), then
// the scales and then the minimums as float16, each padded with zeros to a multiple of 8
// blocks. A missing last block of an odd pair has codes, scale and minimum 0.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "claimed_items.h"
#include "vec.h"

#include <immintrin.h>

namespace ragkv {

constexpr int64_t kInt4Group = 32;
constexpr int64_t kInt4ScaleGroups = 8;  // scales read (and converted) 8 blocks at a time

inline int64_t int4_pairs(int64_t in) { return (in / kInt4Group + 1) / 2; }
inline int64_t int4_scale_slots(int64_t in) {
  return (in / kInt4Group + kInt4ScaleGroups - 1) / kInt4ScaleGroups * kInt4ScaleGroups;
}
inline int64_t int4_row_bytes(int64_t in) { return 32 * int4_pairs(in) + 4 * int4_scale_slots(in); }

// One activation row quantized per group of 32: codes (padded to whole pairs with zeros),
// scale d and d * (sum of the codes), which carries the weights' minimums.
struct QuantizedRows {
  const int8_t* codes;  // [rows][64 * pairs]
  const float* scale;   // [rows][scale slots]
  const float* code_sum;
  int64_t codes_stride, scale_stride;
};

namespace int4_detail {

struct Scratch;
template <int Slot, typename T>
T* scratch(int64_t size) {
  return thread_buffer<Scratch, Slot, T>(size);
}

inline float quantize_group_avx2(const float* x, int8_t* codes, int64_t* code_sum) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 v[4], peak = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    peak = _mm256_max_ps(peak, _mm256_andnot_ps(sign, v[i]));
  }
  __m128 half = _mm_max_ps(_mm256_castps256_ps128(peak), _mm256_extractf128_ps(peak, 1));
  half = _mm_max_ps(half, _mm_movehl_ps(half, half));
  const float top = _mm_cvtss_f32(_mm_max_ss(half, _mm_shuffle_ps(half, half, 1)));
  const __m256 inverse = _mm256_set1_ps(top > 0.f ? 127.f / top : 0.f);
  __m256i q[4];
  for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inverse));  // round to nearest even
  const __m256i low = _mm256_packs_epi32(q[0], q[1]), high = _mm256_packs_epi32(q[2], q[3]);
  const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(low, high), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes), bytes);
  const __m256i sums = _mm256_madd_epi16(_mm256_add_epi16(low, high), _mm256_set1_epi16(1));
  __m128i total = _mm_add_epi32(_mm256_castsi256_si128(sums), _mm256_extracti128_si256(sums, 1));
  total = _mm_hadd_epi32(total, total);
  total = _mm_hadd_epi32(total, total);
  *code_sum = _mm_cvtsi128_si32(total);
  return top / 127.f;
}

constexpr int64_t kNearTiles = 4;  // tiles ahead fetched into L1 (a tile: 2 channels, 768 bytes for SmolLM2)
constexpr int64_t kFarTiles = 64;  // and into L2

// Output channel j's float16 scales of the 8 blocks from `group` (its row's scale slots at
// `row`): use(r, d * activation row r's scales) for each row, and the minimums times the
// rows' code sums added into minimums[r][j].
template <int Rows, int Outs, typename Use>
inline void group_scales(const QuantizedRows& x, const uint8_t* row, int64_t slots, int64_t group, int j,
                         __m256 (&minimums)[Rows][Outs], const Use& use) {
  const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * group)));
  const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * (slots + group))));
  for (int r = 0; r < Rows; ++r) {
    use(r, _mm256_mul_ps(d, _mm256_loadu_ps(x.scale + r * x.scale_stride + group)));
    minimums[r][j] = _mm256_fmadd_ps(m, _mm256_loadu_ps(x.code_sum + r * x.scale_stride + group), minimums[r][j]);
  }
}

// Rows x[0:Rows] (quantized) against output channels [o, o + Outs).
template <int Rows, int Outs>
inline void int4_tile(const QuantizedRows& x, const uint8_t* w, int64_t in, int64_t o, float* y, int64_t y_stride) {
  const int64_t stride = int4_row_bytes(in), pairs = int4_pairs(in), slots = int4_scale_slots(in);
  const uint8_t* base = w + o * stride;
  prefetch_weights_ahead(base, Outs * stride, kNearTiles, kFarTiles);
  __m256 acc[Rows][Outs], minimums[Rows][Outs];
  for (int r = 0; r < Rows; ++r)
    for (int j = 0; j < Outs; ++j) acc[r][j] = minimums[r][j] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1), nibble = _mm256_set1_epi8(0x0F);
  for (int64_t group = 0; group < slots; group += kInt4ScaleGroups) {
    alignas(32) float scales[Rows][Outs][kInt4ScaleGroups];
    for (int j = 0; j < Outs; ++j)
      group_scales<Rows, Outs>(x, base + j * stride + 32 * pairs, slots, group, j, minimums,
                               [&](int r, __m256 scaled) { _mm256_store_ps(scales[r][j], scaled); });
    const int64_t last_pair = std::min(pairs, (group + kInt4ScaleGroups) / 2);
    for (int64_t pair = group / 2; pair < last_pair; ++pair) {
      const int64_t slot = 2 * pair - group;
      __m256i x0[Rows], x1[Rows];
      for (int r = 0; r < Rows; ++r) {
        const int8_t* codes = x.codes + r * x.codes_stride + 64 * pair;
        x0[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes));
        x1[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 32));
      }
      for (int j = 0; j < Outs; ++j) {
        const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(base + j * stride + 32 * pair));
        const __m256i q0 = _mm256_and_si256(packed, nibble);
        const __m256i q1 = _mm256_and_si256(_mm256_srli_epi16(packed, 4), nibble);
        for (int r = 0; r < Rows; ++r) {
          const __m256 p0 = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(q0, x0[r]), ones));
          const __m256 p1 = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(q1, x1[r]), ones));
          acc[r][j] = _mm256_fmadd_ps(_mm256_broadcast_ss(&scales[r][j][slot]), p0, acc[r][j]);
          acc[r][j] = _mm256_fmadd_ps(_mm256_broadcast_ss(&scales[r][j][slot + 1]), p1, acc[r][j]);
        }
      }
    }
  }
  for (int r = 0; r < Rows; ++r)
    for (int j = 0; j < Outs; ++j) y[r * y_stride + o + j] = sum_lanes(_mm256_add_ps(acc[r][j], minimums[r][j]));
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
// int4_tile with one block pair per 512-bit register (block 2p in the low half, 2p + 1 in
// the high) and VNNI's vpdpbusd for the 4-product integer sums: per 64 weights and row one
// dot, one conversion, one lane permute and one FMA, against ten 256-bit instructions.
template <int Rows, int Outs>
inline void int4_tile_vnni(const QuantizedRows& x, const uint8_t* w, int64_t in, int64_t o, float* y, int64_t y_stride) {
  const int64_t stride = int4_row_bytes(in), pairs = int4_pairs(in), slots = int4_scale_slots(in);
  const uint8_t* base = w + o * stride;
  prefetch_weights_ahead(base, Outs * stride, kNearTiles, kFarTiles);
  __m512 acc[Rows][Outs];
  __m256 minimums[Rows][Outs];
  for (int r = 0; r < Rows; ++r)
    for (int j = 0; j < Outs; ++j) {
      acc[r][j] = _mm512_setzero_ps();
      minimums[r][j] = _mm256_setzero_ps();
    }
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  // lanes 0-7 take scale 2s of a group's 8, lanes 8-15 scale 2s + 1
  const __m512i spread[4] = {
      _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
      _mm512_setr_epi32(2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3),
      _mm512_setr_epi32(4, 4, 4, 4, 4, 4, 4, 4, 5, 5, 5, 5, 5, 5, 5, 5),
      _mm512_setr_epi32(6, 6, 6, 6, 6, 6, 6, 6, 7, 7, 7, 7, 7, 7, 7, 7)};
  for (int64_t group = 0; group < slots; group += kInt4ScaleGroups) {
    __m512 scales[Rows][Outs];
    for (int j = 0; j < Outs; ++j)
      group_scales<Rows, Outs>(x, base + j * stride + 32 * pairs, slots, group, j, minimums,
                               [&](int r, __m256 scaled) { scales[r][j] = _mm512_castps256_ps512(scaled); });
    const int64_t last_pair = std::min(pairs, (group + kInt4ScaleGroups) / 2);
    for (int64_t pair = group / 2; pair < last_pair; ++pair) {
      const __m512i& lanes = spread[pair - group / 2];
      __m512i codes[Rows];
      for (int r = 0; r < Rows; ++r) codes[r] = _mm512_loadu_si512(x.codes + r * x.codes_stride + 64 * pair);
      for (int j = 0; j < Outs; ++j) {
        const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(base + j * stride + 32 * pair));
        const __m512i q = _mm512_and_si512(
            _mm512_inserti64x4(_mm512_castsi256_si512(packed), _mm256_srli_epi16(packed, 4), 1), nibble);
        for (int r = 0; r < Rows; ++r) {
          const __m512 dot = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), q, codes[r]));
          acc[r][j] = _mm512_fmadd_ps(_mm512_permutexvar_ps(lanes, scales[r][j]), dot, acc[r][j]);
        }
      }
    }
  }
  for (int r = 0; r < Rows; ++r)
    for (int j = 0; j < Outs; ++j)
      y[r * y_stride + o + j] = _mm512_reduce_add_ps(acc[r][j]) + sum_lanes(minimums[r][j]);
}
#endif

template <int Rows>
inline void int4_rows(const QuantizedRows& x, const uint8_t* w, int64_t in, int64_t begin, int64_t end, float* y,
                      int64_t y_stride) {
  constexpr int Outs = Rows <= 2 ? 2 : 1;
  int64_t o = begin;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
  for (; o + Outs <= end; o += Outs) int4_tile_vnni<Rows, Outs>(x, w, in, o, y, y_stride);
  for (; o < end; ++o) int4_tile_vnni<Rows, 1>(x, w, in, o, y, y_stride);
#else
  for (; o + Outs <= end; o += Outs) int4_tile<Rows, Outs>(x, w, in, o, y, y_stride);
  for (; o < end; ++o) int4_tile<Rows, 1>(x, w, in, o, y, y_stride);
#endif
}

}  // namespace int4_detail

// Quantizes `rows` rows of x [rows, in] into buffers of the calling thread.
inline QuantizedRows quantize_rows(const float* x, int64_t rows, int64_t in) {
  using namespace int4_detail;
  const int64_t pairs = int4_pairs(in), slots = int4_scale_slots(in), blocks = in / kInt4Group;
  const int64_t codes_stride = 64 * pairs;
  int8_t* codes = scratch<0, int8_t>(rows * codes_stride);
  float* scale = scratch<1, float>(rows * slots);
  float* code_sum = scratch<2, float>(rows * slots);
  for (int64_t r = 0; r < rows; ++r) {
    // the padding (an odd pair's missing block, scale slots past the last group) reads as zero
    std::fill(codes + r * codes_stride + blocks * kInt4Group, codes + (r + 1) * codes_stride, 0);
    std::fill(scale + r * slots + blocks, scale + (r + 1) * slots, 0.f);
    std::fill(code_sum + r * slots + blocks, code_sum + (r + 1) * slots, 0.f);
    for (int64_t block = 0; block < blocks; ++block) {
      const float* group = x + r * in + block * kInt4Group;
      int8_t* group_codes = codes + r * codes_stride + block * kInt4Group;
      int64_t sum = 0;
      const float d = quantize_group_avx2(group, group_codes, &sum);
      scale[r * slots + block] = d;
      code_sum[r * slots + block] = d * static_cast<float>(sum);
    }
  }
  return {codes, scale, code_sum, codes_stride, slots};
}

// x [rows, in] float32 (in a multiple of 32) against int4 rows w [out, int4_row_bytes(in)];
// y [rows, out] float32. The threads claim blocks of output channels (claimed_items.h).
inline void int4_linear(const float* x, int64_t rows, int64_t in, const uint8_t* w, int64_t out, float* y) {
  constexpr int64_t kChannelBlock = 64;
  const QuantizedRows quantized = quantize_rows(x, rows, in);
  const int64_t blocks = (out + kChannelBlock - 1) / kChannelBlock, stride = int4_row_bytes(in);
  for_each_claimed(blocks, [&](int64_t index) {
    const int64_t block = index * kChannelBlock, block_end = std::min(block + kChannelBlock, out);
    for (int64_t r = 0; r < rows; r += 4) {
      QuantizedRows tile = quantized;
      tile.codes += r * quantized.codes_stride;
      tile.scale += r * quantized.scale_stride;
      tile.code_sum += r * quantized.scale_stride;
      float* yr = y + r * out;
      switch (std::min<int64_t>(4, rows - r)) {
        case 1: int4_detail::int4_rows<1>(tile, w, in, block, block_end, yr, out); break;
        case 2: int4_detail::int4_rows<2>(tile, w, in, block, block_end, yr, out); break;
        case 3: int4_detail::int4_rows<3>(tile, w, in, block, block_end, yr, out); break;
        default: int4_detail::int4_rows<4>(tile, w, in, block, block_end, yr, out); break;
      }
    }
  });
}

}  // namespace ragkv
