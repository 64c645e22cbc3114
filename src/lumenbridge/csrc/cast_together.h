// Tensors made together as views of one buffer: autocast's casts of a
// tokenize call's parameters, and the parameters' gradients (autograd.cpp).
#pragma once

#include <ATen/ATen.h>

#include <vector>

namespace lumenbridge {

// `tensors` (all defined, on one device) in `dtype` as views of one buffer,
// each starting on a multiple of 16 elements, since the kernels (and fused
// optimizers) take their vector paths only for 16-byte-aligned tensors
// (benchmarks/NOTES.md, twenty-second session). Freeing them frees one
// block of memory, however many tensors there are.
std::vector<at::Tensor> in_one_buffer(at::TensorList tensors, at::ScalarType dtype);

// `tensors` (undefined entries allowed) as autocast casts them for `device`
// to `dtype`, as cached_cast would each: float32 tensors that autocast
// casts go through one conversion (one node for autograd, and one copy
// kernel that converts, each way: in_one_buffer) instead of one per tensor,
// which costs a training step a few dozen small kernels and autograd nodes;
// any other tensor through cached_cast.
std::vector<at::Tensor> autocast_together(const std::vector<at::Tensor>& tensors, at::ScalarType dtype,
                                          c10::DeviceType device);

}  // namespace lumenbridge
