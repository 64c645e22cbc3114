// Autocast's casts of a tokenize call's parameters, made together.
#pragma once

#include <ATen/ATen.h>

#include <vector>

namespace lumenbridge {

// `tensors` (undefined entries allowed) as autocast casts them for `device`
// to `dtype`, as cached_cast would each: float32 tensors that autocast
// casts go through one conversion (one node for autograd, and one copy and
// one conversion kernel each way) instead of one per tensor, which costs a
// training step a few dozen small kernels and autograd nodes; any other
// tensor through cached_cast.
std::vector<at::Tensor> autocast_together(const std::vector<at::Tensor>& tensors, at::ScalarType dtype,
                                          c10::DeviceType device);

}  // namespace lumenbridge
