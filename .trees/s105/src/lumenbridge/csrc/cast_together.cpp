// Autocast's casts of a tokenize call's parameters as one autograd Function
// (cast_together.h).
#include "cast_together.h"

#include <ATen/autocast_mode.h>
#include <torch/autograd.h>

namespace lumenbridge {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The tensors in `dtype`: one flat copy of them all (one kernel), converted
// (one more), and views of it shaped as each tensor. Each view starts on a
// multiple of kAlign elements, since the kernels take their vector paths only
// for 16-byte-aligned tensors (benchmarks/NOTES.md, twenty-second session).
// The padding is zeros, not left unset, so that the copy reads no
// uninitialized memory (compute-sanitizer's initcheck).
variable_list converted(at::TensorList tensors, at::ScalarType dtype) {
  constexpr int64_t kAlign = 16;  // elements: at least 16 bytes in every dtype
  std::vector<at::Tensor> flat;
  std::vector<int64_t> offsets;
  int64_t offset = 0;
  at::Tensor padding;
  for (const at::Tensor& t : tensors) {
    offsets.push_back(offset);
    flat.push_back(t.reshape(-1));
    const int64_t gap = (kAlign - t.numel() % kAlign) % kAlign;
    if (gap > 0) {
      if (!padding.defined()) padding = at::zeros({kAlign}, t.options());
      flat.push_back(padding.narrow(0, 0, gap));
    }
    offset += t.numel() + gap;
  }
  const at::Tensor all = at::cat(flat).to(dtype);
  variable_list parts;
  for (size_t k = 0; k < tensors.size(); ++k) {
    parts.push_back(all.narrow(0, offsets[k], tensors[k].numel()).view(tensors[k].sizes()));
  }
  return parts;
}

struct CastTogether : torch::autograd::Function<CastTogether> {
  static variable_list forward(AutogradContext* ctx, at::TensorList tensors, at::ScalarType dtype) {
    ctx->saved_data["dtype"] = static_cast<int64_t>(tensors[0].scalar_type());
    return converted(tensors, dtype);
  }

  // The gradients back in the tensors' dtype, as each cast's backward gives them.
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list result = converted(grads, static_cast<at::ScalarType>(ctx->saved_data["dtype"].toInt()));
    result.emplace_back();  // dtype
    return result;
  }
};

}  // namespace

std::vector<at::Tensor> autocast_together(const std::vector<at::Tensor>& tensors, at::ScalarType dtype,
                                          c10::DeviceType device) {
  std::vector<at::Tensor> result(tensors);
  std::vector<size_t> picked;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    if (!t.defined()) continue;
    if (t.scalar_type() == at::kFloat && dtype != at::kFloat && at::autocast::is_autocast_eligible(t, device)) {
      picked.push_back(i);
    } else {
      result[i] = at::autocast::cached_cast(dtype, t, device);
    }
  }
  if (picked.empty()) return result;
  variable_list sources;
  for (size_t i : picked) sources.push_back(tensors[i]);
  // As a TensorList, so that autograd takes its tensors as the Function's inputs.
  const variable_list cast = CastTogether::apply(at::TensorList(sources), dtype);
  for (size_t k = 0; k < picked.size(); ++k) result[picked[k]] = cast[k];
  return result;
}

}  // namespace lumenbridge
