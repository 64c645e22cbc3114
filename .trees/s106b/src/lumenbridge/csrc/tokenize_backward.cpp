// lumenbridge::tokenize_backward, composed: the gradients of the whole
// tokenizer from its inputs, the same code on every device; and the composed
// lumenbridge::tokenize_for_training, which is its recompute, kept.
//
// The backward first recomputes the forward once, keeping each stage's
// pointwise output p_i that it reads (before its norm; not the images'
// stage's where the next stage reads it from rows, backward_reads_rows, nor
// the last stage's where no norm follows it) and, for the weight
// gradients, its depthwise output d_i, as GEMM rows. tokenize_for_training
// returns the rows of d_i for every stage and p_i for every stage after the
// first that the backward reads (SavedForward; written by the fused kernels
// as they go on CUDA), which autograd keeps between forward and backward:
// then the recompute is, where the backward reads it, the first stage's
// GEMM. With tokenize's own autograd (nothing saved) it recomputes all. Then, from the
// last stage down, it takes the stage's gradients:
//   norm        LayerNorm / affine backward on p_i            (layer_norm.h; ATen)
//   pointwise   dW = g^T d, db = sum g, g_d = g W              (GEMMs over rows; on
//                                                               CUDA one kernel for
//                                                               the images' stage, or
//                                                               folded into the next
//                                                               stage's depthwise one)
//   depthwise   dW, db from g_d and x_i = act(n_{i-1}),        (LumenBridge kernels)
//               g_n = act'(n_{i-1}) g_x with g_x from g_d
// where n_{i-1} = norm(p_{i-1}). Neither x_i nor g_x is stored: the
// depthwise kernels take n_{i-1} and apply the activation, or its slope,
// themselves (activated_depthwise.h), in the recompute too.
// Activations are channels-last throughout, so the pointwise stages are plain
// GEMMs over [pixels, channels] rows and LayerNorms reduce contiguous rows;
// only the depthwise kernels of a stage with few input channels (the images')
// run in NCHW.
// Every reduction is an ATen reduction, a GEMM or one of LumenBridge's
// weight-gradient and LayerNorm kernels (fixed order): no atomics, so the
// gradients are bitwise deterministic.
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>

#include "tokenize_steps.h"

namespace lumenbridge {
namespace {

// An [N, C, h, w] tensor as its [N * h * w, C] rows (a view where it is
// channels-last already), and rows back as a channels-last [N, C, h, w] view.
at::Tensor rows(const at::Tensor& x) {
  return dense(x, Layout::NHWC).permute({0, 2, 3, 1}).reshape({-1, x.size(1)});
}

at::Tensor from_rows(const at::Tensor& r, int64_t n, int64_t h, int64_t w) {
  return r.view({n, h, w, r.size(1)}).permute({0, 3, 1, 2});
}

// The layout a stage's depthwise kernels run in: NHWC, except below one
// 16-byte vector of half-type channels (the 3-channel images), where NHWC's
// channel vectors are mostly empty (about 1.5 ms per forward at 224 x 224,
// B = 256, bf16, for 96 MB of traffic) and the NCHW kernels' rows are dense.
constexpr int64_t kMinNhwcChannels = 8;
Layout depthwise_layout(const TokenizeStage& s) {
  return s.in_channels < kMinNhwcChannels ? Layout::NCHW : Layout::NHWC;
}

// Whether stage i's depthwise backward takes its input before the activation
// as the previous stage's depthwise rows and pointwise terms
// (depthwise_backward_from_rows) instead of as a tensor: where those rows are
// narrow (the previous stage's few input channels: the images'), given the
// rows are kept (`rows_kept`: the parameters get gradients) and no stage norm
// lies between. Then the recompute skips the previous stage's pointwise
// output, the presets' largest tensor (112 x 112 x 96), and the CUDA kernel
// computes it as it loads the rows.
bool backward_reads_rows(const TokenizeProblem& p, size_t i, bool rows_kept) {
  return i > 0 && rows_kept && p.stage_norm == StageNorm::NONE &&
         depthwise_layout(p.stages[i - 1]) == Layout::NCHW;
}

// The activation a stage's depthwise kernels apply to their input: the one
// between stages, none before the first (the images).
Activation activation_before(size_t stage, const TokenizeProblem& p) {
  return stage == 0 ? Activation::NONE : p.activation;
}

// The pointwise GEMMs run over rows [M, Cin + 1] padded with zero columns to
// a multiple of kRowAlignment (8), with ones in column Cin: the GEMMs then carry the bias in
// the forward (a weight column) and the bias gradient in the weight
// gradient's GEMM, with no pass of their own over a stage's largest tensors
// (cuBLAS's bias epilogue took 0.20 of the images' stage's 0.48 ms GEMM, and
// the bias gradients' GEMMs 147 us a step; H200, B = 256, bf16), and cuBLAS
// takes slow unaligned kernels for an inner dimension of 3 (the images').
int64_t padding_columns(int64_t columns) { return (kRowAlignment - columns % kRowAlignment) % kRowAlignment; }

// The pointwise weight and bias as [Cout, Cin + 1], the rows' first columns'
// terms; and as the forward GEMM's [Cout, depthwise_row_width(Cin)].
at::Tensor pointwise_terms(const TokenizeStage& s) {
  return at::cat({s.pw_weight.view({s.out_channels, s.in_channels}), s.pw_bias.view({s.out_channels, 1})}, 1);
}

at::Tensor pointwise_matrix(const TokenizeStage& s) {
  return at::constant_pad_nd(pointwise_terms(s), {0, depthwise_row_width(s.in_channels) - s.in_channels - 1});
}

// Stage i's depthwise output, from its input before the activation `pre`, as
// the pointwise GEMMs' rows: the depthwise kernel writes its channels straight
// into them, one copy of a broadcast row [1, 0, ..., 0] fills the rest. Built
// once by the recompute and kept for the weight gradient.
at::Tensor depthwise_rows(const at::Tensor& pre, const TokenizeProblem& p, size_t i, const BackwardKernels& kernels) {
  const TokenizeStage& s = p.stages[i];
  const Layout layout = depthwise_layout(s);
  at::Tensor r = new_output(depthwise_rows_sizes(p, i), pre.options(), at::MemoryFormat::Contiguous);
  const int64_t cin = s.in_channels, pad = r.size(1) - cin;
  at::Tensor ones_then_zeros = at::zeros({1, pad}, r.options());
  ones_then_zeros.select(1, 0).fill_(1);
  r.narrow(1, cin, pad).copy_(ones_then_zeros.expand({r.size(0), pad}));
  at::Tensor d = from_rows(r.narrow(1, 0, cin), p.N, s.out_h, s.out_w);
  kernels.depthwise_forward_into(dense(pre, layout), s.dw_weight, s.dw_bias, stage_depthwise_problem(p, i, layout),
                                 activation_before(i, p), d);
  return r;
}

// The images normalized and zero padded, dense in the images' stage's
// depthwise layout: that stage's input in the composed backward.
at::Tensor images_stage_input(const at::Tensor& images, const TokenizeProblem& p) {
  return dense(normalized_images(images, p), depthwise_layout(p.stages[0]));
}

// The pointwise convolution as one GEMM over rows: [M, Cin] -> [M, Cout].
at::Tensor pointwise(const at::Tensor& rows_of_d, const TokenizeStage& s, const TokenizeProblem& p) {
  return from_rows(at::mm(rows_of_d, pointwise_matrix(s).t()), p.N, s.out_h, s.out_w);
}

// Sums over rows in the opmath type (float for half types), returned in `dtype`.
at::Tensor row_sum(const at::Tensor& r, at::ScalarType dtype) {
  return r.sum(0, false, at::toOpMathType(r.scalar_type())).to(dtype);
}

// The stage norm's backward on [N, C, h, w]: the input gradient, and the
// norm parameters' when asked for.
AffineGrads stage_norm_backward(const at::Tensor& grad, const at::Tensor& x, const TokenizeStage& s,
                                const TokenizeProblem& p, bool parameters, const BackwardKernels& kernels) {
  switch (p.stage_norm) {
    case StageNorm::NONE: return {grad};
    case StageNorm::AFFINE: {
      AffineGrads out{grad * s.norm_weight.view({1, -1, 1, 1})};
      if (parameters) {
        const at::ScalarType acc = at::toOpMathType(x.scalar_type());
        out.weight = row_sum(rows(grad).to(acc) * rows(x).to(acc), p.dtype);
        out.bias = row_sum(rows(grad), p.dtype);
      }
      return out;
    }
    case StageNorm::LAYERNORM: {
      AffineGrads out =
          kernels.layer_norm_backward(rows(grad), rows(x), s.norm_weight, s.norm_bias, p.eps, parameters);
      out.input = from_rows(out.input, x.size(0), x.size(2), x.size(3));
      return out;
    }
  }
  return {grad};
}

// The token gradient as a channels-last [N, D, h, w] tensor, whatever the format.
at::Tensor token_grad_map(const at::Tensor& grad_tokens, const TokenizeProblem& p) {
  const at::Tensor nhwc = p.format == TokenFormat::NCHW
                              ? grad_tokens.permute({0, 2, 3, 1})
                              : grad_tokens.reshape({p.N, p.grid_h(), p.grid_w(), p.embed_dim()});
  return nhwc.contiguous().permute({0, 3, 1, 2});
}

// Which stages' pointwise outputs the forward below keeps: those
// tokenize_for_training saves (and the last, which makes the tokens), or
// those the backward reads (not where it reads the next stage's input from
// rows; the last only where a norm follows it).
enum class KeptOutputs { SAVED, READ };

// The forward once more: the kept stages' pointwise outputs (before their
// norms; the others released as the next stage takes them) and, for the
// pointwise weight gradients, each stage's depthwise output as the GEMMs'
// rows (a quarter of the pointwise outputs' bytes at the presets' widths,
// kept rather than recomputed), each taken from `saved` where the training
// forward saved it.
struct Recomputed {
  std::vector<at::Tensor> outputs;
  std::vector<at::Tensor> depthwise;
};
Recomputed recompute_forward(const at::Tensor& images, const TokenizeProblem& p, const BackwardKernels& kernels,
                             bool keep_depthwise, KeptOutputs kept_outputs, const SavedForward& saved) {
  Recomputed r;
  at::Tensor pre;  // the previous stage's normed output
  for (size_t i = 0; i < p.stages.size(); ++i) {
    const TokenizeStage& s = p.stages[i];
    const bool last = i + 1 == p.stages.size();
    const SavedStage given = saved.stage(i);
    // The last stage's output makes the tokens in the training forward; the
    // backward reads it only where a norm follows it.
    const bool kept = kept_outputs == KeptOutputs::SAVED ? last || SavedForward::saves_output(i, p)
                      : last                             ? p.last_output_normed()
                                                         : !backward_reads_rows(p, i + 1, keep_depthwise);
    const bool feeds_next = !last && saved.empty();  // the next stage's rows come from it
    const bool computes_output = !given.output.defined() && (kept || feeds_next);
    at::Tensor rows_of_d = given.rows.defined()                    ? given.rows
                           : !(keep_depthwise || computes_output) ? at::Tensor()
                           : i == 0                                 ? kernels.images_depthwise_rows(images, p)
                                                                    : depthwise_rows(pre, p, i, kernels);
    at::Tensor output = given.output.defined() ? from_rows(given.output, p.N, s.out_h, s.out_w)
                        : computes_output      ? pointwise(rows_of_d, s, p)
                                               : at::Tensor();
    r.depthwise.push_back(keep_depthwise ? std::move(rows_of_d) : at::Tensor());
    if (feeds_next) pre = apply_stage_norm(output, s, p);
    r.outputs.push_back(kept ? std::move(output) : at::Tensor());
  }
  return r;
}

// A stage's input before the activation, as its depthwise backward takes it:
// for a later stage n_{i-1} as `pre`, dense in the stage's depthwise layout,
// or where backward_reads_rows as the previous stage's depthwise `rows` and
// `pointwise` terms; for the first, the `images` as the op takes them.
struct StageInput {
  at::Tensor pre, rows, pointwise, images;
};

// The gradient one stage's backward hands to the stage before it: of that
// stage's normed output, or, where its pointwise backward was folded into
// this stage's depthwise backward (depthwise_backward_folding_pointwise), of
// its depthwise output.
struct HandedGrad {
  at::Tensor grad;
  bool of_depthwise = false;
};

// One stage's backward. `handed` is the gradient the next stage handed on,
// `output` the stage's pointwise output, `depthwise` its depthwise rows and
// `input` its input (all taken over, so they are released as soon as they
// are used). The parameters' gradients go into `grads` (the previous
// stage's pointwise ones too, where it folds); returns what it hands on,
// undefined when the first stage needs no input gradient.
HandedGrad stage_backward(HandedGrad handed, at::Tensor output, at::Tensor depthwise, StageInput input, size_t i,
                          const TokenizeProblem& p, TokenizeGradMask mask, const BackwardKernels& kernels,
                          TokenizeGrads& grads) {
  const TokenizeStage& s = p.stages[i];
  const DepthwiseProblem dw = stage_depthwise_problem(p, i, depthwise_layout(s));
  at::Tensor g_d;
  // Each tensor is released after its last use: the largest stage inputs and
  // gradients (112 x 112 x 96 for the presets) would otherwise overlap.
  if (handed.of_depthwise) {
    g_d = std::move(handed.grad);
  } else {
    AffineGrads norm = stage_norm_backward(handed.grad, output, s, p, mask.parameters, kernels);
    handed.grad.reset();
    output.reset();
    if (mask.parameters && p.stage_norm != StageNorm::NONE) {
      grads.norm_weights[i] = norm.weight;
      grads.norm_biases[i] = norm.bias;
    }
    at::Tensor g_p = rows(norm.input);
    norm.input.reset();
    // Handed g_p's only reference, a kernel may write g_d over it (pitched;
    // cuda/pointwise_backward_wide.cu). The images' stage's kernels read g_d
    // dense, so there g_p is kept.
    PointwiseGrads pointwise =
        kernels.pointwise_backward(i == 0 ? g_p : std::move(g_p), depthwise, s.pw_weight, dw, mask.parameters);
    if (mask.parameters) {
      grads.pw_weights[i] = std::move(pointwise.weight);
      grads.pw_biases[i] = std::move(pointwise.bias);
    }
    g_d = std::move(pointwise.grad_depthwise);
  }
  depthwise.reset();
  if (i == 0) {
    // No activation before the images' stage: its input gradient needs no input.
    if (mask.parameters) {
      std::tie(grads.dw_weights[0], grads.dw_biases[0]) =
          kernels.images_depthwise_backward_weight(g_d, input.images, p);
    }
    if (!mask.images) return {};
    return {kernels.depthwise_backward_input(g_d, s.dw_weight, at::Tensor(), dw, Activation::NONE)};
  }
  const Activation activation = activation_before(i, p);
  if (!mask.parameters) return {kernels.depthwise_backward_input(g_d, s.dw_weight, input.pre, dw, activation)};
  if (input.rows.defined() && kernels.depthwise_backward_folding_pointwise != nullptr) {
    if (auto folded = kernels.depthwise_backward_folding_pointwise(g_d, s.dw_weight, input.rows, input.pointwise, dw,
                                                                   activation)) {
      grads.dw_weights[i] = std::move(folded->weight);
      grads.dw_biases[i] = std::move(folded->bias);
      grads.pw_weights[i - 1] = std::move(folded->previous.weight);
      grads.pw_biases[i - 1] = std::move(folded->previous.bias);
      return {std::move(folded->previous.grad_depthwise), true};
    }
  }
  at::Tensor grad_pre;
  std::tie(grad_pre, grads.dw_weights[i], grads.dw_biases[i]) =
      input.rows.defined()
          ? kernels.depthwise_backward_from_rows(g_d, s.dw_weight, input.rows, input.pointwise, dw, activation)
          : kernels.depthwise_backward(g_d, s.dw_weight, std::move(input.pre), dw, activation);
  return {grad_pre};
}

}  // namespace

// g_d = g_p W, the GEMM's weight [Cout, Cin] padded with zero columns to its
// output's row width (as it is, no copy, where Cin needs none); the weight
// gradient g_p^T d and, from the ones column, the bias gradient
// sum_m g_p[m, :] in one GEMM (accumulating in float), so g_p is read once
// more.
PointwiseGrads pointwise_backward_composed(at::Tensor grad, const at::Tensor& rows_of_d, const at::Tensor& weight,
                                           const DepthwiseProblem& p, bool parameters) {
  const int64_t cin = p.C, cout = weight.size(0), padding = padding_columns(cin);
  const at::Tensor matrix = weight.view({cout, cin});
  const at::Tensor w = padding == 0 ? matrix : at::constant_pad_nd(matrix, {0, padding});
  PointwiseGrads out;
  out.grad_depthwise = dense(from_rows(at::mm(grad, w).narrow(1, 0, cin), p.N, p.Ho, p.Wo), p.layout);
  if (parameters) {
    const at::Tensor product = at::mm(grad.t(), rows_of_d);
    out.weight = product.narrow(1, 0, cin).contiguous().view({cout, cin, 1, 1});
    out.bias = product.select(1, cin).contiguous();
  }
  return out;
}

at::Tensor images_depthwise_rows_composed(const at::Tensor& images, const TokenizeProblem& p,
                                          const BackwardKernels& kernels) {
  return depthwise_rows(images_stage_input(images, p), p, 0, kernels);
}

std::tuple<at::Tensor, at::Tensor> images_depthwise_backward_weight_composed(const at::Tensor& grad_depthwise,
                                                                             const at::Tensor& images,
                                                                             const TokenizeProblem& p,
                                                                             const BackwardKernels& kernels) {
  return kernels.depthwise_backward_weight(grad_depthwise, images_stage_input(images, p),
                                           stage_depthwise_problem(p, 0, depthwise_layout(p.stages[0])),
                                           Activation::NONE);
}

int64_t depthwise_row_width(int64_t in_channels) { return in_channels + 1 + padding_columns(in_channels + 1); }

std::vector<int64_t> depthwise_rows_sizes(const TokenizeProblem& p, size_t stage) {
  return {p.stage_pixels(stage), depthwise_row_width(p.stages[stage].in_channels)};
}

std::vector<int64_t> saved_output_sizes(const TokenizeProblem& p, size_t stage) {
  return {p.stage_pixels(stage), p.stages[stage].out_channels};
}

size_t SavedForward::output_count(const TokenizeProblem& p) {
  size_t count = 0;
  for (size_t i = 0; i < p.stages.size(); ++i) count += saves_output(i, p) ? 1 : 0;
  return count;
}

SavedStage SavedForward::stage(size_t i) const {
  if (empty()) return {};
  return {rows[i], i >= 1 && i - 1 < outputs.size() ? outputs[i - 1] : at::Tensor()};
}

TrainingResult tokenize_for_training_composed(const at::Tensor& images, const TokenizeProblem& p,
                                              const BackwardKernels& kernels) {
  Recomputed forward = recompute_forward(images, p, kernels, true, KeptOutputs::SAVED, {});
  const size_t S = p.stages.size();
  at::Tensor tokens = tokens_from(apply_stage_norm(forward.outputs.back(), p.stages.back(), p), p);
  SavedForward saved;
  for (size_t i = 0; i < S; ++i) {
    saved.rows.push_back(std::move(forward.depthwise[i]));
    if (SavedForward::saves_output(i, p)) saved.outputs.push_back(rows(forward.outputs[i]));
  }
  return {tokens, saved.rows, saved.outputs};
}

TokenizeGrads tokenize_backward_composed(const at::Tensor& grad_tokens, const at::Tensor& images,
                                         const TokenizeProblem& p, TokenizeGradMask mask,
                                         const BackwardKernels& kernels, const SavedForward& saved) {
  // Without view tracking a view holds no reference to its base, so a
  // gradient whose last view is handed on is its memory's sole reference
  // (sole_reference), which kernels may write over. No autograd graph is
  // built here: the op's autograd kernel sits above this one.
  const at::AutoDispatchBelowADInplaceOrView below;
  const size_t S = p.stages.size();
  Recomputed forward = recompute_forward(images, p, kernels, mask.parameters, KeptOutputs::READ, saved);
  std::vector<at::Tensor>& outputs = forward.outputs;
  TokenizeGrads grads;
  if (mask.parameters) {
    for (auto* list : {&grads.dw_weights, &grads.dw_biases, &grads.pw_weights, &grads.pw_biases}) {
      list->resize(S);
    }
    if (p.stage_norm != StageNorm::NONE) {
      grads.norm_weights.resize(S);
      grads.norm_biases.resize(S);
    }
  }

  // g: the gradient of the current stage's output after its norm.
  at::Tensor g = token_grad_map(grad_tokens, p);
  if (p.has_token_norm()) {
    const at::Tensor last = apply_stage_norm(outputs.back(), p.stages.back(), p);
    AffineGrads token = kernels.layer_norm_backward(rows(g), rows(last), p.token_norm_weight, p.token_norm_bias,
                                                    p.eps, mask.parameters);
    g = from_rows(token.input, p.N, p.grid_h(), p.grid_w());
    grads.token_norm_weight = token.weight;
    grads.token_norm_bias = token.bias;
  }
  HandedGrad handed{std::move(g)};
  for (size_t i = S; i-- > 0;) {
    // The stage input before its activation: the previous stage's normed
    // output (or its rows, which that stage still needs), or the images.
    StageInput input;
    if (i == 0) {
      input.images = images;
    } else if (backward_reads_rows(p, i, mask.parameters)) {
      input.rows = forward.depthwise[i - 1];
      input.pointwise = pointwise_terms(p.stages[i - 1]);
    } else {
      // Without a stage norm the previous stage's backward never reads its
      // output, so it is handed over and its memory can take the gradient.
      at::Tensor previous = p.stage_norm == StageNorm::NONE ? std::move(outputs[i - 1]) : outputs[i - 1];
      input.pre = dense(apply_stage_norm(previous, p.stages[i - 1], p), depthwise_layout(p.stages[i]));
    }
    handed = stage_backward(std::move(handed), std::move(outputs[i]), std::move(forward.depthwise[i]),
                            std::move(input), i, p, mask, kernels, grads);
  }
  if (mask.images) {
    // Padding was added after normalization: its gradient is dropped.
    grads.images = dense(handed.grad.narrow(2, 0, p.H).narrow(3, 0, p.W), p.layout);
  }
  return grads;
}

namespace cpu {
BackwardKernels backward_kernels() {
  return {&cpu::activated_depthwise_forward_into,      &cpu::activated_depthwise_backward_input,
          &cpu::activated_depthwise_backward_weight,   &cpu::activated_depthwise_backward,
          &cpu::activated_depthwise_backward_from_rows, nullptr,
          &pointwise_backward_composed,
          &layer_norm_backward_aten,                    &cpu::images_depthwise_rows,
          &cpu::images_depthwise_backward_weight};
}

at::Tensor images_depthwise_rows(const at::Tensor& images, const TokenizeProblem& p) {
  return images_depthwise_rows_composed(images, p, backward_kernels());
}

std::tuple<at::Tensor, at::Tensor> images_depthwise_backward_weight(const at::Tensor& grad_depthwise,
                                                                     const at::Tensor& images,
                                                                     const TokenizeProblem& p) {
  return images_depthwise_backward_weight_composed(grad_depthwise, images, p, backward_kernels());
}

TrainingResult tokenize_for_training(const at::Tensor& images, const TokenizeProblem& p) {
  return tokenize_for_training_composed(images, p, backward_kernels());
}

TokenizeGrads tokenize_backward(const at::Tensor& grad_tokens, const at::Tensor& images,
                                const TokenizeProblem& p, TokenizeGradMask mask, const SavedForward& saved) {
  return tokenize_backward_composed(grad_tokens, images, p, mask, backward_kernels(), saved);
}
}  // namespace cpu

#ifdef LUMENBRIDGE_WITH_CUDA
namespace cuda {
BackwardKernels backward_kernels() {
  return {&cuda::activated_depthwise_forward_into,      &cuda::activated_depthwise_backward_input,
          &cuda::activated_depthwise_backward_weight,   &cuda::activated_depthwise_backward,
          &cuda::activated_depthwise_backward_from_rows, &cuda::activated_depthwise_backward_folding_pointwise,
          &cuda::pointwise_backward,
          &cuda::layer_norm_backward,                    &cuda::images_depthwise_rows,
          &cuda::images_depthwise_backward_weight};
}

TokenizeGrads tokenize_backward(const at::Tensor& grad_tokens, const at::Tensor& images,
                                const TokenizeProblem& p, TokenizeGradMask mask, const SavedForward& saved) {
  return tokenize_backward_composed(grad_tokens, images, p, mask, backward_kernels(), saved);
}
}  // namespace cuda
#endif

}  // namespace lumenbridge
