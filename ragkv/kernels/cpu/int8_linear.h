// y[r][o] = scale[o] * sum_i x[r][i] * w[o][i] for a few activation rows (decode steps),
// with int8 weights (symmetric, one bf16 scale per output channel: the layout of
// ragkv.engine.linear.Int8Kernel) and float32 activations and accumulation.
//
// Each weight vector is loaded and widened once per tile of up to 4 activation rows, so
// one row reads the matrix at memory speed and 8 rows cost little more than compute for
// 8 FMAs per widened vector. Output channels are split over torch's intra-op threads.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "claimed_items.h"
#include "vec.h"

#include <immintrin.h>

namespace ragkv {

constexpr int64_t kInt8NearTiles = 1;  // tiles ahead fetched into L1 (a tile: 8 channels, 4.6 KB for SmolLM2's head)
constexpr int64_t kInt8FarTiles = 64;  // and into L2

inline __m256 widen_int8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// Rows x[0:Rows] against output channels [o, o + Outs).
template <int Rows, int Outs>
inline void int8_tile(const float* x, int64_t x_stride, const int8_t* w, int64_t in, int64_t o,
                      const at::BFloat16* scales, float* y, int64_t y_stride) {
  __m256 acc[Rows][Outs];
  for (int r = 0; r < Rows; ++r)
    for (int j = 0; j < Outs; ++j) acc[r][j] = _mm256_setzero_ps();
  // the tile's rows are one contiguous block, read as Outs interleaved streams
  prefetch_weights_ahead(w + o * in, Outs * in, kInt8NearTiles, kInt8FarTiles);
  for (int64_t i = 0; i < in; i += 8) {
    __m256 xv[Rows];
    for (int r = 0; r < Rows; ++r) xv[r] = _mm256_loadu_ps(x + r * x_stride + i);
    for (int j = 0; j < Outs; ++j) {
      const __m256 wv = widen_int8(w + (o + j) * in + i);
      for (int r = 0; r < Rows; ++r) acc[r][j] = _mm256_fmadd_ps(xv[r], wv, acc[r][j]);
    }
  }
  for (int r = 0; r < Rows; ++r)
    for (int j = 0; j < Outs; ++j) y[r * y_stride + o + j] = sum_lanes(acc[r][j]) * load_float(scales, o + j);
}

template <int Rows>
inline void int8_rows(const float* x, int64_t x_stride, const int8_t* w, int64_t in, int64_t begin, int64_t end,
                      const at::BFloat16* scales, float* y, int64_t y_stride) {
  constexpr int Outs = Rows == 1 ? 8 : (Rows == 2 ? 4 : 2);  // >= 6 independent FMA chains
  int64_t o = begin;
  for (; o + Outs <= end; o += Outs) int8_tile<Rows, Outs>(x, x_stride, w, in, o, scales, y, y_stride);
  for (; o < end; ++o) int8_tile<Rows, 1>(x, x_stride, w, in, o, scales, y, y_stride);
}

// x [rows, in] and y [rows, out], both float32 and row-major; `in` a multiple of 8 on AVX2.
// The threads claim blocks of output channels one at a time (claimed_items.h).
inline void int8_linear(const float* x, int64_t rows, int64_t in, const int8_t* w, const at::BFloat16* scales,
                        int64_t out, float* y) {
  // Blocks of out / 32 channels, 32 to 256: the L2 fetches run kInt8FarTiles tiles ahead,
  // and past a block's end they warm channels the other thread may claim (small blocks
  // restart those fetches too often on a wide LM head).
  const int64_t block_channels = std::clamp<int64_t>(out / 32 / 8 * 8, 32, 256);
  const int64_t blocks = (out + block_channels - 1) / block_channels;
  for_each_claimed(blocks, [&](int64_t index) {
    const int64_t block = index * block_channels, block_end = std::min(block + block_channels, out);
    for (int64_t r = 0; r < rows; r += 4) {
      const float* xr = x + r * in;
      float* yr = y + r * out;
      switch (std::min<int64_t>(4, rows - r)) {
        case 1: int8_rows<1>(xr, in, w, in, block, block_end, scales, yr, out); break;
        case 2: int8_rows<2>(xr, in, w, in, block, block_end, scales, yr, out); break;
        case 3: int8_rows<3>(xr, in, w, in, block, block_end, scales, yr, out); break;
        default: int8_rows<4>(xr, in, w, in, block, block_end, scales, yr, out); break;
      }
    }
  });
}

}  // namespace ragkv
