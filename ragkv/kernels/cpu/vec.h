// AVX2 helpers shared by the CPU kernels: per-thread scratch buffers, widening
// bf16 to float32, fetching a linear's weights ahead and reducing a vector's lanes.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include <immintrin.h>

// The kernels are written for AVX2 with FMA only (cpu_extension.buildable() builds them on
// no other CPU; there the torch paths run), so no untested scalar fallback exists.
#if !defined(__AVX2__) || !defined(__FMA__)
#error "the compiled CPU kernels need AVX2 and FMA (-march=native on a CPU that has them)"
#endif

namespace ragkv {

// A buffer of the calling thread, kept across calls (resized, never shrunk or cleared).
// Owner and Slot name it, so that two kernels' buffers never alias.
template <typename Owner, int Slot, typename T>
T* thread_buffer(int64_t size) {
  thread_local std::vector<T> buffer;
  if (static_cast<int64_t>(buffer.size()) < size) buffer.resize(size);
  return buffer.data();
}

// 2^f on [0, 1) as a degree-6 polynomial, highest power first (relative error ~2e-7): the
// fractional part of every exp the kernels compute (softmax arguments, as 2^(x log2 e)).
constexpr float kExp2Polynomial[7] = {1.535336188319500e-4f, 1.339887440266574e-3f, 9.618437357674640e-3f,
                                      5.550332471162809e-2f, 2.402264791363012e-1f, 6.931472028550421e-1f,
                                      1.0f};

inline float load_float(const float* p, int64_t i) { return p[i]; }

inline float load_float(const at::BFloat16* p, int64_t i) {
  uint32_t bits = static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(p)[i]) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// The weight tile `near` tiles on from `tile` into L1 and the one `far` tiles on into L2 (a
// tile is `bytes` long), for a few-row linear that streams its weights once: the hardware
// prefetcher follows a thread's interleaved rows too late, and with L1 fetches alone one
// step's linears waited on DRAM about as long as they computed.
inline void prefetch_weights_ahead(const void* tile, int64_t bytes, int64_t near, int64_t far) {
  const char* at = static_cast<const char*>(tile);
  for (int64_t line = 0; line < bytes; line += 64) {
    _mm_prefetch(at + near * bytes + line, _MM_HINT_T0);
    _mm_prefetch(at + far * bytes + line, _MM_HINT_T1);
  }
}

inline float sum_lanes(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

}  // namespace ragkv
