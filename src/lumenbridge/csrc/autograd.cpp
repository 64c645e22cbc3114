// The autograd kernels of lumenbridge::tokenize and tokenize_for_training,
// registered at the Autograd key: each saves what the backward needs and calls
// the registered op lumenbridge::tokenize_backward through the dispatcher, so
// torch.compile, torch.export and opcheck trace the backward as that op.
// Written here rather than with torch.library.register_autograd because that
// function's wrapper for ops with tensor-list arguments flattens, rebuilds and
// checks every argument in Python on each call: about 0.4 ms of host time per
// training step on a 2-core CPU, against 15-35 us for this kernel's forward
// there (benchmarks/NOTES.md, eighteenth and nineteenth sessions).
#include <torch/autograd.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/library.h>

#include <initializer_list>
#include <type_traits>
#include <utility>

#include "cast_together.h"
#include "op_signatures.h"
#include "tokenize.h"

namespace lumenbridge {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

void append(variable_list& to, at::TensorList tensors) { to.insert(to.end(), tensors.begin(), tensors.end()); }

// The gradients numbered as autograd numbers the op's arguments: one for each
// tensor of a list and one for every other argument (undefined for the
// options and wherever tokenize_backward computed none).
variable_list numbered_gradients(const TokenizeBackwardResult& grads, size_t stages, size_t norms) {
  const auto& [images, dw_weights, dw_biases, pw_weights, pw_biases, norm_weights, norm_biases, token_norm] = grads;
  variable_list numbered;
  const auto add = [&numbered](const std::vector<at::Tensor>& computed, size_t count) {
    for (size_t k = 0; k < count; ++k) numbered.push_back(computed.empty() ? at::Tensor() : computed[k]);
  };
  add(images, 1);
  for (const auto* list : {&dw_weights, &dw_biases, &pw_weights, &pw_biases}) add(*list, stages);
  numbered.resize(numbered.size() + 3);  // strides, activation, stage_norm
  add(norm_weights, norms);
  add(norm_biases, norms);
  add(token_norm, 2);
  numbered.resize(numbered.size() + 5);  // eps, mean, std, padded_size, output_fmt
  return numbered;
}

// The parameters' gradients (all of the parameters' one dtype) made views of
// one buffer (in_one_buffer): the caller's `p.grad = None` or zero_grad then
// frees one block of memory where it freed one per parameter, on the host's
// path to the next step's first kernel, and the separate gradients are freed
// here instead, in the backward, whose host work runs ahead of the GPU.
void into_one_buffer(TokenizeBackwardResult& grads) {
  auto& [images, dw_weights, dw_biases, pw_weights, pw_biases, norm_weights, norm_biases, token_norm] = grads;
  std::vector<at::Tensor*> slots;
  std::vector<at::Tensor> separate;
  for (auto* list : {&dw_weights, &dw_biases, &pw_weights, &pw_biases, &norm_weights, &norm_biases, &token_norm}) {
    for (at::Tensor& g : *list) {
      if (!g.defined()) continue;
      slots.push_back(&g);
      separate.push_back(g);
    }
  }
  if (slots.empty()) return;
  const std::vector<at::Tensor> joined = in_one_buffer(separate, separate.front().scalar_type());
  for (size_t k = 0; k < slots.size(); ++k) *slots[k] = joined[k];
}

// Whether every tensor is a leaf (as parameters are, and autocast's casts of
// them are not): autograd then keeps their gradients as .grad.
bool all_leaves(std::initializer_list<at::TensorList> lists) {
  for (at::TensorList list : lists) {
    for (const at::Tensor& t : list) {
      if (t.defined() && !t.is_leaf()) return false;
    }
  }
  return true;
}

// The op `name` (tokenize, whose Result is the tokens, or
// tokenize_for_training) as an autograd Function.
template <const char* name, typename Result>
struct TokenizeFunction : torch::autograd::Function<TokenizeFunction<name, Result>> {
  static constexpr bool kTraining = std::is_same_v<Result, TrainingResult>;

  // The op itself, below the Autograd key: its arguments as the op takes them.
  template <typename... Args>
  static Result below_autograd(Args&&... args) {
    at::AutoDispatchBelowADInplaceOrView below;
    return typed_op<TokenizeSignature<Result>, name>().call(std::forward<Args>(args)...);
  }

  // Saves the inputs and, for tokenize_for_training, what it returned besides
  // the tokens (marked non-differentiable); the backward recomputes the rest.
  static variable_list forward(AutogradContext* ctx, const at::Tensor& images, at::TensorList dw_weights,
                               at::TensorList dw_biases, at::TensorList pw_weights, at::TensorList pw_biases,
                               at::IntArrayRef strides, c10::string_view activation, c10::string_view stage_norm,
                               at::TensorList norm_weights, at::TensorList norm_biases,
                               const c10::optional<at::Tensor>& token_norm_weight,
                               const c10::optional<at::Tensor>& token_norm_bias, double eps,
                               at::ArrayRef<double> mean, at::ArrayRef<double> std, c10::SymIntArrayRef padded_size,
                               c10::string_view output_fmt) {
    Result result = below_autograd(images, dw_weights, dw_biases, pw_weights, pw_biases, strides, activation,
                                   stage_norm, norm_weights, norm_biases, token_norm_weight, token_norm_bias, eps,
                                   mean, std, padded_size, output_fmt);
    variable_list saved{images};
    for (at::TensorList list : {dw_weights, dw_biases, pw_weights, pw_biases, norm_weights, norm_biases}) {
      append(saved, list);
    }
    saved.push_back(token_norm_weight.value_or(at::Tensor()));
    saved.push_back(token_norm_bias.value_or(at::Tensor()));
    variable_list outputs;
    if constexpr (kTraining) {
      const auto& [tokens, saved_rows, saved_outputs] = result;
      variable_list kept;
      append(kept, saved_rows);
      append(kept, saved_outputs);
      ctx->mark_non_differentiable(kept);
      append(saved, kept);
      outputs = {tokens};
      append(outputs, kept);
      ctx->saved_data["saved_outputs"] = static_cast<int64_t>(saved_outputs.size());
    } else {
      outputs = {result};
      ctx->saved_data["saved_outputs"] = int64_t{0};
    }
    // What is saved gets no gradient: materialized, autograd would hand the
    // backward zeros of its sizes (about 800 MB at B = 256 for lumenbridge-base).
    ctx->set_materialize_grads(false);
    ctx->save_for_backward(std::move(saved));
    ctx->saved_data["stages"] = static_cast<int64_t>(dw_weights.size());
    ctx->saved_data["norms"] = static_cast<int64_t>(norm_weights.size());
    ctx->saved_data["strides"] = strides.vec();
    ctx->saved_data["activation"] = std::string(activation);
    ctx->saved_data["stage_norm"] = std::string(stage_norm);
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["mean"] = mean.vec();
    ctx->saved_data["std"] = std.vec();
    ctx->saved_data["padded_size"] = padded_size.vec();
    ctx->saved_data["output_fmt"] = std::string(output_fmt);
    ctx->saved_data["parameters_are_leaves"] = all_leaves(
        {dw_weights, dw_biases, pw_weights, pw_biases, norm_weights, norm_biases, as_list(token_norm_weight),
         as_list(token_norm_bias)});
    return outputs;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto count = [ctx](const char* key) { return static_cast<size_t>(ctx->saved_data[key].toInt()); };
    const size_t stages = count("stages"), norms = count("norms"), saved_outputs = count("saved_outputs");
    const at::Tensor& grad_tokens = grads[0];
    if (!grad_tokens.defined()) return numbered_gradients({}, stages, norms);  // no gradient reached the tokens
    const variable_list saved = ctx->get_saved_variables();
    size_t next = 1;
    const auto take = [&saved, &next](size_t length) {
      const at::TensorList part(saved.data() + next, length);
      next += length;
      return part;
    };
    const at::TensorList dw_weights = take(stages), dw_biases = take(stages), pw_weights = take(stages),
                         pw_biases = take(stages), norm_weights = take(norms), norm_biases = take(norms);
    const at::Tensor &token_norm_weight = saved[next], &token_norm_bias = saved[next + 1];
    next += 2;
    const at::TensorList saved_rows = take(kTraining ? stages : 0), kept_outputs = take(saved_outputs);
    // Autograd numbers only the tensor arguments here: the images, then every parameter.
    const size_t parameters = 4 * stages + 2 * norms + token_norm_weight.defined() + token_norm_bias.defined();
    const bool parameters_grad = ctx->needs_input_grad({{1, 1 + parameters}});
    const std::vector<int64_t> strides = ctx->saved_data["strides"].toIntVector();
    const std::vector<c10::SymInt> padded_size = ctx->saved_data["padded_size"].toSymIntVector();
    const std::vector<double> mean = ctx->saved_data["mean"].toDoubleVector();
    const std::vector<double> std = ctx->saved_data["std"].toDoubleVector();
    TokenizeBackwardResult computed = typed_op<TokenizeBackwardSignature, kTokenizeBackward>().call(
        grad_tokens, saved[0], dw_weights, dw_biases, pw_weights, pw_biases, strides,
        ctx->saved_data["activation"].toStringRef(), ctx->saved_data["stage_norm"].toStringRef(), norm_weights,
        norm_biases, optional(token_norm_weight), optional(token_norm_bias), ctx->saved_data["eps"].toDouble(),
        mean, std, padded_size, ctx->saved_data["output_fmt"].toStringRef(), saved_rows, kept_outputs,
        {ctx->needs_input_grad(0), parameters_grad});
    // Only gradients that autograd keeps as .grad are worth one buffer; a cast's
    // (autocast's CastTogether) packs its own, and packing here too would copy twice.
    // (A compiled region that gets the casts as inputs sees them as leaves and
    // packs: a copy too many there, not a wrong gradient.)
    if (ctx->saved_data["parameters_are_leaves"].toBool()) into_one_buffer(computed);
    return numbered_gradients(computed, stages, norms);
  }
};

template <const char* name, typename Result>
Result tokenize_autograd(const at::Tensor& images, at::TensorList dw_weights, at::TensorList dw_biases,
                         at::TensorList pw_weights, at::TensorList pw_biases, at::IntArrayRef strides,
                         c10::string_view activation, c10::string_view stage_norm, at::TensorList norm_weights,
                         at::TensorList norm_biases, const c10::optional<at::Tensor>& token_norm_weight,
                         const c10::optional<at::Tensor>& token_norm_bias, double eps, at::ArrayRef<double> mean,
                         at::ArrayRef<double> std, c10::SymIntArrayRef padded_size, c10::string_view output_fmt) {
  using Function = TokenizeFunction<name, Result>;
  check_no_tangents({images, dw_weights, dw_biases, pw_weights, pw_biases, norm_weights, norm_biases,
                     as_list(token_norm_weight), as_list(token_norm_bias)});
  // Grad mode on and a tensor argument requiring grad, as PyTorch's own kernels decide.
  const bool records = torch::autograd::compute_requires_grad(
      images, dw_weights, dw_biases, pw_weights, pw_biases, norm_weights, norm_biases, token_norm_weight,
      token_norm_bias);
  if (!records) {  // nothing to differentiate: no graph node
    return Function::below_autograd(images, dw_weights, dw_biases, pw_weights, pw_biases, strides, activation,
                                    stage_norm, norm_weights, norm_biases, token_norm_weight, token_norm_bias, eps,
                                    mean, std, padded_size, output_fmt);
  }
  variable_list outputs =
      Function::apply(images, dw_weights, dw_biases, pw_weights, pw_biases, strides, activation, stage_norm,
                      norm_weights, norm_biases, token_norm_weight, token_norm_bias, eps, mean, std, padded_size,
                      output_fmt);
  if constexpr (Function::kTraining) {
    const size_t rows = dw_weights.size();
    const auto begin = outputs.begin() + 1;
    return {outputs[0], std::vector<at::Tensor>(begin, begin + rows),
            std::vector<at::Tensor>(begin + rows, outputs.end())};
  } else {
    return outputs[0];
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(lumenbridge, Autograd, m) {
  m.impl("tokenize", &tokenize_autograd<kTokenize, at::Tensor>);
  m.impl("tokenize_for_training", &tokenize_autograd<kTokenizeForTraining, TrainingResult>);
}

}  // namespace lumenbridge
