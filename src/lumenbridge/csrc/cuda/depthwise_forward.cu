// Depthwise forward entry point: allocates the output and hands the problem to
// the kernel for its layout (depthwise_forward_nchw.cu, depthwise_forward_nhwc.cu).
#include <c10/cuda/CUDAGuard.h>

#include "common.cuh"
#include "depthwise_forward.cuh"

namespace lumenbridge {
namespace cuda {

void launch_depthwise_forward(const at::Tensor& input, const at::Tensor& weight,
                              const at::Tensor& bias, at::Tensor& output,
                              const DepthwiseProblem& p) {
  if (output.numel() == 0) return;
  if (p.layout == Layout::NCHW) {
    launch_depthwise_forward_nchw(input, weight, bias, output, p);
  } else {
    launch_depthwise_forward_nhwc(input, weight, bias, output, p);
  }
}

at::Tensor depthwise_forward(const at::Tensor& input, const at::Tensor& weight,
                             const c10::optional<at::Tensor>& bias, const DepthwiseProblem& p) {
  check_extents_fit_int(p);
  const c10::cuda::CUDAGuard guard(input.device());
  at::Tensor output = new_output({p.N, p.C, p.Ho, p.Wo}, input.options(), p.memory_format());
  launch_depthwise_forward(input, weight, bias.has_value() ? *bias : at::Tensor(), output, p);
  return output;
}

}  // namespace cuda
}  // namespace lumenbridge
