// Depthwise forward launchers, shared with the stride-1 input gradient
// (which is the forward convolution with the kernel flipped).
#pragma once

#include <torch/types.h>

#include "../activation.h"
#include "../gateway.h"

namespace lumenbridge {
namespace cuda {

// output = depthwise(act(input), weight) + bias for a validated problem;
// writes into `output`, which has the problem's output extents and layout
// (NHWC: pixels any pitch apart, channels dense, rows of pixels dense).
// `bias` may be undefined; only NHWC takes an input activation other than NONE.
void launch_depthwise_forward(const at::Tensor& input, const at::Tensor& weight,
                              const at::Tensor& bias, at::Tensor& output,
                              const DepthwiseProblem& p, Activation input_activation);

// The per-layout launchers behind it (depthwise_forward_{nchw,nhwc}.cu).
void launch_depthwise_forward_nchw(const at::Tensor& input, const at::Tensor& weight,
                                   const at::Tensor& bias, at::Tensor& output,
                                   const DepthwiseProblem& p);
void launch_depthwise_forward_nhwc(const at::Tensor& input, const at::Tensor& weight,
                                   const at::Tensor& bias, at::Tensor& output,
                                   const DepthwiseProblem& p, Activation input_activation);

}  // namespace cuda
}  // namespace lumenbridge
