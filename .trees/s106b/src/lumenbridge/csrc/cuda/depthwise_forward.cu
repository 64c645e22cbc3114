// Depthwise forward entry point: allocates the output and hands the problem to
// the kernel for its layout (depthwise_forward_nchw.cu, depthwise_forward_nhwc.cu);
// and its form with an input activation, into a given output (activated_depthwise.h).
#include <c10/cuda/CUDAGuard.h>

#include "../activated_depthwise.h"
#include "common.cuh"
#include "depthwise_forward.cuh"

namespace lumenbridge {
namespace cuda {

void launch_depthwise_forward(const at::Tensor& input, const at::Tensor& weight,
                              const at::Tensor& bias, at::Tensor& output,
                              const DepthwiseProblem& p, Activation input_activation) {
  if (output.numel() == 0) return;
  if (p.layout == Layout::NCHW) {
    TORCH_INTERNAL_ASSERT(input_activation == Activation::NONE, "the NCHW forward takes no input activation");
    launch_depthwise_forward_nchw(input, weight, bias, output, p);
  } else {
    launch_depthwise_forward_nhwc(input, weight, bias, output, p, input_activation);
  }
}

at::Tensor depthwise_forward(const at::Tensor& input, const at::Tensor& weight,
                             const c10::optional<at::Tensor>& bias, const DepthwiseProblem& p) {
  check_extents_fit_int(p);
  const c10::cuda::CUDAGuard guard(input.device());
  at::Tensor output = new_output({p.N, p.C, p.Ho, p.Wo}, input.options(), p.memory_format());
  launch_depthwise_forward(input, weight, bias.has_value() ? *bias : at::Tensor(), output, p, Activation::NONE);
  return output;
}

void activated_depthwise_forward_into(const at::Tensor& pre, const at::Tensor& weight, const at::Tensor& bias,
                                      const DepthwiseProblem& p, Activation activation, at::Tensor& out) {
  if (p.layout == Layout::NCHW) {  // the NCHW kernels write dense outputs and take no activation
    out.copy_(depthwise_forward(activate(pre, activation), weight,
                                bias.defined() ? c10::optional<at::Tensor>(bias) : c10::nullopt, p));
    return;
  }
  check_extents_fit_int(p);
  const c10::cuda::CUDAGuard guard(pre.device());
  launch_depthwise_forward(pre, weight, bias, out, p, activation);
}

}  // namespace cuda
}  // namespace lumenbridge
