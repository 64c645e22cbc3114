// Tensors as views of one buffer, and autocast's casts of a tokenize call's
// parameters made that way as one autograd Function (cast_together.h).
#include "cast_together.h"

#include <ATen/autocast_mode.h>
#include <torch/autograd.h>

namespace lumenbridge {

// One buffer, its pieces written by one multi-tensor copy (which converts),
// each shaped as its tensor. The padding between them is left unwritten: no
// kernel reads it.
std::vector<at::Tensor> in_one_buffer(at::TensorList tensors, at::ScalarType dtype) {
  constexpr int64_t kAlign = 16;  // elements: at least 16 bytes in every dtype
  // Symbolic sizes where a compiler traces the backward (torch.compile, opcheck).
  std::vector<c10::SymInt> offsets;
  c10::SymInt total = 0;
  for (const at::Tensor& t : tensors) {
    offsets.push_back(total);
    total = total + (t.sym_numel() + kAlign - 1) / kAlign * kAlign;
  }
  const at::Tensor all = at::empty_symint({total}, tensors.front().options().dtype(dtype));
  // Flat pieces on both sides, so that every pair has the same sizes and strides (the copy's fast path).
  std::vector<at::Tensor> pieces, sources;
  for (size_t k = 0; k < tensors.size(); ++k) {
    pieces.push_back(all.narrow_symint(0, offsets[k], tensors[k].sym_numel()));
    sources.push_back(tensors[k].reshape(-1));
  }
  at::_foreach_copy_(pieces, sources);
  std::vector<at::Tensor> parts;
  for (size_t k = 0; k < tensors.size(); ++k) parts.push_back(pieces[k].view_symint(tensors[k].sym_sizes()));
  return parts;
}

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct CastTogether : torch::autograd::Function<CastTogether> {
  static variable_list forward(AutogradContext* ctx, at::TensorList tensors, at::ScalarType dtype) {
    ctx->saved_data["dtype"] = static_cast<int64_t>(tensors[0].scalar_type());
    return in_one_buffer(tensors, dtype);
  }

  // The gradients back in the tensors' dtype, as each cast's backward gives them.
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list result = in_one_buffer(grads, static_cast<at::ScalarType>(ctx->saved_data["dtype"].toInt()));
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
