// The steps of the composed tokenizer, defined once in tokenize_composed.cpp:
// its forward runs them, and the backward (tokenize_backward.cpp) runs them
// again to recompute the activations it needs, so both follow one definition.
#pragma once

#include "tokenize.h"

namespace lumenbridge {

// uint8 images normalized with mean/std (float images as given), in the
// parameters' dtype, zero padded to Hp x Wp, dense in the problem's layout.
at::Tensor normalized_images(const at::Tensor& images, const TokenizeProblem& p);

// The stage norm of stage `stage` on its pointwise output [N, C, h, w].
at::Tensor apply_stage_norm(const at::Tensor& x, const TokenizeStage& stage, const TokenizeProblem& p);

// The depthwise convolution of stage `stage` (its input extents, K, stride)
// on activations in `layout`.
DepthwiseProblem stage_depthwise_problem(const TokenizeProblem& p, size_t stage, Layout layout);

// Dense NCHW or NHWC, whichever the depthwise kernels read for this layout.
at::Tensor dense(const at::Tensor& x, Layout layout);

// The op's output from the last stage's normed output [N, D, h, w]: the token
// norm, then the requested format.
at::Tensor tokens_from(const at::Tensor& last, const TokenizeProblem& p);

}  // namespace lumenbridge
