// One few-row linear: int8 weights with a bf16 scale per output channel (int8_linear.h)
// or int4 rows with their scales inside (int4_linear.h), behind one `apply`.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <utility>

#include "int4_linear.h"
#include "int8_linear.h"

namespace ragkv {

// int8 (weight [out, in] int8, bf16 scale per output channel) or int4 (weight
// [out, int4_row_bytes(in)] uint8, scales empty).
class PackedLinear {
 public:
  PackedLinear(at::Tensor weight, at::Tensor scales, int64_t in)
      : weight_(std::move(weight)), scales_(std::move(scales)), in_(in) {
    TORCH_CHECK(weight_.dim() == 2 && weight_.is_contiguous(), "weights must be contiguous matrices");
    int4_ = weight_.scalar_type() == at::kByte;
    if (int4_) {
      TORCH_CHECK(in % kInt4Group == 0 && weight_.size(1) == int4_row_bytes(in),
                  "int4 weights must be uint8 [out, int4_row_bytes(in)], in a multiple of 32");
    } else {
      TORCH_CHECK(weight_.scalar_type() == at::kChar && weight_.size(1) == in && in % 8 == 0,
                  "int8 weights must be [out, in], in a multiple of 8");
      TORCH_CHECK(scales_.scalar_type() == at::kBFloat16 && scales_.numel() == weight_.size(0),
                  "int8 scales must be bf16 [out]");
      scales_ = scales_.contiguous();
    }
  }
  int64_t in() const { return in_; }
  int64_t out() const { return weight_.size(0); }
  void apply(const float* x, int64_t rows, float* y) const {
    if (int4_)
      int4_linear(x, rows, in_, weight_.data_ptr<uint8_t>(), out(), y);
    else
      int8_linear(x, rows, in_, weight_.data_ptr<int8_t>(), scales_.data_ptr<at::BFloat16>(), out(), y);
  }

 private:
  at::Tensor weight_, scales_;
  int64_t in_;
  bool int4_ = false;
};

}  // namespace ragkv
