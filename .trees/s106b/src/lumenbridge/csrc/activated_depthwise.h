// The depthwise kernels as the composed backward (tokenize_backward.cpp)
// calls them, with the activation before the convolution folded in: `pre`
// holds pre-activations, and the convolution's input is x = act(pre).
//   forward          depthwise(x) + bias, into a given [N, C, Ho, Wo] output
//                    (the backward's GEMM rows: for NHWC, any pixel pitch)
//   backward_weight  (grad_weight, grad_bias) against x
//   backward_input   the gradient of pre: act'(pre) times that of x
//   backward         both: (gradient of pre, grad_weight, grad_bias); handed
//                    pre's only reference, it may write the gradient over pre
//                    (CUDA's one-pass kernel does)
//   backward_from_rows  both, with pre given as the previous stage's
//                    depthwise rows and pointwise terms (pre_from_rows)
// On CUDA the NHWC kernels apply act to their input tiles as they land, so x
// never reaches device memory, and the stride-2 input gradient multiplies by
// the slope as it stores, so the gradient of x never does; at stride 2,
// backward reads pre and grad_output once for both gradients, and
// backward_from_rows computes pre from the rows as it loads them (for up to
// four terms), so pre never reaches device memory. The other
// cases, and the CPU, run the ATen forms (activation.h) around the plain
// kernels.
#pragma once

#include "activation.h"
#include "gateway.h"

namespace lumenbridge {

// Each device's entries (CPU: cpu/depthwise_cpu.cpp; CUDA: beside each
// kernel), the same signatures in both namespaces.
#define LUMENBRIDGE_ACTIVATED_DEPTHWISE_ENTRIES                                                            \
  void activated_depthwise_forward_into(const at::Tensor& pre, const at::Tensor& weight,                   \
                                        const at::Tensor& bias, const DepthwiseProblem& p,                 \
                                        Activation activation, at::Tensor& out);                           \
  at::Tensor activated_depthwise_backward_input(const at::Tensor& grad_output, const at::Tensor& weight,   \
                                                const at::Tensor& pre, const DepthwiseProblem& p,          \
                                                Activation activation);                                    \
  std::tuple<at::Tensor, at::Tensor> activated_depthwise_backward_weight(                                 \
      const at::Tensor& grad_output, const at::Tensor& pre, const DepthwiseProblem& p, Activation activation); \
  std::tuple<at::Tensor, at::Tensor, at::Tensor> activated_depthwise_backward(                             \
      const at::Tensor& grad_output, const at::Tensor& weight, at::Tensor pre, const DepthwiseProblem& p,   \
      Activation activation);                                                                              \
  std::tuple<at::Tensor, at::Tensor, at::Tensor> activated_depthwise_backward_from_rows(                    \
      const at::Tensor& grad_output, const at::Tensor& weight, const at::Tensor& rows,                      \
      const at::Tensor& pointwise, const DepthwiseProblem& p, Activation activation);

namespace cpu {
LUMENBRIDGE_ACTIVATED_DEPTHWISE_ENTRIES
}  // namespace cpu

namespace cuda {
LUMENBRIDGE_ACTIVATED_DEPTHWISE_ENTRIES
// Whether backward (and backward_from_rows) of problem p in `dtype` runs in
// the one-pass kernel on the current device, which reads a grad_output whose
// pixels lie further apart than C (as the wide pointwise backward writes it).
bool depthwise_backward_in_one_pass(const DepthwiseProblem& p, at::ScalarType dtype);
}  // namespace cuda

#undef LUMENBRIDGE_ACTIVATED_DEPTHWISE_ENTRIES

// backward as its two parts, from one device's entries: the CPU's, and the
// CUDA cases the one-pass kernel does not cover.
inline std::tuple<at::Tensor, at::Tensor, at::Tensor> depthwise_backward_in_two_passes(
    decltype(&cpu::activated_depthwise_backward_input) input_pass,
    decltype(&cpu::activated_depthwise_backward_weight) weight_pass, const at::Tensor& grad_output,
    const at::Tensor& weight, const at::Tensor& pre, const DepthwiseProblem& p, Activation activation) {
  auto [grad_weight, grad_bias] = weight_pass(grad_output, pre, p, activation);
  return {input_pass(grad_output, weight, pre, p, activation), grad_weight, grad_bias};
}

// pre as [N, C, H, W], dense in the problem's layout, from the previous
// stage's depthwise rows [N * H * W, >= terms] and its pointwise terms
// [C, terms] (weight columns, then the bias, which the rows' ones column
// carries): the first `terms` columns of the rows times pointwise^T.
inline at::Tensor pre_from_rows(const at::Tensor& rows, const at::Tensor& pointwise, const DepthwiseProblem& p) {
  return at::mm(rows.narrow(1, 0, pointwise.size(1)), pointwise.t())
      .view({p.N, p.H, p.W, p.C})
      .permute({0, 3, 1, 2})
      .contiguous(p.memory_format());
}

}  // namespace lumenbridge
