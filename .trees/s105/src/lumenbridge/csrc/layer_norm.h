// LayerNorm's backward over rows [M, C], as the composed backward takes it
// for the token norm and the stage norms: ATen's form on every device
// (layer_norm.cpp), and on CUDA a one-pass kernel (cuda/layer_norm_backward.cu)
// that takes ATen's form for rows it does not cover.
#pragma once

#include <ATen/core/Tensor.h>

namespace lumenbridge {

// The gradients of a per-channel map's input and of its weight and bias
// (undefined when they were not asked for).
struct AffineGrads {
  at::Tensor input, weight, bias;
};

// The input gradient of LayerNorm(x; weight, bias, eps) for `grad`, and the
// parameters' when `parameters`; both forms reduce in a fixed order (no
// atomics), so the gradients are bitwise deterministic.
AffineGrads layer_norm_backward_aten(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& weight,
                                     const at::Tensor& bias, double eps, bool parameters);

namespace cuda {
AffineGrads layer_norm_backward(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& weight,
                                const at::Tensor& bias, double eps, bool parameters);
}  // namespace cuda

}  // namespace lumenbridge
