// The A2ATS plan's checks and the per-layer view the sparse attention reads (a2ats_plan.h).
#include "a2ats_plan.h"

#include <cmath>
#include <utility>

namespace ragkv {

A2atsPlan::A2atsPlan(at::Tensor codes, at::Tensor centroid_tiles, at::Tensor centroid_scales, at::Tensor key_mean,
                     at::Tensor rotary, bool logits)
    : codes_(std::move(codes)), centroid_tiles_(std::move(centroid_tiles)),
      centroid_scales_(std::move(centroid_scales)), key_mean_(std::move(key_mean)),
      rotary_(std::move(rotary)), logits_(logits) {
  TORCH_CHECK(codes_.dim() == 3 && codes_.scalar_type() == at::kShort && codes_.stride(2) == 1,
              "codes must be [layers, Hkv, capacity] int16 with contiguous rows");
  TORCH_CHECK(centroid_tiles_.dim() == 5 && centroid_tiles_.scalar_type() == at::kChar &&
                  centroid_tiles_.is_contiguous() && centroid_tiles_.size(4) == kTileCentroids,
              "centroid tiles must be contiguous [layers, Hkv, C / 16, D, 16] int8");
  TORCH_CHECK(centroid_scales_.scalar_type() == at::kFloat && centroid_scales_.is_contiguous() &&
                  centroid_scales_.sizes() == at::IntArrayRef({centroid_tiles_.size(0), centroid_tiles_.size(1),
                                                               centroid_tiles_.size(2) * kTileCentroids}),
              "centroid scales must be contiguous [layers, Hkv, C] float32, one per tiled centroid");
  TORCH_CHECK(key_mean_.numel() == 0 || (key_mean_.scalar_type() == at::kFloat && key_mean_.is_contiguous() &&
                                         key_mean_.dim() == 3),
              "key mean must be contiguous [layers, Hkv, D] float32 or empty");
  TORCH_CHECK(rotary_.dim() == 2 && rotary_.scalar_type() == at::kFloat && rotary_.is_contiguous() &&
                  rotary_.size(0) >= a2ats_detail::kTileRows,
              "rotary table must be contiguous [positions, D] float32 covering one scoring tile");
  // each rotation pair's frequency w and scaling r from the table's position 1, for the
  // mean-key term's tables at half offsets (once per plan, for every layer and step)
  const int64_t dim = rotary_.size(1), half = dim / 2, offsets = a2ats_detail::kHalfTile;
  const float* position_one = rotary_.data_ptr<float>() + dim;
  middle_offsets_.resize(dim * offsets);
  half_turn_.resize(dim);
  for (int64_t i = 0; i < half; ++i) {
    const double r = std::hypot(position_one[i], position_one[half + i]);
    const double cos_w = position_one[i] / r, sin_w = position_one[half + i] / r;  // w < pi: cos(w / 2) > 0
    const double cos_half = std::sqrt((1 + cos_w) / 2), sin_half = sin_w / (2 * cos_half);
    half_turn_[i] = static_cast<float>(cos_half / r);
    half_turn_[half + i] = static_cast<float>(sin_half / r);
    double c = cos_half, s = sin_half;  // at offset u + 1/2, stepped by w
    for (int64_t u = 0; u < offsets; ++u) {
      middle_offsets_[i * offsets + u] = static_cast<float>(r * c);
      middle_offsets_[(half + i) * offsets + u] = static_cast<float>(r * s);
      const double next_c = c * cos_w - s * sin_w;
      s = s * cos_w + c * sin_w;
      c = next_c;
    }
  }
}

void A2atsPlan::step(at::Tensor wrope_cos, at::Tensor wrope_sin, int64_t rotation, int64_t start, int64_t end,
                     int64_t k, int64_t candidates) {
  TORCH_CHECK(wrope_cos.dim() == 2 && wrope_cos.scalar_type() == at::kFloat && wrope_cos.is_contiguous() &&
                  wrope_sin.sizes() == wrope_cos.sizes() && wrope_sin.scalar_type() == at::kFloat &&
                  wrope_sin.is_contiguous() && wrope_cos.size(1) == rotary_.size(1),
              "wrope cos/sin must be contiguous [rotations, D] float32");
  TORCH_CHECK(0 <= rotation && rotation < wrope_cos.size(0), "wrope row out of range");
  TORCH_CHECK(0 <= start && start <= end && 0 <= k && k <= candidates, "need 0 <= start <= end, 0 <= k <= candidates");
  wrope_cos_ = std::move(wrope_cos);
  wrope_sin_ = std::move(wrope_sin);
  rotation_ = rotation;
  start_ = start;
  end_ = end;
  k_ = k;
  candidates_ = candidates;
  stepped_ = true;
}

void A2atsPlan::check(int64_t layers, int64_t kv_heads, int64_t dim, int64_t length) const {
  TORCH_CHECK(stepped_, "an A2ATS plan needs its step set before it runs");
  TORCH_CHECK(codes_.size(0) == layers && codes_.size(1) == kv_heads && codes_.size(2) >= end_,
              "codes must cover every layer, KV head and candidate row");
  TORCH_CHECK(centroid_tiles_.size(0) == layers && centroid_tiles_.size(1) == kv_heads &&
                  centroid_tiles_.size(3) == dim,
              "centroid tiles must be [layers, Hkv, C / 16, D, 16] of this model");
  TORCH_CHECK(key_mean_.numel() == 0 || key_mean_.sizes() == at::IntArrayRef({layers, kv_heads, dim}),
              "key mean must be [layers, Hkv, D] of this model");
  TORCH_CHECK(rotary_.size(1) == dim && rotary_.size(0) >= end_, "rotary table must cover every candidate position");
  TORCH_CHECK(end_ <= length, "candidate rows beyond the cache");
}

A2atsLayer A2atsPlan::layer(int64_t l) const {
  return {codes_.data_ptr<int16_t>() + l * codes_.stride(0),
          codes_.stride(1),
          centroid_tiles_.data_ptr<int8_t>() + l * centroid_tiles_.stride(0),
          centroid_scales_.data_ptr<float>() + l * centroid_scales_.stride(0),
          l + 1 < layers() ? centroid_tiles_.data_ptr<int8_t>() + (l + 1) * centroid_tiles_.stride(0) : nullptr,
          centroid_tiles_.stride(0),
          centroid_tiles_.size(2) * kTileCentroids,
          key_mean_.numel() == 0 ? nullptr : key_mean_.data_ptr<float>() + l * key_mean_.stride(0),
          rotary_.data_ptr<float>(),
          middle_offsets_.data(),
          half_turn_.data(),
          wrope_cos_.data_ptr<float>() + rotation_ * wrope_cos_.size(1),
          wrope_sin_.data_ptr<float>() + rotation_ * wrope_sin_.size(1),
          start_,
          end_,
          k_,
          candidates_,
          logits_};
}

}  // namespace ragkv
