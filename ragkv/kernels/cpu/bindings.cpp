// The Python module of the compiled CPU kernels (ragkv.kernels.cpu_extension builds it once
// per machine): bindings only; the ops live in tensor_ops, a2ats_plan and decode_model.
#include <torch/extension.h>

#include "a2ats_plan.h"
#include "decode_model.h"
#include "tensor_ops.h"

namespace py = pybind11;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using py::arg;
  const auto no_gil = py::call_guard<py::gil_scoped_release>();
  m.def("decode_attention", &ragkv::decode_attention_op, "batched dense decode attention over per-request caches",
        no_gil);
  m.def("selective_attention", &ragkv::selective_attention_op,
        "causal-by-position attention of many query rows over one cache layer", no_gil);
  m.def("flash_blocks", &ragkv::flash_blocks_op,
        "causal-by-position attention of sorted query rows in blocks of torch's CPU flash kernel", no_gil);
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
  m.def("bf16_flash", &ragkv::bf16_flash_op,
        "causal-by-position attention of sorted bf16 query rows in AVX512-BF16 dot products", no_gil);
#endif
  m.def("a2ats_attention", &ragkv::a2ats_attention_op, "A2ATS sparse decode attention over one cache layer", no_gil);
  py::class_<ragkv::A2atsPlan>(m, "A2atsPlan")
      .def(py::init<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, bool>(), arg("codes"),
           arg("centroid_tiles"), arg("centroid_scales"), arg("key_mean"), arg("rotary"), arg("logits"))
      .def("step", &ragkv::A2atsPlan::step, arg("wrope_cos"), arg("wrope_sin"), arg("rotation"), arg("start"),
           arg("end"), arg("k"), arg("candidates"));
  m.def("int8_linear", &ragkv::int8_linear_op, "few-row float32 x int8 matmul with per-channel scales", no_gil);
  m.def("int4_linear", &ragkv::int4_linear_op, "few-row float32 x int4 (groups of 32, scale and minimum) matmul",
        no_gil);

  // the decode step's weights cross by name (ragkv.engine.decode_weights mirrors these)
  py::class_<ragkv::PackedWeight>(m, "PackedWeight")
      .def(py::init<at::Tensor, at::Tensor>(), arg("weight"), arg("scales"))
      .def_readwrite("weight", &ragkv::PackedWeight::weight)
      .def_readwrite("scales", &ragkv::PackedWeight::scales);
  py::class_<ragkv::DecodeLayerWeights>(m, "DecodeLayerWeights")
      .def(py::init<at::Tensor, ragkv::PackedWeight, ragkv::PackedWeight, at::Tensor, ragkv::PackedWeight,
                    ragkv::PackedWeight>(),
           arg("input_norm"), arg("qkv"), arg("o_proj"), arg("post_attention_norm"), arg("gate_up"), arg("down"))
      .def_readwrite("input_norm", &ragkv::DecodeLayerWeights::input_norm)
      .def_readwrite("qkv", &ragkv::DecodeLayerWeights::qkv)
      .def_readwrite("o_proj", &ragkv::DecodeLayerWeights::o_proj)
      .def_readwrite("post_attention_norm", &ragkv::DecodeLayerWeights::post_attention_norm)
      .def_readwrite("gate_up", &ragkv::DecodeLayerWeights::gate_up)
      .def_readwrite("down", &ragkv::DecodeLayerWeights::down);
  py::class_<ragkv::DecodeModel>(m, "DecodeModel")
      .def(py::init<const std::vector<ragkv::DecodeLayerWeights>&, at::Tensor, at::Tensor, const ragkv::PackedWeight&,
                    at::Tensor, double, int64_t, int64_t, int64_t, int64_t, double, double>(),
           arg("layers"), arg("embed"), arg("final_norm"), arg("lm_head"), arg("inv_freq"), arg("attention_scaling"),
           arg("heads"), arg("kv_heads"), arg("head_dim"), arg("intermediate"), arg("eps"), arg("scale"))
      .def("step", &ragkv::DecodeModel::step, no_gil);
}
