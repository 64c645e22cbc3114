// The operator gateway: op schemas, the one set of argument checks, and the
// registration of the CPU and CUDA kernels behind torch.ops.lumenbridge.*.
// Every check lives here once; kernels receive a validated DepthwiseProblem.
// Failures raise RuntimeError in Python with messages that start "LumenBridge:".
// Plain TORCH_CHECK throws from inside libc10 (torchCheckFail); the typed
// variants would throw from this library, which on toolchains that link their
// own libstdc++ into it means a second exception runtime.
#include <ATen/autocast_mode.h>
#include <torch/csrc/autograd/forward_grad.h>
#include <torch/library.h>

#include <array>
#include <cstdio>
#include <cmath>
#include <atomic>

#include "cast_together.h"
#include "gateway.h"
#include "kernel_sizes.h"
#include "op_signatures.h"
#include "tokenize.h"

namespace lumenbridge {
namespace {

std::atomic<bool> poison_outputs{false};

void set_poison_outputs(bool enabled) { poison_outputs.store(enabled); }

void check_dtype(const at::Tensor& t, const char* name) {
  const auto dtype = t.scalar_type();
  const bool half_or_float =
      dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16;
  // float64 exists for gradcheck on the CPU; GPU kernels stay in the fast types.
  const bool cpu_double = dtype == at::kDouble && t.device().is_cpu();
  TORCH_CHECK(half_or_float || cpu_double, "LumenBridge: ", name, " has dtype ", text(dtype),
              "; supported are float32, float16 and bfloat16 (and float64 on the CPU)");
}

void check_same_device(const at::Tensor& reference, const char* reference_name,
                       const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device() == reference.device(), "LumenBridge: ", name, " is on ", text(t.device()),
              " but ", reference_name, " is on ", text(reference.device()),
              "; all tensors must be on the same device");
}

void check_same_dtype(const at::Tensor& reference, const char* reference_name,
                      const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == reference.scalar_type(), "LumenBridge: ", name, " has dtype ",
              text(t.scalar_type()), " but ", reference_name, " has dtype ",
              text(reference.scalar_type()),
              "; they must match");
}

void check_4d(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 4, "LumenBridge: ", name, " must be 4-D [N, C, H, W], got ", text(t.dim()),
              "-D with shape ", text(t.sizes()));
  TORCH_CHECK(t.size(1) >= 1 && t.size(2) >= 1 && t.size(3) >= 1, "LumenBridge: ", name,
              " must have at least one channel and one pixel, got shape ", text(t.sizes()));
}

void check_stride(int64_t stride) {
  TORCH_CHECK(stride == 1 || stride == 2, "LumenBridge: stride must be 1 or 2, got ", text(stride));
}

void check_kernel_size(int64_t k) {
  TORCH_CHECK(is_supported_kernel_size(k),
              "LumenBridge: kernel_size must be one of ", text(kKernelSizes),
              " (odd, so padding K/2 is symmetric), got ", text(k));
}

// Depthwise weight: [C, 1, K, K], dense, K one of KernelSizes.
int64_t check_weight(const at::Tensor& weight, int64_t channels) {
  TORCH_CHECK(weight.dim() == 4 && weight.size(1) == 1 && weight.size(2) == weight.size(3),
              "LumenBridge: weight must have shape [C, 1, K, K], got ", text(weight.sizes()));
  TORCH_CHECK(weight.size(0) == channels, "LumenBridge: weight has ", text(weight.size(0)),
              " channels but the input has ", text(channels));
  check_kernel_size(weight.size(2));
  TORCH_CHECK(weight.is_contiguous(), "LumenBridge: weight must be contiguous, got strides ",
              text(weight.strides()));
  return weight.size(2);
}

void check_bias(const c10::optional<at::Tensor>& bias, const at::Tensor& input, int64_t channels) {
  if (!bias.has_value()) return;
  check_same_device(input, "input", *bias, "bias");
  check_same_dtype(input, "input", *bias, "bias");
  TORCH_CHECK(bias->dim() == 1 && bias->size(0) == channels,
              "LumenBridge: bias must have shape [", text(channels), "], got ",
              text(bias->sizes()));
  TORCH_CHECK(bias->is_contiguous(), "LumenBridge: bias must be contiguous");
}

// The kernels read contiguous NCHW or channels-last NHWC natively. A tensor
// may satisfy both (C == 1, or H == W == 1); the layout chosen is one that all
// activation tensors of the call satisfy, so such tensors never conflict.
Layout check_layout(std::initializer_list<std::pair<const at::Tensor*, const char*>> tensors) {
  bool all_nchw = true, all_nhwc = true;
  for (const auto& [t, name] : tensors) {
    const bool nchw = t->is_contiguous();
    const bool nhwc = t->is_contiguous(at::MemoryFormat::ChannelsLast);
    TORCH_CHECK(nchw || nhwc, "LumenBridge: ", name,
                " must be contiguous NCHW or channels-last NHWC, got sizes ", text(t->sizes()),
                " and strides ", text(t->strides()),
                "; call .contiguous() or .contiguous(memory_format=torch.channels_last) first");
    all_nchw = all_nchw && nchw;
    all_nhwc = all_nhwc && nhwc;
  }
  TORCH_CHECK(all_nchw || all_nhwc,
              "LumenBridge: all activation tensors of one call must share one memory layout "
              "(all contiguous NCHW or all channels-last NHWC)");
  return all_nchw ? Layout::NCHW : Layout::NHWC;
}

DepthwiseProblem make_problem(int64_t N, int64_t C, int64_t H, int64_t W, int64_t K,
                              int64_t stride, Layout layout) {
  DepthwiseProblem p;
  p.N = N;
  p.C = C;
  p.H = H;
  p.W = W;
  p.K = K;
  p.stride = stride;
  p.pad = K / 2;
  p.Ho = depthwise_output_extent(p.H, K, stride);
  p.Wo = depthwise_output_extent(p.W, K, stride);
  p.layout = layout;
  return p;
}

void check_grad_output_shape(const at::Tensor& grad_output, const DepthwiseProblem& p) {
  const std::vector<int64_t> expected{p.N, p.C, p.Ho, p.Wo};
  TORCH_CHECK(grad_output.sizes() == at::IntArrayRef(expected), "LumenBridge: grad_output has shape ",
              text(grad_output.sizes()), " but expected ", text(expected), " for an input of ",
              text({p.N, p.C, p.H, p.W}), " with K=", text(p.K), " and stride ", text(p.stride));
}

DepthwiseProblem check_forward(const at::Tensor& input, const at::Tensor& weight,
                               const c10::optional<at::Tensor>& bias, int64_t stride) {
  check_4d(input, "input");
  check_dtype(input, "input");
  check_same_device(input, "input", weight, "weight");
  check_same_dtype(input, "input", weight, "weight");
  const int64_t K = check_weight(weight, input.size(1));
  check_bias(bias, input, input.size(1));
  check_stride(stride);
  return make_problem(input.size(0), input.size(1), input.size(2), input.size(3), K, stride,
                      check_layout({{&input, "input"}}));
}

DepthwiseProblem check_backward_input(const at::Tensor& grad_output, const at::Tensor& weight,
                                      int64_t stride, at::IntArrayRef input_size) {
  check_4d(grad_output, "grad_output");
  check_dtype(grad_output, "grad_output");
  check_same_device(grad_output, "grad_output", weight, "weight");
  check_same_dtype(grad_output, "grad_output", weight, "weight");
  const int64_t K = check_weight(weight, grad_output.size(1));
  check_stride(stride);
  TORCH_CHECK(input_size.size() == 2 && input_size[0] >= 1 && input_size[1] >= 1,
              "LumenBridge: input_size must be [H, W] with H, W >= 1, got ", text(input_size));
  const Layout layout = check_layout({{&grad_output, "grad_output"}});
  const DepthwiseProblem p = make_problem(grad_output.size(0), grad_output.size(1),
                                          input_size[0], input_size[1], K, stride, layout);
  check_grad_output_shape(grad_output, p);
  return p;
}

DepthwiseProblem check_backward_weight(const at::Tensor& grad_output, const at::Tensor& input,
                                       int64_t kernel_size, int64_t stride) {
  check_4d(input, "input");
  check_4d(grad_output, "grad_output");
  check_dtype(input, "input");
  check_same_device(input, "input", grad_output, "grad_output");
  check_same_dtype(input, "input", grad_output, "grad_output");
  check_kernel_size(kernel_size);
  check_stride(stride);
  const Layout layout = check_layout({{&input, "input"}, {&grad_output, "grad_output"}});
  const DepthwiseProblem p = make_problem(input.size(0), input.size(1), input.size(2),
                                          input.size(3), kernel_size, stride, layout);
  check_grad_output_shape(grad_output, p);
  return p;
}

// One entry point per op, instantiated once per device's kernels: the checks
// run first, then the kernel, whatever the device.
template <auto kernel>
auto forward_entry(const at::Tensor& input, const at::Tensor& weight,
                         const c10::optional<at::Tensor>& bias, int64_t stride) {
  check_no_tangents({input, weight, as_list(bias)});
  return kernel(input, weight, bias, check_forward(input, weight, bias, stride));
}

template <auto kernel>
auto backward_input_entry(const at::Tensor& grad_output, const at::Tensor& weight,
                                int64_t stride, at::IntArrayRef input_size) {
  check_no_tangents({grad_output, weight});
  return kernel(grad_output, weight, check_backward_input(grad_output, weight, stride, input_size));
}

template <auto kernel>
auto backward_weight_entry(const at::Tensor& grad_output,
                                                         const at::Tensor& input,
                                                         int64_t kernel_size, int64_t stride) {
  check_no_tangents({grad_output, input});
  return kernel(grad_output, input,
                check_backward_weight(grad_output, input, kernel_size, stride));
}

// The fakes' kernels (native.py): the checks alone, so that a call on meta or
// fake tensors of known sizes fails as it would on a device.
void no_depthwise_kernel(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&,
                         const DepthwiseProblem&) {}
void no_backward_kernel(const at::Tensor&, const at::Tensor&, const DepthwiseProblem&) {}

// ---- tokenize: the whole tokenizer -------------------------------------------

template <typename Enum>
Enum parse_choice(const std::string& value, const char* what,
                  std::initializer_list<std::pair<const char*, Enum>> choices) {
  std::string names;
  for (const auto& [name, e] : choices) {
    if (value == name) return e;
    names += names.empty() ? name : std::string(", ") + name;
  }
  TORCH_CHECK(false, "LumenBridge: ", what, " must be one of ", names, ", got '", value, "'");
}

StageNorm parse_stage_norm(const std::string& value) {
  return parse_choice<StageNorm>(
      value, "stage_norm",
      {{"none", StageNorm::NONE}, {"layernorm", StageNorm::LAYERNORM}, {"affine", StageNorm::AFFINE}});
}

void check_vector(const at::Tensor& t, const char* name, int64_t length) {
  TORCH_CHECK(t.dim() == 1 && t.size(0) == length, "LumenBridge: ", name, " must have shape [",
              text(length), "], got ", text(t.sizes()));
  TORCH_CHECK(t.is_contiguous(), "LumenBridge: ", name, " must be contiguous");
}

// value as the parameters' dtype holds it, overflowing to infinity (a
// double past float's range is infinite first: converting it is undefined).
double in_dtype(double value, at::ScalarType dtype) {
  constexpr float kInfinity = std::numeric_limits<float>::infinity();
  const float narrow = std::abs(value) <= std::numeric_limits<float>::max() ? static_cast<float>(value)
                       : value > 0                                          ? kInfinity
                                                                            : -kInfinity;
  switch (dtype) {
    case at::kHalf:
      return static_cast<float>(c10::Half(narrow));
    case at::kBFloat16:
      return static_cast<float>(c10::BFloat16(narrow));
    case at::kFloat:
      return narrow;
    default:
      return value;
  }
}

// A parameter of the call: same device and dtype as the first depthwise weight.
void check_parameter(const at::Tensor& t, const at::Tensor& reference, const std::string& name) {
  check_same_device(reference, "dw_weights[0]", t, name.c_str());
  check_same_dtype(reference, "dw_weights[0]", t, name.c_str());
}

TokenizeStage check_stage(const TokenizeProblem& p, size_t i, int64_t in_channels,
                          const at::Tensor& dw_weight, const at::Tensor& dw_bias,
                          const at::Tensor& pw_weight, const at::Tensor& pw_bias,
                          int64_t stride, const at::Tensor& reference) {
  const std::string at = "stage " + text(static_cast<int64_t>(i)) + " ";
  for (const auto& [t, name] : {std::pair{&dw_weight, "dw_weight"}, {&dw_bias, "dw_bias"},
                                {&pw_weight, "pw_weight"}, {&pw_bias, "pw_bias"}}) {
    check_parameter(*t, reference, at + name);
  }
  TORCH_CHECK(dw_weight.dim() == 4 && dw_weight.size(0) == in_channels && dw_weight.size(1) == 1 &&
                  dw_weight.size(2) == p.K && dw_weight.size(3) == p.K,
              "LumenBridge: ", at, "dw_weight must have shape [", text(in_channels), ", 1, ",
              text(p.K), ", ", text(p.K), "], got ", text(dw_weight.sizes()));
  TORCH_CHECK(dw_weight.is_contiguous(), "LumenBridge: ", at, "dw_weight must be contiguous");
  check_vector(dw_bias, (at + "dw_bias").c_str(), in_channels);
  TORCH_CHECK(pw_weight.dim() == 4 && pw_weight.size(0) >= 1 && pw_weight.size(1) == in_channels &&
                  pw_weight.size(2) == 1 && pw_weight.size(3) == 1,
              "LumenBridge: ", at, "pw_weight must have shape [C_out, ", text(in_channels),
              ", 1, 1], got ", text(pw_weight.sizes()));
  TORCH_CHECK(pw_weight.is_contiguous(), "LumenBridge: ", at, "pw_weight must be contiguous");
  check_vector(pw_bias, (at + "pw_bias").c_str(), pw_weight.size(0));
  check_stride(stride);
  TokenizeStage stage;
  stage.dw_weight = dw_weight;
  stage.dw_bias = dw_bias;
  stage.pw_weight = pw_weight;
  stage.pw_bias = pw_bias;
  stage.stride = stride;
  stage.in_channels = in_channels;
  stage.out_channels = pw_weight.size(0);
  return stage;
}

TokenizeProblem check_tokenize(const at::Tensor& images, at::TensorList dw_weights,
                               at::TensorList dw_biases, at::TensorList pw_weights,
                               at::TensorList pw_biases, at::IntArrayRef strides,
                               const std::string& activation, const std::string& stage_norm,
                               at::TensorList norm_weights, at::TensorList norm_biases,
                               const c10::optional<at::Tensor>& token_norm_weight,
                               const c10::optional<at::Tensor>& token_norm_bias, double eps,
                               at::ArrayRef<double> mean, at::ArrayRef<double> std,
                               at::IntArrayRef padded_size, const std::string& output_fmt) {
  const size_t S = dw_weights.size();
  TORCH_CHECK(S >= 1, "LumenBridge: tokenize needs at least one stage (dw_weights is empty)");
  TORCH_CHECK(dw_biases.size() == S && pw_weights.size() == S && pw_biases.size() == S &&
                  strides.size() == S,
              "LumenBridge: dw_weights, dw_biases, pw_weights, pw_biases and strides must have "
              "one entry per stage, got ",
              text({static_cast<int64_t>(dw_weights.size()), static_cast<int64_t>(dw_biases.size()),
                    static_cast<int64_t>(pw_weights.size()), static_cast<int64_t>(pw_biases.size()),
                    static_cast<int64_t>(strides.size())}));
  const at::Tensor& reference = dw_weights[0];
  check_dtype(reference, "dw_weights[0]");
  check_4d(images, "images");
  check_same_device(reference, "dw_weights[0]", images, "images");
  TokenizeProblem p;
  p.uint8_input = images.scalar_type() == at::kByte;
  TORCH_CHECK(p.uint8_input || images.scalar_type() == reference.scalar_type(),
              "LumenBridge: images must be uint8 (0..255) or have the parameters' dtype ",
              text(reference.scalar_type()), ", got ", text(images.scalar_type()));
  p.layout = check_layout({{&images, "images"}});
  p.N = images.size(0);
  p.C = images.size(1);
  p.H = images.size(2);
  p.W = images.size(3);
  p.dtype = reference.scalar_type();
  TORCH_CHECK(reference.dim() == 4, "LumenBridge: dw_weights[0] must have shape [C, 1, K, K], got ",
              text(reference.sizes()));
  p.K = reference.size(2);
  check_kernel_size(p.K);
  TORCH_CHECK(padded_size.size() == 2 && padded_size[0] >= p.H && padded_size[1] >= p.W &&
                  padded_size[0] <= kMaxExtent && padded_size[1] <= kMaxExtent,
              "LumenBridge: padded_size must be [H, W] at least the image size ", text({p.H, p.W}),
              " and at most ", text(kMaxExtent), " each, got ", text(padded_size));
  p.Hp = padded_size[0];
  p.Wp = padded_size[1];
  int64_t channels = p.C, h = p.Hp, w = p.Wp;
  for (size_t i = 0; i < S; ++i) {
    TokenizeStage stage = check_stage(p, i, channels, dw_weights[i], dw_biases[i], pw_weights[i],
                                      pw_biases[i], strides[i], reference);
    h = stage.out_h = depthwise_output_extent(h, p.K, stage.stride);
    w = stage.out_w = depthwise_output_extent(w, p.K, stage.stride);
    channels = stage.out_channels;
    p.stages.push_back(stage);
  }
  p.activation = parse_choice<Activation>(activation, "activation",
                                          {{"gelu", Activation::GELU}, {"relu", Activation::RELU},
                                           {"silu", Activation::SILU}, {"none", Activation::NONE}});
  p.stage_norm = parse_stage_norm(stage_norm);
  const size_t norms = p.stage_norm == StageNorm::NONE ? 0 : S;
  TORCH_CHECK(norm_weights.size() == norms && norm_biases.size() == norms, "LumenBridge: stage_norm '",
              stage_norm, "' needs ", text(static_cast<int64_t>(norms)),
              " norm weights and biases (one per stage), got ",
              text({static_cast<int64_t>(norm_weights.size()), static_cast<int64_t>(norm_biases.size())}));
  for (size_t i = 0; i < norms; ++i) {
    const std::string at = "stage " + text(static_cast<int64_t>(i)) + " norm_";
    check_parameter(norm_weights[i], reference, at + "weight");
    check_parameter(norm_biases[i], reference, at + "bias");
    check_vector(norm_weights[i], (at + "weight").c_str(), p.stages[i].out_channels);
    check_vector(norm_biases[i], (at + "bias").c_str(), p.stages[i].out_channels);
    p.stages[i].norm_weight = norm_weights[i];
    p.stages[i].norm_bias = norm_biases[i];
  }
  TORCH_CHECK(token_norm_weight.has_value() == token_norm_bias.has_value(),
              "LumenBridge: token_norm_weight and token_norm_bias must be given together");
  if (token_norm_weight.has_value()) {
    check_parameter(*token_norm_weight, reference, "token_norm_weight");
    check_parameter(*token_norm_bias, reference, "token_norm_bias");
    check_vector(*token_norm_weight, "token_norm_weight", channels);
    check_vector(*token_norm_bias, "token_norm_bias", channels);
    p.token_norm_weight = *token_norm_weight;
    p.token_norm_bias = *token_norm_bias;
  }
  // The norms compute in float32 at least, where a smaller eps is zero.
  TORCH_CHECK(eps > 0 && (p.dtype == at::kDouble || static_cast<float>(eps) > 0),
              "LumenBridge: eps must be positive", p.dtype == at::kDouble ? "" : " in float32", ", got ", text(eps));
  p.eps = eps;
  TORCH_CHECK(mean.size() == static_cast<size_t>(p.C) && std.size() == static_cast<size_t>(p.C),
              "LumenBridge: mean and std need one entry per image channel (", text(p.C), "), got ",
              text({static_cast<int64_t>(mean.size()), static_cast<int64_t>(std.size())}));
  for (double s : std) {
    TORCH_CHECK(std::isfinite(s) && s > 0, "LumenBridge: std entries must be positive and finite, got ", text(s));
  }
  for (double m : mean) {
    TORCH_CHECK(std::isfinite(m), "LumenBridge: mean entries must be finite, got ", text(m));
  }
  if (p.uint8_input) {
    for (int64_t c = 0; c < p.C; ++c) {
      // Pixels 0..255 are normalized in the parameters' dtype (or in float
      // with 1 / std): the statistics and what they map pixels to must be
      // finite there, and std not zero.
      const double reach = std::max(std::abs(mean[c]), std::abs(255.0 - mean[c])) / std[c];
      const double rounded_std = in_dtype(std[c], p.dtype);
      TORCH_CHECK(std::isfinite(in_dtype(mean[c], p.dtype)) && std::isfinite(rounded_std) && rounded_std > 0 &&
                      std::isfinite(in_dtype(reach, p.dtype)),
                  "LumenBridge: channel ", text(c), "'s mean ", text(mean[c]), " and std ", text(std[c]),
                  " do not normalize pixel values 0..255 to finite ", text(p.dtype), " values");
    }
  }
  p.mean.assign(mean.begin(), mean.end());
  p.std.assign(std.begin(), std.end());
  p.format = parse_choice<TokenFormat>(
      output_fmt, "output_fmt",
      {{"NLC", TokenFormat::NLC}, {"NCHW", TokenFormat::NCHW}, {"NHWC", TokenFormat::NHWC}});
  return p;
}

// Images in a layout the kernels do not read (a permuted view, say) are
// copied to NCHW first (as layout.memory_format_of, which the fakes use,
// says of them): the tokens do not depend on the layout, and an exported
// program has no guard on its inputs' strides that would make the caller
// copy them.
at::Tensor dense_images(const at::Tensor& images) {
  if (images.dim() != 4 || images.is_contiguous() || images.is_contiguous(at::MemoryFormat::ChannelsLast)) {
    return images;
  }
  return images.contiguous();
}

// tokenize's and tokenize_for_training's entry (the same arguments).
template <auto kernel>
auto tokenize_entry(const at::Tensor& images, at::TensorList dw_weights, at::TensorList dw_biases,
                    at::TensorList pw_weights, at::TensorList pw_biases, at::IntArrayRef strides,
                    c10::string_view activation, c10::string_view stage_norm, at::TensorList norm_weights,
                    at::TensorList norm_biases, const c10::optional<at::Tensor>& token_norm_weight,
                    const c10::optional<at::Tensor>& token_norm_bias, double eps, at::ArrayRef<double> mean,
                    at::ArrayRef<double> std, at::IntArrayRef padded_size, c10::string_view output_fmt) {
  check_no_tangents({images, dw_weights, dw_biases, pw_weights, pw_biases, norm_weights, norm_biases,
                     as_list(token_norm_weight), as_list(token_norm_bias)});
  const at::Tensor dense = dense_images(images);
  return kernel(dense, check_tokenize(dense, dw_weights, dw_biases, pw_weights, pw_biases, strides,
                                      std::string(activation), std::string(stage_norm), norm_weights,
                                      norm_biases, token_norm_weight, token_norm_bias, eps, mean, std,
                                      padded_size, std::string(output_fmt)));
}

void no_tokenize_kernel(const at::Tensor&, const TokenizeProblem&) {}

// One list tokenize_for_training saved, handed back: entry k has sizes(k).
template <typename Sizes>
void check_saved_list(const TokenizeProblem& p, at::TensorList saved, const char* list, Sizes sizes,
                      const at::Tensor& images) {
  for (size_t k = 0; k < saved.size(); ++k) {
    const at::Tensor& t = saved[k];
    const std::string name = std::string(list) + "[" + text(static_cast<int64_t>(k)) + "]";
    check_same_device(images, "images", t, name.c_str());
    TORCH_CHECK(t.scalar_type() == p.dtype, "LumenBridge: ", name, " has dtype ", text(t.scalar_type()),
                " but the parameters have dtype ", text(p.dtype));
    const std::vector<int64_t> expected = sizes(k);
    TORCH_CHECK(t.sizes() == at::IntArrayRef(expected), "LumenBridge: ", name, " must have shape ", text(expected),
                ", got ", text(t.sizes()));
    TORCH_CHECK(t.is_contiguous(), "LumenBridge: ", name, " must be contiguous");
  }
}

// What tokenize_for_training saved, handed back: nothing, or what that op
// returned: each stage's depthwise rows and the outputs SavedForward names.
void check_saved(const TokenizeProblem& p, at::TensorList saved_rows, at::TensorList saved_outputs,
                 const at::Tensor& images) {
  const size_t S = p.stages.size();
  const bool none = saved_rows.empty() && saved_outputs.empty();
  const size_t outputs = SavedForward::output_count(p);
  TORCH_CHECK(none || (saved_rows.size() == S && saved_outputs.size() == outputs),
              "LumenBridge: saved_rows and saved_outputs must both be empty or hold ", text(static_cast<int64_t>(S)),
              " and ", text(static_cast<int64_t>(outputs)),
              " tensors (each stage's depthwise rows, the outputs of the stages after the first that the backward "
              "reads, as tokenize_for_training returns them), got ",
              text(static_cast<int64_t>(saved_rows.size())), " and ", text(static_cast<int64_t>(saved_outputs.size())));
  check_saved_list(p, saved_rows, "saved_rows", [&](size_t k) { return depthwise_rows_sizes(p, k); }, images);
  check_saved_list(p, saved_outputs, "saved_outputs", [&](size_t k) { return saved_output_sizes(p, k + 1); }, images);
}

// tokenize_backward takes tokenize's arguments plus the gradient of its output,
// what tokenize_for_training saved (or nothing) and which gradients to
// compute: output_mask = [images, parameters].
TokenizeProblem check_tokenize_backward(const at::Tensor& grad_tokens, const at::Tensor& images,
                                        TokenizeProblem p, at::TensorList saved_rows,
                                        at::TensorList saved_outputs, std::array<bool, 2> output_mask) {
  check_same_device(images, "images", grad_tokens, "grad_tokens");
  TORCH_CHECK(grad_tokens.scalar_type() == p.dtype, "LumenBridge: grad_tokens has dtype ",
              text(grad_tokens.scalar_type()), " but the tokens have the parameters' dtype ", text(p.dtype));
  TORCH_CHECK(grad_tokens.sizes() == at::IntArrayRef(p.output_sizes()), "LumenBridge: grad_tokens has shape ",
              text(grad_tokens.sizes()), " but the tokens have shape ", text(p.output_sizes()));
  TORCH_CHECK(!(output_mask[0] && p.uint8_input),
              "LumenBridge: uint8 images have no gradient; output_mask[0] must be false for them");
  check_saved(p, saved_rows, saved_outputs, images);
  return p;
}

template <auto kernel>
TokenizeBackwardResult tokenize_backward_entry(
    const at::Tensor& grad_tokens, const at::Tensor& images, at::TensorList dw_weights, at::TensorList dw_biases,
    at::TensorList pw_weights, at::TensorList pw_biases, at::IntArrayRef strides, c10::string_view activation,
    c10::string_view stage_norm, at::TensorList norm_weights, at::TensorList norm_biases,
    const c10::optional<at::Tensor>& token_norm_weight, const c10::optional<at::Tensor>& token_norm_bias,
    double eps, at::ArrayRef<double> mean, at::ArrayRef<double> std, at::IntArrayRef padded_size,
    c10::string_view output_fmt, at::TensorList saved_rows, at::TensorList saved_outputs,
    std::array<bool, 2> output_mask) {
  check_no_tangents({grad_tokens, images, dw_weights, dw_biases, pw_weights, pw_biases, norm_weights, norm_biases,
                     as_list(token_norm_weight), as_list(token_norm_bias)});
  const at::Tensor dense = dense_images(images);
  const TokenizeProblem p = check_tokenize_backward(
      grad_tokens, dense,
      check_tokenize(dense, dw_weights, dw_biases, pw_weights, pw_biases, strides, std::string(activation),
                     std::string(stage_norm), norm_weights, norm_biases, token_norm_weight, token_norm_bias,
                     eps, mean, std, padded_size, std::string(output_fmt)),
      saved_rows, saved_outputs, output_mask);
  TokenizeGrads g = kernel(grad_tokens, dense, p, {output_mask[0], output_mask[1]},
                           SavedForward{saved_rows.vec(), saved_outputs.vec()});
  std::vector<at::Tensor> grad_images, token_norm;
  if (g.images.defined()) grad_images.push_back(g.images);
  if (g.token_norm_weight.defined()) token_norm = {g.token_norm_weight, g.token_norm_bias};
  return {grad_images, g.dw_weights, g.dw_biases, g.pw_weights, g.pw_biases, g.norm_weights, g.norm_biases,
          token_norm};
}

// Autocast: tokenize (and tokenize_for_training, whose result type is
// Result) runs in the autocast dtype, as PyTorch's convolutions do (float64
// tensors and uint8 images are left as they are). The casts are
// differentiable, so float32 parameters get float32 gradients; the
// parameters' are made together (autocast_together).
template <c10::DeviceType device, const char* name, typename Result>
Result tokenize_autocast(const at::Tensor& images, at::TensorList dw_weights, at::TensorList dw_biases,
                         at::TensorList pw_weights, at::TensorList pw_biases, at::IntArrayRef strides,
                         c10::string_view activation, c10::string_view stage_norm, at::TensorList norm_weights,
                         at::TensorList norm_biases, const c10::optional<at::Tensor>& token_norm_weight,
                         const c10::optional<at::Tensor>& token_norm_bias, double eps, at::ArrayRef<double> mean,
                         at::ArrayRef<double> std, c10::SymIntArrayRef padded_size, c10::string_view output_fmt) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(at::autocast::get_autocast_dispatch_key_from_device_type(device));
  const at::ScalarType dtype = at::autocast::get_autocast_dtype(device);
  std::vector<at::Tensor> parameters;
  for (at::TensorList list : {dw_weights, dw_biases, pw_weights, pw_biases, norm_weights, norm_biases}) {
    parameters.insert(parameters.end(), list.begin(), list.end());
  }
  parameters.push_back(token_norm_weight.value_or(at::Tensor()));
  parameters.push_back(token_norm_bias.value_or(at::Tensor()));
  const std::vector<at::Tensor> cast = autocast_together(parameters, dtype, device);
  auto next = cast.begin();
  const auto take = [&next](size_t count) {
    std::vector<at::Tensor> part(next, next + count);
    next += count;
    return part;
  };
  const size_t S = dw_weights.size(), norms = norm_weights.size();
  const std::vector<at::Tensor> dw_w = take(S), dw_b = take(S), pw_w = take(S), pw_b = take(S);
  const std::vector<at::Tensor> norm_w = take(norms), norm_b = take(norm_biases.size());
  return typed_op<TokenizeSignature<Result>, name>().call(
      at::autocast::cached_cast(dtype, images, device), dw_w, dw_b, pw_w, pw_b, strides, activation, stage_norm,
      norm_w, norm_b, optional(next[0]), optional(next[1]), eps, mean, std, padded_size, output_fmt);
}

// Which CUDA path tokenize takes for a configuration: "fused", or "composed: <why>".
std::string tokenize_path(at::ScalarType dtype, int64_t in_channels, at::IntArrayRef widths,
                          int64_t kernel_size, at::IntArrayRef strides, c10::string_view stage_norm) {
#ifdef LUMENBRIDGE_WITH_CUDA
  const StageNorm norm = parse_stage_norm(std::string(stage_norm));
  const std::string reason =
      cuda::fused_unsupported_reason(dtype, in_channels, widths.vec(), kernel_size, strides.vec(), norm);
  return reason.empty() ? "fused" : "composed: " + reason;
#else
  return "composed: the extension was built without CUDA kernels";
#endif
}

}  // namespace

void check_no_tangents(std::initializer_list<at::TensorList> arguments) {
  if (!torch::autograd::ForwardADLevel::try_get_by_idx(0)) return;  // no dual level open: no tangent anywhere
  for (const at::TensorList& list : arguments) {
    for (const at::Tensor& t : list) {
      TORCH_CHECK(!t.defined() || !t._fw_grad(/*level=*/0).defined(),
                  "LumenBridge: an argument carries a forward-mode AD tangent, which the native ops do not "
                  "propagate; backend=\"reference\" supports forward-mode AD");
    }
  }
}

at::TensorList as_list(const c10::optional<at::Tensor>& t) { return t.has_value() ? at::TensorList(*t) : at::TensorList(); }

std::string text(int64_t value) { return std::to_string(value); }

// Six significant digits, so that a tiny value is not printed as 0.000000.
std::string text(double value) {
  std::array<char, 32> buffer{};
  std::snprintf(buffer.data(), buffer.size(), "%.6g", value);
  return buffer.data();
}

std::string text(at::IntArrayRef values) {
  std::string joined = "[";
  for (size_t i = 0; i < values.size(); ++i) {
    joined += (i ? ", " : "") + std::to_string(values[i]);
  }
  return joined + "]";
}

std::string text(at::ScalarType dtype) { return c10::toString(dtype); }

std::string text(const at::Device& device) { return device.str(); }

at::Tensor new_output(at::IntArrayRef sizes, const at::TensorOptions& options,
                      at::MemoryFormat memory_format) {
  at::Tensor out = at::empty(sizes, options.memory_format(memory_format));
  if (poison_outputs.load()) {
    out.fill_(at::isFloatingType(out.scalar_type()) ? c10::Scalar(std::numeric_limits<double>::quiet_NaN())
                                                    : c10::Scalar(int64_t{0x5A}));
  }
  return out;
}

bool sole_reference(const at::Tensor& t) {
  return t.use_count() == 1 && t.storage().use_count() == 1 && !t.requires_grad();
}

// Each op's arguments, spelled once: the ops and their checks alone (the
// fakes' kernels) share them.
#define LUMENBRIDGE_FORWARD_ARGUMENTS "(Tensor input, Tensor weight, Tensor? bias, int stride)"
#define LUMENBRIDGE_BACKWARD_INPUT_ARGUMENTS "(Tensor grad_output, Tensor weight, int stride, int[2] input_size)"
#define LUMENBRIDGE_BACKWARD_WEIGHT_ARGUMENTS "(Tensor grad_output, Tensor input, int kernel_size, int stride)"
#define LUMENBRIDGE_TOKENIZE_ARGUMENTS                                                                   \
  "Tensor images, Tensor[] dw_weights, Tensor[] dw_biases, Tensor[] pw_weights, Tensor[] pw_biases, "  \
  "int[] strides, str activation, str stage_norm, Tensor[] norm_weights, Tensor[] norm_biases, "       \
  "Tensor? token_norm_weight, Tensor? token_norm_bias, float eps, float[] mean, float[] std, "         \
  "SymInt[2] padded_size, str output_fmt"

TORCH_LIBRARY(lumenbridge, m) {
  m.def("depthwise_conv2d" LUMENBRIDGE_FORWARD_ARGUMENTS " -> Tensor");
  m.def("depthwise_conv2d_backward_input" LUMENBRIDGE_BACKWARD_INPUT_ARGUMENTS " -> Tensor");
  m.def("depthwise_conv2d_backward_weight" LUMENBRIDGE_BACKWARD_WEIGHT_ARGUMENTS " -> (Tensor, Tensor)");
  m.def("tokenize(" LUMENBRIDGE_TOKENIZE_ARGUMENTS ") -> Tensor");
  m.def("tokenize_for_training(" LUMENBRIDGE_TOKENIZE_ARGUMENTS
        ") -> (Tensor tokens, Tensor[] saved_rows, Tensor[] saved_outputs)");
  m.def(
      "tokenize_backward(Tensor grad_tokens, " LUMENBRIDGE_TOKENIZE_ARGUMENTS
      ", Tensor[] saved_rows, Tensor[] saved_outputs, bool[2] output_mask) -> "
      "(Tensor[] grad_images, Tensor[] grad_dw_weights, Tensor[] grad_dw_biases, Tensor[] grad_pw_weights, "
      "Tensor[] grad_pw_biases, Tensor[] grad_norm_weights, Tensor[] grad_norm_biases, "
      "Tensor[] grad_token_norm)");
  m.def("tokenize_path(ScalarType dtype, int in_channels, int[] widths, int kernel_size, int[] strides, "
      "str stage_norm) -> str",
        &tokenize_path);
  m.def("depthwise_row_width(int in_channels) -> int", &depthwise_row_width);
  m.def("_set_poison_outputs(bool enabled) -> ()", &set_poison_outputs);
  // The checks alone, for the fakes: composite, so that they read the
  // metadata of meta and fake tensors directly (of known sizes only: the
  // fakes call them where no size is symbolic).
  m.def("_check_depthwise_conv2d" LUMENBRIDGE_FORWARD_ARGUMENTS " -> ()", &forward_entry<no_depthwise_kernel>);
  m.def("_check_depthwise_conv2d_backward_input" LUMENBRIDGE_BACKWARD_INPUT_ARGUMENTS " -> ()",
        &backward_input_entry<no_backward_kernel>);
  m.def("_check_depthwise_conv2d_backward_weight" LUMENBRIDGE_BACKWARD_WEIGHT_ARGUMENTS " -> ()",
        &backward_weight_entry<no_backward_kernel>);
  m.def("_check_tokenize(" LUMENBRIDGE_TOKENIZE_ARGUMENTS ") -> ()", &tokenize_entry<no_tokenize_kernel>);
}

#undef LUMENBRIDGE_FORWARD_ARGUMENTS
#undef LUMENBRIDGE_BACKWARD_INPUT_ARGUMENTS
#undef LUMENBRIDGE_BACKWARD_WEIGHT_ARGUMENTS
#undef LUMENBRIDGE_TOKENIZE_ARGUMENTS

TORCH_LIBRARY_IMPL(lumenbridge, CPU, m) {
  m.impl("depthwise_conv2d", &forward_entry<cpu::depthwise_forward>);
  m.impl("depthwise_conv2d_backward_input", &backward_input_entry<cpu::depthwise_backward_input>);
  m.impl("depthwise_conv2d_backward_weight",
         &backward_weight_entry<cpu::depthwise_backward_weight>);
  m.impl("tokenize", &tokenize_entry<cpu::tokenize>);
  m.impl("tokenize_for_training", &tokenize_entry<cpu::tokenize_for_training>);
  m.impl("tokenize_backward", &tokenize_backward_entry<cpu::tokenize_backward>);
}

TORCH_LIBRARY_IMPL(lumenbridge, AutocastCPU, m) {
  m.impl("tokenize", &tokenize_autocast<c10::DeviceType::CPU, kTokenize, at::Tensor>);
  m.impl("tokenize_for_training", &tokenize_autocast<c10::DeviceType::CPU, kTokenizeForTraining, TrainingResult>);
}

TORCH_LIBRARY_IMPL(lumenbridge, AutocastCUDA, m) {
  m.impl("tokenize", &tokenize_autocast<c10::DeviceType::CUDA, kTokenize, at::Tensor>);
  m.impl("tokenize_for_training", &tokenize_autocast<c10::DeviceType::CUDA, kTokenizeForTraining, TrainingResult>);
}

#ifdef LUMENBRIDGE_WITH_CUDA
TORCH_LIBRARY_IMPL(lumenbridge, CUDA, m) {
  m.impl("depthwise_conv2d", &forward_entry<cuda::depthwise_forward>);
  m.impl("depthwise_conv2d_backward_input",
         &backward_input_entry<cuda::depthwise_backward_input>);
  m.impl("depthwise_conv2d_backward_weight",
         &backward_weight_entry<cuda::depthwise_backward_weight>);
  m.impl("tokenize", &tokenize_entry<cuda::tokenize>);
  m.impl("tokenize_for_training", &tokenize_entry<cuda::tokenize_for_training>);
  m.impl("tokenize_backward", &tokenize_backward_entry<cuda::tokenize_backward>);
}
#endif

}  // namespace lumenbridge
