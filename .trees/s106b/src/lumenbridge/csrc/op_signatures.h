// The C++ signatures of the tokenize ops (their schemas are in gateway.cpp),
// for kernels that call an op again through the dispatcher: the gateway's
// autocast kernels and the autograd kernels (autograd.cpp). padded_size is
// symbolic (SymInt[2]) so that torch.export can keep the image size dynamic;
// the device kernels take it as plain ints, which the dispatcher unpacks.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>

#include <array>
#include <tuple>
#include <vector>

namespace lumenbridge {

inline constexpr char kTokenize[] = "lumenbridge::tokenize";
inline constexpr char kTokenizeForTraining[] = "lumenbridge::tokenize_for_training";
inline constexpr char kTokenizeBackward[] = "lumenbridge::tokenize_backward";

// tokenize returns the tokens; tokenize_for_training the tokens, saved_rows and saved_outputs.
template <typename Result>
using TokenizeSignature = Result(const at::Tensor& images, at::TensorList dw_weights, at::TensorList dw_biases,
                                 at::TensorList pw_weights, at::TensorList pw_biases, at::IntArrayRef strides,
                                 c10::string_view activation, c10::string_view stage_norm,
                                 at::TensorList norm_weights, at::TensorList norm_biases,
                                 const c10::optional<at::Tensor>& token_norm_weight,
                                 const c10::optional<at::Tensor>& token_norm_bias, double eps,
                                 at::ArrayRef<double> mean, at::ArrayRef<double> std, c10::SymIntArrayRef padded_size,
                                 c10::string_view output_fmt);

// grad_images (empty or one), then the gradients of dw_weights, dw_biases,
// pw_weights, pw_biases, norm_weights, norm_biases and the token norm's
// weight and bias (each empty where not asked for).
using TokenizeBackwardResult =
    std::tuple<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>,
               std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>>;
using TokenizeBackwardSignature = TokenizeBackwardResult(
    const at::Tensor& grad_tokens, const at::Tensor& images, at::TensorList dw_weights, at::TensorList dw_biases,
    at::TensorList pw_weights, at::TensorList pw_biases, at::IntArrayRef strides, c10::string_view activation,
    c10::string_view stage_norm, at::TensorList norm_weights, at::TensorList norm_biases,
    const c10::optional<at::Tensor>& token_norm_weight, const c10::optional<at::Tensor>& token_norm_bias,
    double eps, at::ArrayRef<double> mean, at::ArrayRef<double> std, c10::SymIntArrayRef padded_size,
    c10::string_view output_fmt, at::TensorList saved_rows, at::TensorList saved_outputs,
    std::array<bool, 2> output_mask);

// A tensor as an optional argument of the ops: absent where undefined.
inline c10::optional<at::Tensor> optional(const at::Tensor& t) {
  return t.defined() ? c10::optional<at::Tensor>(t) : c10::nullopt;
}

// The op `name` with its signature, looked up once per caller.
template <typename Signature, const char* name>
const c10::TypedOperatorHandle<Signature>& typed_op() {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
  return op;
}

}  // namespace lumenbridge
