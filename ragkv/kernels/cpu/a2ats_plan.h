// One request's A2ATS state for the compiled sparse attention (a2ats.h), as
// ragkv.sparse.a2ats holds it: codes [layers, Hkv, capacity] int16, residual centroids in
// tiles of 16 [layers, Hkv, C / 16, D, 16] int8 (coordinate d of 16 centroids side by side;
// C padded to a multiple of 16) with their scales [layers, Hkv, C] float32, key mean
// [layers, Hkv, D] float32 (empty: no mean-key term), rotary [positions, D] float32 ([cos |
// sin] of every rotation pair at each position), ranking by the group's summed
// probabilities, or its summed logits when `logits`. Built once and kept while those
// tensors are; each decode step then sets its own part (`step`), since a build with the
// step's cold caches is a visible share of a step.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "a2ats.h"

namespace ragkv {

class A2atsPlan {
 public:
  A2atsPlan(at::Tensor codes, at::Tensor centroid_tiles, at::Tensor centroid_scales, at::Tensor key_mean,
            at::Tensor rotary, bool logits);

  // This step's part: wrope cos/sin [rotations, D] float32 at relative positions (offset -
  // position), of which row `rotation` is the current token's; rows [start, end) are
  // scored and k of them kept, the codes picking `candidates` (>= k; more: the k of them
  // with the most exact mass).
  void step(at::Tensor wrope_cos, at::Tensor wrope_sin, int64_t rotation, int64_t start, int64_t end, int64_t k,
            int64_t candidates);

  // Checks the state against a model and a cache of `length` rows.
  void check(int64_t layers, int64_t kv_heads, int64_t dim, int64_t length) const;

  A2atsLayer layer(int64_t l) const;

  int64_t k() const { return std::min(k_, end_ - start_); }
  int64_t layers() const { return codes_.size(0); }
  bool selects() const { return k_ < end_ - start_; }

 private:
  at::Tensor codes_, centroid_tiles_, centroid_scales_, key_mean_, rotary_, wrope_cos_, wrope_sin_;
  std::vector<float> middle_offsets_, half_turn_;
  int64_t rotation_ = 0, start_ = 0, end_ = 0, k_ = 0, candidates_ = 0;
  bool logits_, stepped_ = false;
};

}  // namespace ragkv
