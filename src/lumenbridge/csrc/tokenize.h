// The contract of lumenbridge::tokenize, the whole tokenizer as one op: the
// gateway (gateway.cpp) validates every argument once and builds a
// TokenizeProblem; the per-device implementations trust it.
//   cpu:  composed from ATen's channels-last convolutions, in chunks of images
//         (tokenize_composed.cpp)
//   cuda: the fused stage kernels (cuda/tokenize_fused.cu) where they cover the
//         problem, else the same composition over the CUDA depthwise kernels.
// Its backward, lumenbridge::tokenize_backward, is composed on both devices
// (tokenize_backward.cpp). lumenbridge::tokenize_for_training is tokenize that
// also returns what the backward would otherwise recompute first.
#pragma once

#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "activated_depthwise.h"
#include "gateway.h"
#include "layer_norm.h"

namespace lumenbridge {

// "affine" is a per-channel scale and shift: how the model passes an eval-mode
// BatchNorm. A training-mode BatchNorm needs batch statistics and never reaches the op.
enum class StageNorm { NONE, LAYERNORM, AFFINE };
enum class TokenFormat { NLC, NCHW, NHWC };

// One stage: depthwise K x K (stride) with bias, pointwise 1 x 1 with bias,
// then the optional stage norm. Tensors are the model's parameters in their
// nn layouts: dw [Cin, 1, K, K], pw [Cout, Cin, 1, 1].
struct TokenizeStage {
  at::Tensor dw_weight, dw_bias, pw_weight, pw_bias, norm_weight, norm_bias;
  int64_t stride, in_channels, out_channels;
  int64_t out_h, out_w;  // output extents of this stage
};

struct TokenizeProblem {
  int64_t N, C, H, W;  // images as given
  int64_t Hp, Wp;      // extents after zero padding (in normalized space) on the bottom/right
  Layout layout;
  bool uint8_input;
  at::ScalarType dtype;  // compute and output dtype: the parameters'
  int64_t K;
  std::vector<TokenizeStage> stages;
  Activation activation;  // between stages, none after the last
  StageNorm stage_norm;
  at::Tensor token_norm_weight, token_norm_bias;  // undefined without a token norm
  double eps;                                     // of every LayerNorm
  std::vector<double> mean, std;                  // uint8 normalization, 0..255 scale
  TokenFormat format;

  int64_t embed_dim() const { return stages.back().out_channels; }
  int64_t grid_h() const { return stages.back().out_h; }
  int64_t grid_w() const { return stages.back().out_w; }
  // Stage i's output pixels over the batch: the rows of its depthwise rows and saved output.
  int64_t stage_pixels(size_t i) const { return N * stages[i].out_h * stages[i].out_w; }
  bool has_token_norm() const { return token_norm_weight.defined(); }
  // Whether a norm follows the last stage's pointwise output (the backward then reads that output).
  bool last_output_normed() const { return has_token_norm() || stage_norm != StageNorm::NONE; }
  // The sizes of the op's output (contiguous) in the requested format.
  std::vector<int64_t> output_sizes() const;
};

// The tokenizer composed from per-layer kernels: `depthwise` is the device's
// depthwise forward entry point for NCHW problems (NHWC ones use ATen's
// depthwise convolution, which measured faster there), everything else is
// ATen. The reference semantics, shared by the CPU and by CUDA problems the
// fused kernels do not cover.
using DepthwiseEntry = at::Tensor (*)(const at::Tensor&, const at::Tensor&,
                                      const c10::optional<at::Tensor>&, const DepthwiseProblem&);
at::Tensor tokenize_composed(const at::Tensor& images, const TokenizeProblem& p,
                             DepthwiseEntry depthwise);

// ---- lumenbridge::tokenize_backward ---------------------------------------------
// The gradients of tokenize from its arguments and what tokenize_for_training
// saved (SavedForward): the backward recomputes the rest of the forward
// (tokenize_backward.cpp).
// A field that was not asked for (images for uint8 input, or every parameter
// when only the images need a gradient) stays undefined or empty.
struct TokenizeGrads {
  at::Tensor images;  // in the images' layout, unpadded
  std::vector<at::Tensor> dw_weights, dw_biases, pw_weights, pw_biases, norm_weights, norm_biases;
  at::Tensor token_norm_weight, token_norm_bias;  // undefined without a token norm
};

// Which gradients a backward call computes (the schema's output_mask).
struct TokenizeGradMask {
  bool images, parameters;
};

// A stage's pointwise backward over rows: the gradient of its depthwise
// output, [N, Cin, h, w] in the stage's depthwise layout, and (when
// asked for) its pointwise weight and bias gradients. Composed of two GEMMs
// on every device (tokenize_backward.cpp); on CUDA, in half types, stages
// with up to three input channels take one kernel
// (cuda/pointwise_backward_narrow.cu: output channels a multiple of 16 up
// to 256), and NHWC stages with up to 96 (a multiple of 8) another
// (cuda/pointwise_backward_wide.cu: output channels a multiple of 16 up to
// 192). The gradient is dense, except that the wide kernel (which runs only
// where the parameters get gradients, so the stage's depthwise backward
// takes both at once), handed g's only reference where that backward runs
// in one pass (cuda::depthwise_backward_in_one_pass), writes it over g:
// channels-last with its pixels Cout elements apart. No other kernel reads
// such a gradient.
struct PointwiseGrads {
  at::Tensor grad_depthwise, weight, bias;
};
// grad: [M, Cout] rows of the pointwise output's gradient; rows: the stage's
// depthwise rows; weight: [Cout, Cin, 1, 1]; p: the stage's depthwise problem.
PointwiseGrads pointwise_backward_composed(at::Tensor grad, const at::Tensor& rows, const at::Tensor& weight,
                                           const DepthwiseProblem& p, bool parameters);
namespace cuda {
PointwiseGrads pointwise_backward(at::Tensor grad, const at::Tensor& rows, const at::Tensor& weight,
                                  const DepthwiseProblem& p, bool parameters);
// The wide stages' kernel (above); nullopt where it does not cover the
// problem. Where `grad` is its memory's only reference (pointwise_backward's
// own argument), it writes g_d over it.
std::optional<PointwiseGrads> pointwise_backward_wide(const at::Tensor& grad, const at::Tensor& rows,
                                                      const at::Tensor& weight, const DepthwiseProblem& p);
}  // namespace cuda

// A stage's depthwise weight and bias gradients, computed from the previous
// (narrow) stage's rows, with that stage's pointwise backward folded into
// the same pass: the gradient of pre, between the two, never reaches
// device memory. On CUDA (cuda/depthwise_backward_both.cu: half types,
// stride 2, NHWC); nullopt where that kernel does not cover the problem.
// The arguments are activated_depthwise_backward_from_rows's. Where
// grad_output is the only reference to its memory, the previous stage's
// g_d takes that memory: the caller reads grad_output no more once this
// returns gradients.
struct FoldedGrads {
  at::Tensor weight, bias;
  PointwiseGrads previous;
};
namespace cuda {
std::optional<FoldedGrads> activated_depthwise_backward_folding_pointwise(const at::Tensor& grad_output,
                                                                           const at::Tensor& weight,
                                                                           const at::Tensor& rows,
                                                                           const at::Tensor& pointwise,
                                                                           const DepthwiseProblem& p,
                                                                           Activation activation);
}  // namespace cuda

// The images' stage's depthwise convolution as the backward needs it, from
// the images as the op takes them: its output as rows
// (depthwise_rows_sizes(p, 0)), and its weight and bias gradients from the
// gradient of that output (dense in the stage's depthwise layout). Composed,
// from the normalized, padded images and the device's depthwise kernels
// (tokenize_backward.cpp); on CUDA, one pass over the images each where the
// rows are narrow (cuda/images_stage.cu).
struct BackwardKernels;
at::Tensor images_depthwise_rows_composed(const at::Tensor& images, const TokenizeProblem& p,
                                          const BackwardKernels& kernels);
std::tuple<at::Tensor, at::Tensor> images_depthwise_backward_weight_composed(const at::Tensor& grad_depthwise,
                                                                             const at::Tensor& images,
                                                                             const TokenizeProblem& p,
                                                                             const BackwardKernels& kernels);
#define LUMENBRIDGE_IMAGES_STAGE_ENTRIES                                                                   \
  at::Tensor images_depthwise_rows(const at::Tensor& images, const TokenizeProblem& p);                    \
  std::tuple<at::Tensor, at::Tensor> images_depthwise_backward_weight(                                     \
      const at::Tensor& grad_depthwise, const at::Tensor& images, const TokenizeProblem& p);
namespace cpu {
LUMENBRIDGE_IMAGES_STAGE_ENTRIES
}  // namespace cpu
namespace cuda {
LUMENBRIDGE_IMAGES_STAGE_ENTRIES
}  // namespace cuda
#undef LUMENBRIDGE_IMAGES_STAGE_ENTRIES

// One device's kernels, as the composed backward takes them.
struct BackwardKernels {
  decltype(&cpu::activated_depthwise_forward_into) depthwise_forward_into;
  decltype(&cpu::activated_depthwise_backward_input) depthwise_backward_input;
  decltype(&cpu::activated_depthwise_backward_weight) depthwise_backward_weight;
  decltype(&cpu::activated_depthwise_backward) depthwise_backward;  // both at once
  decltype(&cpu::activated_depthwise_backward_from_rows) depthwise_backward_from_rows;
  decltype(&cuda::activated_depthwise_backward_folding_pointwise) depthwise_backward_folding_pointwise;  // or null
  decltype(&pointwise_backward_composed) pointwise_backward;
  decltype(&layer_norm_backward_aten) layer_norm_backward;
  decltype(&cpu::images_depthwise_rows) images_depthwise_rows;
  decltype(&cpu::images_depthwise_backward_weight) images_depthwise_backward_weight;
};

// ---- what the training forward saves -------------------------------------------
// Each stage's depthwise output d, as the backward's pointwise GEMMs take it:
// rows [N * h * w, depthwise_row_width(Cin)] holding d's channels, a one (the
// bias's column), then zeros to a multiple of kRowAlignment. With them the
// backward skips recomputing the depthwise convolutions. A stage of fewer
// than kRowAlignment input channels (the images') has rows of exactly
// kRowAlignment.
// The CUDA kernels that read such narrow rows (cuda/depthwise_backward_both.cu,
// cuda/pointwise_backward_narrow.cu) take up to kNarrowRowTerms of their
// columns: up to three channels (RGB images) and the ones column.
constexpr int64_t kRowAlignment = 8, kNarrowRowTerms = 4;
int64_t depthwise_row_width(int64_t in_channels);
// The sizes of stage `stage`'s rows: [N * h * w, depthwise_row_width(Cin)].
std::vector<int64_t> depthwise_rows_sizes(const TokenizeProblem& p, size_t stage);
// A stage's pointwise output before its activation and norm, rows [N * h *
// w, Cout], which the next stage's backward (the last stage's: its norm's)
// reads: saved, the backward skips recomputing it.
std::vector<int64_t> saved_output_sizes(const TokenizeProblem& p, size_t stage);

// What tokenize_for_training saves for one stage (undefined where it saves nothing).
struct SavedStage {
  at::Tensor rows, output;
};
// What it saves for all: the rows of stages 0 .. S - 1 and the outputs of
// stages 1 .. S - 2, and S - 1's where a norm follows it (without one the
// backward reads no output of the last stage, and the tokens are that
// output), or nothing (the backward recomputes them); the ops take and
// return them as the lists saved_rows and saved_outputs. The first stage's
// output is not kept: the second stage's backward reads its rows
// (backward_reads_rows), and it is the presets' largest tensor.
struct SavedForward {
  std::vector<at::Tensor> rows, outputs;

  static bool saves_output(size_t stage, const TokenizeProblem& p) {
    return stage >= 1 && (stage + 1 < p.stages.size() || p.last_output_normed());
  }
  static size_t output_count(const TokenizeProblem& p);
  bool empty() const { return rows.empty(); }
  SavedStage stage(size_t i) const;
};
using TrainingResult = std::tuple<at::Tensor, std::vector<at::Tensor>, std::vector<at::Tensor>>;

// tokenize_for_training composed from the device's kernels and ATen: the
// backward's recompute, kept (tokenize_backward.cpp).
TrainingResult tokenize_for_training_composed(const at::Tensor& images, const TokenizeProblem& p,
                                              const BackwardKernels& kernels);

// The backward composed from the device's kernels and ATen, for any device;
// grad_tokens has the forward output's sizes, any strides.
TokenizeGrads tokenize_backward_composed(const at::Tensor& grad_tokens, const at::Tensor& images,
                                         const TokenizeProblem& p, TokenizeGradMask mask,
                                         const BackwardKernels& kernels, const SavedForward& saved);

// The tokenize, tokenize_for_training and tokenize_backward entries of each device.
namespace cpu {
BackwardKernels backward_kernels();
at::Tensor tokenize(const at::Tensor& images, const TokenizeProblem& p);
TrainingResult tokenize_for_training(const at::Tensor& images, const TokenizeProblem& p);
TokenizeGrads tokenize_backward(const at::Tensor& grad_tokens, const at::Tensor& images,
                                const TokenizeProblem& p, TokenizeGradMask mask, const SavedForward& saved);
}  // namespace cpu
namespace cuda {
BackwardKernels backward_kernels();
at::Tensor tokenize(const at::Tensor& images, const TokenizeProblem& p);
TrainingResult tokenize_for_training(const at::Tensor& images, const TokenizeProblem& p);
TokenizeGrads tokenize_backward(const at::Tensor& grad_tokens, const at::Tensor& images,
                                const TokenizeProblem& p, TokenizeGradMask mask, const SavedForward& saved);
// Why the fused kernels do not cover a configuration ("" when they do); the
// one statement of what they support. `widths` and `strides` are per stage.
std::string fused_unsupported_reason(at::ScalarType dtype, int64_t in_channels,
                                     const std::vector<int64_t>& widths, int64_t kernel_size,
                                     const std::vector<int64_t>& strides, StageNorm norm);
}  // namespace cuda

}  // namespace lumenbridge
