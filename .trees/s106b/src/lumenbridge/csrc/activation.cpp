#include "activation.h"

#include <ATen/ATen.h>

namespace lumenbridge {

at::Tensor activate(const at::Tensor& x, Activation activation) {
  switch (activation) {
    case Activation::GELU: return at::gelu(x);  // the erf form
    case Activation::RELU: return at::relu(x);
    case Activation::SILU: return at::silu(x);
    case Activation::NONE: return x;
  }
  return x;
}

void activate_(at::Tensor& x, Activation activation) {
  switch (activation) {
    case Activation::GELU: at::gelu_(x); return;
    case Activation::RELU: at::relu_(x); return;
    case Activation::SILU: at::silu_(x); return;
    case Activation::NONE: return;
  }
}

void activation_backward_(at::Tensor& grad, const at::Tensor& pre, Activation activation) {
  switch (activation) {
    case Activation::GELU: at::gelu_backward_out(grad, grad, pre); return;
    case Activation::RELU: at::threshold_backward_out(grad, grad, pre, 0); return;
    case Activation::SILU: at::silu_backward_out(grad, grad, pre); return;
    case Activation::NONE: return;
  }
}

}  // namespace lumenbridge
