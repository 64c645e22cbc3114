// The activation between stages: the choice the op's config carries, and its
// ATen forms, the reference semantics (GELU in its erf form). The CUDA
// depthwise kernels of the composed backward also evaluate it on their loads
// and stores (cuda/activation.cuh); where they cannot, these forms run around them.
#pragma once

#include <ATen/core/Tensor.h>

namespace lumenbridge {

enum class Activation { GELU, RELU, SILU, NONE };

at::Tensor activate(const at::Tensor& x, Activation activation);

// The same, written over x: where x is an intermediate no one else reads, this
// spares a new tensor (on the CPU, large allocations are fresh pages each
// time, and faulting them in cost more than GELU itself at the first stage).
void activate_(at::Tensor& x, Activation activation);

// grad * act'(pre), written over `grad`.
void activation_backward_(at::Tensor& grad, const at::Tensor& pre, Activation activation);

}  // namespace lumenbridge
