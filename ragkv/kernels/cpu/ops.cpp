// The compiled CPU ops (ragkv.kernels.cpu_extension builds this file once per machine):
// batched dense decode attention, A2ATS sparse decode attention, few-row int8 and int4
// linears, and a whole decode step of a Llama-style model with int8 or int4 weights that
// runs every layer without returning to Python between ops.
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <tuple>
#include <vector>

#include "a2ats.h"
#include "attention.h"
#include "int4_linear.h"
#include "int8_linear.h"
#include "selective_attention.h"

namespace ragkv {
namespace {

// Views of one layer of each request's cache: [layers, Hkv, rows, D] caches with `layer`,
// or [Hkv, rows, D] cache layers with layer = -1.
template <typename T>
std::vector<CacheView<T>> layer_views(const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values,
                                      const std::vector<int64_t>& lengths, int64_t layer) {
  std::vector<CacheView<T>> views;
  for (size_t b = 0; b < keys.size(); ++b) {
    const at::Tensor &k = keys[b], &v = values[b];
    const int64_t heads_axis = k.dim() - 3, offset = layer < 0 ? 0 : layer * k.stride(0);
    views.push_back({k.data_ptr<T>() + offset, v.data_ptr<T>() + offset, k.stride(heads_axis), k.stride(heads_axis + 1),
                     lengths[b]});
  }
  return views;
}

void check_caches(const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values,
                  const std::vector<int64_t>& lengths, int64_t batch, int64_t kv_heads, int64_t dim, int64_t rank) {
  TORCH_CHECK(static_cast<int64_t>(keys.size()) == batch && static_cast<int64_t>(values.size()) == batch &&
                  static_cast<int64_t>(lengths.size()) == batch,
              "one key, value and length per request");
  const auto dtype = keys[0].scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "caches must be float32 or bfloat16");
  for (int64_t b = 0; b < batch; ++b) {
    const at::Tensor &k = keys[b], &v = values[b];
    TORCH_CHECK(k.dim() == rank && v.sizes() == k.sizes() && v.strides() == k.strides(),
                "keys and values of a request must share shape and layout");
    TORCH_CHECK(k.scalar_type() == dtype && v.scalar_type() == dtype, "every cache must share one dtype");
    TORCH_CHECK(k.size(rank - 3) == kv_heads && k.size(rank - 1) == dim && k.stride(rank - 1) == 1,
                "cache layers must be [Hkv, rows, D] with contiguous rows");
    TORCH_CHECK(lengths[b] >= 1 && lengths[b] <= k.size(rank - 2), "length out of range");
  }
}

}  // namespace

// q [B, Hq, D]; keys[b], values[b] [Hkv, capacity_b, D]; request b attends to its first
// lengths[b] rows. Returns [B, Hq, D] float32.
at::Tensor decode_attention_op(const at::Tensor& q, const std::vector<at::Tensor>& keys,
                               const std::vector<at::Tensor>& values, const std::vector<int64_t>& lengths,
                               double scale) {
  TORCH_CHECK(q.dim() == 3, "q must be [B, Hq, D]");
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2), kv_heads = keys.at(0).size(0);
  TORCH_CHECK(heads % kv_heads == 0 && heads / kv_heads <= kMaxGroup, "query heads per KV head must be <= 16");
  TORCH_CHECK(dim % 8 == 0 && dim <= kMaxDim, "head_dim must be a multiple of 8, at most 256");
  check_caches(keys, values, lengths, batch, kv_heads, dim, 3);
  const at::Tensor q_scaled = (q.to(at::kFloat) * scale).contiguous();
  at::Tensor out = at::empty({batch, heads, dim}, q.options().dtype(at::kFloat));
  if (keys[0].scalar_type() == at::kFloat)
    decode_attention<float>(q_scaled.data_ptr<float>(), layer_views<float>(keys, values, lengths, -1), heads,
                            kv_heads, dim, out.data_ptr<float>());
  else
    decode_attention<at::BFloat16>(q_scaled.data_ptr<float>(), layer_views<at::BFloat16>(keys, values, lengths, -1),
                                   heads, kv_heads, dim, out.data_ptr<float>());
  return out;
}

// q [N, Hq, D]; keys/values one cache layer [Hkv, rows, D]; query row i attends to the
// first limits[i] rows. Returns [N, Hq, D] float32.
at::Tensor selective_attention_op(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                                  const std::vector<int64_t>& limits, double scale) {
  TORCH_CHECK(q.dim() == 3, "q must be [N, Hq, D]");
  const int64_t n = q.size(0), heads = q.size(1), dim = q.size(2), kv_heads = keys.size(0);
  TORCH_CHECK(heads % kv_heads == 0 && heads / kv_heads <= kMaxGroup, "query heads per KV head must be <= 16");
  TORCH_CHECK(dim % 16 == 0 && dim <= kMaxDim, "head_dim must be a multiple of 16, at most 256");
  TORCH_CHECK(static_cast<int64_t>(limits.size()) == n, "one limit per query row");
  check_caches({keys}, {values}, {keys.size(1)}, 1, kv_heads, dim, 3);
  for (const int64_t limit : limits) TORCH_CHECK(limit >= 1 && limit <= keys.size(1), "limit out of range");
  const at::Tensor q_scaled = (q.to(at::kFloat) * scale).contiguous();
  at::Tensor out = at::empty({n, heads, dim}, q.options().dtype(at::kFloat));
  if (keys.scalar_type() == at::kFloat)
    selective_attention<float>(q_scaled.data_ptr<float>(), keys.data_ptr<float>(), values.data_ptr<float>(),
                               keys.stride(0), keys.stride(1), limits.data(), n, heads, kv_heads, dim,
                               out.data_ptr<float>());
  else
    selective_attention<at::BFloat16>(q_scaled.data_ptr<float>(), keys.data_ptr<at::BFloat16>(),
                                      values.data_ptr<at::BFloat16>(), keys.stride(0), keys.stride(1), limits.data(),
                                      n, heads, kv_heads, dim, out.data_ptr<float>());
  return out;
}

// One request's A2ATS state, as ragkv.sparse.a2ats holds it: codes [layers, Hkv, capacity]
// int16, residual centroids in tiles of 16 [layers, Hkv, C / 16, D, 16] int8 (coordinate d of
// 16 centroids side by side; C padded to a multiple of 16) with their scales [layers, Hkv, C]
// float32, key mean [layers, Hkv, D] float32 (empty: no mean-key term), rotary
// [positions, D] float32 ([cos | sin] of every rotation pair at each position), ranking by
// the group's summed probabilities, or its summed logits when `logits`. Built once and kept
// while those tensors are; each decode step then sets its own part (`step`), since a build
// with the step's cold caches is a visible share of a step.
class A2atsPlan {
 public:
  A2atsPlan(at::Tensor codes, at::Tensor centroid_tiles, at::Tensor centroid_scales, at::Tensor key_mean,
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

  // This step's part: wrope cos/sin [rotations, D] float32 at relative positions (offset -
  // position), of which row `rotation` is the current token's; rows [start, end) are
  // scored and k of them kept, the codes picking `candidates` (>= k; more: the k of them
  // with the most exact mass).
  void step(at::Tensor wrope_cos, at::Tensor wrope_sin, int64_t rotation, int64_t start, int64_t end, int64_t k,
            int64_t candidates) {
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

  // Checks the state against a model and a cache of `length` rows.
  void check(int64_t layers, int64_t kv_heads, int64_t dim, int64_t length) const {
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

  A2atsLayer layer(int64_t l) const {
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

  int64_t k() const { return std::min(k_, end_ - start_); }
  int64_t layers() const { return codes_.size(0); }
  bool selects() const { return k_ < end_ - start_; }

 private:
  at::Tensor codes_, centroid_tiles_, centroid_scales_, key_mean_, rotary_, wrope_cos_, wrope_sin_;
  std::vector<float> middle_offsets_, half_turn_;
  int64_t rotation_ = 0, start_ = 0, end_ = 0, k_ = 0, candidates_ = 0;
  bool logits_, stepped_ = false;
};

// q [Hq, D] over one cache layer keys/values [Hkv, capacity, D] of `length` rows with the
// A2ATS state of `layer`. Returns (out [Hq, D] float32, chosen rows [Hkv, k] int64, ascending).
std::tuple<at::Tensor, at::Tensor> a2ats_attention_op(const at::Tensor& q, const at::Tensor& keys,
                                                      const at::Tensor& values, int64_t length, const A2atsPlan& plan,
                                                      int64_t layer, double scale) {
  TORCH_CHECK(q.dim() == 2, "q must be [Hq, D]");
  const int64_t heads = q.size(0), dim = q.size(1), kv_heads = keys.size(0);
  TORCH_CHECK(heads % kv_heads == 0 && heads / kv_heads <= kMaxGroup, "query heads per KV head must be <= 16");
  TORCH_CHECK(dim % 8 == 0 && dim <= kMaxDim, "head_dim must be a multiple of 8, at most 256");
  check_caches({keys}, {values}, {length}, 1, kv_heads, dim, 3);
  TORCH_CHECK(layer >= 0 && layer < plan.layers(), "layer out of range");
  plan.check(plan.layers(), kv_heads, dim, length);
  const at::Tensor q_scaled = (q.to(at::kFloat) * scale).contiguous();
  at::Tensor out = at::empty({heads, dim}, q.options().dtype(at::kFloat));
  at::Tensor chosen = at::empty({kv_heads, plan.k()}, q.options().dtype(at::kLong));
  int64_t* chosen_ptr = plan.selects() ? chosen.data_ptr<int64_t>() : nullptr;
  if (keys.scalar_type() == at::kFloat)
    a2ats_attention<float>(q_scaled.data_ptr<float>(), layer_views<float>({keys}, {values}, {length}, -1)[0],
                           plan.layer(layer), heads, kv_heads, dim, out.data_ptr<float>(), chosen_ptr);
  else
    a2ats_attention<at::BFloat16>(q_scaled.data_ptr<float>(),
                                  layer_views<at::BFloat16>({keys}, {values}, {length}, -1)[0], plan.layer(layer),
                                  heads, kv_heads, dim, out.data_ptr<float>(), chosen_ptr);
  return {out, chosen};
}

// One few-row linear of the compiled step: int8 (weight [out, in] int8, bf16 scale per
// output channel) or int4 (weight [out, int4_row_bytes(in)] uint8, scales empty).
class PackedLinear {
 public:
  PackedLinear(at::Tensor weight, at::Tensor scales, int64_t in) : weight_(std::move(weight)), scales_(std::move(scales)), in_(in) {
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

// x [rows, in] float32 through one packed linear -> [rows, out] float32.
at::Tensor packed_linear_op(const at::Tensor& x, const PackedLinear& linear) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) == linear.in(), "x must be [rows, in] float32");
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({x.size(0), linear.out()}, x.options());
  linear.apply(xc.data_ptr<float>(), x.size(0), y.data_ptr<float>());
  return y;
}

// x [rows, in] float32 @ (weight [out, in] int8 * scales [out] bf16)^T -> [rows, out] float32.
at::Tensor int8_linear_op(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales) {
  TORCH_CHECK(weight.scalar_type() == at::kChar, "weight must be int8");
  return packed_linear_op(x, PackedLinear(weight, scales, x.size(-1)));
}

// x [rows, in] float32 @ int4 rows weight [out, int4_row_bytes(in)] uint8 (int4_linear.h) -> [rows, out] float32.
at::Tensor int4_linear_op(const at::Tensor& x, const at::Tensor& weight, int64_t in) {
  TORCH_CHECK(weight.scalar_type() == at::kByte, "int4 rows must be uint8");
  return packed_linear_op(x, PackedLinear(weight, weight.new_empty({0}), in));
}

// A Llama-style decoder (RMSNorm, fused q/k/v without bias or q/k norms, rotate-half RoPE,
// GQA, SiLU-gated MLP) with int8 or int4 weights, as ragkv.engine.model.CausalLM lays it out.
class DecodeModel {
 public:
  // layers[l] = {input_norm, qkv weight, qkv scales, o weight, o scales, post-attention norm,
  //              gate_up weight, gate_up scales, down weight, down scales}; each weight int8
  //              with its scales or int4 rows with empty scales (PackedLinear); embed [vocab,
  //              hidden] float32; inv_freq [D / 2] float32 and attention_scaling as
  //              ragkv.engine.rope.Rotary holds them
  DecodeModel(std::vector<std::vector<at::Tensor>> layers, at::Tensor embed, at::Tensor final_norm,
              at::Tensor lm_weight, at::Tensor lm_scales, at::Tensor inv_freq, double attention_scaling,
              int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t intermediate, double eps, double scale)
      : embed_(std::move(embed)), inv_freq_(std::move(inv_freq)),
        attention_scaling_(static_cast<float>(attention_scaling)), final_norm_(std::move(final_norm)),
        heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim),
        hidden_size_(final_norm_.size(0)), intermediate_(intermediate), eps_(static_cast<float>(eps)),
        scale_(static_cast<float>(scale)),
        lm_head_(std::move(lm_weight), std::move(lm_scales), final_norm_.size(0)) {
    TORCH_CHECK(heads % kv_heads == 0 && heads / kv_heads <= kMaxGroup, "query heads per KV head must be <= 16");
    TORCH_CHECK(head_dim % 8 == 0 && head_dim <= kMaxDim, "head_dim must be a multiple of 8, at most 256");
    TORCH_CHECK(embed_.dim() == 2 && embed_.scalar_type() == at::kFloat && embed_.is_contiguous() &&
                    embed_.size(1) == hidden_size_,
                "embeddings must be contiguous [vocab, hidden] float32");
    TORCH_CHECK(inv_freq_.scalar_type() == at::kFloat && inv_freq_.is_contiguous() && inv_freq_.numel() == head_dim / 2,
                "inv_freq must be [head_dim / 2] float32");
    const int64_t attention_width = heads * head_dim, qkv_width = (heads + 2 * kv_heads) * head_dim;
    for (const auto& layer : layers) {
      TORCH_CHECK(layer.size() == 10, "each layer needs 10 tensors");
      for (int i : {0, 5}) TORCH_CHECK(layer[i].scalar_type() == at::kFloat, "float32 norms");
      Layer built{layer[0], layer[5], PackedLinear(layer[1], layer[2], hidden_size_),
                  PackedLinear(layer[3], layer[4], attention_width), PackedLinear(layer[6], layer[7], hidden_size_),
                  PackedLinear(layer[8], layer[9], intermediate)};
      TORCH_CHECK(built.qkv.out() == qkv_width && built.o.out() == hidden_size_ && built.gate_up.out() == 2 * intermediate &&
                      built.down.out() == hidden_size_,
                  "linear shapes do not match the model's dimensions");
      layers_.push_back(std::move(built));
    }
  }

  // token_ids[b] at RoPE position positions[b]; keys[b]/values[b] [layers, Hkv, capacity, D]
  // caches whose row rows[b] is written, attending to rows [0, rows[b]]. The embeddings and
  // cos | sin are looked up here. Several tokens of one request (a short
  // prefill) pass the same cache with consecutive rows. plans is empty (all dense) or has
  // one entry per row: an A2ATS plan makes that request's attention sparse. Returns
  // next-token logits [len(logit_rows), vocab] float32 of the batch rows logit_rows.
  at::Tensor step(const std::vector<int64_t>& token_ids, const std::vector<int64_t>& positions,
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

 private:
  void rms_norm(const float* x, const at::Tensor& weight, float* out, int64_t batch) const {
    const float* w = weight.data_ptr<float>();
    for (int64_t b = 0; b < batch; ++b) {
      const float* xb = x + b * hidden_size_;
      float squares = 0.f;
      for (int64_t i = 0; i < hidden_size_; ++i) squares += xb[i] * xb[i];
      const float inverse = 1.f / std::sqrt(squares / hidden_size_ + eps_);
      for (int64_t i = 0; i < hidden_size_; ++i) out[b * hidden_size_ + i] = w[i] * (xb[i] * inverse);
    }
  }

  // x * cos + rotate_half(x) * sin for one head vector
  void rope(const float* x, const float* cos, const float* sin, float factor, float* out) const {
    const int64_t half = head_dim_ / 2;
    for (int64_t d = 0; d < half; ++d) {
      out[d] = (x[d] * cos[d] - x[d + half] * sin[d]) * factor;
      out[d + half] = (x[d + half] * cos[d + half] + x[d] * sin[d + half]) * factor;
    }
  }

  template <typename T>
  at::Tensor run(const at::Tensor& hidden, const at::Tensor& cos, const at::Tensor& sin,
                 const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values,
                 const std::vector<int64_t>& rows, const std::vector<int64_t>& lengths,
                 const std::vector<int64_t>& logit_rows, const std::vector<std::optional<A2atsPlan>>& plans) const {
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

  // Every row's attention for one layer: one batched call for the dense requests, the
  // sparse ones each over its own cache.
  template <typename T>
  void attend(const float* queries, const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values,
              const std::vector<int64_t>& lengths, const std::vector<std::optional<A2atsPlan>>& plans, int64_t layer,
              float* attended) const {
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

  // out = silu(gate) * up, silu(g) = g * sigmoid(g) from e = exp(-|g|) (no overflow),
  // vectorised: a scalar libm exp per element is a visible share of a decode step.
  static void silu_gate(const float* gate, const float* up, int64_t n, float* out) {
    int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
    const __m256 sign = _mm256_set1_ps(-0.f), one = _mm256_set1_ps(1.f);
    for (; i + 8 <= n; i += 8) {
      const __m256 g = _mm256_loadu_ps(gate + i);
      const __m256 e = exp_nonpositive8(_mm256_or_ps(g, sign));  // exp(-|g|)
      const __m256 sigmoid = _mm256_div_ps(_mm256_blendv_ps(one, e, g), _mm256_add_ps(one, e));  // g < 0: e / (1 + e)
      _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(g, sigmoid), _mm256_loadu_ps(up + i)));
    }
#endif
    for (; i < n; ++i) {
      const float e = exp_nonpositive(-std::fabs(gate[i]));
      out[i] = gate[i] * ((gate[i] < 0.f ? e : 1.f) / (1.f + e)) * up[i];
    }
  }

  static void add_into(float* x, const float* update, int64_t n) {
    for (int64_t i = 0; i < n; ++i) x[i] += update[i];
  }

  struct Layer {
    at::Tensor input_norm, post_attention_norm;
    PackedLinear qkv, o, gate_up, down;
  };

  at::Tensor embed_, inv_freq_;
  float attention_scaling_;
  at::Tensor final_norm_;
  int64_t heads_, kv_heads_, head_dim_, hidden_size_, intermediate_;
  float eps_, scale_;
  PackedLinear lm_head_;
  std::vector<Layer> layers_;
};

}  // namespace ragkv

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &ragkv::decode_attention_op, "batched dense decode attention over per-request caches",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("selective_attention", &ragkv::selective_attention_op,
        "causal-by-position attention of many query rows over one cache layer",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("a2ats_attention", &ragkv::a2ats_attention_op, "A2ATS sparse decode attention over one cache layer",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  pybind11::class_<ragkv::A2atsPlan>(m, "A2atsPlan")
      .def(pybind11::init<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, bool>())
      .def("step", &ragkv::A2atsPlan::step);
  m.def("int8_linear", &ragkv::int8_linear_op, "few-row float32 x int8 matmul with per-channel scales",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("int4_linear", &ragkv::int4_linear_op, "few-row float32 x int4 (groups of 32, scale and minimum) matmul",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  pybind11::class_<ragkv::DecodeModel>(m, "DecodeModel")
      .def(pybind11::init<std::vector<std::vector<at::Tensor>>, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                          at::Tensor, double, int64_t, int64_t, int64_t, int64_t, double, double>())
      .def("step", &ragkv::DecodeModel::step, pybind11::call_guard<pybind11::gil_scoped_release>());
}
