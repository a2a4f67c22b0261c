// The compiled decode step (decode_model.h): embeddings, RoPE, every layer's norms,
// projections, cache append, attention and MLP, then the LM head, in one call.
#include "decode_model.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "a2ats.h"
#include "attention.h"
#include "cache_views.h"

#include <immintrin.h>

namespace ragkv {
namespace {

// out = silu(gate) * up, silu(g) = g * sigmoid(g) from e = exp(-|g|) (no overflow),
// vectorised: a scalar libm exp per element is a visible share of a decode step.
void silu_gate(const float* gate, const float* up, int64_t n, float* out) {
  int64_t i = 0;
  const __m256 sign = _mm256_set1_ps(-0.f), one = _mm256_set1_ps(1.f);
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 e = exp_nonpositive8(_mm256_or_ps(g, sign));  // exp(-|g|)
    const __m256 sigmoid = _mm256_div_ps(_mm256_blendv_ps(one, e, g), _mm256_add_ps(one, e));  // g < 0: e / (1 + e)
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(g, sigmoid), _mm256_loadu_ps(up + i)));
  }
  for (; i < n; ++i) {
    const float e = exp_nonpositive(-std::fabs(gate[i]));
    out[i] = gate[i] * ((gate[i] < 0.f ? e : 1.f) / (1.f + e)) * up[i];
  }
}

void add_into(float* x, const float* update, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] += update[i];
}

}  // namespace

DecodeModel::DecodeModel(const std::vector<DecodeLayerWeights>& layers, at::Tensor embed, at::Tensor final_norm,
                         const PackedWeight& lm_head, at::Tensor inv_freq, double attention_scaling, int64_t heads,
                         int64_t kv_heads, int64_t head_dim, int64_t intermediate, double eps, double scale)
    : embed_(std::move(embed)), inv_freq_(std::move(inv_freq)),
      attention_scaling_(static_cast<float>(attention_scaling)), final_norm_(std::move(final_norm)),
      heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim),
      hidden_size_(final_norm_.size(0)), intermediate_(intermediate), eps_(static_cast<float>(eps)),
      scale_(static_cast<float>(scale)),
      lm_head_(lm_head.weight, lm_head.scales, final_norm_.size(0)) {
  TORCH_CHECK(heads % kv_heads == 0 && heads / kv_heads <= kMaxGroup, "query heads per KV head must be <= 16");
  TORCH_CHECK(head_dim % 8 == 0 && head_dim <= kMaxDim, "head_dim must be a multiple of 8, at most 256");
  TORCH_CHECK(embed_.dim() == 2 && embed_.scalar_type() == at::kFloat && embed_.is_contiguous() &&
                  embed_.size(1) == hidden_size_,
              "embeddings must be contiguous [vocab, hidden] float32");
  TORCH_CHECK(inv_freq_.scalar_type() == at::kFloat && inv_freq_.is_contiguous() && inv_freq_.numel() == head_dim / 2,
              "inv_freq must be [head_dim / 2] float32");
  const int64_t attention_width = heads * head_dim, qkv_width = (heads + 2 * kv_heads) * head_dim;
  for (const DecodeLayerWeights& layer : layers) {
    TORCH_CHECK(layer.input_norm.scalar_type() == at::kFloat && layer.post_attention_norm.scalar_type() == at::kFloat,
                "float32 norms");
    Layer built{layer.input_norm,
                layer.post_attention_norm,
                PackedLinear(layer.qkv.weight, layer.qkv.scales, hidden_size_),
                PackedLinear(layer.o_proj.weight, layer.o_proj.scales, attention_width),
                PackedLinear(layer.gate_up.weight, layer.gate_up.scales, hidden_size_),
                PackedLinear(layer.down.weight, layer.down.scales, intermediate)};
    TORCH_CHECK(built.qkv.out() == qkv_width && built.o.out() == hidden_size_ &&
                    built.gate_up.out() == 2 * intermediate && built.down.out() == hidden_size_,
                "linear shapes do not match the model's dimensions");
    layers_.push_back(std::move(built));
  }
}

at::Tensor DecodeModel::step(const std::vector<int64_t>& token_ids, const std::vector<int64_t>& positions,
                             const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values,
                             const std::vector<int64_t>& rows, const std::vector<int64_t>& logit_rows,
                             const std::vector<std::optional<A2atsPlan>>& plans) const {
  const int64_t batch = static_cast<int64_t>(token_ids.size());
  TORCH_CHECK(batch >= 1 && static_cast<int64_t>(positions.size()) == batch, "one position per token");
  for (const int64_t token : token_ids) TORCH_CHECK(token >= 0 && token < embed_.size(0), "token id out of range");
  for (const int64_t position : positions) TORCH_CHECK(position >= 0, "negative position");
  std::vector<int64_t> lengths(rows);
  for (auto& length : lengths) length += 1;
  check_caches(keys, values, lengths, batch, kv_heads_, head_dim_, 4);
  for (const auto& k : keys) TORCH_CHECK(k.size(0) == static_cast<int64_t>(layers_.size()), "cache layer count");
  for (const int64_t row : logit_rows) TORCH_CHECK(row >= 0 && row < batch, "logit row out of range");
  TORCH_CHECK(plans.empty() || static_cast<int64_t>(plans.size()) == batch, "no plans, or one per row");
  for (int64_t b = 0; b < static_cast<int64_t>(plans.size()); ++b) {
    if (!plans[b]) continue;
    plans[b]->check(static_cast<int64_t>(layers_.size()), kv_heads_, head_dim_, lengths[b]);
    for (int64_t other = 0; other < batch; ++other)
      TORCH_CHECK(other == b || !keys[other].is_same(keys[b]), "a sparse request decodes one row of its own cache");
  }
  // the new tokens' embeddings and the cos | sin of their positions, as Rotary.cos_sin
  // computes them (float32 angle, cos and sin rounded to float32, then scaled)
  const auto f32 = embed_.options();
  at::Tensor hidden = at::empty({batch, hidden_size_}, f32), cos = at::empty({batch, head_dim_}, f32);
  at::Tensor sin = at::empty({batch, head_dim_}, f32);
  const int64_t half = head_dim_ / 2;
  for (int64_t b = 0; b < batch; ++b) {
    const float* row = embed_.data_ptr<float>() + token_ids[b] * hidden_size_;
    std::copy(row, row + hidden_size_, hidden.data_ptr<float>() + b * hidden_size_);
    float* c = cos.data_ptr<float>() + b * head_dim_;
    float* s = sin.data_ptr<float>() + b * head_dim_;
    for (int64_t i = 0; i < half; ++i) {
      const float angle = static_cast<float>(positions[b]) * inv_freq_.data_ptr<float>()[i];
      c[i] = c[half + i] = std::cos(angle) * attention_scaling_;
      s[i] = s[half + i] = std::sin(angle) * attention_scaling_;
    }
  }
  if (keys[0].scalar_type() == at::kFloat)
    return run<float>(hidden, cos, sin, keys, values, rows, lengths, logit_rows, plans);
  return run<at::BFloat16>(hidden, cos, sin, keys, values, rows, lengths, logit_rows, plans);
}

void DecodeModel::rms_norm(const float* x, const at::Tensor& weight, float* out, int64_t batch) const {
  const float* w = weight.data_ptr<float>();
  for (int64_t b = 0; b < batch; ++b) {
    const float* xb = x + b * hidden_size_;
    float squares = 0.f;
    for (int64_t i = 0; i < hidden_size_; ++i) squares += xb[i] * xb[i];
    const float inverse = 1.f / std::sqrt(squares / hidden_size_ + eps_);
    for (int64_t i = 0; i < hidden_size_; ++i) out[b * hidden_size_ + i] = w[i] * (xb[i] * inverse);
  }
}

void DecodeModel::rope(const float* x, const float* cos, const float* sin, float factor, float* out) const {
  const int64_t half = head_dim_ / 2;
  for (int64_t d = 0; d < half; ++d) {
    out[d] = (x[d] * cos[d] - x[d + half] * sin[d]) * factor;
    out[d + half] = (x[d + half] * cos[d + half] + x[d] * sin[d + half]) * factor;
  }
}

template <typename T>
at::Tensor DecodeModel::run(const at::Tensor& hidden, const at::Tensor& cos, const at::Tensor& sin,
                            const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values,
                            const std::vector<int64_t>& rows, const std::vector<int64_t>& lengths,
                            const std::vector<int64_t>& logit_rows,
                            const std::vector<std::optional<A2atsPlan>>& plans) const {
  const int64_t batch = hidden.size(0), hs = hidden_size_, dim = head_dim_;
  const int64_t qkv_width = (heads_ + 2 * kv_heads_) * dim, attention_width = heads_ * dim;
  const auto f32 = hidden.options().dtype(at::kFloat);
  at::Tensor residual = hidden.contiguous().clone();
  at::Tensor normed = at::empty({batch, hs}, f32), update = at::empty({batch, hs}, f32);
  at::Tensor qkv = at::empty({batch, qkv_width}, f32), queries = at::empty({batch, attention_width}, f32);
  at::Tensor attended = at::empty({batch, attention_width}, f32);
  at::Tensor gate_up = at::empty({batch, 2 * intermediate_}, f32), gated = at::empty({batch, intermediate_}, f32);
  const at::Tensor cos_c = cos.contiguous(), sin_c = sin.contiguous();
  float* x = residual.data_ptr<float>();
  std::vector<float> rotated(dim);
  for (size_t layer = 0; layer < layers_.size(); ++layer) {
    const Layer& w = layers_[layer];
    rms_norm(x, w.input_norm, normed.data_ptr<float>(), batch);
    w.qkv.apply(normed.data_ptr<float>(), batch, qkv.data_ptr<float>());
    for (int64_t b = 0; b < batch; ++b) {
      const float* row = qkv.data_ptr<float>() + b * qkv_width;
      const float* c = cos_c.data_ptr<float>() + b * dim;
      const float* s = sin_c.data_ptr<float>() + b * dim;
      for (int64_t h = 0; h < heads_; ++h)
        rope(row + h * dim, c, s, scale_, queries.data_ptr<float>() + (b * heads_ + h) * dim);
      T* k_cache = keys[b].data_ptr<T>() + layer * keys[b].stride(0) + rows[b] * keys[b].stride(2);
      T* v_cache = values[b].data_ptr<T>() + layer * values[b].stride(0) + rows[b] * values[b].stride(2);
      for (int64_t h = 0; h < kv_heads_; ++h) {
        rope(row + (heads_ + h) * dim, c, s, 1.f, rotated.data());
        const float* v = row + (heads_ + kv_heads_ + h) * dim;
        for (int64_t d = 0; d < dim; ++d) {
          k_cache[h * keys[b].stride(1) + d] = static_cast<T>(rotated[d]);
          v_cache[h * values[b].stride(1) + d] = static_cast<T>(v[d]);
        }
      }
    }
    attend<T>(queries.data_ptr<float>(), keys, values, lengths, plans, static_cast<int64_t>(layer),
           attended.data_ptr<float>());
    w.o.apply(attended.data_ptr<float>(), batch, update.data_ptr<float>());
    add_into(x, update.data_ptr<float>(), batch * hs);
    rms_norm(x, w.post_attention_norm, normed.data_ptr<float>(), batch);
    w.gate_up.apply(normed.data_ptr<float>(), batch, gate_up.data_ptr<float>());
    for (int64_t b = 0; b < batch; ++b) {
      const float* g = gate_up.data_ptr<float>() + b * 2 * intermediate_;
      silu_gate(g, g + intermediate_, intermediate_, gated.data_ptr<float>() + b * intermediate_);
    }
    w.down.apply(gated.data_ptr<float>(), batch, update.data_ptr<float>());
    add_into(x, update.data_ptr<float>(), batch * hs);
  }
  const int64_t outputs = static_cast<int64_t>(logit_rows.size());
  for (int64_t i = 0; i < outputs; ++i)
    std::copy(x + logit_rows[i] * hs, x + (logit_rows[i] + 1) * hs, update.data_ptr<float>() + i * hs);
  rms_norm(update.data_ptr<float>(), final_norm_, normed.data_ptr<float>(), outputs);
  at::Tensor logits = at::empty({outputs, lm_head_.out()}, f32);
  lm_head_.apply(normed.data_ptr<float>(), outputs, logits.data_ptr<float>());
  return logits;
}

template <typename T>
void DecodeModel::attend(const float* queries, const std::vector<at::Tensor>& keys,
                         const std::vector<at::Tensor>& values, const std::vector<int64_t>& lengths,
                         const std::vector<std::optional<A2atsPlan>>& plans, int64_t layer, float* attended) const {
  const int64_t width = heads_ * head_dim_, batch = static_cast<int64_t>(keys.size());
  std::vector<at::Tensor> dense_keys, dense_values;
  std::vector<int64_t> dense_lengths, dense;
  for (int64_t b = 0; b < batch; ++b)
    if (plans.empty() || !plans[b]) {
      dense.push_back(b);
      dense_keys.push_back(keys[b]);
      dense_values.push_back(values[b]);
      dense_lengths.push_back(lengths[b]);
    }
  if (!dense.empty())
    decode_attention<T>(queries, layer_views<T>(dense_keys, dense_values, dense_lengths, layer), heads_, kv_heads_,
                        head_dim_, attended, dense);
  for (int64_t b = 0; b < batch; ++b)
    if (!plans.empty() && plans[b])
      a2ats_attention<T>(queries + b * width, layer_views<T>({keys[b]}, {values[b]}, {lengths[b]}, layer)[0],
                         plans[b]->layer(layer), heads_, kv_heads_, head_dim_, attended + b * width, nullptr);
}

}  // namespace ragkv
