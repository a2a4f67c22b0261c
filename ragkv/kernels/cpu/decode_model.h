// A Llama-style decoder (RMSNorm, fused q/k/v without bias or q/k norms, rotate-half RoPE,
// GQA, SiLU-gated MLP) with int8 or int4 weights that runs a whole decode step, every
// layer, without returning to Python between ops. Its weights arrive as named structs
// (ragkv.engine.decode_weights mirrors them field for field), built once per model.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "a2ats_plan.h"
#include "packed_linear.h"

namespace ragkv {

// One few-row linear's tensors: int8 weight [out, in] with bf16 scales [out], or int4 rows
// [out, int4_row_bytes(in)] uint8 with empty scales.
struct PackedWeight {
  at::Tensor weight, scales;
};

// One layer's weights; norms float32 [hidden].
struct DecodeLayerWeights {
  at::Tensor input_norm;
  PackedWeight qkv;  // hidden -> (Hq + 2 Hkv) * D
  PackedWeight o_proj;  // Hq * D -> hidden
  at::Tensor post_attention_norm;
  PackedWeight gate_up;  // hidden -> 2 * intermediate
  PackedWeight down;  // intermediate -> hidden
};

class DecodeModel {
 public:
  // embed [vocab, hidden] float32; inv_freq [D / 2] float32 and attention_scaling as
  // ragkv.engine.rope.Rotary holds them; scale the softmax scale of q.k.
  DecodeModel(const std::vector<DecodeLayerWeights>& layers, at::Tensor embed, at::Tensor final_norm,
              const PackedWeight& lm_head, at::Tensor inv_freq, double attention_scaling, int64_t heads,
              int64_t kv_heads, int64_t head_dim, int64_t intermediate, double eps, double scale);

  // token_ids[b] at RoPE position positions[b]; keys[b]/values[b] [layers, Hkv, capacity, D]
  // caches whose row rows[b] is written, attending to rows [0, rows[b]]. The embeddings and
  // cos | sin are looked up here. Several tokens of one request (a short
  // prefill) pass the same cache with consecutive rows. plans is empty (all dense) or has
  // one entry per row: an A2ATS plan makes that request's attention sparse. Returns
  // next-token logits [len(logit_rows), vocab] float32 of the batch rows logit_rows.
  at::Tensor step(const std::vector<int64_t>& token_ids, const std::vector<int64_t>& positions,
                  const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values,
                  const std::vector<int64_t>& rows, const std::vector<int64_t>& logit_rows,
                  const std::vector<std::optional<A2atsPlan>>& plans) const;

 private:
  struct Layer {
    at::Tensor input_norm, post_attention_norm;
    PackedLinear qkv, o, gate_up, down;
  };

  void rms_norm(const float* x, const at::Tensor& weight, float* out, int64_t batch) const;
  // x * cos + rotate_half(x) * sin for one head vector
  void rope(const float* x, const float* cos, const float* sin, float factor, float* out) const;
  template <typename T>
  at::Tensor run(const at::Tensor& hidden, const at::Tensor& cos, const at::Tensor& sin,
                 const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values,
                 const std::vector<int64_t>& rows, const std::vector<int64_t>& lengths,
                 const std::vector<int64_t>& logit_rows, const std::vector<std::optional<A2atsPlan>>& plans) const;
  // Every row's attention for one layer: one batched call for the dense requests, the
  // sparse ones each over its own cache.
  template <typename T>
  void attend(const float* queries, const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values,
              const std::vector<int64_t>& lengths, const std::vector<std::optional<A2atsPlan>>& plans, int64_t layer,
              float* attended) const;

  at::Tensor embed_, inv_freq_;
  float attention_scaling_;
  at::Tensor final_norm_;
  int64_t heads_, kv_heads_, head_dim_, hidden_size_, intermediate_;
  float eps_, scale_;
  PackedLinear lm_head_;
  std::vector<Layer> layers_;
};

}  // namespace ragkv
