#include "layer_norm.h"

#include <ATen/ATen.h>

namespace lumenbridge {

// ATen's own backward, after its forward once more for the statistics (in
// float for half types).
AffineGrads layer_norm_backward_aten(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& weight,
                                     const at::Tensor& bias, double eps, bool parameters) {
  const std::vector<int64_t> shape{x.size(-1)};
  const auto statistics = at::native_layer_norm(x, shape, weight, bias, eps);
  const auto grads = at::native_layer_norm_backward(grad, x, shape, std::get<1>(statistics),
                                                    std::get<2>(statistics), weight, bias,
                                                    {true, parameters, parameters});
  return {std::get<0>(grads), std::get<1>(grads), std::get<2>(grads)};
}

}  // namespace lumenbridge
